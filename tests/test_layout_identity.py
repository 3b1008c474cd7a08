"""Layout identity: every engine setting that changes a stored page's bytes is in the
fingerprint, read from a real `VllmConfig` (a tiny local model, no engine started);
layouts without identity keep the fingerprint they had before identity existed. Recurrent
states add their conv-state layout and tensors, and entries stored under one conv-state
layout are misses under the other."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import vllm
from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    get_conv_state_layout,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from hybridkv.core.config import HybridKVConfig
from hybridkv.core.keys import chain_seed, chunk_keys, group_key, split_group_key
from hybridkv.core.layout import GroupKind, GroupSpec, Layout
from hybridkv.core.planner import Planner
from hybridkv.core.store import TieredStore
from hybridkv.vllm.checkpoint import checkpoint_fingerprint
from hybridkv.vllm.layout import UnsupportedLayout, layout_from_vllm

GROUPS = (GroupSpec(GroupKind.FULL, 16, 4096, ("model.layers.0.attn",)),)
IDENTITY = (("kv_cache_dtype", "auto"), ("kv_cache_layout", "LBHNC"), ("weights", "ab12"))


def test_layout_without_identity_keeps_its_fingerprint():
    """The fingerprint of tests/test_keys.py's layout, computed before `identity` existed:
    disk entries stored then stay readable."""
    layout = Layout(
        model="org/model",
        groups=(
            GroupSpec(GroupKind.FULL, 16, 4096, ("model.layers.0.attn", "model.layers.2.attn")),
            GroupSpec(GroupKind.SLIDING, 16, 2048, ("model.layers.1.attn",), window=64),
            GroupSpec(GroupKind.STATE, 64, 9000, ("model.layers.3.linear_attn",), dtype="bf16"),
        ),
        tp_size=2,
    )
    assert "identity" not in layout.describe()
    assert layout.fingerprint.hex() == "d222fd7b4e04665b4ee819bbb1d7ffc1"


def test_each_identity_field_changes_the_fingerprint():
    base = Layout("m", GROUPS, identity=IDENTITY)
    variants = [Layout("m", GROUPS), Layout("m", GROUPS, identity=IDENTITY[:2])]
    for i, (name, value) in enumerate(IDENTITY):
        changed = list(IDENTITY)
        changed[i] = (name, value + "x")
        variants.append(Layout("m", GROUPS, identity=tuple(changed)))
    variants.append(Layout("m", GROUPS, identity=(*IDENTITY, ("revision", "r1"))))
    fps = [base.fingerprint] + [v.fingerprint for v in variants]
    assert len(set(fps)) == len(fps)
    # Order does not matter: pairs are kept sorted.
    assert Layout("m", GROUPS, identity=IDENTITY[::-1]) == base
    assert Layout("m", GROUPS, identity=IDENTITY[::-1]).fingerprint == base.fingerprint


def test_identity_is_shown_in_layout_json_and_names_are_unique():
    described = Layout("m", GROUPS, identity=IDENTITY).describe()
    assert json.loads(json.dumps(described))["identity"] == dict(IDENTITY)
    with pytest.raises(ValueError, match="unique"):
        Layout("m", GROUPS, identity=(("a", "1"), ("a", "2")))


# ---- read from vLLM's config ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from hybridkv.models import make_model

    return make_model("qwen3", tmp_path_factory.mktemp("models") / "qwen3", size="tiny")


def _kv_cache_config(physical: str | None = "LBHNC") -> KVCacheConfig:
    spec = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        kv_cache_layout=physical,
    )


def _vllm_config(model: Path, cache: dict | None = None, load: dict | None = None, **kw):
    return VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, **kw),
        cache_config=CacheConfig(**(cache or {})),
        load_config=LoadConfig(**(load or {})),
    )


def _identity(vllm_config, kv_cache_config=None) -> dict[str, str]:
    layout = layout_from_vllm(vllm_config, kv_cache_config or _kv_cache_config(), "m")
    return dict(layout.identity)


def test_identity_read_from_a_real_vllm_config(model_dir):
    identity = _identity(
        _vllm_config(
            model_dir,
            cache={"cache_dtype": "fp8"},
            dtype="float32",
            revision="r1",
            hf_overrides={"rope_theta": 5e5},
        )
    )
    assert identity["kv_cache_layout"] == "LBHNC"
    assert identity["model_dtype"] == "torch.float32"
    assert identity["kv_cache_dtype"] == "fp8"
    assert identity["revision"] == "r1"
    assert json.loads(identity["hf_overrides"]) == {"rope_theta": 5e5}
    assert json.loads(identity["quantization"]) == [None, None]
    assert identity["load_format"] == "auto"
    assert identity["weights"] == checkpoint_fingerprint(str(model_dir)) != ""


def test_every_identity_setting_changes_the_fingerprint(model_dir, tmp_path):
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    config = tmp_path / "config"  # the same config, read from elsewhere
    config.mkdir()
    shutil.copy(copy / "config.json", config / "config.json")
    base = _vllm_config(copy)

    def fingerprint(vllm_config, physical: str | None = "LBHNC") -> bytes:
        return layout_from_vllm(vllm_config, _kv_cache_config(physical), "m").fingerprint

    quantized = _vllm_config(copy)
    quantized.model_config.quantization = "fp8"  # online fp8 cannot be built on a CPU
    fps = {
        "base": fingerprint(base),
        "layout": fingerprint(base, "LBNHC"),
        "dtype": fingerprint(_vllm_config(copy, dtype="float32")),
        "kv_dtype": fingerprint(_vllm_config(copy, cache={"cache_dtype": "fp8"})),
        "skip_layers": fingerprint(_vllm_config(copy, cache={"kv_cache_dtype_skip_layers": ["0"]})),
        "quantization": fingerprint(quantized),
        "revision": fingerprint(_vllm_config(copy, revision="r1")),
        "hf_overrides": fingerprint(_vllm_config(copy, hf_overrides={"rope_theta": 5e5})),
        "load_format": fingerprint(_vllm_config(copy, load={"load_format": "dummy"})),
        "max_model_len": fingerprint(_vllm_config(copy, max_model_len=64)),
        "generation": fingerprint(
            _vllm_config(copy, override_generation_config={"attn_temperature_tuning": True})
        ),
        "hf_config_path": fingerprint(_vllm_config(copy, hf_config_path=str(config))),
        "loader_extra": fingerprint(
            _vllm_config(copy, load={"model_loader_extra_config": {"tensorizer_uri": "s3://x"}})
        ),
        "code_revision": fingerprint(_vllm_config(copy, code_revision="c1")),
    }
    assert fingerprint(_vllm_config(copy)) == fps["base"]  # rebuilt: the same
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten in place
    os.utime(weights, ns=(1, 1))
    fps["weights"] = fingerprint(_vllm_config(copy))
    assert len(set(fps.values())) == len(fps), fps


def test_unresolved_kv_cache_layout_is_refused(model_dir):
    with pytest.raises(UnsupportedLayout, match="not resolved"):
        layout_from_vllm(_vllm_config(model_dir), _kv_cache_config(None), "m")
    # The engine core records it on the cache config too; that one is enough.
    vllm_config = _vllm_config(model_dir)
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    assert _identity(vllm_config, _kv_cache_config(None))["kv_cache_layout"] == "LBNHC"


def test_vllm_version_is_in_every_layouts_identity(model_dir, monkeypatch):
    """A vLLM upgrade may change what no setting names (a kernel's page layout): its
    entries get a new directory. Attention-only layouts get nothing recurrent."""
    vllm_config = _vllm_config(model_dir)
    identity = _identity(vllm_config)
    assert identity["vllm_version"] == vllm.__version__
    assert "conv_state_layout" not in identity and "state_tensors" not in identity
    before = layout_from_vllm(vllm_config, _kv_cache_config(), "m").fingerprint
    monkeypatch.setattr(vllm, "__version__", vllm.__version__ + ".post1")
    assert layout_from_vllm(vllm_config, _kv_cache_config(), "m").fingerprint != before


# ---- recurrent states ----------------------------------------------------------------------
STATE_LAYER = "model.layers.0.linear_attn"


@pytest.fixture
def conv_state_layout(monkeypatch) -> Iterator[Callable[[str], None]]:
    """Choose vLLM's SSM conv-state layout as a user does, by its environment variable.
    vLLM caches its answer per process (and an engine started in this process froze the
    environment), so both caches are emptied, and vLLM's again at the end."""
    from vllm import envs

    envs.disable_envs_cache()

    def choose(layout: str) -> None:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
        get_conv_state_layout.cache_clear()

    yield choose
    get_conv_state_layout.cache_clear()


def _gdn_spec(vllm_config, shapes=None, dtypes=None) -> MambaSpec:
    """A Qwen3-Next GDN layer's state spec as vLLM's calculators make it for this config
    and the conv-state layout in effect (`shapes` / `dtypes` replace theirs)."""
    cache = vllm_config.cache_config
    return MambaSpec(
        block_size=16,
        shapes=shapes
        or MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel_size=4
        ),
        dtypes=dtypes
        or MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        ),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )


