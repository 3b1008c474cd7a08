"""`hybridkv serve` and the generated models' tokenizer, as an operator uses them: the
installed `hybridkv` script starts vLLM's OpenAI-compatible server on a model directory
from `make_model`, and clients send text (chat, completions, logprobs), not token ids.

The serve test runs one real server (about 40 s on 2 cores); the others take seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SEED
from openai import AsyncOpenAI
from serving import MiB, free_port, last_boundary, launch
from test_server import assert_clean_log

from hybridkv.models import build_tokenizer, model_config, write_tokenizer

HYBRIDKV = str(Path(sys.executable).with_name("hybridkv"))  # the installed script
SENTENCE = "The cache keeps what the model has already computed, so a repeated prefix is not computed again. "  # noqa: E501
QUESTION = "What does the cache keep?"


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_tokenizer_files_are_deterministic(size: str, tmp_path: Path) -> None:
    """Two builds write the same bytes, so a model directory (and the prefix keys of
    text prompts) is the same on every machine and every run."""
    vocab = model_config("qwen3", size)["vocab_size"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_tokenizer(tmp_path / d, vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert build_tokenizer(vocab).get_vocab_size() == vocab


@pytest.mark.parametrize("arch", ["qwen3-next", "gemma3"])
def test_tokenizer_as_transformers_loads_it(arch: str, model_dirs: dict[str, str]) -> None:
    """What vLLM gets from the model directory: text round-trips, the vocabulary is the
    model's (every id the model can emit decodes; no token id is out of the model's
    range), the special tokens are the ids the config names, chat renders."""
    from transformers import AutoTokenizer

    model = Path(model_dirs[arch])
    tok = AutoTokenizer.from_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    assert len(tok) == vocab and max(tok.get_vocab().values()) == vocab - 1
    assert all(t is not None for t in tok.convert_ids_to_tokens(list(range(vocab))))

    text = "Hello, the cache keeps ünïcode 日本語 and\ttabs\n  and 12345 digits!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and max(ids) < vocab
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        assert config.get(key) in (None, getattr(tok, key)), key  # gemma3 names them

    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = "<bos><|im_start|>system\nBe brief.<eos>\n<|im_start|>user\nHi<eos>\n"
    assert chat == expected + "<|im_start|>assistant\n"


def long_chat(tok_dir: str) -> tuple[list[dict[str, str]], int]:
    """A chat whose system prompt repeats a sentence a drawn number of times (seeded, 8
    to 40: about 260 to 1,200 tokens), and its length in tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    n = random.Random(SEED * 100 + 5).randint(8, 40)
    chat = [
        {"role": "system", "content": SENTENCE * n},
        {"role": "user", "content": QUESTION},
    ]
    return chat, len(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])


