"""Builds the Cython extensions in native/ (metadata lives in pyproject.toml)."""
import platform

from Cython.Build import cythonize
from setuptools import Extension, setup

_X86 = platform.machine().lower() in ("x86_64", "amd64")

EXTENSIONS = [
    Extension("native.atomics", ["native/atomics.pyx"], extra_compile_args=["-O2"]),
    Extension("native.hashing", ["native/hashing.pyx"], extra_compile_args=["-O2"]),
    Extension("native.copy", ["native/copy.pyx"], extra_compile_args=["-O2"]),
    Extension("native.blockindex", ["native/blockindex.pyx"], extra_compile_args=["-O2"]),
    # XXH3 from vendored xxHash 0.8.4 (BSD-2-Clause, native/LICENSE.xxhash) compiled into the
    # extension: no run-time library to install; on x86-64 its dispatcher picks AVX2/AVX-512
    Extension("native.checksum", ["native/checksum.pyx"] + (["native/xxh_x86dispatch.c"] if _X86 else []),
              include_dirs=["native"], define_macros=[("KVS_XXH_DISPATCH", None)] if _X86 else [],
              extra_compile_args=["-O3"]),
]

setup(ext_modules=cythonize(EXTENSIONS, language_level=3, quiet=True))
