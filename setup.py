"""Packaging that pyproject.toml cannot say: the one import package and the Cython extensions.

The distribution installs exactly one top-level import package, ``kvsidecar`` (an implicit
namespace package: no ``kvsidecar/__init__.py`` anywhere), whose parts live in the repository's
top-level folders::

    kvsidecar.sidecar    <- sidecar/      the per-node process
    kvsidecar.shm        <- shm/          shared-memory primitives and the wire protocol
    kvsidecar.connector  <- connector/    what an engine rank imports
    kvsidecar._native    <- native/       Cython extensions (private)

Sub-packages are found below each folder, so a new one needs no edit here.  scripts/ and
tests/ are not installed.  An editable install (``pip install -e .``) maps the same names
onto the checkout; a built wheel carries the same tree.
"""
import platform

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

PARTS = {"sidecar": "sidecar", "shm": "shm", "connector": "connector", "_native": "native"}

PACKAGE_DIR = {f"kvsidecar.{name}": folder for name, folder in PARTS.items()}
PACKAGES = [pkg for name, folder in PARTS.items()
            for pkg in [f"kvsidecar.{name}"] + [f"kvsidecar.{name}.{sub}" for sub in find_packages(folder)]]

_X86 = platform.machine().lower() in ("x86_64", "amd64")
XXHASH = "native/third_party/xxhash"

EXTENSIONS = [
    Extension(f"kvsidecar._native.{mod}", [f"native/{mod}.pyx"], include_dirs=["native"],
              depends=["native/kvs_sync.h"], extra_compile_args=["-O2"])
    for mod in ("atomics", "hashing", "copy", "blockindex", "ring")
] + [
    # XXH3 from vendored xxHash 0.8.4 (BSD-2-Clause, native/third_party/xxhash/LICENSE.xxhash)
    # compiled into the extension: no run-time library to install; on x86-64 its dispatcher
    # picks AVX2/AVX-512
    Extension("kvsidecar._native.checksum",
              ["native/checksum.pyx"] + ([f"{XXHASH}/xxh_x86dispatch.c"] if _X86 else []),
              include_dirs=["native", XXHASH], define_macros=[("KVS_XXH_DISPATCH", None)] if _X86 else [],
              depends=["native/kvs_xxh.h", f"{XXHASH}/xxhash.h", f"{XXHASH}/xxh_x86dispatch.h"],
              extra_compile_args=["-O3"]),
]

setup(
    package_dir=PACKAGE_DIR,
    packages=PACKAGES,
    exclude_package_data={"": ["*.pyx", "*.c"]},
    package_data={"kvsidecar._native": ["third_party/xxhash/LICENSE.xxhash"]},  # BSD-2: ships with the binary
    ext_modules=cythonize(EXTENSIONS, language_level=3, quiet=True),
)
