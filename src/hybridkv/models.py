"""Deterministic random-weight hybrid models, written locally from a transformers config,
with a small locally trained tokenizer.

Nothing is downloaded: tests, the demo and the benchmarks run on these. The same
architecture, size and seed always give byte-identical weights and tokenizer files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ARCHS = ("qwen3-next", "gemma3", "qwen3", "gpt-oss")
SIZES = ("tiny", "small")

_VOCAB = {"tiny": 2048, "small": 32000}


def _dims(size: str, layers: tuple[int, int]) -> dict[str, Any]:
    """Shapes every architecture here shares; head dims are ones the CPU kernels take."""
    tiny = size == "tiny"
    return dict(
        hidden_size=256 if tiny else 768,
        intermediate_size=512 if tiny else 2048,
        num_hidden_layers=layers[0] if tiny else layers[1],
        num_attention_heads=4 if tiny else 8,
        num_key_value_heads=2,
        head_dim=64 if tiny else 128,
        max_position_embeddings=16384,
    )


def _qwen3_next(size: str) -> dict[str, Any]:
    # The CPU GDN kernel takes linear head dims of 64 or 128 only, and bf16.
    tiny = size == "tiny"
    return dict(
        _dims(size, (4, 8)),
        model_type="qwen3_next",
        full_attention_interval=4,
        linear_num_key_heads=2 if tiny else 4,
        linear_num_value_heads=4 if tiny else 8,
        linear_key_head_dim=64 if tiny else 128,
        linear_value_head_dim=64 if tiny else 128,
        linear_conv_kernel_dim=4,
        num_experts=4 if tiny else 8,
        num_experts_per_tok=2,
        moe_intermediate_size=128 if tiny else 512,
        shared_expert_intermediate_size=128 if tiny else 512,
        decoder_sparse_step=1,
    )


def _gemma3(size: str) -> dict[str, Any]:
    return dict(
        _dims(size, (6, 12)),
        model_type="gemma3_text",
        sliding_window=192 if size == "tiny" else 512,
    )


def _qwen3(size: str) -> dict[str, Any]:
    return dict(_dims(size, (2, 12)), model_type="qwen3")


def _gpt_oss(size: str) -> dict[str, Any]:
    # Layers alternate sliding (128-token window, as gpt-oss ships) and full attention;
    # every attention head has a learned sink. Mixture of experts as in gpt-oss.
    tiny = size == "tiny"
    dims = _dims(size, (4, 12))
    return dict(
        dims,
        model_type="gpt_oss",
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (dims["num_hidden_layers"] // 2),
        num_local_experts=4 if tiny else 8,
        num_experts_per_tok=2,
    )


_BUILDERS = {"qwen3-next": _qwen3_next, "gemma3": _gemma3, "qwen3": _qwen3, "gpt-oss": _gpt_oss}


def model_config(arch: str, size: str = "tiny") -> dict[str, Any]:
    if arch not in _BUILDERS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    cfg = _BUILDERS[arch](size)
    cfg.update(vocab_size=_VOCAB[size], tie_word_embeddings=False, torch_dtype="bfloat16")
    return cfg


MARKER = "hybridkv-model.json"  # what make_model writes last, naming the model it made


def model_for(arch: str, size: str, model: str | Path | None) -> Path:
    """The model a command runs: `model` as it is where it holds a model hybridkv did not
    make (a user's: files and no marker), else the random-weight model of `arch` and
    `size`, made if missing, at `model` or under $HYBRIDKV_HOME."""
    if model is not None:
        path = Path(model)
        if path.is_dir() and not (path / MARKER).exists() and any(path.iterdir()):
            return path
    return make_model(arch, model or default_model_dir(arch, size), size=size)


def default_model_dir(arch: str, size: str) -> Path:
    """Where the demo and benchmarks keep generated models: $HYBRIDKV_HOME/models/."""
    home = Path(os.environ.get("HYBRIDKV_HOME", Path.home() / ".cache" / "hybridkv"))
    return home / "models" / f"{arch}-{size}"


# Special tokens, first in every vocabulary at the ids Gemma-3's config names (pad 0,
# eos 1, bos 2), so the same tokenizer fits all three architectures; Qwen3's configs name
# none (vLLM then takes eos from the tokenizer). `<|im_start|>` opens a chat turn, eos
# ends it, so a chat answer stops at eos.
PAD, EOS, BOS, TURN = "<pad>", "<eos>", "<bos>", "<|im_start|>"
SPECIAL_TOKENS = (PAD, EOS, BOS, TURN)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# English the byte-level BPE learns its first merges from (weighted above the filler), so
# ordinary text takes few tokens and random-weight output decodes to word-like pieces.
_ENGLISH = """\
The cache keeps what the model has already computed, so a repeated prefix is not
computed again. A hybrid model mixes full attention, sliding window attention and
recurrent state; every part must be restored at the same token position or not at all.
You are a helpful assistant. Answer the question in one short sentence, please.
What is the capital of France? Paris is the capital of France. Thank you for asking.
How many tokens were restored from the cache, and how long did the first token take?
Hello! How are you today? I am fine, thanks. Tell me a story about a small robot that
learned to read: it started with letters, then words, then whole books in the library.
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026.
Write a function in Python that returns the sum of a list of numbers: def total(xs):
    return sum(xs)
"""


def _tokenizer_corpus() -> list[str]:
    """The training text: the English above, repeated so its pairs merge first, then
    seeded pseudo-words that give enough distinct pairs to fill a 32000-token vocab."""
    rng = random.Random(0)
    syllables = [c + v + e for c in "bcdfghjklmnprstvwz" for v in "aeiou" for e in ("", *"nrst")]
    lexicon = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(30000)
    ]
    words = [lexicon[rng.randrange(len(lexicon))] for _ in range(60000)]
    filler = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return [_ENGLISH] * 20 + filler


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` tokens (every id the model can emit
    decodes, and any text encodes), trained on a fixed corpus: the same bytes each time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:  # the corpus ran out of pairs to merge
        raise RuntimeError(f"tokenizer: {tok.get_vocab_size()} tokens, expected {vocab_size}")
    # A text prompt starts with bos, as Gemma-3 expects (a chat's bos comes from the template).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """tokenizer.json and a tokenizer_config.json with the special tokens and a chat
    template, so vLLM serves text prompts, chat and logprobs from the model directory."""
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# Bumped when what make_model writes changes, so existing model directories are rebuilt.
_FORMAT = 2


def make_model(arch: str, out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write config, safetensors and tokenizer of a random-weight model; reuse an existing
    one. The weights depend only on (arch, size, seed), never on the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    marker = out / MARKER
    spec = {"arch": arch, "size": size, "seed": seed, "format": _FORMAT}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    if not marker.exists() and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} holds files hybridkv did not write (no {MARKER}): "
            "not writing a random-weight model over them"
        )
    cfg_dict = model_config(arch, size)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_tokenizer(out, cfg.vocab_size)
    marker.write_text(json.dumps(spec))
    return out
