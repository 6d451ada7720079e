"""hotloop: an OpenAI Responses API server (HTTP, SSE and WebSocket mode) that keeps agent loops hot."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hotloop")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
