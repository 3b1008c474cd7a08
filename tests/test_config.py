"""User configuration: sizes, validation, and errors that name the key at fault."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.core.config import ConfigError, HybridKVConfig, parse_size


@pytest.mark.parametrize("raw", [None, {}])
def test_defaults(raw):
    cfg = HybridKVConfig.from_dict(raw)
    assert cfg == HybridKVConfig()
    assert cfg.cpu_bytes == 2 * 1024**3
    assert cfg.chunk_tokens is None
    assert cfg.checkpoint_policy == "prompt_and_end"
    assert cfg.model_id is None


def test_from_dict_does_not_mutate_its_input():
    raw = {"cpu_bytes": "1KiB"}
    HybridKVConfig.from_dict(raw)
    assert raw == {"cpu_bytes": "1KiB"}


def test_all_settings():
    cfg = HybridKVConfig.from_dict(
        {
            "cpu_bytes": "512MiB",
            "chunk_tokens": 256,
            "checkpoint_policy": "every_chunk",
            "model_id": "org/model",
        }
    )
    assert cfg == HybridKVConfig(
        cpu_bytes=512 * 1024**2,
        chunk_tokens=256,
        checkpoint_policy="every_chunk",
        model_id="org/model",
    )
    assert HybridKVConfig.from_dict({"chunk_tokens": None}).chunk_tokens is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("512MiB", 512 * 1024**2),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("1.5 GiB", 3 * 1024**3 // 2),
        (" 10 kib ", 10 * 1024),
        ("3M", 3 * 10**6),
        ("2Ti", 2 * 1024**4),
        ("7B", 7),
        ("42", 42),
        (1234, 1234),
        (0, 0),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected
    assert HybridKVConfig.from_dict({"cpu_bytes": value}).cpu_bytes == expected


UNITS = ["KiB", "MiB", "GiB", "TiB", "Ki", "Mi", "Gi", "Ti", "KB", "MB", "GB", "TB", "K", "M", "G"]


@given(n=st.integers(0, 10**6), unit=st.sampled_from(UNITS))
def test_parse_size_units(n, unit):
    base = 1024 if "i" in unit else 1000
    power = "KMGT".index(unit[0]) + 1
    assert parse_size(f"{n}{unit}") == n * base**power
    assert parse_size(f"{n}{unit.lower()}") == n * base**power


@pytest.mark.parametrize("value", ["lots", "12XB", "-5", "-1MiB", "1e9", "", "MiB", 1.5, None, []])
def test_bad_sizes(value):
    with pytest.raises(ConfigError, match=r"^cpu_bytes: "):
        HybridKVConfig.from_dict({"cpu_bytes": value})


@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_a_size(value):
    with pytest.raises(ConfigError, match=r"^cpu_bytes: "):
        HybridKVConfig.from_dict({"cpu_bytes": value})


def test_negative_size():
    with pytest.raises(ConfigError, match=r"^cpu_bytes: size must not be negative"):
        HybridKVConfig.from_dict({"cpu_bytes": -1})
    with pytest.raises(ConfigError, match=r"^my_key: "):
        parse_size(-1, "my_key")


def test_unknown_key():
    with pytest.raises(ConfigError, match=r"^cpu_byte: unknown hybridkv setting"):
        HybridKVConfig.from_dict({"cpu_byte": "1GiB"})
    # The first unknown key (sorted) is named even next to valid ones.
    with pytest.raises(ConfigError, match=r"^a_setting: "):
        HybridKVConfig.from_dict({"zzz": 1, "a_setting": 2, "cpu_bytes": 1})


def test_load_step_bytes_is_a_size_and_0_means_no_limit():
    assert HybridKVConfig.from_dict({"load_step_bytes": "16MiB"}).load_step_bytes == 16 * MiB
    assert HybridKVConfig.from_dict({"load_step_bytes": 0}).load_step_bytes == 0
    for bad in (-1, "fast", True, None):
        with pytest.raises(ConfigError, match=r"^load_step_bytes: "):
            HybridKVConfig.from_dict({"load_step_bytes": bad})


@pytest.mark.parametrize("value", ["every", "", None, "PROMPT_AND_END", 1])
def test_bad_checkpoint_policy(value):
    with pytest.raises(ConfigError, match=r"^checkpoint_policy: "):
        HybridKVConfig.from_dict({"checkpoint_policy": value})


def test_tier_order_errors_name_their_source(tmp_path):
    f = tmp_path / "tiers.yaml"
    f.write_text("tiers: [{kind: disk, path: /tmp/x}]\n")
    with pytest.raises(ConfigError) as e:
        HybridKVConfig.from_dict({"config_file": str(f)}, env={})
    assert str(e.value).startswith("tiers: a cpu tier is required") and str(f) in str(e.value)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379?db=2", "unix:///run/redis.sock"]
)
def test_a_cluster_url_no_cluster_can_serve_is_refused(url):
    """A Redis Cluster has database 0 alone and no unix sockets: such a URL would leave
    the tier down for good, retrying, instead of failing at start."""
    msg = _err({"redis_url": url, "redis_cluster": True}, "redis_cluster")
    assert "Cluster" in msg
    HybridKVConfig.from_dict({"redis_url": url}, env={})  # without cluster: fine
    HybridKVConfig.from_dict({"redis_url": "redis://h:6379/0", "redis_cluster": True}, env={})


def test_a_config_file_not_in_utf8_names_the_key(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("# café\ncpu_bytes: 1GiB\n".encode("latin-1"))
    msg = _err({"config_file": str(f)}, "config_file")
    assert "UTF-8" in msg


@pytest.mark.parametrize("value", [0, -1, "x", "64", True, False, 64.0])
def test_bad_chunk_tokens(value):
    with pytest.raises(ConfigError, match=r"^chunk_tokens: "):
        HybridKVConfig.from_dict({"chunk_tokens": value})


@pytest.mark.parametrize("value", ["", None, 7, b"org/model", ["a"]])
def test_bad_model_id(value):
    with pytest.raises(ConfigError, match=r"^model_id: "):
        HybridKVConfig.from_dict({"model_id": value})


def test_disk_settings(tmp_path):
    cfg = HybridKVConfig.from_dict(
        {
            "disk_path": str(tmp_path / "new"),
            "disk_bytes": "2GiB",
            "disk_fsync": True,
            "disk_direct_io": True,
            "disk_queue_bytes": "64MiB",
        }
    )
    assert (cfg.disk_path, cfg.disk_bytes) == (str(tmp_path / "new"), 2 * 1024**3)
    assert (cfg.disk_fsync, cfg.disk_queue_bytes) == (True, 64 * 1024**2)
    assert cfg.disk.direct_io and not HybridKVConfig.from_dict({"disk_path": "/x"}).disk_direct_io
    assert HybridKVConfig.from_dict({"disk_path": str(tmp_path)}).disk_bytes == 16 * 1024**3
    assert HybridKVConfig().disk_path is None


@pytest.mark.parametrize(
    "key",
    [
        "disk_bytes",
        "disk_fsync",
        "disk_direct_io",
        "disk_queue_bytes",
        "disk_mode",
        "integrity_key",
    ],
)
def test_disk_setting_without_disk_path(key):
    with pytest.raises(ConfigError, match=rf"^{key}: has no effect without disk_path"):
        HybridKVConfig.from_dict({key: "1GiB"})


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"disk_path": ""}, "disk_path"),
        ({"disk_path": 7}, "disk_path"),
        ({"disk_bytes": 0}, "disk_bytes"),
        ({"disk_bytes": "big"}, "disk_bytes"),
        ({"disk_queue_bytes": 0}, "disk_queue_bytes"),
        ({"disk_fsync": "yes"}, "disk_fsync"),
        ({"disk_direct_io": "yes"}, "disk_direct_io"),
    ],
)
def test_bad_disk_settings(tmp_path, extra, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        HybridKVConfig.from_dict({"disk_path": str(tmp_path), **extra})


def test_disk_path_must_not_be_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match=r"^disk_path: .* is not a directory"):
        HybridKVConfig.from_dict({"disk_path": str(f)})


@pytest.mark.parametrize(
    ("value", "mode"),
    [("0660", 0o660), ("660", 0o660), ("0o640", 0o640), (" 0600 ", 0o600), (0o770, 0o770)],
)
def test_disk_mode(tmp_path, value, mode):
    cfg = HybridKVConfig.from_dict({"disk_path": str(tmp_path), "disk_mode": value})
    assert cfg.disk_mode == mode
    assert HybridKVConfig.from_dict({"disk_path": str(tmp_path)}).disk_mode == 0o600


@pytest.mark.parametrize(
    "value", ["0400", "0200", 660, "0o1777", 0o4600, "rw-rw----", "0999", "", True, None, 6.6]
)
def test_bad_disk_mode(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^disk_mode: "):
        HybridKVConfig.from_dict({"disk_path": str(tmp_path), "disk_mode": value})


def test_integrity_key_stays_out_of_repr(tmp_path):
    secret = "s3cret-of-sixteen-chars"
    cfg = HybridKVConfig.from_dict({"disk_path": str(tmp_path), "integrity_key": secret})
    assert cfg.integrity_key == secret and secret not in repr(cfg)
    assert HybridKVConfig.from_dict({"disk_path": str(tmp_path)}).integrity_key is None


@pytest.mark.parametrize("value", ["too-short", "", 1234567890123456789, b"sixteen-bytes-of-it"])
def test_bad_integrity_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^integrity_key: ") as err:
        HybridKVConfig.from_dict({"disk_path": str(tmp_path), "integrity_key": value})
    assert not value or str(value) not in str(err.value)  # a secret is never echoed


# ---------------------------------------------------------------------------------------
# The typed model: tiers, shorthand, sources, effective config.

import json  # noqa: E402
import os  # noqa: E402

import pydantic  # noqa: E402

from hybridkv.core.config import (  # noqa: E402
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    effective,
    format_size,
    mask_url,
    parse_mode,
)

GiB, MiB = 1024**3, 1024**2
SECRET = "s3cret-of-sixteen-chars"


@pytest.fixture(autouse=True)
def _no_hybridkv_env(monkeypatch):
    """The shell's HYBRIDKV_* settings must not leak into these tests."""
    for name in list(os.environ):
        if name.startswith("HYBRIDKV_"):
            monkeypatch.delenv(name)


