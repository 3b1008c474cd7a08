"""User configuration: one typed model of hybridkv's settings, checked once at engine start.

`HybridKVConfig` is a pydantic-settings `BaseSettings`. Its sources, highest precedence
first (`settings_customise_sources`; a key given by a higher source replaces it):

1. `HYBRIDKV_<KEY>` environment variables, for the scalar top-level and shorthand keys;
2. `kv_connector_extra_config`, the dict handed to `from_dict` (or the keyword arguments);
3. `config_file`: a YAML or JSON file of the same keys, named by either source above;
4. the defaults below.

The one canonical shape of the tiers is the `tiers` list (lookup order, cpu first, at most
one of each kind). The flat keys users write (`cpu_bytes`, `disk_path`, `redis_url`, ...)
are a shorthand for fields of that list: `_fold` translates them, after the sources merge.
Every error is a `ConfigError` whose message starts with the key at fault, as the user
wrote it, and says which file or variable it came from: a bad deployment fails at start
instead of running without a cache. Secrets (`integrity_key`, passwords in Redis URLs)
are never echoed in errors, reprs or `effective()`. docs/config.md describes every key.
"""

from __future__ import annotations

import json
import logging
import os
import re
from abc import abstractmethod
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from decimal import Decimal
from typing import Annotated, Any, Generic, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainSerializer,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

log = logging.getLogger(__name__)

KiB, MiB, GiB = 1024, 1024**2, 1024**3


class ConfigError(ValueError):
    """A bad hybridkv setting; the message starts with the key at fault."""


# ---------------------------------------------------------------------------------------
# Values pydantic has no type for. Each check raises a ValueError naming no key: the
# error's location does (`_explain`).

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
# K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti powers of 1024; a trailing B changes nothing.
_UNITS = {"": 1, "B": 1}
for _power, _prefix in enumerate("KMGT", start=1):
    for _suffix, _base in (("", 1000), ("B", 1000), ("I", 1024), ("IB", 1024)):
        _UNITS[_prefix + _suffix] = _base**_power


def _size(value: Any) -> int:
    """Bytes: an int, or a string like "1.5 GiB" read exactly (pydantic's ByteSize goes
    through a float and knows no "Ki" or "K")."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        n = int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise ValueError(f"expected a size like '512MiB' or an integer, got {value!r}")
    if n < 0:
        raise ValueError(f"size must not be negative, got {value!r}")
    return n


def format_size(n: int) -> str:
    """The shortest exact spelling of `n` bytes that `parse_size` reads back ("2GiB")."""
    for unit in ("TiB", "GiB", "MiB", "KiB", "TB", "GB", "MB", "KB"):
        if n and n % _UNITS[unit.upper()] == 0:
            return f"{n // _UNITS[unit.upper()]}{unit}"
    return f"{n}B"


_MODE_RE = re.compile(r"^(?:0o?)?([0-7]{1,4})$", re.IGNORECASE)


def _mode(value: Any) -> int:
    """File permissions: an int (0o660) or an octal string ("0660", "660", "0o660"); the
    owner reads and writes, nothing beyond 0o777 (no setuid, sticky)."""
    m = _MODE_RE.match(value.strip()) if isinstance(value, str) else None
    if m:
        mode = int(m.group(1), 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError(f"expected octal permissions like '0660', got {value!r}")
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise ValueError(
            f"permissions must be within 0777 and let the owner read and write "
            f"(0600), got {value!r} ({mode:#o})"
        )
    return mode


def _keyed(check: Callable[[Any], int], value: Any, key: str) -> int:
    try:
        return check(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def parse_size(value: Any, key: str = "size") -> int:
    """A byte count from an int or a string such as "512MiB", "2GB", "1.5 GiB" (K, M, G,
    T: powers of 1000; Ki, Mi, Gi, Ti: powers of 1024; a fraction of a byte is dropped)."""
    return _keyed(_size, value, key)


def parse_mode(value: Any, key: str = "disk_mode") -> int:
    """File permissions as `disk_mode` reads them."""
    return _keyed(_mode, value, key)


def _directory(value: str) -> str:
    """A directory this process can use: an existing one it can read (a read-only one
    serves its entries and stores none: the disk tier says so at start), or one it can
    create (its nearest existing parent is a writable directory)."""
    if os.path.exists(value):
        if not os.path.isdir(value):
            raise ValueError(f"{value!r} exists and is not a directory")
        if not os.access(value, os.R_OK | os.X_OK):
            raise ValueError(f"{value!r} is not readable by this process")
        return value
    parent = os.path.dirname(os.path.abspath(value))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"cannot create {value!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create {value!r}: {parent!r} is not writable by this process")
    return value


def _masked_query(query: str) -> str:
    """A URL's query with every `password=` value replaced by ***."""
    if "password=" not in query.lower():
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    return urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")


