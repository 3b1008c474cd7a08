"""Engine-agnostic description of a model's KV cache groups.

A hybrid model's cache comes in *groups*; each group has one kind of layer, its own
tokens-per-block and its own page size. A block id names one page in every layer of its
group. Recurrent groups hold one state per block, and the state in block i is the state
after token (i + 1) * block_tokens.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

import blake3

# In every layout's fingerprint: raise it whenever the bytes of an entry change for the
# same layout and identity (the header, the canonical order of a page's pieces), so that
# no reader takes older entries for newer ones. 9fece0d reordered kernel-split pages
# without raising it; the identity fields added after it moved every engine's entries
# to new directories, which the version would have done.
FORMAT_VERSION = 1


class GroupKind(enum.StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"  # recurrent (Mamba / GDN) state: one per checkpoint boundary


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group as the engine allocates it."""

    kind: GroupKind
    block_tokens: int
    # Unpadded bytes of one block summed over the group's layers: what a stored block holds.
    block_bytes: int
    layer_names: tuple[str, ...]
    # Tokens visible behind a position (sliding groups only).
    window: int | None = None
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if (self.kind is GroupKind.SLIDING) != (self.window is not None):
            raise ValueError("window is set exactly for sliding groups")


@dataclass(frozen=True)
class Layout:
    """Everything that changes the bytes of a stored entry; hashed into every key."""

    model: str
    groups: tuple[GroupSpec, ...]
    tp_size: int = 1
    # Each tensor-parallel rank holds a different slice of the heads.
    tp_rank: int = 0
    format_version: int = FORMAT_VERSION
    # What else decides the bytes (engine's physical KV layout, dtypes, quantization,
    # weights...): (name, value) pairs, kept sorted by name; names are unique.
    identity: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        identity = tuple(sorted(self.identity))
        if len({name for name, _ in identity}) != len(identity):
            raise ValueError(f"identity names must be unique: {identity}")
        object.__setattr__(self, "identity", identity)

    def describe(self) -> dict:
        d = asdict(self)
        for g in d["groups"]:
            g["kind"] = GroupKind(g["kind"]).value
            g["layer_names"] = list(g["layer_names"])
        # Left out when empty: layouts without identity keep their fingerprint.
        if identity := d.pop("identity"):
            d["identity"] = dict(identity)
        return d

    @property
    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever stored bytes would not be interchangeable."""
        blob = json.dumps(self.describe(), sort_keys=True).encode()
        return blake3.blake3(blob).digest(16)
