"""`hybridkv gc`: trims a disk directory, safely while engines use it. What goes, in which
order and why it is safe: core/trim.py; this module parses options and presents."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.cli.app import app, size_option
from hybridkv.cli.inspect_cmd import byte_progress, human_bytes

if TYPE_CHECKING:  # imported when run: the store's readers import torch (seconds)
    from hybridkv.core.trim import Plan


@app.command()
def gc(
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="a disk_path (or one layout directory in it)")
    ],
    max_bytes: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="remove least recently used chunks until the entries of every layout "
            "together take at most SIZE (8GiB, 500MB)",
        ),
    ] = None,
    older_than: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="remove chunks last used longer ago (30m, 12h, 7d)"),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            metavar="ID",
            help="remove a layout's entries and directory (its fingerprint, or 4+ of its "
            "first hex digits)",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would go, remove nothing")
    ] = False,
) -> None:
    """Remove entries from a disk directory, safely while engines use it: a chunk's
    attention KV and the recurrent states at its end go together, an engine reading a
    removed entry counts a miss and recomputes. Criteria combine: --layout, then
    --older-than, then --max-bytes on what is left."""
    from hybridkv.core import trim
    from hybridkv.core.inventory import DiskStore, InventoryError

    if max_bytes is None and older_than is None and layout is None:
        raise typer.BadParameter("give --max-bytes, --older-than or --layout")
    if "://" in path:
        raise typer.BadParameter(
            "gc trims disk directories; Redis evicts by itself (maxmemory-policy)",
            param_hint="PATH",
        )
    limit = size_option(max_bytes, "--max-bytes") if max_bytes is not None else None
    try:
        age = trim.parse_duration(older_than) if older_than is not None else None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--older-than") from None
    try:
        inventory = DiskStore(path).inventory()
    except InventoryError as e:
        typer.echo(f"hybridkv gc: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        p = trim.plan(inventory, max_bytes=limit, older_than_s=age, layout=layout)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--layout") from None

    console = Console(highlight=False)
    show_plan(console, p, dry_run)
    if dry_run or not (p.entries() or p.layouts):  # a whole layout may hold no entries
        return
    with byte_progress("removing", p.bytes, quiet=False) as advance:
        result = trim.execute(p, advance)
    left = p.total_bytes - result.removed_bytes
    console.print(
        f"removed {result.removed} entries ({human_bytes(result.removed_bytes)}); "
        f"{human_bytes(left)} of entries left"
    )
    if result.skipped:
        console.print(f"{result.skipped} left: an engine replaced or removed them meanwhile")
    for where in result.layout_dirs_removed:
        console.print(f"removed layout directory {escape(where)}")
    for where in result.layout_dirs_left:
        console.print(
            f"kept layout directory {escape(where)}: a write is under way in it, or it "
            "cannot be read or removed by this user"
        )


def show_plan(console: Console, p: Plan, dry_run: bool) -> None:
    """Per layout: entries, bytes and chunks that go."""
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for lay in p.layouts:
        rows[lay.fingerprint][0] += len(lay.entries)
        rows[lay.fingerprint][1] += sum(e.size for e in lay.entries)
        rows[lay.fingerprint][2] += len({e.chunk_key for e in lay.entries})
    for u in p.units:
        rows[u.layout.fingerprint][0] += len(u.entries)
        rows[u.layout.fingerprint][1] += u.bytes
        rows[u.layout.fingerprint][2] += 1
    verb = "would remove" if dry_run else "removing"
    table = Table("layout", box=None, title=f"{verb}:", title_justify="left")
    for column in ("entries", "bytes", "chunks"):
        table.add_column(column, justify="right")
    for fp, (entries, nbytes, chunks) in sorted(rows.items()):
        whole = " (whole layout)" if any(lay.fingerprint == fp for lay in p.layouts) else ""
        table.add_row(fp + whole, str(entries), human_bytes(nbytes), str(chunks))
    total = p.bytes
    chunks = sum(r[2] for r in rows.values())
    table.add_row("all", str(len(p.entries())), human_bytes(total), str(chunks))
    console.print(table)
    console.print(
        f"entries {human_bytes(p.total_bytes)} before, {human_bytes(p.total_bytes - total)} after"
    )
