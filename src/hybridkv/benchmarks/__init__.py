"""Benchmarks that ship with the package, so `hybridkv bench` runs them anywhere
hybridkv is installed; bench/*.py are thin wrappers that write the repo's figures."""