async def chat_once(client: AsyncOpenAI, model: str, chat: list[dict[str, str]]) -> dict:
    r = await client.chat.completions.create(
        model=model,
        messages=chat,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = r.choices[0]
    return {
        "text": choice.message.content,
        "logprobs": [(t.token, t.logprob) for t in choice.logprobs.content],
        "completion_tokens": r.usage.completion_tokens,
        "cached": r.usage.prompt_tokens_details.cached_tokens or 0,
    }


@pytest.mark.engine
def test_serve_restores_a_chat_prefix(model_dirs: dict[str, str], tmp_path: Path) -> None:
    """`hybridkv serve` becomes vLLM's server (same pid), with the model's tokenizer:
    a long chat, vLLM's own prefix cache emptied, the same chat again: hybridkv restores
    the prefix and the greedy answer and its logprobs are identical. A text completion
    with logprobs works too. SIGTERM stops it cleanly (exit 0, no error logged) once
    the disk tier's writes are done (files are there)."""
    model = model_dirs["qwen3-next"]
    chat, length = long_chat(model)
    port = free_port()
    vllm_args = ["--enforce-eager", "--max-model-len", "4096", "--enable-prompt-tokens-details"]
    vllm_args += ["--kv-cache-memory-bytes", str(64 * MiB)]
    options = ["--cpu", "256MiB", "--disk", str(tmp_path / "kv"), "--port", str(port)]
    cmd = [HYBRIDKV, "serve", model, *options, "--", *vllm_args]
    server = launch(cmd, model, port, tmp_path / "serve.log")
    try:
        cmdline = psutil.Process(server.proc.pid).cmdline()
        assert "vllm.entrypoints.openai.api_server" in cmdline, cmdline
        assert '"kv_connector": "HybridKVConnector"' in " ".join(cmdline)
        # A load that fails is recomputed, not an error for the client.
        assert '"kv_load_failure_policy": "recompute"' in " ".join(cmdline)
        # With a disk tier, SIGTERM waits for hybridkv's queued disk writes.
        assert cmdline[cmdline.index("--shutdown-timeout") + 1] == "30"

        async def run() -> tuple[dict, dict, object]:
            client = server.client()
            cold = await chat_once(client, model, chat)
            await asyncio.to_thread(server.reset_prefix_cache)
            restored = await chat_once(client, model, chat)
            text = await client.completions.create(
                model=model, prompt="Hello, how are", max_tokens=4, temperature=0, logprobs=1
            )
            return cold, restored, text

        cold, restored, text = asyncio.run(run())
        assert cold["cached"] == 0, cold
        assert restored["cached"] == last_boundary(length, server.chunk_tokens()), restored
        assert cold["completion_tokens"] > 0 and restored == dict(cold, cached=restored["cached"])
        choice = text.choices[0]
        assert choice.text and len(choice.logprobs.token_logprobs) == text.usage.completion_tokens
    finally:
        code = server.stop()
    assert code == 0, f"server did not stop on SIGTERM (exit {code}):\n{server.log_tail()}"
    assert_clean_log(server)
    # hybridkv logs into the server's log (its start-up line), and did not warn about
    # the load failure policy.
    assert server.chunk_tokens() > 0
    assert not any("kv_load_failure_policy is" in ln for ln in server.log_lines())
    assert any(p.is_file() for p in (tmp_path / "kv").rglob("*")), "no disk entries"


def test_serve_bad_config_fails_before_vllm(model_dirs: dict[str, str], tmp_path: Path) -> None:
    """A misspelt key in the config file stops `hybridkv serve` in seconds, naming the
    key and the file, with vLLM never started; so does a bad size option."""
    config = tmp_path / "hybridkv.yaml"
    config.write_text("cpu_bites: 1GiB\n")
    model = model_dirs["qwen3"]
    for args, needle in (
        (["--config", str(config)], "cpu_bites: unknown hybridkv setting in config_file"),
        (["--cpu", "lots"], "--cpu"),
    ):
        t = time.monotonic()
        r = subprocess.run(
            [HYBRIDKV, "serve", model, "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert needle in r.stderr, r.stderr
        assert "api_server" not in r.stdout + r.stderr  # the exec line was never printed
        assert time.monotonic() - t < 15


def test_serve_options_win_and_a_redis_password_stays_off_the_command_line(
    model_dirs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The options reach the server as the HYBRIDKV_* variables they stand for: above the
    caller's own variables (a stale HYBRIDKV_CPU_BYTES does not win over --cpu), and the
    Redis URL with its password never in vLLM's argv (which `ps` and vLLM's argument log
    show) nor in the line echoed; a config error does not repeat it either."""
    import os

    from typer.testing import CliRunner

    from hybridkv.cli.app import app

    started: dict = {}

    def execvpe(path, argv, env):
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", execvpe)
    monkeypatch.setenv("HYBRIDKV_CPU_BYTES", "lots")
    url = "redis://:TOPSECRET@127.0.0.1:6390/0"
    model = model_dirs["qwen3"]
    runner = CliRunner()
    r = runner.invoke(app, ["serve", model, "--cpu", "1GiB", "--redis", url])
    assert r.exit_code == 0, r.output
    assert "TOPSECRET" not in " ".join(started["argv"]) and "TOPSECRET" not in r.output
    assert started["env"]["HYBRIDKV_REDIS_URL"] == url
    assert started["env"]["HYBRIDKV_CPU_BYTES"] == "1GiB"
    bad = tmp_path / "hybridkv.yaml"
    bad.write_text("cpu_bites: 1GiB\n")
    r = runner.invoke(app, ["serve", model, "--redis", url, "--config", str(bad)])
    assert r.exit_code == 2 and "cpu_bites" in r.output and "TOPSECRET" not in r.output
    r = runner.invoke(app, ["serve", model, "--redis", "redis://:TOPSECRET@h:notaport/0"])
    assert r.exit_code == 2 and "option --redis" in r.output, r.output
    assert "TOPSECRET" not in r.output


@pytest.mark.parametrize(
    ("tiers", "timeout"),
    [({}, False), ({"disk_path": "/tmp/kv"}, True), ({"redis_url": "redis://h:6379"}, True)],
)
def test_a_tier_with_queued_writes_gets_a_shutdown_timeout(tiers, timeout) -> None:
    """With a disk or a Redis tier (both write in the background), SIGTERM must wait for
    the queued writes: the server gets a shutdown timeout, before the user's arguments
    (theirs wins)."""
    from hybridkv.cli.serve import server_vllm_args
    from hybridkv.core.config import HybridKVConfig

    settings = HybridKVConfig.from_dict(tiers, env={})
    args = server_vllm_args(settings, ["--shutdown-timeout", "5"])
    assert args == (["--shutdown-timeout", "30"] if timeout else []) + ["--shutdown-timeout", "5"]
