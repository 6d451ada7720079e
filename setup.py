"""Cython extensions only; the Rust extension is declared in pyproject.toml.

setuptools-rust builds ``hotloop._native`` from the Cargo workspace and cythonize builds the
modules in ``cython_ext/``, so one ``pip install .`` produces one wheel holding both.
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

CYTHON_MODULES = {
    "hotloop._frames": "cython_ext/frames.pyx",
}

setup(
    ext_modules=cythonize(
        [Extension(name, [src]) for name, src in CYTHON_MODULES.items()],
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    )
)
