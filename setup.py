"""Builds the Cython extensions in native/ (metadata lives in pyproject.toml)."""
from Cython.Build import cythonize
from setuptools import Extension, setup

EXTENSIONS = [
    Extension("native.atomics", ["native/atomics.pyx"], extra_compile_args=["-O2"]),
    Extension("native.hashing", ["native/hashing.pyx"], extra_compile_args=["-O2"]),
    Extension("native.copy", ["native/copy.pyx"], extra_compile_args=["-O2"]),
    Extension("native.blockindex", ["native/blockindex.pyx"], extra_compile_args=["-O2"]),
]

setup(ext_modules=cythonize(EXTENSIONS, language_level=3, quiet=True))