def _hybrid_kv_cache_config(state: MambaSpec) -> KVCacheConfig:
    attn = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn),
            KVCacheGroupSpec([STATE_LAYER], state),
        ],
        kv_cache_layout="NHD",
    )


def test_recurrent_identity_read_from_a_real_kv_cache_config(model_dir, conv_state_layout):
    conv_state_layout("DS")
    vllm_config = _vllm_config(model_dir, cache={"mamba_ssm_cache_dtype": "float32"})
    identity = _identity(vllm_config, _hybrid_kv_cache_config(_gdn_spec(vllm_config)))
    assert identity["conv_state_layout"] == "DS"
    # Per state group (group 1): its tensors, the conv state (dim, state_len) under DS.
    assert json.loads(identity["state_tensors"]) == {
        "1": [["torch.bfloat16[128, 3]", "torch.float32[4, 16, 16]"]]
    }
    assert identity["vllm_version"] == vllm.__version__


def test_every_recurrent_identity_setting_changes_the_fingerprint(model_dir, conv_state_layout):
    """Each changes how a state's bytes split into tensors, none its byte count."""
    vllm_config = _vllm_config(model_dir)
    spec = _gdn_spec(vllm_config, ((3, 128), (4, 16, 16)), (torch.bfloat16, torch.float32))

    def layout(state: MambaSpec) -> Layout:
        return layout_from_vllm(vllm_config, _hybrid_kv_cache_config(state), "m")

    conv_state_layout("SD")
    base = layout(spec)
    variants = {
        "state shape": layout(_gdn_spec(vllm_config, ((128, 3), (4, 16, 16)), spec.dtypes)),
        "state dtype": layout(_gdn_spec(vllm_config, spec.shapes, (torch.float16, torch.float32))),
    }
    conv_state_layout("DS")
    variants["conv state layout"] = layout(spec)  # the same spec: only the layout differs
    for name, changed in variants.items():
        assert changed.groups[1].block_bytes == base.groups[1].block_bytes, name
        assert changed.fingerprint != base.fingerprint, name
    conv_state_layout("SD")
    assert layout(spec).fingerprint == base.fingerprint