def full_tiers(path):
    return [
        {"kind": "cpu", "bytes": "4GiB"},
        {
            "kind": "disk",
            "path": path,
            "bytes": "64GiB",
            "fsync": False,
            "queue_bytes": "128MiB",
            "mode": "0660",
            "load_weight": 1.0,
            "store": "always",
        },
        {
            "kind": "redis",
            "url": "redis://127.0.0.1:6379/0",
            "cluster": False,
            "ttl_s": None,
            "key_prefix": "hybridkv",
            "timeout_ms": 200,
            "max_entry_bytes": "8MiB",
            "queue_bytes": "256MiB",
            "load_weight": 0.5,
            "store": "on_evict",
        },
    ]


def test_tiers_list(tmp_path):
    cfg = HybridKVConfig.from_dict({"tiers": full_tiers(str(tmp_path))})
    cpu, disk, redis = cfg.tiers
    assert isinstance(cpu, CpuTierConfig) and cpu.bytes == 4 * GiB and cpu.store == "always"
    assert isinstance(disk, DiskTierConfig)
    assert (disk.path, disk.bytes, disk.mode, disk.queue_bytes) == (
        str(tmp_path),
        64 * GiB,
        0o660,
        128 * MiB,
    )
    assert isinstance(redis, RedisTierConfig)
    assert (redis.url, redis.load_weight, redis.store) == (
        "redis://127.0.0.1:6379/0",
        0.5,
        "on_evict",
    )
    assert (cfg.cpu, cfg.disk, cfg.redis) == (cpu, disk, redis)
    assert cfg.tier("disk") is disk
    # The flat attributes read the same values.
    assert (cfg.cpu_bytes, cfg.disk_path, cfg.disk_bytes, cfg.disk_mode) == (
        4 * GiB,
        str(tmp_path),
        64 * GiB,
        0o660,
    )
    assert (cfg.disk_fsync, cfg.disk_queue_bytes) == (False, 128 * MiB)
    assert (cfg.redis_url, cfg.redis_cluster, cfg.redis_ttl_s) == (redis.url, False, None)
    assert (cfg.redis_key_prefix, cfg.redis_timeout_ms) == ("hybridkv", 200)
    assert (cfg.redis_max_entry_bytes, cfg.redis_queue_bytes) == (8 * MiB, 256 * MiB)


