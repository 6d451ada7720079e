"""Cython extensions only; the Rust extension is declared in pyproject.toml.

setuptools-rust builds ``hotloop._native`` from the Cargo workspace and cythonize builds the
modules in ``cython_ext/``, so one ``pip install .`` produces one wheel holding both.

``HOTLOOP_PURE_WHEEL=1`` builds the pure-Python wheel instead (``py3-none-any``): no compiled
module, so the pure-Python twins (``hotloop._pure``) run in their place; it is what pip installs
where no wheel of the running CPython and platform exists (README, Building).
"""

import os

from setuptools import Extension, setup
from setuptools.dist import Distribution

CYTHON_MODULES = {
    "hotloop._frames": "cython_ext/frames.pyx",
}
PURE = os.environ.get("HOTLOOP_PURE_WHEEL", "").strip().lower() in ("1", "true", "yes", "on")


class _Distribution(Distribution):
    def finalize_options(self) -> None:
        super().finalize_options()  # (setuptools-rust adds the Rust extension of pyproject.toml here)
        if PURE:
            self.rust_extensions = []
            self.has_ext_modules = lambda: False  # a pure wheel: purelib, tagged py3-none-any


def _extensions() -> list[Extension]:
    if PURE:
        return []
    from Cython.Build import cythonize

    return cythonize(
        [Extension(name, [src]) for name, src in CYTHON_MODULES.items()],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )


setup(distclass=_Distribution, ext_modules=_extensions())
