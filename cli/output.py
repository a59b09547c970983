"""How the `trajstore` commands show and export query results.

Exports (`--format csv|json|parquet`) take any result a query can return: each format gets
the columns it can hold (CSV has no lists or maps: they become JSON text; neither CSV nor
Parquet holds DuckDB's INTERVAL: it becomes ISO 8601 text such as `P0M0DT0.8S`).

On a terminal a result is a table whose long cells are cut (`…`) to `MAX_CELL` characters;
when even that is wider than the terminal, each row becomes a block of `column  value`
lines (psql's expanded display), so nothing wraps into a column of single letters. Piped
into a file or another program, rows are never squeezed to a terminal's width: the table
is as wide as its cells, and no printed line is wrapped (`CommandConsole`), so a command
printed into a log can be pasted back as it was.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, BinaryIO

import click
from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

if TYPE_CHECKING:
    import pyarrow as pa

MAX_CELL = 40  # characters of one cell in a table; `--format csv/json` has every value whole
MAX_LIST_ITEMS = 12
ROW_LIMIT = 100


class CommandConsole(Console):
    """rich's Console for the commands' output: on a terminal as rich prints; piped into a file or another
    program, printed lines are not wrapped at a terminal's width (rich assumes 80 columns there)."""

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        if soft_wrap is None and not self.is_terminal:
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)

    def rule(self, title: Any = "", **kwargs: Any) -> None:
        if self.is_terminal or not title:
            super().rule(title, **kwargs)
        else:  # a rule is as wide as the console: its title would be cut at 80 columns
            self.print(Text.assemble("── ", title if isinstance(title, Text) else str(title), " ──"))


def _iso_interval(value: Any) -> str | None:
    """pyarrow's MonthDayNano as ISO 8601 (`P{months}M{days}DT{seconds}S`)."""
    if value is None:
        return None
    seconds = f"{value.nanoseconds / 1e9:.9f}".rstrip("0").rstrip(".")
    return f"P{value.months}M{value.days}DT{seconds}S"


def exportable(table: pa.Table, fmt: str) -> pa.Table:
    """`table` with every column in a type `fmt` can write (see the module docstring)."""
    import pyarrow as pa
    out = table
    for i, f in enumerate(table.schema):
        column = table.column(i)
        if pa.types.is_interval(f.type):
            out = out.set_column(i, f.name, pa.array([_iso_interval(v) for v in column.to_pylist()], pa.string()))
        elif fmt == "csv" and pa.types.is_nested(f.type):
            out = out.set_column(i, f.name, pa.array([None if v is None else json.dumps(v, default=str)
                                                      for v in column.to_pylist()], pa.string()))
    return out


def write_table(table: pa.Table, fmt: str, output: str | None, console: Console) -> None:
    """Show `table` (`table`) or export it (`csv`, `json` lines, `parquet`) to `output` or stdout."""
    if fmt == "table":
        print_table(table, console)
        return
    if fmt == "parquet" and not output:
        raise click.UsageError("--format parquet needs --output FILE")
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    data = exportable(table, fmt)
    if fmt == "parquet":
        pq.write_table(data, output)
        return
    sink: BinaryIO = open(output, "wb") if output else sys.stdout.buffer  # noqa: SIM115 - closed below
    try:
        if fmt == "csv":
            pacsv.write_csv(data, sink)
        else:
            for row in data.to_pylist():
                sink.write((json.dumps(row, default=str) + "\n").encode())
    finally:
        if output:
            sink.close()
        else:
            sink.flush()


def cell(value: Any, limit: int | None = MAX_CELL) -> str:
    """One value as table text: floats to 4 significant digits, long lists and strings cut."""
    if value is None:
        return ""
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, datetime):
        text = value.isoformat(sep=" ", timespec="milliseconds")
    elif isinstance(value, list):
        shown = [round(v, 4) if isinstance(v, float) else v for v in value[:MAX_LIST_ITEMS]]
        text = json.dumps(shown, default=str)
        if len(value) > MAX_LIST_ITEMS:
            text = text[:-1] + f", ... ({len(value)} items)]"
    else:
        text = str(value)
    text = text.replace("\n", " ")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def print_table(table: pa.Table, console: Console, title: str | None = None, limit: int = ROW_LIMIT) -> None:
    """A result on the console in the layout that fits it (see the module docstring)."""
    rows = [[cell(v) for v in row.values()] for row in table.slice(0, limit).to_pylist()]
    names = table.column_names
    widths = [max([len(n), *(len(r[i]) for r in rows)]) for i, n in enumerate(names)]
    natural = sum(widths) + 3 * len(names) + 1  # cells, their padding and rules
    if console.is_terminal and natural > console.width and names:
        _print_records(names, rows, console, title)
    else:
        view = RichTable(title=title, header_style="bold")
        for name in names:
            view.add_column(name, no_wrap=True, overflow="ellipsis")
        for row in rows:
            view.add_row(*(Text(c) for c in row))  # Text: cells are data, not markup
        if console.is_terminal:
            console.print(view)
        else:  # piped: as wide as the cells, never wrapped at a terminal's width
            Console(file=console.file, width=max(natural, len(title or "")), color_system=None).print(view)
    if table.num_rows > limit:
        console.print(f"... {table.num_rows - limit} more rows (use --format csv/json/parquet for all)",
                      style="dim", highlight=False)


def _print_records(names: list[str], rows: list[list[str]], console: Console, title: str | None) -> None:
    """One block of `column  value` lines per row: for results wider than the terminal."""
    if title:
        console.print(title, style="bold", highlight=False)
    pad = max(len(n) for n in names)
    for k, row in enumerate(rows, start=1):
        console.print(Text(f"-[ row {k} ]" + "-" * max(0, min(console.width, pad + MAX_CELL + 2) - 11 - len(str(k))),
                           style="dim"))
        for name, value in zip(names, row):
            console.print(Text(f"{name.ljust(pad)}  {value}"), overflow="ellipsis", no_wrap=True)