def test_tier_order_is_lookup_order(tmp_path):
    tiers = full_tiers(str(tmp_path))
    cfg = HybridKVConfig.from_dict({"tiers": [tiers[0], tiers[2], tiers[1]]})
    assert [t.kind for t in cfg.tiers] == ["cpu", "redis", "disk"]
    assert HybridKVConfig.from_dict({"tiers": [{"kind": "cpu"}]}) == HybridKVConfig()


def test_flat_attributes_without_tiers():
    cfg = HybridKVConfig()
    assert [t.kind for t in cfg.tiers] == ["cpu"]
    assert (cfg.disk, cfg.redis, cfg.disk_path, cfg.redis_url) == (None, None, None, None)
    assert (cfg.disk_bytes, cfg.disk_fsync, cfg.disk_queue_bytes, cfg.disk_mode) == (
        16 * GiB,
        False,
        256 * MiB,
        0o600,
    )
    assert (cfg.redis_cluster, cfg.redis_ttl_s, cfg.redis_key_prefix) == (False, None, "hybridkv")
    assert (cfg.redis_timeout_ms, cfg.redis_max_entry_bytes) == (200, 8 * MiB)
    assert cfg.eviction_alpha == 0.25 and cfg.integrity_key is None and cfg.config_file is None
    assert cfg.load_step_bytes == 64 * MiB


def test_frozen_and_hashable(tmp_path):
    cfg = HybridKVConfig.from_dict({"disk_path": str(tmp_path)})
    with pytest.raises(pydantic.ValidationError):
        cfg.chunk_tokens = 5
    with pytest.raises(pydantic.ValidationError):
        cfg.tiers[1].bytes = 5
    assert hash(cfg) == hash(HybridKVConfig.from_dict({"disk_path": str(tmp_path)}))


@pytest.mark.parametrize(
    ("flat", "tiers"),
    [
        ({}, [{"kind": "cpu"}]),
        ({"cpu_bytes": "1GiB"}, [{"kind": "cpu", "bytes": GiB}]),
        (
            {"disk_path": "{d}", "disk_bytes": "2GiB", "disk_fsync": True, "disk_mode": 0o640},
            [
                {"kind": "cpu"},
                {"kind": "disk", "path": "{d}", "bytes": 2 * GiB, "fsync": True, "mode": "0640"},
            ],
        ),
        (
            {"disk_path": "{d}", "disk_queue_bytes": "1MiB", "redis_url": "redis://h:1/2"},
            [
                {"kind": "cpu"},
                {"kind": "disk", "path": "{d}", "queue_bytes": MiB},
                {"kind": "redis", "url": "redis://h:1/2"},
            ],
        ),
        (
            {
                "cpu_bytes": 7,
                "redis_url": "rediss://h/0",
                "redis_cluster": True,
                "redis_ttl_s": 3600,
                "redis_key_prefix": "kv",
                "redis_timeout_ms": 50,
                "redis_max_entry_bytes": "1MiB",
                "redis_queue_bytes": "64MiB",
                "integrity_key": SECRET,
            },
            [
                {"kind": "cpu", "bytes": 7},
                {
                    "kind": "redis",
                    "url": "rediss://h/0",
                    "cluster": True,
                    "ttl_s": 3600,
                    "key_prefix": "kv",
                    "timeout_ms": 50,
                    "max_entry_bytes": MiB,
                    "queue_bytes": 64 * MiB,
                },
            ],
        ),
    ],
)
def test_shorthand_is_a_tiers_list(tmp_path, flat, tiers):
    d = str(tmp_path / "d")
    flat = {k: v.replace("{d}", d) if isinstance(v, str) else v for k, v in flat.items()}
    tiers = [
        {k: v.replace("{d}", d) if isinstance(v, str) else v for k, v in t.items()} for t in tiers
    ]
    extra = {"integrity_key": flat["integrity_key"]} if "integrity_key" in flat else {}
    a = HybridKVConfig.from_dict(flat)
    b = HybridKVConfig.from_dict({"tiers": tiers, **extra})
    assert a == b and effective(a) == effective(b)
    assert HybridKVConfig(**flat) == a  # direct construction takes the shorthand too


FLAT_VALUES = {
    "cpu_bytes": st.sampled_from([0, "1KiB", "3GB", 12345]),
    "disk_bytes": st.sampled_from(["1GiB", 99, "2TB"]),
    "disk_fsync": st.booleans(),
    "disk_direct_io": st.booleans(),
    "disk_queue_bytes": st.sampled_from(["1MiB", 4096]),
    "disk_mode": st.sampled_from(["0600", "0660", 0o640]),
    "redis_cluster": st.booleans(),
    "redis_ttl_s": st.sampled_from([None, 1, 86400]),
    "redis_key_prefix": st.sampled_from(["hybridkv", "a:b"]),
    "redis_timeout_ms": st.integers(1, 10_000),
    "redis_max_entry_bytes": st.sampled_from(["4KiB", "8MiB", 10**6]),
    "redis_queue_bytes": st.sampled_from(["1MiB", 10**9]),
}


@given(
    flat=st.fixed_dictionaries({}, optional=FLAT_VALUES),
    disk=st.booleans(),
    redis=st.booleans(),
)
def test_shorthand_is_a_tiers_list_property(flat, disk, redis):
    flat = {k: v for k, v in flat.items() if (disk or not k.startswith("disk_"))}
    flat = {k: v for k, v in flat.items() if (redis or not k.startswith("redis_"))}
    if disk:
        flat["disk_path"] = "/tmp/hybridkv-config-test"
    if redis:
        flat["redis_url"] = "redis://127.0.0.1:6379/0"
    tiers: list[dict] = [{"kind": "cpu"}]
    for key, value in flat.items():
        kind, _, field_name = key.partition("_")
        t = next((t for t in tiers if t["kind"] == kind), None)
        if t is None:
            t = {"kind": kind}
            tiers.append(t)
        t[field_name] = value
    tiers.sort(key=lambda t: ["cpu", "disk", "redis"].index(t["kind"]))
    assert HybridKVConfig.from_dict(flat, env={}) == HybridKVConfig.from_dict(
        {"tiers": tiers}, env={}
    )


# Every validation error path names its key -----------------------------------------------