def mask_url(url: str) -> str:
    """`url` with its password (user info or `?password=`) replaced by ***. Only ever
    shown, so where the URL is ambiguous it masks more than needed, never less."""
    scheme, sep, rest = url.partition("://")
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if sep and "@" in rest[len(netloc) :]:
        # An '@' past the authority urllib found: a password holding '/', '?', '#' or
        # '@' (each ends the authority early), or an '@' in the path or query. Mask
        # everything up to the last '@' but a user name, and any password= after it.
        userinfo, _, after = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        where, mark, query = after.partition("?")
        return f"{scheme}://{user + ':***' if colon else '***'}@{where}{mark}{_masked_query(query)}"
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else netloc
    elif "password=" not in parts.query.lower():
        return url
    query = _masked_query(parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redis_url(value: str) -> str:
    """What redis-py's `from_url` takes. Not pydantic's RedisDsn: that refuses unix://
    sockets, and fills in a missing host as localhost where a typo should fail."""
    shown = mask_url(value)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        # Not urllib's message: it quotes what it took for the port, which may be part
        # of a password.
        raise ValueError(
            f"{shown!r} is not a valid URL (its port is not a number; a password holding "
            "'/', '?' or '#' must be percent-encoded)"
        ) from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"expected a redis://, rediss:// or unix:// URL, got {shown!r}")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"a unix:// URL needs a socket path, got {shown!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"the URL names no host, got {shown!r}")
    import redis  # the options in its query, as the tier's client will read them

    try:
        redis.ConnectionPool.from_url(value).make_connection()  # no socket opened yet
    except (TypeError, ValueError) as e:
        raise ValueError(f"redis-py cannot use {shown!r}: {e}") from None
    return value


def _not_null(value: Any) -> Any:
    if value is None:
        raise ValueError("null is not a value; leave the key out for the default")
    return value


def _long_secret(value: SecretStr) -> SecretStr:
    if len(value.get_secret_value()) < 16:
        raise ValueError("expected a secret string of 16 characters or more")
    return value


# Sizes and modes read as above and are spelled back in units and octal by `effective`;
# other checks are pydantic's own, strict (no "yes" for true, no "64" for 64).
Size = Annotated[ByteSize, BeforeValidator(_size), PlainSerializer(format_size, when_used="json")]
PositiveSize = Annotated[Size, Field(gt=0)]
Mode = Annotated[
    int, BeforeValidator(_mode), PlainSerializer(lambda m: f"0{m:o}", when_used="json")
]
Text = Annotated[StrictStr, Field(min_length=1)]
PositiveInt = Annotated[StrictInt, Field(gt=0)]
Weight = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
RedisURL = Annotated[Text, AfterValidator(_redis_url), PlainSerializer(mask_url, when_used="json")]
Secret = Annotated[
    SecretStr,
    Field(strict=True),
    AfterValidator(_long_secret),
    PlainSerializer(lambda _: "***", when_used="json"),
]


# ---------------------------------------------------------------------------------------
# Tiers


