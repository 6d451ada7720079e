"""hotloop: an OpenAI Responses API server (HTTP, SSE and WebSocket mode) that keeps agent loops hot."""

# The one place the version is written: pyproject.toml reads it (``dynamic = ["version"]``), so
# the wheel's metadata, ``hotloop --version`` and this attribute agree (tests/unit/test_version.py).
__version__ = "0.1.0"

__all__ = ["__version__"]