def _err(raw, key, env=None):
    with pytest.raises(ConfigError) as e:
        HybridKVConfig.from_dict(raw, env=env or {})
    msg = str(e.value)
    assert msg.startswith(f"{key}: "), msg
    return msg


@pytest.mark.parametrize(
    ("tier", "key"),
    [
        ({"kind": "disk"}, "tiers[1].path"),
        ({"kind": "disk", "path": ""}, "tiers[1].path"),
        ({"kind": "disk", "path": "{d}", "bytes": 0}, "tiers[1].bytes"),
        ({"kind": "disk", "path": "{d}", "bytes": "1 furlong"}, "tiers[1].bytes"),
        ({"kind": "disk", "path": "{d}", "fsync": "yes"}, "tiers[1].fsync"),
        ({"kind": "disk", "path": "{d}", "queue_bytes": 0}, "tiers[1].queue_bytes"),
        ({"kind": "disk", "path": "{d}", "mode": "0400"}, "tiers[1].mode"),
        ({"kind": "disk", "path": "{d}", "load_weight": 0}, "tiers[1].load_weight"),
        ({"kind": "disk", "path": "{d}", "load_weight": -1.0}, "tiers[1].load_weight"),
        ({"kind": "disk", "path": "{d}", "load_weight": float("inf")}, "tiers[1].load_weight"),
        ({"kind": "disk", "path": "{d}", "load_weight": True}, "tiers[1].load_weight"),
        ({"kind": "disk", "path": "{d}", "store": "sometimes"}, "tiers[1].store"),
        ({"kind": "disk", "path": "{d}", "paht": "x"}, "tiers[1].paht"),
        ({"kind": "redis"}, "tiers[1].url"),
        ({"kind": "redis", "url": "http://h/0"}, "tiers[1].url"),
        ({"kind": "redis", "url": "redis://h:port/0"}, "tiers[1].url"),
        ({"kind": "redis", "url": "redis:///0"}, "tiers[1].url"),
        ({"kind": "redis", "url": 6379}, "tiers[1].url"),
        ({"kind": "redis", "url": "redis://h", "cluster": 1}, "tiers[1].cluster"),
        ({"kind": "redis", "url": "redis://h", "ttl_s": 0}, "tiers[1].ttl_s"),
        ({"kind": "redis", "url": "redis://h", "ttl_s": 1.5}, "tiers[1].ttl_s"),
        ({"kind": "redis", "url": "redis://h", "key_prefix": ""}, "tiers[1].key_prefix"),
        ({"kind": "redis", "url": "redis://h", "key_prefix": "a{b}"}, "tiers[1].key_prefix"),
        ({"kind": "redis", "url": "redis://h", "timeout_ms": 0}, "tiers[1].timeout_ms"),
        (
            {"kind": "redis", "url": "redis://h", "max_entry_bytes": "1KiB"},
            "tiers[1].max_entry_bytes",
        ),
        ({"kind": "redis", "url": "redis://h", "queue_bytes": 0}, "tiers[1].queue_bytes"),
        ({"kind": "redis", "url": "redis://h", "bytes": "1GiB"}, "tiers[1].bytes"),
        ({"kind": "ssd"}, "tiers[1].kind"),
        ({"path": "/x"}, "tiers[1].kind"),
        ("disk", "tiers[1]"),
    ],
)
def test_bad_tier(tmp_path, tier, key):
    if isinstance(tier, dict):
        tier = {
            k: v.replace("{d}", str(tmp_path)) if isinstance(v, str) else v for k, v in tier.items()
        }
    _err({"tiers": [{"kind": "cpu"}, tier]}, key)


@pytest.mark.parametrize(
    ("cpu", "key"),
    [
        ({"kind": "cpu", "bytes": -1}, "tiers[0].bytes"),
        ({"kind": "cpu", "store": "never"}, "tiers[0].store"),
        ({"kind": "cpu", "path": "/x"}, "tiers[0].path"),
    ],
)
def test_bad_cpu_tier(cpu, key):
    _err({"tiers": [cpu]}, key)


def test_tier_list_structure(tmp_path):
    disk = {"kind": "disk", "path": str(tmp_path)}
    redis = {"kind": "redis", "url": "redis://h/0"}
    assert "required" in _err({"tiers": []}, "tiers")
    assert "required" in _err({"tiers": [disk]}, "tiers")
    assert "first" in _err({"tiers": [disk, {"kind": "cpu"}]}, "tiers[1].kind")
    assert "second" in _err({"tiers": [{"kind": "cpu"}, disk, disk]}, "tiers[2].kind")
    assert "second" in _err({"tiers": [{"kind": "cpu"}, redis, disk, redis]}, "tiers[3].kind")
    assert "second" in _err({"tiers": [{"kind": "cpu"}, {"kind": "cpu"}]}, "tiers[1].kind")
    _err({"tiers": "cpu"}, "tiers")
    assert HybridKVConfig.from_dict({"tiers": None}) == HybridKVConfig()  # null: the default
    assert HybridKVConfig.from_dict({"tiers": None, "cpu_bytes": 1}).cpu_bytes == 1


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"redis_url": "redis://h", "redis_cluster": "no"}, "redis_cluster"),
        ({"redis_url": "redis://h", "redis_ttl_s": -5}, "redis_ttl_s"),
        ({"redis_url": "redis://h", "redis_key_prefix": "{x"}, "redis_key_prefix"),
        ({"redis_url": "redis://h", "redis_timeout_ms": "fast"}, "redis_timeout_ms"),
        ({"redis_url": "redis://h", "redis_max_entry_bytes": 100}, "redis_max_entry_bytes"),
        ({"redis_url": "redis://h", "redis_queue_bytes": "-1"}, "redis_queue_bytes"),
        ({"redis_url": "ftp://h"}, "redis_url"),
        ({"redis_url": ""}, "redis_url"),
        ({"eviction_alpha": -0.1}, "eviction_alpha"),
        ({"eviction_alpha": "1"}, "eviction_alpha"),
        ({"eviction_alpha": True}, "eviction_alpha"),
        ({"eviction_alpha": float("nan")}, "eviction_alpha"),
        ({"config_file": 7}, "config_file"),
        ({"config_file": ""}, "config_file"),
    ],
)
def test_bad_settings(raw, key):
    _err(raw, key)


