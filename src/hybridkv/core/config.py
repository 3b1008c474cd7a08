"""User configuration: one typed model of hybridkv's settings, checked once at engine start.

Sources, lowest to highest precedence (a key given by a higher source replaces it):

1. defaults (below, and docs/config.md);
2. `config_file`: a YAML or JSON file (a mapping of the same keys) named by the
   `config_file` key of `kv_connector_extra_config` or by `HYBRIDKV_CONFIG_FILE`;
3. `kv_connector_extra_config` itself (the dict handed to `HybridKVConfig.from_dict`);
4. `HYBRIDKV_<KEY>` environment variables, for the scalar top-level and shorthand keys
   (`HYBRIDKV_CPU_BYTES=8GiB`, `HYBRIDKV_DISK_PATH=/var/cache/hybridkv`,
   `HYBRIDKV_REDIS_URL=redis://cache:6379/0`); an empty variable counts as unset.

Tiers are a list in lookup order (`tiers: [{kind: cpu, ...}, {kind: disk, ...},
{kind: redis, ...}]`): the first is the cpu tier, at most one of each kind. The flat keys
`cpu_bytes`, `disk_*` and `redis_*` are a shorthand for the same list: within one source
they cannot be combined with `tiers`, and a higher source's shorthand key sets that field
of the lower sources' tier of its kind (adding the disk or redis tier when it gives
`disk_path` / `redis_url`; a null `disk_path` / `redis_url` removes it).

Every error is a `ConfigError` whose message starts with the key at fault (`disk_bytes: ...`,
`tiers[2].url: ...`), so a bad deployment fails at engine start rather than silently running
without a cache. Secrets (`integrity_key`, passwords in Redis URLs) are never echoed in
errors, reprs, or `effective()`, which gives the configuration as it applies, for logging
once at start. docs/config.md describes every key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from decimal import Decimal
from typing import Annotated, Any, Generic, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticUndefined

log = logging.getLogger(__name__)

KiB, MiB, GiB = 1024, 1024**2, 1024**3

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
# K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024; a trailing B changes nothing.
_UNITS = {"": 1, "B": 1}
for _power, _prefix in enumerate("KMGT", start=1):
    for _suffix, _base in (("", 1000), ("B", 1000), ("I", 1024), ("IB", 1024)):
        _UNITS[_prefix + _suffix] = _base**_power


class ConfigError(ValueError):
    """A bad hybridkv setting; the message starts with the key at fault."""


class _Invalid(ValueError):
    """A bad value, before it is known under which key (the caller adds the key)."""


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise _Invalid(f"expected a size like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise _Invalid(f"expected a size like '512MiB' or an integer, got {value!r}")
    if n < 0:
        raise _Invalid(f"size must not be negative, got {value!r}")
    return n


Size = Annotated[int, BeforeValidator(_size)]


def parse_size(value: Any, key: str = "size") -> int:
    """Parse a byte count: an int, or a string such as "512MiB", "2GB", "1.5 GiB"
    (K, M, G, T: powers of 1000; Ki, Mi, Gi, Ti: powers of 1024; fractions of a byte are
    dropped)."""
    try:
        return _size(value)
    except _Invalid as e:
        raise ConfigError(f"{key}: {e}") from None


def format_size(n: int) -> str:
    """The shortest exact spelling of `n` bytes that `parse_size` reads back ("2GiB")."""
    for unit, mult in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    for unit, mult in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


_MODE_RE = re.compile(r"^(?:0o?)?([0-7]{1,4})$", re.IGNORECASE)


def _mode(value: Any) -> int:
    m = _MODE_RE.match(value.strip()) if isinstance(value, str) else None
    if m:
        mode = int(m.group(1), 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise _Invalid(f"expected octal permissions like '0660', got {value!r}")
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise _Invalid(
            f"permissions must be within 0777 and let the owner read and write "
            f"(0600), got {value!r} ({mode:#o})"
        )
    return mode


Mode = Annotated[int, BeforeValidator(_mode)]


def parse_mode(value: Any, key: str = "disk_mode") -> int:
    """Parse file permissions: an int (0o660) or an octal string ("0660", "660", "0o660").
    The owner must be able to read and write; nothing beyond 0o777 (no setuid, sticky)."""
    try:
        return _mode(value)
    except _Invalid as e:
        raise ConfigError(f"{key}: {e}") from None


# ---------------------------------------------------------------------------------------
# Value types: each check raises _Invalid with a message that names no key (the error's
# location does) and never echoes a secret.


def _positive_size(value: Any) -> int:
    n = _size(value)
    if n == 0:
        raise _Invalid("must be more than 0 bytes")
    return n


PositiveSize = Annotated[int, BeforeValidator(_positive_size)]


MIN_PART_BYTES = 4096  # the Redis tier's smallest part (core/tiers/redis.py)


def _part_size(value: Any) -> int:
    n = _size(value)
    if n < MIN_PART_BYTES:
        raise _Invalid(f"must be at least {MIN_PART_BYTES} bytes (4KiB), got {value!r}")
    return n


PartSize = Annotated[int, BeforeValidator(_part_size)]


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {value!r}")
    return value


Bool = Annotated[bool, BeforeValidator(_bool)]


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _Invalid(f"expected a positive integer, got {value!r}")
    return value


PositiveInt = Annotated[int, BeforeValidator(_positive_int)]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"expected a number, got {value!r}")
    return float(value)


def _non_negative(value: Any) -> float:
    x = _number(value)
    if not x >= 0:
        raise _Invalid(f"expected a number >= 0, got {value!r}")
    return x


NonNegative = Annotated[float, BeforeValidator(_non_negative)]


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise _Invalid(f"expected a TCP port number from 1 to 65535, got {value!r}")
    return value


Port = Annotated[int, BeforeValidator(_port)]


def _weight(value: Any) -> float:
    x = _number(value)
    if not (x > 0 and math.isfinite(x)):
        raise _Invalid(f"expected a finite number > 0, got {value!r}")
    return x


Weight = Annotated[float, BeforeValidator(_weight)]


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {value!r}")
    return value


Text = Annotated[str, BeforeValidator(_text)]


def _choice(*options: str, note: str = "") -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options or not isinstance(value, str):
            raise _Invalid(f"expected one of {options}{note}, got {value!r}")
        return value

    return check


def _secret(value: Any) -> str:
    if not isinstance(value, str) or len(value) < 16:
        # The value is a secret: never echo it.
        raise _Invalid("expected a secret string of 16 characters or more")
    return value


Secret = Annotated[str, BeforeValidator(_secret)]


def _directory(value: Any) -> str:
    """A directory this process can use: an existing one it can read (a read-only one
    serves its entries and stores none: the disk tier says so at start), or one it can
    create (its nearest existing parent is a writable directory)."""
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a directory path, got {value!r}")
    if os.path.exists(value):
        if not os.path.isdir(value):
            raise _Invalid(f"{value!r} exists and is not a directory")
        if not os.access(value, os.R_OK | os.X_OK):
            raise _Invalid(f"{value!r} is not readable by this process")
        return value
    parent = os.path.dirname(os.path.abspath(value))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _Invalid(f"cannot create {value!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _Invalid(f"cannot create {value!r}: {parent!r} is not writable by this process")
    return value


Directory = Annotated[str, BeforeValidator(_directory)]


def mask_url(url: str) -> str:
    """`url` with its password (user info or `?password=`) replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" not in netloc and "password=" not in parts.query.lower():
        return url
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"{userinfo}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redis_url(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a URL like 'redis://host:6379/0', got {value!r}")
    shown = mask_url(value)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as e:
        raise _Invalid(f"{shown!r} is not a valid URL ({e})") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise _Invalid(f"expected a redis://, rediss:// or unix:// URL, got {shown!r}")
    if parts.scheme == "unix" and not parts.path:
        raise _Invalid(f"a unix:// URL needs a socket path, got {shown!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise _Invalid(f"the URL names no host, got {shown!r}")
    return value


RedisURL = Annotated[str, BeforeValidator(_redis_url)]


def _key_prefix(value: Any) -> str:
    text = _text(value)
    if "{" in text or "}" in text:
        raise _Invalid(f"must not hold braces (hybridkv's hash tag uses them), got {value!r}")
    return text


KeyPrefix = Annotated[str, BeforeValidator(_key_prefix)]


STORE_POLICIES = ("always", "on_evict", "never")
CHECKPOINT_POLICIES = ("prompt_and_end", "every_chunk")

StorePolicy = Annotated[
    Literal["always", "on_evict", "never"], BeforeValidator(_choice(*STORE_POLICIES))
]
CpuStorePolicy = Annotated[
    Literal["always", "on_evict"],
    BeforeValidator(
        _choice("always", "on_evict", note=" ('never' would leave the cpu tier unused)")
    ),
]
CheckpointPolicy = Annotated[
    Literal["prompt_and_end", "every_chunk"], BeforeValidator(_choice(*CHECKPOINT_POLICIES))
]


T = TypeVar("T")


class _FlatSetting(Generic[T]):
    """A read-only attribute under a shorthand key's name (`disk_bytes`): that field of
    the configuration's tier of its kind, or the field's default when there is no such
    tier (None for the field that makes the tier: `disk_path`, `redis_url`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.kind, self.field = _FLAT[name]

    def __get__(self, config: HybridKVConfig | None, owner: type | None = None) -> T:
        if config is None:
            return self  # type: ignore[return-value]
        tier = config.tier(self.kind)
        if tier is not None:
            return getattr(tier, self.field)
        default = _TIER_MODELS[self.kind].model_fields[self.field].default
        return None if default is PydanticUndefined else default  # type: ignore[return-value]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,
        protected_namespaces=(),
        ignored_types=(_FlatSetting,),
    )


# ---------------------------------------------------------------------------------------
# Tiers


class CpuTierConfig(_Model):
    """Host memory (pinned when the engine's cache is on a GPU): always the first tier."""

    kind: Literal["cpu"] = "cpu"
    # Host memory for cached entries.
    bytes: Size = 2 * GiB
    # A hit's matched tokens x load_weight ranks the tiers that hold it (ties: the faster).
    load_weight: Weight = 1.0
    # When entries are stored here: always, or on_evict (when the GPU cache evicts them).
    store: CpuStorePolicy = "always"


class DiskTierConfig(_Model):
    """Local (or shared-filesystem) directory; persists across restarts."""

    kind: Literal["disk"] = "disk"
    path: Directory
    bytes: PositiveSize = 16 * GiB
    # fsync each file before its rename: durability across power loss, not correctness
    # (a torn file fails its checksum and is a miss).
    fsync: Bool = False
    # Read files past the page cache (O_DIRECT): no page-cache work or second copy of
    # entries; faster restores on a busy CPU host, slower reads on an idle one.
    direct_io: Bool = False
    # Bytes waiting to be written before further stores are dropped (and counted).
    queue_bytes: PositiveSize = 256 * MiB
    # Permissions of the tier's files (directories get the matching search bits):
    # private by default; e.g. 0o660 for engines of one group sharing the path.
    mode: Mode = 0o600
    load_weight: Weight = 1.0
    # always | on_evict (what the tier above evicts) | never (read-only).
    store: StorePolicy = "always"


class RedisTierConfig(_Model):
    """A Redis / Valkey server or Redis Cluster shared by replicas; Redis evicts."""

    kind: Literal["redis"] = "redis"
    # redis://[[user]:password@]host:port/db, rediss://… (TLS), or unix:///path.sock.
    url: RedisURL
    # A Redis Cluster (url names any node).
    cluster: Bool = False
    # Expiry of every value written; None: none (the server's maxmemory-policy evicts).
    ttl_s: PositiveInt | None = None
    key_prefix: KeyPrefix = "hybridkv"
    # Longest any connect or read may wait before the tier is marked down.
    timeout_ms: PositiveInt = 200
    # Values longer than this are split into parts of this size.
    max_entry_bytes: PartSize = 8 * MiB
    # Bytes waiting to be written before further stores are dropped (and counted).
    queue_bytes: PositiveSize = 256 * MiB
    load_weight: Weight = 1.0
    store: StorePolicy = "always"

    def __repr_args__(self):  # the URL may hold a password
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "url" else value


TierConfig = Annotated[
    CpuTierConfig | DiskTierConfig | RedisTierConfig, Field(discriminator="kind")
]
TIER_KINDS = ("cpu", "disk", "redis")
_TIER_MODELS: dict[str, type[_Model]] = {
    "cpu": CpuTierConfig,
    "disk": DiskTierConfig,
    "redis": RedisTierConfig,
}

# Shorthand: flat key -> (tier kind, field), `{kind}_{field}` for every field of a tier
# but these (`cpu_bytes`, `disk_path`, ..., `redis_queue_bytes`).
_NO_SHORTHAND = ("kind", "load_weight", "store")
_FLAT: dict[str, tuple[str, str]] = {
    f"{kind}_{name}": (kind, name)
    for kind, model in _TIER_MODELS.items()
    for name in model.model_fields
    if name not in _NO_SHORTHAND
}
# The shorthand key that creates a tier of each kind.
_PRIMARY = {"disk": "disk_path", "redis": "redis_url"}


# ---------------------------------------------------------------------------------------
# Folding sources and shorthand keys into one input


def _kind_of(tier: Any) -> Any:
    return tier.get("kind") if isinstance(tier, Mapping) else getattr(tier, "kind", None)


class _Merge:
    """Applies sources in precedence order, remembering where each value came from so
    that an error names the key the user wrote, and where."""

    def __init__(self) -> None:
        self.top: dict[str, Any] = {}
        self.tiers: Any = None  # None: the default, a cpu tier alone
        self.flat_names: dict[tuple[str, str], str] = {}  # (kind, field) -> flat key
        self.sources: dict[str, str] = {}  # key as written -> " (from …)" or ""

    def apply(self, layer: Mapping[str, Any], source: Callable[[str], str]) -> None:
        flat = {k: v for k, v in layer.items() if k in _FLAT}
        if "tiers" in layer:  # null: the default list
            if flat and layer["tiers"] is not None:
                key = sorted(flat)[0]
                raise ConfigError(
                    f"{key}: cannot be combined with tiers in one place; set "
                    f"{_FLAT[key][1]!r} of the {_FLAT[key][0]} tier in the tiers list"
                    f"{source(key)}"
                )
            tiers = layer["tiers"]
            self.tiers = list(tiers) if isinstance(tiers, list | tuple) else tiers
            self.flat_names = {}
            self.sources["tiers"] = source("tiers")
        for key, value in layer.items():
            if key not in _FLAT and key != "tiers":
                self.top[key] = value
                self.sources[key] = source(key)
        if flat:
            self._apply_flat(flat, source)

    def _apply_flat(self, flat: dict[str, Any], source: Callable[[str], str]) -> None:
        if self.tiers is None:
            self.tiers = [{"kind": "cpu"}]
        if not isinstance(self.tiers, list):
            return  # not a list: validation names `tiers`
        tiers = [dict(t) if isinstance(t, Mapping) else t for t in self.tiers]
        for kind in TIER_KINDS:
            items = {k: v for k, v in flat.items() if _FLAT[k][0] == kind}
            if not items:
                continue
            at = next((i for i, t in enumerate(tiers) if _kind_of(t) == kind), None)
            primary = _PRIMARY.get(kind)
            if primary in items and items[primary] is None:
                # A null disk_path / redis_url: no tier of this kind.
                others = sorted(k for k in items if k != primary)
                if others:
                    raise ConfigError(
                        f"{others[0]}: has no effect without {primary}{source(others[0])}"
                    )
                if at is not None:
                    del tiers[at]
                self.flat_names = {n: k for n, k in self.flat_names.items() if n[0] != kind}
                continue
            if at is None:
                if primary is not None and primary not in items:
                    key = sorted(items)[0]
                    raise ConfigError(f"{key}: has no effect without {primary}{source(key)}")
                if kind == "cpu":
                    at = 0
                elif kind == "disk":  # under cpu, above redis: the shorthand's order
                    at = next(
                        (i for i, t in enumerate(tiers) if _kind_of(t) == "redis"), len(tiers)
                    )
                else:
                    at = len(tiers)
                tiers.insert(at, {"kind": kind})
            if not isinstance(tiers[at], Mapping):
                tiers[at] = tiers[at].model_dump()
            for key, value in items.items():
                tiers[at][_FLAT[key][1]] = value
                self.flat_names[_FLAT[key]] = key
                self.sources[key] = source(key)
        self.tiers = tiers

    def result(self) -> dict[str, Any]:
        out = dict(self.top)
        if self.tiers is not None:
            out["tiers"] = self.tiers
        return out


def _no_source(key: str) -> str:
    return ""


# The sources of the configuration being built by from_dict, for its error messages.
_MERGE: ContextVar[_Merge | None] = ContextVar("hybridkv_config_merge", default=None)


def _folded(data: Mapping[str, Any]) -> _Merge:
    merge = _Merge()
    merge.apply(data, _no_source)
    return merge


# ---------------------------------------------------------------------------------------
# The model


class HybridKVConfig(_Model):
    """Settings read from `kv_connector_extra_config` (see the module docstring and
    docs/config.md). `tiers` is the normalized tier list; the flat attributes
    (`cpu_bytes`, `disk_path`, `redis_url`, ...) read the same values from it."""

    # Lookup order; the first is the cpu tier, at most one of each kind.
    tiers: tuple[TierConfig, ...] = (CpuTierConfig(),)
    # Tokens per stored chunk; None picks the smallest size every group's block tiles.
    chunk_tokens: PositiveInt | None = None
    # Which recurrent-state boundaries are kept: see core/policy.py.
    checkpoint_policy: CheckpointPolicy = "prompt_and_end"
    # Names the weights in every key. Defaults to the engine's model path; set it when
    # replicas load the same weights from different paths.
    # (null is not a value: leave the key out for the default.)
    model_id: Annotated[str | None, BeforeValidator(_text)] = None
    # Secret that MACs every disk and Redis entry, so that whoever can write to a shared
    # disk path or Redis cannot inject KV: entries without this MAC are misses.
    integrity_key: Secret | None = Field(default=None, repr=False)
    # Weight of prefill saved per byte against recency when CPU memory evicts recurrent
    # boundaries (core/eviction.py); 0 is LRU over whole boundaries.
    eviction_alpha: NonNegative = 0.25
    # Bytes each rank writes into its KV cache for restores in one engine step; the rest
    # waits for the next steps, so a large restore does not stall decoding requests
    # (the GPU copies overlap forwards; a CPU engine copies in the step). 0: no limit.
    load_step_bytes: Size = 64 * MiB
    # Serve the vllm:hybridkv_* metrics over HTTP on this port from the scheduler side's
    # process, for engines without vLLM's server (offline LLM); off by default.
    metrics_port: Port | None = None
    # The YAML / JSON file the settings were merged from (read by from_dict only).
    config_file: Text | None = None

    def __init__(self, /, **data: Any) -> None:
        # pydantic runs this for model_validate too: every path raises ConfigError.
        try:
            super().__init__(**data)
        except ValidationError as e:
            merge = _MERGE.get()
            if merge is None:
                with contextlib.suppress(ConfigError):
                    merge = _folded(data)
            raise ConfigError(_explain(e, merge)) from None

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> HybridKVConfig:
        """The configuration from `kv_connector_extra_config` (`raw`), the file it names
        in `config_file`, and `HYBRIDKV_*` variables of `env` (default: os.environ)."""
        merge = _merge_sources(dict(raw or {}), os.environ if env is None else env)
        token = _MERGE.set(merge)  # so that errors name the keys as the sources spell them
        try:
            return cls(**merge.result())
        finally:
            _MERGE.reset(token)

    @model_validator(mode="before")
    @classmethod
    def _fold_shorthand(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = _folded(data).result()
        tiers = data.get("tiers", ())
        kinds = {_kind_of(t) for t in tiers} if isinstance(tiers, list | tuple) else {"?"}
        if data.get("integrity_key") is not None and not kinds & {"disk", "redis", "?"}:
            raise ConfigError(
                "integrity_key: has no effect without disk_path or redis_url (a disk or redis tier)"
            )
        return data

    @model_validator(mode="after")
    def _check_tiers(self) -> HybridKVConfig:
        kinds = [t.kind for t in self.tiers]
        if "cpu" not in kinds:
            raise ConfigError("tiers: a cpu tier is required, first in the list")
        if kinds[0] != "cpu":
            raise ConfigError(
                f"tiers[{kinds.index('cpu')}].kind: the cpu tier must come first "
                f"(tiers are listed in lookup order)"
            )
        for i, kind in enumerate(kinds):
            if kind in kinds[:i]:
                raise ConfigError(f"tiers[{i}].kind: a second {kind} tier; at most one of each")
        return self

    # Tiers by kind ----------------------------------------------------------------------

    def tier(self, kind: str) -> CpuTierConfig | DiskTierConfig | RedisTierConfig | None:
        """The tier of `kind` ('cpu', 'disk', 'redis'), or None when there is none."""
        return next((t for t in self.tiers if t.kind == kind), None)

    @property
    def cpu(self) -> CpuTierConfig:
        return self.tiers[0]  # type: ignore[return-value]

    @property
    def disk(self) -> DiskTierConfig | None:
        return self.tier("disk")  # type: ignore[return-value]

    @property
    def redis(self) -> RedisTierConfig | None:
        return self.tier("redis")  # type: ignore[return-value]

    # Flat attributes, as before tiers were a list: the value of the tier of their kind,
    # or its default when there is no such tier.
    cpu_bytes = _FlatSetting[int]()
    # Disk: `disk_path` is None without a disk tier.
    disk_path = _FlatSetting[str | None]()
    disk_bytes = _FlatSetting[int]()
    disk_fsync = _FlatSetting[bool]()
    disk_direct_io = _FlatSetting[bool]()
    disk_queue_bytes = _FlatSetting[int]()
    disk_mode = _FlatSetting[int]()
    # Redis: `redis_url` is None without a redis tier.
    redis_url = _FlatSetting[str | None]()
    redis_cluster = _FlatSetting[bool]()
    redis_ttl_s = _FlatSetting[int | None]()
    redis_key_prefix = _FlatSetting[str]()
    redis_timeout_ms = _FlatSetting[int]()
    redis_max_entry_bytes = _FlatSetting[int]()
    redis_queue_bytes = _FlatSetting[int]()


# Keys settable from the environment: scalar top-level and shorthand keys.
_ENV_PREFIX = "HYBRIDKV_"
_ENV_NOT_SETTINGS = {"HYBRIDKV_HOME"}  # read elsewhere (models.py)
_ENV_BOOL = {"disk_fsync", "disk_direct_io", "redis_cluster"}
_ENV_INT = {"chunk_tokens", "redis_ttl_s", "redis_timeout_ms", "metrics_port"}
_ENV_FLOAT = {"eviction_alpha"}
_ENV_NULLABLE = {"chunk_tokens", "redis_ttl_s", "metrics_port"}
_ENV_KEYS = (set(HybridKVConfig.model_fields) - {"tiers"}) | set(_FLAT)
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOL_WORDS.update({"false": False, "0": False, "no": False, "off": False})


def _env_value(key: str, text: str) -> Any:
    """The setting an environment variable's text stands for; text that does not read
    as the key's type is passed on as is, for validation to name."""
    word = text.strip().lower()
    if key in _ENV_NULLABLE and word in ("none", "null"):
        return None
    if key in _ENV_BOOL:
        return _BOOL_WORDS.get(word, text)
    if key in _ENV_INT and re.fullmatch(r"[+-]?\d+", word):
        return int(word)
    if key in _ENV_FLOAT:
        try:
            return float(word)
        except ValueError:
            return text
    return text


def env_settings(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The settings of `HYBRIDKV_*` variables in `env`: key -> (value, variable)."""
    out: dict[str, tuple[Any, str]] = {}
    for name, text in env.items():
        if not name.startswith(_ENV_PREFIX) or name in _ENV_NOT_SETTINGS:
            continue
        key = name[len(_ENV_PREFIX) :].lower()
        if key not in _ENV_KEYS:
            log.warning(
                "hybridkv: ignoring %s: not a setting (settable: %s)",
                name,
                ", ".join(f"{_ENV_PREFIX}{k.upper()}" for k in sorted(_ENV_KEYS)),
            )
            continue
        if text.strip():
            out[key] = (_env_value(key, text), name)
    return out


def load_config_file(path: str) -> dict[str, Any]:
    """The settings in a YAML (or, by a .json suffix, JSON) file: a mapping of keys."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config_file: cannot read {path!r}: {e.strerror or e}") from None
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError as e:
            raise ConfigError(f"config_file: {path!r} is not valid JSON: {e}") from None
    else:
        import yaml  # PyYAML comes with vLLM

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config_file: {path!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(
            f"config_file: {path!r} must hold a mapping of settings by name, "
            f"got {type(data).__name__}"
        )
    if "config_file" in data:
        raise ConfigError(f"config_file: {path!r} names another config_file; files do not nest")
    return data


def _merge_sources(raw: dict[str, Any], env: Mapping[str, str]) -> _Merge:
    from_env = env_settings(env)
    merge = _Merge()
    path = from_env["config_file"][0] if "config_file" in from_env else raw.get("config_file")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"config_file: expected a file path, got {path!r}")
        merge.apply(load_config_file(path), lambda k: f" (from config_file {path!r})")
    merge.apply(raw, _no_source)
    merge.apply(
        {k: v for k, (v, _) in from_env.items()},
        lambda k: f" (from environment {from_env[k][1]})",
    )
    return merge


# ---------------------------------------------------------------------------------------
# Errors


def _where(loc: tuple[Any, ...], merge: _Merge | None) -> tuple[str, str]:
    """The key a location names as the user wrote it, and the source suffix."""
    if not loc:
        return "", ""
    sources = merge.sources if merge is not None else {}
    if loc[0] == "tiers" and len(loc) >= 2 and isinstance(loc[1], int):
        rest = list(loc[2:])
        kind = rest.pop(0) if rest and rest[0] in TIER_KINDS else None
        if kind is not None and rest and merge is not None:
            flat = merge.flat_names.get((kind, rest[0]))
            if flat is not None:
                return ".".join([flat, *map(str, rest[1:])]), sources.get(flat, "")
        name = f"tiers[{loc[1]}]" + "".join(f".{p}" for p in rest)
        return name, sources.get("tiers", "")
    return ".".join(map(str, loc)), sources.get(str(loc[0]), "")


def _tier_kind(err: Any) -> str | None:
    loc = err["loc"]
    if len(loc) >= 3 and loc[0] == "tiers" and loc[2] in TIER_KINDS:
        return loc[2]
    return None


def _describe(err: Any, merge: _Merge | None) -> str:
    kind, loc = err["type"], err["loc"]
    name, suffix = _where(loc, merge)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a check across keys: names its own key
        return str(cause)
    if isinstance(cause, _Invalid):
        return f"{name}: {cause}{suffix}"
    if kind == "extra_forbidden":
        tier = _tier_kind(err)
        if tier is not None:
            known = ", ".join(_TIER_MODELS[tier].model_fields)
            return f"{name}: unknown setting of a {tier} tier{suffix} (known: {known})"
        # suffix: " (from config_file '…')" -> " in config_file '…'"
        where = f" in {suffix[len(' (from ') : -1]}" if suffix else " in kv_connector_extra_config"
        known = ", ".join(sorted(_ENV_KEYS | {"tiers"}))
        return f"{name}: unknown hybridkv setting{where} (known: {known})"
    if kind == "union_tag_not_found":
        return f"{name}.kind: missing; expected one of {TIER_KINDS}{suffix}"
    if kind == "union_tag_invalid":
        got = (err.get("ctx") or {}).get("tag")
        return f"{name}.kind: expected one of {TIER_KINDS}, got {got!r}{suffix}"
    if kind == "missing":
        tier = _tier_kind(err)
        return f"{name}: required{f' for a {tier} tier' if tier else ''}{suffix}"
    if kind == "model_attributes_type" and name.startswith("tiers["):
        got = _shown(err["input"])
        return f"{name}: expected a mapping like {{'kind': 'disk', ...}}, got {got!r}{suffix}"
    if kind in ("tuple_type", "list_type") and name == "tiers":
        return f"tiers: expected a list of tiers, got {_shown(err['input'])!r}{suffix}"
    msg = err["msg"][:1].lower() + err["msg"][1:]
    if name.split(".")[0] in ("integrity_key", "url", "redis_url") or name.endswith(".url"):
        return f"{name}: {msg}{suffix}"  # never echo a secret
    return f"{name}: {msg}, got {_shown(err['input'])!r}{suffix}"


def _shown(value: Any) -> Any:
    """`value` as an error may echo it: a string that may be a URL loses its password."""
    return mask_url(value) if isinstance(value, str) and "://" in value else value


def _explain(e: ValidationError, merge: _Merge | None) -> str:
    """One line per problem; unknown keys first (alphabetically), then the rest in the
    model's order, so the message starts with a key at fault."""
    errors = e.errors(include_url=False)
    errors.sort(key=lambda err: (err["type"] != "extra_forbidden", _sort_key(err)))
    return "\n".join(dict.fromkeys(_describe(err, merge) for err in errors))


def _sort_key(err: Any) -> str:
    return ".".join(map(str, err["loc"])) if err["type"] == "extra_forbidden" else ""


# ---------------------------------------------------------------------------------------
# Logging


def effective(config: HybridKVConfig) -> dict[str, Any]:
    """The configuration as it applies, for logging once at start: every key (tiers as
    the normalized list), sizes spelled in units, secrets masked (`integrity_key` as
    "***", passwords in Redis URLs as ***). Apart from the masked secrets it is itself a
    valid configuration."""
    tiers = []
    for tier in config.tiers:
        entry = tier.model_dump()
        for key in ("bytes", "queue_bytes", "max_entry_bytes"):
            if key in entry:
                entry[key] = format_size(entry[key])
        if "mode" in entry:
            entry["mode"] = f"0{entry['mode']:o}"
        if "url" in entry:
            entry["url"] = mask_url(entry["url"])
        tiers.append(entry)
    out: dict[str, Any] = {"tiers": tiers}
    out.update(config.model_dump(exclude={"tiers", "integrity_key"}))
    out["integrity_key"] = None if config.integrity_key is None else "***"
    return out
