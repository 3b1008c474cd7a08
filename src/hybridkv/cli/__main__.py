"""`python -m hybridkv.cli ARGS`: the `hybridkv` script's command line, for a process
started as a module (the test suite forks it from a parent that imported vLLM)."""

import sys

from hybridkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