@pytest.mark.parametrize(
    "key",
    [
        "redis_cluster",
        "redis_ttl_s",
        "redis_key_prefix",
        "redis_timeout_ms",
        "redis_max_entry_bytes",
        "redis_queue_bytes",
    ],
)
def test_redis_setting_without_redis_url(key):
    assert "has no effect without redis_url" in _err({key: 1}, key)
    assert "has no effect without redis_url" in _err({key: 1, "redis_url": None}, key)


@pytest.mark.parametrize("key", ["cpu_bytes", "disk_path", "disk_mode", "redis_url", "redis_ttl_s"])
def test_shorthand_and_tiers_in_one_place(key):
    msg = _err({"tiers": [{"kind": "cpu"}], key: "1"}, key)
    assert "tiers" in msg


def test_integrity_key_with_redis_only():
    cfg = HybridKVConfig.from_dict({"redis_url": "redis://h/0", "integrity_key": SECRET})
    assert cfg.integrity_key == SECRET and cfg.disk_path is None
    tiers = [{"kind": "cpu"}, {"kind": "redis", "url": "redis://h/0"}]
    assert HybridKVConfig.from_dict({"tiers": tiers, "integrity_key": SECRET}) == cfg
    _err({"tiers": [{"kind": "cpu"}], "integrity_key": SECRET}, "integrity_key")


def test_errors_from_direct_construction_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^disk_bytes: "):
        HybridKVConfig(disk_path=str(tmp_path), disk_bytes=0)
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.bytes: "):
        HybridKVConfig(tiers=[CpuTierConfig(), {"kind": "disk", "path": str(tmp_path), "bytes": 0}])
    cfg = HybridKVConfig(tiers=[CpuTierConfig(bytes=5), DiskTierConfig(path=str(tmp_path))])
    assert (cfg.cpu_bytes, cfg.disk_path) == (5, str(tmp_path))


def test_many_errors_one_line_each():
    msg = _err({"zzz": 1, "chunk_tokens": 0, "eviction_alpha": -1}, "zzz")
    lines = msg.splitlines()
    assert [line.split(":")[0] for line in lines] == ["zzz", "chunk_tokens", "eviction_alpha"]


# Unwritable and unusable disk paths ---------------------------------------------------


def test_disk_path_unwritable(tmp_path, monkeypatch):
    """The check itself (root may write anywhere, so os.access is made to refuse)."""
    real_access = os.access
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    monkeypatch.setattr(os, "access", lambda p, m: p != locked and real_access(p, m))
    assert "not writable" in _err({"disk_path": f"{locked}/a/b"}, "disk_path")
    tiers = [{"kind": "cpu"}, {"kind": "disk", "path": f"{locked}/new"}]
    assert "not writable" in _err({"tiers": tiers}, "tiers[1].path")
    assert "not readable" in _err({"disk_path": locked}, "disk_path")
    HybridKVConfig.from_dict({"disk_path": str(tmp_path / "free" / "new")})