def test_entries_stored_under_one_conv_state_layout_miss_under_the_other(
    model_dir, tmp_path, conv_state_layout
):
    """An engine restarted with the other conv-state layout (a transpose: the same bytes
    per block) must not read the states, nor anything keyed with them, from disk."""
    layouts = {}
    for conv in ("SD", "DS"):
        conv_state_layout(conv)
        vllm_config = _vllm_config(model_dir)
        layouts[conv] = layout_from_vllm(
            vllm_config, _hybrid_kv_cache_config(_gdn_spec(vllm_config)), "m"
        )
    assert layouts["SD"].groups == layouts["DS"].groups  # the bytes cannot tell them apart
    config = HybridKVConfig.from_dict({"cpu_bytes": "16MiB", "disk_path": str(tmp_path)})
    prompt = list(range(1, 33))

    def keys(layout: Layout) -> list[bytes]:
        chunks = chunk_keys(chain_seed(layout.fingerprint, None), prompt, 16)
        return [group_key(k, g) for k in chunks for g in range(len(layout.groups))]

    writer = TieredStore.from_config(config, layouts["SD"], pin=False)
    planner = Planner(layouts["SD"].groups, config.chunk_tokens)
    stored = keys(layouts["SD"])
    for k in stored:
        entry_bytes = planner.entry_bytes(split_group_key(k)[1])
        writer.put(k, torch.ones(entry_bytes, dtype=torch.int8))
    writer.close()  # drains the disk writes

    for conv, want in (("DS", 0), ("SD", len(stored))):  # fresh stores: CPU memory empty
        reader = TieredStore.from_config(config, layouts[conv], pin=False)
        try:
            assert len(reader.get_many(keys(layouts[conv]))) == want, conv
        finally:
            reader.close()