class _Tier(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    kind: str  # each tier's own literal: the list's discriminator, first in dumps
    # A hit's matched tokens x load_weight ranks the tiers that hold it (ties: the faster).
    load_weight: Weight = 1.0
    # always | on_evict (what the tier above evicts) | never (read-only).
    store: Literal["always", "on_evict", "never"] = "always"


class CpuTierConfig(_Tier):
    """Host memory (pinned when the engine's cache is on a GPU): always the first tier."""

    kind: Literal["cpu"] = "cpu"
    bytes: Size = 2 * GiB
    # Every store goes to CPU memory first (no tier above it evicts into it), and a hit
    # it holds is served from it: the two settings only mean something below it.
    store: Literal["always"] = "always"
    load_weight: Literal[1.0] = 1.0


class DiskTierConfig(_Tier):
    """Local (or shared-filesystem) directory; persists across restarts."""

    kind: Literal["disk"] = "disk"
    path: Annotated[Text, AfterValidator(_directory)]
    bytes: PositiveSize = 16 * GiB
    # fsync each file before its rename: durability across power loss, not correctness
    # (a torn file fails its checksum and is a miss).
    fsync: StrictBool = False
    # Read files past the page cache (O_DIRECT): no page-cache work or second copy of
    # entries; faster restores on a busy CPU host, slower reads on an idle one.
    direct_io: StrictBool = False
    # Bytes waiting to be written before further stores are dropped (and counted).
    queue_bytes: PositiveSize = 256 * MiB
    # Permissions of the tier's files (directories get the matching search bits):
    # private by default; e.g. 0o660 for engines of one group sharing the path.
    mode: Mode = 0o600


class RedisTierConfig(_Tier):
    """A Redis / Valkey server or Redis Cluster shared by replicas; Redis evicts."""

    kind: Literal["redis"] = "redis"
    url: RedisURL
    cluster: StrictBool = False
    # Expiry of every value written; None: none (the server's maxmemory-policy evicts).
    ttl_s: PositiveInt | None = None
    # Braces are hybridkv's hash tag.
    key_prefix: Annotated[Text, Field(pattern=r"^[^{}]*$")] = "hybridkv"
    # Longest any connect or read may wait before the tier is marked down.
    timeout_ms: PositiveInt = 200
    # Values longer than this are split into parts of this size (4KiB at least: the
    # tier's MIN_PART_BYTES, core/tiers/redis.py).
    max_entry_bytes: Annotated[Size, Field(ge=4096)] = 8 * MiB
    queue_bytes: PositiveSize = 256 * MiB

    @field_validator("cluster")
    @classmethod
    def _cluster_url(cls, cluster: bool, info: ValidationInfo) -> bool:
        """A Redis Cluster has database 0 alone and no unix sockets: a URL naming either
        would pass here and leave the tier down for good at its first connect."""
        url = info.data.get("url")
        if cluster and url:
            if urlsplit(url).scheme == "unix":
                raise ValueError("a Redis Cluster is reached by redis:// or rediss://, not unix://")
            import redis.connection

            db = redis.connection.parse_url(url).get("db", 0)
            if db != 0:
                raise ValueError(f"a Redis Cluster has database 0 alone; the URL names {db}")
        return cluster

    def __repr_args__(self):  # the URL may hold a password
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "url" else value


TierConfig = Annotated[
    CpuTierConfig | DiskTierConfig | RedisTierConfig, Field(discriminator="kind")
]
TIER_KINDS = ("cpu", "disk", "redis")  # also the order the shorthand puts tiers in
_TIER_MODELS: dict[str, type[_Tier]] = {
    "cpu": CpuTierConfig,
    "disk": DiskTierConfig,
    "redis": RedisTierConfig,
}


# ---------------------------------------------------------------------------------------
# The shorthand: flat key -> (tier kind, field), `{kind}_{field}` for every field of a
# tier but kind, load_weight and store (`cpu_bytes`, `disk_path`, ..., `redis_queue_bytes`).

_FLAT: dict[str, tuple[str, str]] = {
    f"{kind}_{name}": (kind, name)
    for kind, model in _TIER_MODELS.items()
    for name in model.model_fields
    if name not in ("kind", "load_weight", "store")
}
# The shorthand key that makes a tier of its kind; null removes the tier.
_PRIMARY = {"disk": "disk_path", "redis": "redis_url"}


def _kind_of(tier: Any) -> Any:
    return tier.get("kind") if isinstance(tier, Mapping) else getattr(tier, "kind", None)


def _fold(
    data: dict[str, Any], where: Mapping[str, str]
) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """`data` (the merged sources) with its shorthand keys set in the `tiers` list, and
    which shorthand key set each (kind, field), for errors to name. A tier the list lacks
    joins it in cpu, disk, redis order."""
    flat = {k: data.pop(k) for k in list(data) if k in _FLAT}
    if "tiers" in data and data["tiers"] is None:
        del data["tiers"]  # null: the default list
    tiers = data.get("tiers", [{"kind": "cpu"}])
    if not flat or not isinstance(tiers, list | tuple):
        return data, {}  # not a list: validation names `tiers`
    tiers = [t.model_dump() if isinstance(t, BaseModel) else t for t in tiers]
    names: dict[tuple[str, str], str] = {}
    for kind in TIER_KINDS:
        items = {k: v for k, v in flat.items() if _FLAT[k][0] == kind}
        primary = _PRIMARY.get(kind)
        if primary in items and items[primary] is None:  # null: no tier of this kind
            del items[primary]
            tiers = [t for t in tiers if _kind_of(t) != kind]
        if not items:
            continue
        at = next((i for i, t in enumerate(tiers) if _kind_of(t) == kind), None)
        if at is None:
            if primary is not None and primary not in items:
                key = min(items)
                raise ConfigError(f"{key}: has no effect without {primary}{where.get(key, '')}")
            later = TIER_KINDS[TIER_KINDS.index(kind) + 1 :]
            at = next((i for i, t in enumerate(tiers) if _kind_of(t) in later), len(tiers))
            tiers.insert(at, {"kind": kind})
        tiers[at] = {**tiers[at], **{_FLAT[k][1]: v for k, v in items.items()}}
        names.update({_FLAT[k]: k for k in items})
    return {**data, "tiers": tiers}, names


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


# ---------------------------------------------------------------------------------------
# Sources

# Carries, through pydantic-settings' merge of the sources, where each key came from
# (" (from config_file '...')"): the higher source's entry wins, as its value does.
_WHERE = "hybridkv:where"
_ENV_PREFIX = "HYBRIDKV_"
_ENV_NOT_SETTINGS = {"HYBRIDKV_HOME"}  # read elsewhere (models.py)
# How a variable's text reads for keys that are not strings; text that does not read
# is passed on as is, for validation to name with the variable.
_ENV_TYPES = {
    key: TypeAdapter(kind)
    for kind, keys in (
        (bool, ("disk_fsync", "disk_direct_io", "redis_cluster")),
        (int, ("chunk_tokens", "redis_ttl_s", "redis_timeout_ms", "metrics_port")),
        (float, ("eviction_alpha",)),
    )
    for key in keys
}
_ENV_NULLABLE = {"chunk_tokens", "redis_ttl_s", "metrics_port"}  # "none" / "null" unsets


def _env_value(key: str, text: str) -> Any:
    word = text.strip().lower()
    if key in _ENV_NULLABLE and word in ("none", "null"):
        return None
    try:
        return _ENV_TYPES[key].validate_python(word) if key in _ENV_TYPES else text
    except ValidationError:
        return text


def _read_config_file(path: str) -> dict[str, Any]:
    """The settings in a YAML (or, by a .json suffix, JSON) file: a mapping of keys."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config_file: cannot read {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config_file: {path!r} is not UTF-8 text (byte {e.start})") from None
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
            # Where, not the line itself: it may hold a secret (integrity_key, a URL).
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "a syntax error"
            raise ConfigError(f"config_file: {path!r} is not valid YAML{at}: {problem}") from None
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


class _Source(PydanticBaseSettingsSource):
    """One source's settings as written. pydantic-settings calls the sources highest
    first, each with what the higher ones set (`current_state`), and merges them key by
    key; what it cannot merge key by key is done here: a tiers list (or null) above
    replaces this source's shorthand keys, and a null disk_path / redis_url above its
    keys of that tier."""

    @abstractmethod
    def read(self) -> dict[str, tuple[Any, str]]:
        """key -> (value, where it came from: "" or " (from ...)")."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: `read` gives every key at once

    def __call__(self) -> dict[str, Any]:
        layer = self.read()
        values = {k: v for k, (v, _) in layer.items()}
        flat = sorted(k for k in values if k in _FLAT)
        if flat and values.get("tiers") is not None:
            kind, field = _FLAT[flat[0]]
            raise ConfigError(
                f"{flat[0]}: cannot be combined with tiers in one place; set {field!r} "
                f"of the {kind} tier in the tiers list{layer[flat[0]][1]}"
            )
        above = self.current_state
        for key in flat:
            primary = _PRIMARY.get(_FLAT[key][0])
            if "tiers" in above or primary in above and above[primary] is None:
                del values[key]
        return {**values, _WHERE: {k: layer[k][1] for k in values}}


class _Environment(_Source):
    """`HYBRIDKV_<KEY>` variables of scalar top-level and shorthand keys; an empty one
    counts as unset, one that names no setting is ignored with a warning."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        super().__init__(settings_cls)
        self.environ = environ

    def read(self) -> dict[str, tuple[Any, str]]:
        out: dict[str, tuple[Any, str]] = {}
        for name, text in self.environ.items():
            if not name.startswith(_ENV_PREFIX) or name in _ENV_NOT_SETTINGS:
                continue
            key = name[len(_ENV_PREFIX) :].lower()
            if key not in _ENV_KEYS:
                log.warning(
                    "hybridkv: ignoring %s: not a setting (settable: %s)",
                    name,
                    ", ".join(f"{_ENV_PREFIX}{k.upper()}" for k in sorted(_ENV_KEYS)),
                )
            elif text.strip():
                out[key] = (_env_value(key, text), f" (from environment {name})")
        return out


class _Arguments(_Source):
    """`kv_connector_extra_config` (the keyword arguments of a direct construction)."""

    def __init__(self, settings_cls: type[BaseSettings], raw: Mapping[str, Any]):
        super().__init__(settings_cls)
        self.raw = raw

    def read(self) -> dict[str, tuple[Any, str]]:
        return {k: (v, "") for k, v in self.raw.items()}


class _ConfigFile(_Source):
    """The file `config_file` names in a higher source (a bad name is left to validation)."""

    def read(self) -> dict[str, tuple[Any, str]]:
        path = self.current_state.get("config_file")
        if not isinstance(path, str) or not path:
            return {}
        where = f" (from config_file {path!r})"
        return {k: (v, where) for k, v in _read_config_file(path).items()}


# What `from_dict` was given (the dict, the environment), for the sources of the model it
# builds. Not keyword arguments: BaseSettings takes some (`_cli_parse_args`) for itself.
_FROM_DICT: ContextVar[tuple[Mapping[str, Any], Mapping[str, str]] | None] = ContextVar(
    "hybridkv_from_dict", default=None
)


# ---------------------------------------------------------------------------------------
# The model


class HybridKVConfig(BaseSettings):
    """Settings read from `kv_connector_extra_config` (see the module docstring and
    docs/config.md). `tiers` is the normalized tier list; the flat attributes
    (`cpu_bytes`, `disk_path`, `redis_url`, ...) read the same values from it."""

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        case_sensitive=True,
        validate_default=False,
        hide_input_in_errors=True,
        ser_json_inf_nan="constants",
        protected_namespaces=(),
        ignored_types=(_FlatSetting,),
    )

    # Lookup order; the first is the cpu tier, at most one of each kind.
    tiers: tuple[TierConfig, ...] = (CpuTierConfig(),)
    # Tokens per stored chunk; None picks the smallest size every group's block tiles.
    chunk_tokens: PositiveInt | None = None
    # Which recurrent-state boundaries are kept: see core/policy.py.
    checkpoint_policy: Literal["prompt_and_end", "every_chunk"] = "prompt_and_end"
    # Names the weights in every key. None: the engine's model path; set it when
    # replicas load the same weights from different paths.
    model_id: Annotated[Text | None, BeforeValidator(_not_null)] = None
    # Secret that MACs every disk and Redis entry, so that whoever can write to a shared
    # disk path or Redis cannot inject KV: entries without this MAC are misses. Read it
    # as `integrity_key` (SecretStr keeps it out of reprs).
    integrity_secret: Secret | None = Field(default=None, alias="integrity_key")
    # Weight of prefill saved per byte against recency when CPU memory evicts recurrent
    # boundaries (core/eviction.py); 0 is LRU over whole boundaries.
    eviction_alpha: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)] = 0.25
    # Bytes each rank writes into its KV cache for restores in one engine step; the rest
    # waits for the next steps, so a large restore does not stall decoding requests
    # (the GPU copies overlap forwards; a CPU engine copies in the step). 0: no limit.
    load_step_bytes: Size = 64 * MiB
    # Serve the vllm:hybridkv_* metrics over HTTP on this port from the scheduler side's
    # process, for engines without vLLM's server (offline LLM); off by default.
    metrics_port: Annotated[StrictInt, Field(ge=1, le=65535)] | None = None
    # The address metrics_port binds: this machine alone unless set ("0.0.0.0": all).
    metrics_host: Text = "127.0.0.1"
    # The YAML / JSON file the settings were merged from.
    config_file: Text | None = None

    def __init__(self, /, **values: Any) -> None:
        # Every failed check reaches here as pydantic's ValidationError around the
        # ConfigError `_fold_and_explain` raised: hand on the ConfigError.
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(_explain(e, {}, {})) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest precedence first, as pydantic-settings takes them."""
        raw, environ = _FROM_DICT.get() or (init_settings(), os.environ)
        return (
            _Environment(settings_cls, environ),
            _Arguments(settings_cls, raw),
            _ConfigFile(settings_cls),
        )

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> HybridKVConfig:
        """The configuration from `kv_connector_extra_config` (`raw`), the file it names
        in `config_file`, and `HYBRIDKV_*` variables of `env` (default: os.environ)."""
        token = _FROM_DICT.set((dict(raw or {}), os.environ if env is None else env))
        try:
            return cls()
        finally:
            _FROM_DICT.reset(token)

    @model_validator(mode="wrap")
    @classmethod
    def _fold_and_explain(
        cls, data: Any, handler: ModelWrapValidatorHandler[HybridKVConfig]
    ) -> HybridKVConfig:
        if not isinstance(data, Mapping):
            return handler(data)
        data = dict(data)
        where = data.pop(_WHERE, {})
        data, names = _fold(data, where)
        tiers = data.get("tiers", ())
        kinds = {_kind_of(t) for t in tiers} if isinstance(tiers, list | tuple) else {"?"}
        if data.get("integrity_key") is not None and not kinds & {"disk", "redis", "?"}:
            raise ConfigError(
                "integrity_key: has no effect without disk_path or redis_url "
                f"(a disk or redis tier){where.get('integrity_key', '')}"
            )
        try:
            config = handler(data)
        except ValidationError as e:
            raise ConfigError(_explain(e, names, where)) from None
        problem = _tier_order_problem([t.kind for t in config.tiers])
        if problem:
            raise ConfigError(f"{problem}{where.get('tiers', '')}")
        return config

    @property
    def integrity_key(self) -> str | None:
        """The secret itself, for the tiers' MAC."""
        secret = self.integrity_secret
        return None if secret is None else secret.get_secret_value()

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


# Every key a source may hold, as written; the environment sets all but `tiers`.
_KEYS = {f.alias or name for name, f in HybridKVConfig.model_fields.items()} | set(_FLAT)
_ENV_KEYS = _KEYS - {"tiers"}


# ---------------------------------------------------------------------------------------
# Errors


def _where(
    loc: tuple[Any, ...], names: Mapping[tuple[str, str], str], where: Mapping[str, str]
) -> tuple[str, str]:
    """The key a location names as the user wrote it, and the source suffix."""
    if loc[:1] == ("tiers",) and len(loc) >= 2 and isinstance(loc[1], int):
        rest = list(loc[2:])
        kind = rest.pop(0) if rest and rest[0] in TIER_KINDS else None
        flat = names.get((kind, rest[0])) if kind and rest else None
        if flat is not None:
            return ".".join([flat, *map(str, rest[1:])]), where.get(flat, "")
        return f"tiers[{loc[1]}]" + "".join(f".{p}" for p in rest), where.get("tiers", "")
    return ".".join(map(str, loc)), where.get(str(loc[0]), "") if loc else ""


def _describe(err: Any, names: Mapping[tuple[str, str], str], where: Mapping[str, str]) -> str:
    kind, loc = err["type"], err["loc"]
    name, suffix = _where(loc, names, where)
    tier = loc[2] if len(loc) >= 3 and loc[0] == "tiers" and loc[2] in TIER_KINDS else None
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a check across keys: names its own key
        return str(cause)
    if isinstance(cause, ValueError):
        return f"{name}: {cause}{suffix}"
    if kind == "extra_forbidden" and tier is not None:
        known = ", ".join(_TIER_MODELS[tier].model_fields)
        return f"{name}: unknown setting of a {tier} tier{suffix} (known: {known})"
    if kind == "extra_forbidden":
        # suffix: " (from config_file '…')" -> " in config_file '…'"
        place = f" in {suffix[len(' (from ') : -1]}" if suffix else " in kv_connector_extra_config"
        return f"{name}: unknown hybridkv setting{place} (known: {', '.join(sorted(_KEYS))})"
    if kind == "union_tag_not_found":
        return f"{name}.kind: missing; expected one of {TIER_KINDS}{suffix}"
    if kind == "union_tag_invalid":
        got = (err.get("ctx") or {}).get("tag")
        return f"{name}.kind: expected one of {TIER_KINDS}, got {got!r}{suffix}"
    if kind == "missing":
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
    """`value` as an error may echo it: a string that may be a URL loses its password, in
    a list or mapping too (a tier written as a mapping echoes its URL)."""
    if isinstance(value, str):
        return mask_url(value) if "://" in value else value
    if isinstance(value, Mapping):
        return {k: "***" if k == "integrity_key" else _shown(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_shown(v) for v in value)
    return value


def _tier_order_problem(kinds: list[str]) -> str | None:
    """What is wrong with the tiers' kinds in this order, naming the key; None if nothing."""
    if "cpu" not in kinds:
        return "tiers: a cpu tier is required, first in the list"
    if kinds[0] != "cpu":
        return (
            f"tiers[{kinds.index('cpu')}].kind: the cpu tier must come first "
            f"(tiers are listed in lookup order)"
        )
    for i, kind in enumerate(kinds):
        if kind in kinds[:i]:
            return f"tiers[{i}].kind: a second {kind} tier; at most one of each"
    return None


def _explain(
    e: ValidationError, names: Mapping[tuple[str, str], str], where: Mapping[str, str]
) -> str:
    """One line per problem; unknown keys first (alphabetically), then the rest in the
    model's order, so the message starts with a key at fault."""
    errors = e.errors(include_url=False)
    errors.sort(
        key=lambda err: (
            err["type"] != "extra_forbidden",
            ".".join(map(str, err["loc"])) if err["type"] == "extra_forbidden" else "",
        )
    )
    return "\n".join(dict.fromkeys(_describe(err, names, where) for err in errors))


def effective(config: HybridKVConfig) -> dict[str, Any]:
    """The configuration as it applies, for logging once at start: every key (tiers as
    the normalized list), sizes spelled in units, modes in octal, secrets masked
    (`integrity_key` as "***", passwords in Redis URLs as ***); `model_id` only when set
    (null is refused: the engine's model path is its default). Apart from the masked
    secrets it is itself a valid configuration."""
    return config.model_dump(
        mode="json", by_alias=True, exclude={"model_id"} if config.model_id is None else None
    )