def test_existing_read_only_disk_path_is_accepted(tmp_path, monkeypatch):
    """A directory of entries this process may read but not write serves hits (the disk
    tier stores nothing there and says so): not a configuration error."""
    real_access = os.access
    frozen = str(tmp_path / "frozen")
    os.mkdir(frozen)
    monkeypatch.setattr(
        os, "access", lambda p, m: real_access(p, m) and not (p == frozen and m & os.W_OK)
    )
    assert HybridKVConfig.from_dict({"disk_path": frozen}).disk_path == frozen
    _err({"disk_path": f"{frozen}/sub"}, "disk_path")  # but nothing can be created in it


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_disk_path_unwritable_for_real(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        _err({"disk_path": str(locked / "cache")}, "disk_path")
    finally:
        locked.chmod(0o700)


def test_disk_path_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert "is not a directory" in _err({"disk_path": str(f / "sub" / "dir")}, "disk_path")
    tiers = [{"kind": "cpu"}, {"kind": "disk", "path": str(f)}]
    assert "is not a directory" in _err({"tiers": tiers}, "tiers[1].path")


# Sources: config_file < kv_connector_extra_config < HYBRIDKV_* environment ----------------


def test_yaml_config_file(tmp_path):
    d = tmp_path / "cache"
    f = tmp_path / "hybridkv.yaml"
    f.write_text(
        "# hybridkv settings\n"
        "tiers:\n"
        "  - {kind: cpu, bytes: 4GiB}\n"
        f"  - kind: disk\n    path: {d}\n    bytes: 64GiB\n    mode: 0660\n"
        "  - {kind: redis, url: 'redis://127.0.0.1:6379/0', ttl_s: 3600}\n"
        "chunk_tokens: 64\n"
    )
    cfg = HybridKVConfig.from_dict({"config_file": str(f)}, env={})
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert (cfg.cpu_bytes, cfg.disk_path, cfg.disk_mode) == (4 * GiB, str(d), 0o660)
    assert (cfg.redis_ttl_s, cfg.chunk_tokens, cfg.config_file) == (3600, 64, str(f))


def test_json_config_file(tmp_path):
    f = tmp_path / "hybridkv.json"
    f.write_text(json.dumps({"cpu_bytes": "1GiB", "checkpoint_policy": "every_chunk"}))
    cfg = HybridKVConfig.from_dict({"config_file": str(f)}, env={})
    assert (cfg.cpu_bytes, cfg.checkpoint_policy) == (GiB, "every_chunk")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert HybridKVConfig.from_dict({"config_file": str(empty)}) == HybridKVConfig(
        config_file=str(empty)
    )


def test_precedence_file_dict_env(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu_bytes: 1GiB\nchunk_tokens: 16\nmodel_id: from-file\neviction_alpha: 3\n")
    raw = {"config_file": str(f), "chunk_tokens": 32, "model_id": "from-dict"}
    env = {"HYBRIDKV_MODEL_ID": "from-env", "HYBRIDKV_EVICTION_ALPHA": "0.5"}
    cfg = HybridKVConfig.from_dict(raw, env=env)
    assert cfg.cpu_bytes == GiB  # file only
    assert cfg.chunk_tokens == 32  # dict over file
    assert cfg.model_id == "from-env"  # env over dict
    assert cfg.eviction_alpha == 0.5  # env over file
    assert HybridKVConfig.from_dict(raw, env={}).model_id == "from-dict"
    assert raw == {"config_file": str(f), "chunk_tokens": 32, "model_id": "from-dict"}


def test_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CPU_BYTES", "8GiB")
    assert HybridKVConfig.from_dict({"cpu_bytes": "1GiB"}).cpu_bytes == 8 * GiB
    monkeypatch.setenv("HYBRIDKV_CPU_BYTES", "")  # empty: unset
    assert HybridKVConfig.from_dict({"cpu_bytes": "1GiB"}).cpu_bytes == GiB


def test_env_value_types(tmp_path):
    env = {
        "HYBRIDKV_DISK_PATH": str(tmp_path),
        "HYBRIDKV_DISK_FSYNC": "true",
        "HYBRIDKV_DISK_DIRECT_IO": "on",
        "HYBRIDKV_DISK_MODE": "0660",
        "HYBRIDKV_CHUNK_TOKENS": "128",
        "HYBRIDKV_REDIS_URL": "redis://h/0",
        "HYBRIDKV_REDIS_CLUSTER": "no",
        "HYBRIDKV_REDIS_TTL_S": "none",
        "HYBRIDKV_REDIS_TIMEOUT_MS": "75",
        "HYBRIDKV_INTEGRITY_KEY": "1234567890123456789",
        "HYBRIDKV_MODEL_ID": "123",
        "HYBRIDKV_HOME": "/not/a/setting",
    }
    cfg = HybridKVConfig.from_dict({"redis_ttl_s": 9, "redis_url": "redis://x/1"}, env=env)
    assert (cfg.disk_path, cfg.disk_fsync, cfg.disk_mode) == (str(tmp_path), True, 0o660)
    assert cfg.disk_direct_io
    assert (cfg.chunk_tokens, cfg.redis_url, cfg.redis_cluster) == (128, "redis://h/0", False)
    assert (cfg.redis_ttl_s, cfg.redis_timeout_ms) == (None, 75)
    assert (cfg.integrity_key, cfg.model_id) == ("1234567890123456789", "123")


def test_env_errors_name_the_key_and_variable():
    msg = _err({}, "cpu_bytes", env={"HYBRIDKV_CPU_BYTES": "lots"})
    assert "HYBRIDKV_CPU_BYTES" in msg
    msg = _err({}, "chunk_tokens", env={"HYBRIDKV_CHUNK_TOKENS": "many"})
    assert "HYBRIDKV_CHUNK_TOKENS" in msg
    _err({}, "disk_fsync", env={"HYBRIDKV_DISK_FSYNC": "maybe", "HYBRIDKV_DISK_PATH": "/tmp"})
    _err({}, "disk_bytes", env={"HYBRIDKV_DISK_BYTES": "1GiB"})


def test_unknown_env_variable_is_ignored_with_a_warning(caplog):
    cfg = HybridKVConfig.from_dict({}, env={"HYBRIDKV_CPU_BYTS": "1GiB", "HYBRIDKV_TIERS": "[]"})
    assert cfg == HybridKVConfig()
    assert "HYBRIDKV_CPU_BYTS" in caplog.text and "HYBRIDKV_TIERS" in caplog.text


def test_env_shorthand_over_a_tiers_list(tmp_path):
    tiers = [{"kind": "cpu", "bytes": "1GiB"}, {"kind": "redis", "url": "redis://h/0"}]
    env = {"HYBRIDKV_CPU_BYTES": "2GiB", "HYBRIDKV_DISK_PATH": str(tmp_path)}
    cfg = HybridKVConfig.from_dict({"tiers": tiers}, env=env)
    # The disk tier joins under cpu and above redis, as the shorthand orders them.
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert (cfg.cpu_bytes, cfg.disk_path, cfg.redis_url) == (2 * GiB, str(tmp_path), "redis://h/0")
    env = {"HYBRIDKV_REDIS_TIMEOUT_MS": "9"}
    assert HybridKVConfig.from_dict({"tiers": tiers}, env=env).redis_timeout_ms == 9
    # A shorthand key for a tier the list lacks, without its path or URL, names itself.
    _err({"tiers": tiers}, "disk_bytes", env={"HYBRIDKV_DISK_BYTES": "1GiB"})


def test_dict_shorthand_over_file_tiers(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(f"tiers:\n  - kind: cpu\n  - kind: disk\n    path: {tmp_path}\n    bytes: 1GiB\n")
    cfg = HybridKVConfig.from_dict({"config_file": str(f), "disk_bytes": "2GiB"}, env={})
    assert (cfg.disk_path, cfg.disk_bytes) == (str(tmp_path), 2 * GiB)
    # A null disk_path in a higher source removes the lower source's disk tier.
    cfg = HybridKVConfig.from_dict({"config_file": str(f), "disk_path": None}, env={})
    assert cfg.disk is None
    # A tiers list in a higher source replaces the whole list.
    cfg = HybridKVConfig.from_dict({"config_file": str(f), "tiers": [{"kind": "cpu"}]}, env={})
    assert [t.kind for t in cfg.tiers] == ["cpu"]


def test_config_file_from_env(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu_bytes: 3GiB\n")
    cfg = HybridKVConfig.from_dict(
        {"config_file": "/nonexistent.yaml"}, env={"HYBRIDKV_CONFIG_FILE": str(f)}
    )
    assert (cfg.cpu_bytes, cfg.config_file) == (3 * GiB, str(f))


@pytest.mark.parametrize(
    ("text", "name", "expect"),
    [
        ("cpu_bytes: [1, 2", "c.yaml", "not valid YAML"),
        ('{"cpu_bytes": ', "c.json", "not valid JSON"),
        ("- cpu_bytes: 1\n", "c.yaml", "must hold a mapping"),
        ("just a string\n", "c.yaml", "must hold a mapping"),
        ("config_file: other.yaml\n", "c.yaml", "do not nest"),
    ],
)
def test_bad_config_file(tmp_path, text, name, expect):
    f = tmp_path / name
    f.write_text(text)
    assert expect in _err({"config_file": str(f)}, "config_file")


def test_missing_config_file(tmp_path):
    assert "cannot read" in _err({"config_file": str(tmp_path / "nope.yaml")}, "config_file")


def test_errors_in_a_config_file_name_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu_bytes: lots\n")
    assert str(f) in _err({"config_file": str(f)}, "cpu_bytes")
    f.write_text("cpu_bites: 1\n")
    msg = _err({"config_file": str(f)}, "cpu_bites")
    assert f"unknown hybridkv setting in config_file '{f}'" in msg
    f.write_text("tiers: [{kind: cpu}, {kind: disk, path: ''}]\n")
    assert str(f) in _err({"config_file": str(f)}, "tiers[1].path")
    f.write_text("tiers: [{kind: cpu}]\ncpu_bytes: 1\n")
    assert str(f) in _err({"config_file": str(f)}, "cpu_bytes")


# Secrets and the effective configuration ----------------------------------------------


def test_effective_masks_secrets(tmp_path):
    url = "redis://user:hunter2-password@127.0.0.1:6379/0"
    raw = {"disk_path": str(tmp_path), "redis_url": url, "integrity_key": SECRET}
    cfg = HybridKVConfig.from_dict(raw)
    eff = effective(cfg)
    text = json.dumps(eff)  # JSON-serializable, for one log line
    assert SECRET not in text and "hunter2" not in text
    assert eff["integrity_key"] == "***"
    assert eff["tiers"][2]["url"] == "redis://user:***@127.0.0.1:6379/0"
    assert eff["tiers"][0] == {
        "kind": "cpu",
        "bytes": "2GiB",
        "load_weight": 1.0,
        "store": "always",
    }
    assert eff["tiers"][1]["mode"] == "0600" and eff["tiers"][1]["bytes"] == "16GiB"
    assert SECRET not in repr(cfg) and "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    assert cfg.redis_url == url  # the tier itself gets the real URL
    assert effective(HybridKVConfig())["integrity_key"] is None


@pytest.mark.parametrize(
    "extra", [{"chunk_tokens": 32, "model_id": "m"}, {}], ids=["set", "defaults"]
)
def test_effective_is_a_valid_config(tmp_path, extra):
    cfg = HybridKVConfig.from_dict({"tiers": full_tiers(str(tmp_path)), **extra}, env={})
    assert HybridKVConfig.from_dict(effective(cfg), env={}) == cfg
    assert HybridKVConfig.from_dict(effective(HybridKVConfig()), env={}) == HybridKVConfig()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("rediss://u:pw@h/0", "rediss://u:***@h/0"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        # a password holding '#', '?' or '/' ends the authority urllib parses
        ("redis://:S3cr#t@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:a/b?c@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://user:p@ss/word@host:6379", "redis://user:***@host:6379"),
        # an '@' in the query: masked more than needed (only ever shown), never less
        ("redis://host:6379/0?password=p@ss", "redis://host:***@ss"),
        ("unix:///tmp/r.sock?password=x@y", "unix://***@y"),
        ("redis://:p/w@h:1/0?password=x", "redis://:***@h:1/0?password=***"),
    ],
)
def test_mask_url(url, shown):
    assert mask_url(url) == shown


@pytest.mark.parametrize("password", ["S3cr#tPW", "S3cr?tPW", "S3cr/tPW", "1234/tPW"])
def test_a_password_urllib_misreads_is_never_shown(password):
    """urllib takes what follows '#', '?' or '/' for the path, query or fragment, and
    what precedes it for the port: neither the URL shown nor urllib's complaint about the
    port may carry any part of the password."""
    msg = _err({"redis_url": f"redis://:{password}@cache:6379/0"}, "redis_url")
    assert "S3cr" not in msg and "tPW" not in msg and "1234" not in msg, msg


def test_url_errors_do_not_echo_passwords():
    msg = _err({"redis_url": "redis://:hunter2@h:bad/0"}, "redis_url")
    assert "hunter2" not in msg
    msg = _err(
        {"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "http://:hunter2@h"}]}, "tiers[1].url"
    )
    assert "hunter2" not in msg


@pytest.mark.parametrize("value", ["too-short", 1234567890123456789, b"sixteen-bytes-of-it"])
def test_integrity_key_never_echoed(value):
    envs = [{}] + ([{"HYBRIDKV_INTEGRITY_KEY": value}] if isinstance(value, str) else [])
    for env in envs:
        raw = {"redis_url": "redis://h/0"} | ({} if env else {"integrity_key": value})
        msg = _err(raw, "integrity_key", env=env)
        assert str(value) not in msg


# Sizes (property tests) -----------------------------------------------------------------

ALL_UNITS = {
    "": 1,
    "B": 1,
    **{p + s: 1000 ** (i + 1) for i, p in enumerate("KMGT") for s in ("", "B")},
    **{p + s: 1024 ** (i + 1) for i, p in enumerate("KMGT") for s in ("i", "iB")},
}


@given(
    n=st.integers(0, 10**9),
    unit=st.sampled_from(sorted(ALL_UNITS)),
    space=st.sampled_from(["", " "]),
)
def test_size_round_trip_every_unit(n, unit, space):
    text = f"{n}{space}{unit}"
    assert parse_size(text) == n * ALL_UNITS[unit]
    assert parse_size(text.lower()) == parse_size(text.upper()) == n * ALL_UNITS[unit]
    assert HybridKVConfig(cpu_bytes=text).cpu_bytes == n * ALL_UNITS[unit]


@given(n=st.integers(0, 10**6), frac=st.integers(0, 999), unit=st.sampled_from(sorted(ALL_UNITS)))
def test_fractional_sizes_floor(n, frac, unit):
    assert parse_size(f"{n}.{frac:03d}{unit}") == (n * 1000 + frac) * ALL_UNITS[unit] // 1000


@given(n=st.integers(0, 2**60))
def test_format_size_round_trip(n):
    assert parse_size(format_size(n)) == n


@given(
    n=st.integers(0, 10**6),
    unit=st.sampled_from(sorted(ALL_UNITS)),
    junk=st.sampled_from(["x", "!", "BB", "-1", "e3", "/s", "Q", "%", ",5", "iBB", " 5"]),
    where=st.sampled_from(["prefix", "suffix"]),
)
def test_garbage_sizes_rejected(n, unit, junk, where):
    if where == "prefix" and junk in (" 5",):
        junk = "-"
    text = f"{junk}{n}{unit}" if where == "prefix" else f"{n}{unit}{junk}"
    with pytest.raises(ConfigError, match=r"^disk_bytes: "):
        HybridKVConfig.from_dict({"disk_path": "/tmp", "disk_bytes": text}, env={})


@given(value=st.one_of(st.floats(), st.none(), st.lists(st.integers()), st.integers(max_value=-1)))
def test_non_sizes_rejected(value):
    with pytest.raises(ConfigError, match=r"^cpu_bytes: "):
        HybridKVConfig(cpu_bytes=value)


@given(text=st.text(alphabet=st.characters(blacklist_categories=["Nd"]), min_size=1))
def test_sizes_without_digits_rejected(text):
    with pytest.raises(ConfigError, match=r"^k: "):
        parse_size(text, "k")


@given(mode=st.integers(0, 0o777))
def test_mode_round_trip(mode):
    if mode & 0o600 == 0o600:
        assert parse_mode(f"0{mode:o}") == parse_mode(mode) == mode
    else:
        with pytest.raises(ConfigError, match=r"^disk_mode: "):
            parse_mode(mode)


# metrics_host, and the warning for shared tiers without integrity_key ------------------


def test_metrics_host():
    assert HybridKVConfig().metrics_host == "127.0.0.1"  # this machine alone by default
    assert HybridKVConfig.from_dict({"metrics_host": "0.0.0.0"}).metrics_host == "0.0.0.0"
    env = {"HYBRIDKV_METRICS_HOST": "10.0.0.5"}
    assert HybridKVConfig.from_dict({"metrics_host": "0.0.0.0"}, env=env).metrics_host == "10.0.0.5"
    for bad in ("", None, 8080):
        _err({"metrics_host": bad}, "metrics_host")


def _warnings(caplog, raw):
    from hybridkv.core.shared_tiers import warn_unprotected_tiers

    caplog.clear()
    warn_unprotected_tiers(HybridKVConfig.from_dict(raw, env={}))
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_shared_disk_without_integrity_key_warns(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)  # mkdir's mode is masked by the umask
    (msg,) = _warnings(caplog, {"disk_path": str(shared)})
    assert str(shared) in msg and "integrity_key" in msg and "0o770" in msg
    shared.chmod(0o707)
    assert len(_warnings(caplog, {"disk_path": str(shared)})) == 1
    # Files others may write, in a private directory (or one not made yet).
    shared.chmod(0o700)
    assert len(_warnings(caplog, {"disk_path": str(shared), "disk_mode": "0660"})) == 1
    assert len(_warnings(caplog, {"disk_path": str(tmp_path / "new"), "disk_mode": "0660"})) == 1
    # A private directory, or the key: nothing to say.
    assert _warnings(caplog, {"disk_path": str(shared)}) == []
    assert _warnings(caplog, {"disk_path": str(tmp_path / "new")}) == []
    shared.chmod(0o777)
    assert _warnings(caplog, {"disk_path": str(shared), "integrity_key": SECRET}) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_disk_directory_of_another_user_warns(tmp_path, caplog):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    (msg,) = _warnings(caplog, {"disk_path": str(theirs)})
    assert "another user" in msg


def test_redis_without_integrity_key_warns(caplog):
    url = "redis://:hunter2@cache:6379/0"
    (msg,) = _warnings(caplog, {"redis_url": url})
    assert "redis://:***@cache:6379/0" in msg and "hunter2" not in msg
    assert _warnings(caplog, {"redis_url": url, "integrity_key": SECRET}) == []
    assert _warnings(caplog, {}) == []  # the cpu tier alone is this process's own


def test_config_errors_never_repeat_a_secret(tmp_path):
    """A YAML syntax error is told by its place, not by the line (which may hold the
    key); a tier written as a mapping, or as a list, shows its URL with the password
    masked; an infinite eviction_alpha is refused."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu_bytes: 1GiB\nintegrity_key: @Kq9#zT!r2vX8mLp\n")
    with pytest.raises(ConfigError) as e:
        HybridKVConfig.from_dict({"config_file": str(bad)}, env={})
    assert "line 2" in str(e.value) and "Kq9" not in str(e.value)
    for tiers in (
        {"redis": {"url": "redis://:FILESECRET@h:6379"}},
        [["redis://:FILESECRET@h:6379"]],
    ):
        with pytest.raises(ConfigError) as e:
            HybridKVConfig.from_dict({"tiers": tiers}, env={})
        assert "tiers" in str(e.value) and "FILESECRET" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="eviction_alpha"):
        HybridKVConfig.from_dict({"eviction_alpha": float("inf")}, env={})


@pytest.mark.parametrize(
    "query", ["passwrd=x", "socket_timeout=abc"], ids=["misspelt", "bad-value"]
)
def test_a_redis_url_option_redis_py_refuses_fails_at_start(query):
    """Not a tier that stays down: the engine would only see it when it connects."""
    with pytest.raises(ConfigError, match="redis_url"):
        HybridKVConfig.from_dict({"redis_url": f"redis://h:6379/0?{query}"}, env={})
    HybridKVConfig.from_dict({"redis_url": "redis://h:6379/0?socket_timeout=2"}, env={})


@pytest.mark.parametrize(
    ("setting", "value"), [("store", "on_evict"), ("load_weight", 2.0)], ids=["store", "weight"]
)
def test_a_cpu_tier_setting_that_would_be_ignored_is_refused(setting, value):
    """The cpu tier takes every store and serves every hit it holds first: a setting
    that means something only below it fails, naming it, instead of being ignored."""
    with pytest.raises(ConfigError, match=f"tiers\\[0\\].{setting}"):
        HybridKVConfig.from_dict({"tiers": [{"kind": "cpu", setting: value}]}, env={})


def test_secrets_in_the_extra_config_are_named_not_shown(caplog):
    """vLLM logs kv_connector_extra_config verbatim at start: a secret there warns,
    naming the keys (never the secret), and says where secrets belong; the same
    settings without secrets warn of nothing."""
    from hybridkv.core.shared_tiers import warn_logged_secrets

    raw = {
        "integrity_key": SECRET,
        "tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "redis://:hunter2@h:6379/0"}],
        "redis_url": "redis://h:6379/0?password=hunter3",
    }
    caplog.clear()
    warn_logged_secrets(raw)
    (msg,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "integrity_key" in msg and "tiers[1].url" in msg and "redis_url" in msg, msg
    assert SECRET not in msg and "hunter" not in msg and "HYBRIDKV_INTEGRITY_KEY" in msg
    caplog.clear()
    warn_logged_secrets({"redis_url": "redis://h:6379/0", "tiers": [{"kind": "cpu"}]})
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
