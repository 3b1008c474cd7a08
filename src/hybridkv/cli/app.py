"""The `hybridkv` typer application and its `bench` sub-group.

Kept apart from the command modules so each can register itself on `app` without
importing the others (every command module imports this one, never the reverse).
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="hybridkv",
    help="KV-cache offloading for hybrid LLMs on vLLM: serve, inspect, trim, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings wrap as paragraphs, `code` shows as code
)
bench = typer.Typer(
    help="Run a workload with and without hybridkv; write JSON and a PNG plot.",
    no_args_is_help=True,
)
app.add_typer(bench, name="bench")


def size_option(value: str, key: str) -> int:
    """A byte size from the command line (`8GiB`, `512MiB`, `1e9`), or a usage error
    naming the option."""
    from hybridkv.core.config import ConfigError, parse_size

    try:
        return parse_size(value, key)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint=key) from None
