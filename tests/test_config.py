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
    assert cfg == HybridKVConfig(512 * 1024**2, 256, "every_chunk", "org/model")
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


@pytest.mark.parametrize("value", ["every", "", None, "PROMPT_AND_END", 1])
def test_bad_checkpoint_policy(value):
    with pytest.raises(ConfigError, match=r"^checkpoint_policy: "):
        HybridKVConfig.from_dict({"checkpoint_policy": value})


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
            "disk_queue_bytes": "64MiB",
        }
    )
    assert (cfg.disk_path, cfg.disk_bytes) == (str(tmp_path / "new"), 2 * 1024**3)
    assert (cfg.disk_fsync, cfg.disk_queue_bytes) == (True, 64 * 1024**2)
    assert HybridKVConfig.from_dict({"disk_path": str(tmp_path)}).disk_bytes == 16 * 1024**3
    assert HybridKVConfig().disk_path is None


@pytest.mark.parametrize(
    "key", ["disk_bytes", "disk_fsync", "disk_queue_bytes", "disk_mode", "integrity_key"]
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
