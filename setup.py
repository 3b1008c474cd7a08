"""The one native part: row copies for the CPU tier (src/hybridkv/_rowcopy.c).

Plain C on the CPython API, no torch headers: it builds with any C compiler in seconds.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("hybridkv._rowcopy", ["src/hybridkv/_rowcopy.c"], extra_compile_args=["-O3"])
    ]
)
