"""The native parts: row copies for the CPU tier (src/hybridkv/_rowcopy.c), the
scheduler side's per-key table (src/hybridkv/_keytable.c), its paged columns
(src/hybridkv/_columns.c) and its eviction orders (src/hybridkv/_roworder.c).

Plain C on the CPython API, no torch headers: they build with any C compiler in seconds.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(f"hybridkv.{name}", [f"src/hybridkv/{name}.c"], extra_compile_args=["-O3"])
        for name in ("_rowcopy", "_keytable", "_columns", "_roworder")
    ]
)
