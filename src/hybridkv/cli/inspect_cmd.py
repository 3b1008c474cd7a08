"""`hybridkv inspect`: what a disk directory or a Redis holds, and with `--verify` whether
every entry is one an engine would load. The listing and the checks are
core/inventory.py's; this module parses options and presents."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hybridkv.cli.app import app

if TYPE_CHECKING:  # imported when run: the store's readers import torch (seconds)
    from hybridkv.core.inventory import Inventory, LayoutInventory, VerifyReport


def human_bytes(n: int) -> str:
    """`n` bytes for a reader: 1.2 MiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def when(seconds: float | None) -> str:
    return "-" if seconds is None else datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


@contextmanager
def byte_progress(what: str, total: int, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar over `total` bytes on stderr (stdout stays the report); yields the
    function that advances it."""
    with Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=quiet,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


@app.command("inspect")
def inspect_cmd(
    target: Annotated[
        str,
        typer.Argument(
            metavar="PATH_OR_URL",
            help="a disk_path (or one layout directory in it), or redis://host:port/db",
        ),
    ],
    check: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="read every entry and check it as an engine would (header, size, "
            "checksum; MAC with --integrity-key); exit status 1 if any is damaged",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON, no tables")] = False,
    integrity_key: Annotated[
        str | None,
        typer.Option(
            envvar="HYBRIDKV_INTEGRITY_KEY",
            help="the engines' integrity_key: --verify checks MACs under it (entries "
            "written with a key are not checked without it)",
        ),
    ] = None,
    key_prefix: Annotated[str, typer.Option(help="Redis: the tier's key_prefix")] = "hybridkv",
) -> None:
    """Show what a disk directory or a Redis holds: layouts (model, dtypes, groups, TP),
    entries and bytes per group and kind, chunks with and without recurrent states,
    oldest and newest use. Reads only; engines may be running."""
    from hybridkv.core.inventory import InventoryError, open_store, verify

    try:
        store = open_store(target, key_prefix)
        try:
            inventory = store.inventory()
            report = None
            if check:
                total = sum(e.size for lay in inventory.layouts for e in lay.entries)
                with byte_progress("verifying", total, as_json) as advance:
                    report = verify(store, inventory, integrity_key, advance)
        finally:
            store.close()
    except InventoryError as e:
        typer.echo(f"hybridkv inspect: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        out: dict[str, Any] = inventory.summary()
        if report is not None:
            out["verify"] = report.summary()
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        console = Console(highlight=False)
        show_inventory(console, inventory)
        if report is not None:
            show_report(console, report, inventory.where)
    if report is not None and report.failed:
        raise typer.Exit(1)


def show_inventory(console: Console, inventory: Inventory) -> None:
    s = inventory.summary()
    n = len(inventory.layouts)
    console.print(
        f"[bold]{inventory.source}[/] {escape(inventory.where)}: {n} layout{'s' * (n != 1)}, "
        f"{s['entries']} entries, {human_bytes(s['bytes'])}"
    )
    for lay, ls in zip(inventory.layouts, s["layouts"], strict=True):
        show_layout(console, lay, ls)
    if inventory.strays.count:
        show_strays(console, "not hybridkv's", s["strays"])


def show_layout(console: Console, lay: LayoutInventory, s: dict[str, Any]) -> None:
    d = lay.description or {}
    identity = d.get("identity") if isinstance(d.get("identity"), dict) else {}
    console.print()
    console.print(f"[bold]layout {lay.fingerprint}[/]")
    console.print(f"  {escape(lay.where)}")
    if lay.description is not None:
        console.print(f"  model {escape(str(d.get('model', '?')))}")
        facts = [
            f"TP {d.get('tp_size', '?')} (rank {d.get('tp_rank', '?')})",
            f"dtype {identity.get('model_dtype', '?')}".replace("torch.", ""),
            f"KV cache dtype {identity.get('kv_cache_dtype', '?')}",
            f"format {d.get('format_version', '?')}",
        ]
        console.print("  " + escape(" · ".join(facts)))
    if lay.note:
        console.print(f"  [yellow]{escape(lay.note)}[/]")
    described = d.get("groups") if isinstance(d.get("groups"), list) else []
    found = {g["group"]: g for g in s["groups"]}
    columns = ["group", "kind", "block tokens", "layers", "dtype"] if described else ["group"]
    table = Table(box=None, padding=(0, 1), pad_edge=False)
    for name in columns:
        table.add_column(name, no_wrap=True)
    for name in ("entries", "bytes"):
        table.add_column(name, justify="right", no_wrap=True)
    for gid in sorted(set(range(len(described))) | set(found)):
        g = described[gid] if gid < len(described) and isinstance(described[gid], dict) else {}
        count = found.get(gid, {"entries": 0, "bytes": 0})
        layers = g.get("layer_names")
        window = f" ({g['window']} tokens)" if g.get("window") else ""
        row = [  # layout.json is anyone's to write: nothing of it read as markup
            str(gid),
            escape(lay.kind_of(gid) + window),
            escape(str(g.get("block_tokens", "?"))),
            str(len(layers)) if isinstance(layers, list) else "?",
            escape(str(g.get("dtype", "?")).replace("torch.", "")),
        ]
        table.add_row(*row[: len(columns)], str(count["entries"]), human_bytes(count["bytes"]))
    console.print(table)
    if described:
        kinds = [
            f"{escape(kind)} {k['entries']} ({human_bytes(k['bytes'])})"
            for kind, k in s["kinds"].items()
        ]
        console.print(f"  by kind: {', '.join(kinds)}")
    c = s["chunks"]
    if c["with_all_states"] is None:
        console.print(f"  chunks: {c['total']} (group kinds not recorded: states unknown)")
    else:
        console.print(
            f"  chunks: {c['total']}; {c['with_all_states']} with every recurrent state, "
            f"{c['with_some_states']} with some, {c['without_states']} with none"
        )
    console.print(f"  last use: oldest {when(s['oldest_use'])}, newest {when(s['newest_use'])}")
    if s["temporary_files"]:
        console.print(
            f"  writes in progress or left by dead writers: {s['temporary_files']} file(s), "
            f"{human_bytes(s['temporary_bytes'])}"
        )
    if lay.strays.count:
        show_strays(console, "no entries", s["strays"])


def show_strays(console: Console, what: str, strays: dict[str, Any]) -> None:
    console.print(
        f"  [yellow]{strays['count']} names here are {what}[/] ({human_bytes(strays['bytes'])})"
    )
    for name in strays["names"]:
        console.print(f"    {escape(name)}")


def show_report(console: Console, report: VerifyReport, root: str) -> None:
    """The verdict, and each entry that failed (disk paths relative to `root`)."""
    console.print()
    style = "red" if report.failed else "green"
    counts = [f"{report.good} good", f"{len(report.damaged)} damaged"]
    for n, what in (
        (len(report.unreadable), "unreadable"),
        (len(report.not_usable_here), "for other settings"),
        (report.gone, "gone meanwhile"),
    ):
        if n:
            counts.append(f"{n} {what}")
    console.print(f"[bold {style}]verified {report.checked} entries:[/] {', '.join(counts)}")
    for title, problems in (
        ("damaged (an engine deletes these on sight)", report.damaged),
        ("unreadable", report.unreadable),
        ("not usable with these settings", report.not_usable_here),
    ):
        if problems:
            console.print(f"{title}:")
            for p in problems:
                where = os.path.relpath(p.where, root) if p.where.startswith(root) else p.where
                console.print(f"  {escape(where)}: {escape(p.detail)}")