# ---- checkpoint fingerprints ---------------------------------------------------------------
def test_checkpoint_fingerprint_follows_weight_and_json_files_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w" * 10)
    (tmp_path / "config.json").write_text("{}")
    fp = checkpoint_fingerprint(str(tmp_path))
    assert fp and fp == checkpoint_fingerprint(str(tmp_path))
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "sub").mkdir()
    assert checkpoint_fingerprint(str(tmp_path)) == fp
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert checkpoint_fingerprint(str(tmp_path)) != fp
    assert checkpoint_fingerprint(str(tmp_path / "model.safetensors")) not in ("", fp)


def test_checkpoint_fingerprint_of_a_hub_id_uses_its_cached_snapshot(tmp_path):
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    snapshot = repo / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"w")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    fp = checkpoint_fingerprint("org/name", None, str(cache))
    assert fp == checkpoint_fingerprint(str(snapshot)) != ""
    assert checkpoint_fingerprint("org/other", None, str(cache)) == ""
    assert checkpoint_fingerprint("/no/such/dir") == ""


def _spec(kind: str):
    from vllm.v1.kv_cache_interface import RSWASpec, SinkFullAttentionSpec, SlidingWindowMLASpec

    common = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    return {
        "sink": lambda: SinkFullAttentionSpec(**common, sink_len=16),
        "rswa": lambda: RSWASpec(**common, rswa_window=64),
        "bounded_replay": lambda: SlidingWindowMLASpec(
            block_size=16,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.bfloat16,
            sliding_window=64,
            bounded_replay=True,
        ),
        "compressed": lambda: FullAttentionSpec(**common, tokens_per_state=4),
    }[kind]()


@pytest.mark.parametrize("kind", ["sink", "rswa", "bounded_replay", "compressed"])
def test_layer_kinds_whose_blocks_hold_more_than_their_tokens_are_refused(model_dir, kind):
    """Sink blocks ahead of a request's tokens, decode-time blocks freed and masked, a
    bounded replay vLLM does not prefix-cache, a state per several tokens: the planner's
    block-per-tokens arithmetic would store and restore the wrong blocks, so the engine
    does not start with hybridkv rather than serve them."""
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], _spec(kind))],
        kv_cache_layout="LBHNC",
    )
    with pytest.raises(UnsupportedLayout, match="KV cache spec"):
        layout_from_vllm(_vllm_config(model_dir), config, "m")


def test_multimodal_settings_for_every_request_are_in_the_identity():
    """An engine-wide processor or media setting changes an item's embeddings while its
    placeholder tokens stay alike: engines differing there must not share entries."""
    from vllm.config import MultiModalConfig

    from hybridkv.vllm.layout import _multimodal_identity

    base = _multimodal_identity(MultiModalConfig())
    assert _multimodal_identity(None) == ()
    for change in (
        {"mm_processor_kwargs": {"num_crops": 4}},
        {"media_io_kwargs": {"video": {"num_frames": 8}}},
        {"video_pruning_rate": 0.5},
    ):
        assert _multimodal_identity(MultiModalConfig(**change)) != base, change
