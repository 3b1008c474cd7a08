"""`hybridkv serve`: vLLM's OpenAI-compatible server with hybridkv configured.

The configuration is checked here, before vLLM starts (a bad key fails in a second, not
after a minute of engine start-up); then this process becomes the server (exec), so
signals, logs and the exit status are the server's own.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hybridkv.cli.app import app, size_option
from hybridkv.models import ARCHS, SIZES, default_model_dir, make_model
from hybridkv.server import server_args

if TYPE_CHECKING:
    from hybridkv.core.config import HybridKVConfig


def generated_model(model: str) -> tuple[str, str] | None:
    """(arch, size) when MODEL names a generated model (`qwen3-next`, `gemma3:small`) and
    no such path exists; None for a path or a model id vLLM resolves itself."""
    arch, _, size = model.partition(":")
    if Path(model).exists() or arch not in ARCHS:
        return None
    if size and size not in SIZES:
        raise typer.BadParameter(f"size {size!r}: expected one of {SIZES}", param_hint="MODEL")
    return arch, size or "tiny"


def server_vllm_args(settings: HybridKVConfig, vllm_args: Sequence[str]) -> list[str]:
    """vLLM's arguments: with a disk or Redis tier, a shutdown timeout first (vLLM's
    default, 0, kills the engine at SIGTERM, losing the writes still queued); the user's
    arguments after it, so a value of theirs wins."""
    args = list(vllm_args)
    if settings.disk is not None or settings.redis is not None:
        args = ["--shutdown-timeout", "30", *args]
    return args


@app.command(epilog="Example: hybridkv serve qwen3-next --cpu 8GiB -- --max-model-len 4096")
def serve(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL",
            help="model directory or id; or ARCH[:SIZE] (qwen3-next, gemma3, qwen3, gpt-oss; "
            "tiny or small) for a generated random-weight model, made under $HYBRIDKV_HOME if "
            "missing and served under that name",
        ),
    ],
    vllm_args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[-- VLLM_ARGS...]",
            help="passed to vLLM's server verbatim, after hybridkv's (so they override)",
        ),
    ] = None,
    cpu: Annotated[
        str | None, typer.Option(metavar="SIZE", help="CPU-memory tier size (cpu_bytes)")
    ] = None,
    disk: Annotated[
        str | None, typer.Option(metavar="PATH", help="disk tier directory (disk_path)")
    ] = None,
    redis: Annotated[
        str | None, typer.Option(metavar="URL", help="Redis / Valkey URL (redis_url)")
    ] = None,
    config: Annotated[
        str | None, typer.Option(metavar="FILE", help="YAML / JSON settings file (config_file)")
    ] = None,
    host: Annotated[str, typer.Option(metavar="HOST", help="address to listen on")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(metavar="N", min=1, max=65535, help="port to listen on")
    ] = 8000,
) -> None:
    """Start vLLM's OpenAI-compatible server with hybridkv and vLLM's prefix caching on.

    Options win; settings not given as options come from HYBRIDKV_* variables and the
    config file (see docs/config.md); all are checked before vLLM starts."""
    from hybridkv.core.config import ConfigError, HybridKVConfig

    if cpu is not None:
        size_option(cpu, "--cpu")  # a bad size is a usage error naming --cpu
    # The options reach the server as the HYBRIDKV_* variables they stand for: above the
    # caller's variables and the file, and a Redis password stays off vLLM's command line
    # (which `ps` and vLLM's own argument log show) and off the line echoed below.
    env = dict(os.environ)
    named: dict[str, str] = {}
    for option, key, value in (
        ("--cpu", "cpu_bytes", cpu),
        ("--disk", "disk_path", disk),
        ("--redis", "redis_url", redis),
        ("--config", "config_file", config),
    ):
        if value is not None:
            variable = "HYBRIDKV_" + key.upper()
            env[variable] = value
            named[f"environment {variable}"] = f"option {option}"
    try:
        settings = HybridKVConfig.from_dict({}, env=env)
    except ConfigError as e:
        message = str(e)
        for variable, option in named.items():
            message = message.replace(variable, option)
        typer.echo(f"hybridkv serve: {message}", err=True)
        raise typer.Exit(2) from None

    args = server_vllm_args(settings, vllm_args or ())
    generated = generated_model(model)
    if generated is not None:
        arch, size = generated
        args = ["--served-model-name", model, *args]
        model = str(make_model(arch, default_model_dir(arch, size), size=size))
    argv = server_args(model, {}, host=host, port=port, vllm_args=args)
    typer.echo("hybridkv serve: " + shlex.join(argv), err=True)
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
