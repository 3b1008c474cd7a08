"""`hybridkv` command line. Each command lives in its own module and registers itself
on the shared typer app when imported here."""

from __future__ import annotations

from hybridkv.cli import bench, demo, gc, inspect_cmd, serve  # noqa: F401 - registering their commands
from hybridkv.cli.app import app


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hybridkv` script (and of tests, with `argv`): the exit status.
    Commands report failure with `typer.Exit(code)`."""
    try:
        app(args=argv, prog_name="hybridkv")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0
