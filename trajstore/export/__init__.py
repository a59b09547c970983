"""Exports of a run's samples to the ecosystem's formats, and the `hf` one read back.

    export(store, "hf", run="r1", out="ds/")                   # datasets.load_dataset("parquet", data_dir="ds/")
    export(store, "sft", run="r1", out="sft.jsonl", where="reward >= 1")
    export(store, "tokens", run="r1", out="tokens.parquet")
    export(store, "ng-trajectory", run="r1", out="rollouts.jsonl")
    ingest_hf(store, "ds/")                                     # the samples, rewards and statuses again

Every format reads the same rows (`trajstore.export.source`: one per sample, with its
rollout's outcome and its turns' boundaries) from one pinned table version, streamed in record
batches under a DuckDB memory limit, and writes them as it goes: memory stays bounded by
the batch and the limit, not by the run. `where` is a SQL condition over those rows.

Design limits: text comes only from the request/response JSON collectors stored (the store
holds no tokenizer); the learner logs no per-token logprobs, so the `tokens` export leaves
`learner_logprob` and `ratio` null.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pyarrow as pa

from trajstore.errors import ExportError, QueryError
from trajstore.export import source
from trajstore.export.hf import write_hf
from trajstore.export.hf_import import read_export
from trajstore.export.nemo_gym import write_trajectories
from trajstore.export.sft import write_sft
from trajstore.export.token_table import write_tokens

if TYPE_CHECKING:
    from trajstore.store import Store

Format = Literal["hf", "sft", "tokens", "ng-trajectory"]

# DuckDB's memory for an export's aggregations and sort; beyond it they spill to disk.
MEMORY_LIMIT = "512MB"


@dataclass(frozen=True)
class ExportResult:
    format: Format
    out: Path
    rows: int  # samples exported (token rows for `tokens`)
    skipped: int  # samples left out (sft: no chat JSON to take text from)
    table_version: int


def _hf(batches: Iterable[pa.RecordBatch], out: Path, source_info: dict[str, object]) -> tuple[int, int]:
    return write_hf(batches, out, source_info), 0


_WRITERS: dict[Format, Callable[[Iterable[pa.RecordBatch], Path, dict[str, object]], tuple[int, int]]] = {
    "hf": _hf,
    "sft": lambda batches, out, _: write_sft(batches, out),
    "tokens": lambda batches, out, _: (write_tokens(batches, out), 0),
    "ng-trajectory": lambda batches, out, _: (write_trajectories(batches, out), 0),
}
FORMATS: tuple[Format, ...] = tuple(_WRITERS)


def _check_out(fmt: Format, out: Path) -> None:
    if fmt == "hf":
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ExportError(f"{out} exists and is not an empty directory; the hf export writes a new dataset "
                              "directory: give a new path or remove it")
    elif out.is_dir():
        raise ExportError(f"{out} is a directory; the {fmt} export writes one file: give a file path")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent} does not exist; create it first or give another output path")


def export(store: Store, fmt: Format, *, run: str, out: str | os.PathLike[str], version: int | None = None,
           where: str | None = None, batch_rows: int = source.BATCH_ROWS,
           memory_limit: str = MEMORY_LIMIT) -> ExportResult:
    """Export run `run`'s samples (those `where` keeps) at table `version` (latest) as `fmt` to `out`."""
    if fmt not in _WRITERS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    _check_out(fmt, out)
    with store.snapshot(version, memory_limit=memory_limit) as snap:
        runs = source.runs(snap)
        if run not in runs:
            raise ExportError(f"run {run!r} has no turns in {store.location.uri} at table version "
                              f"{snap.table_version}; the runs are: {', '.join(runs) or 'none'}")
        if where:
            try:  # before anything is written: a bad filter leaves no half-made output
                source.check_where(snap, run, where)
            except QueryError as exc:
                reason = exc.__cause__ or exc  # DuckDB's own words, without the list of views
                raise ExportError(f"--where {where!r} is not a SQL condition over the export's rows: {reason}\nIts "
                                  f"columns are: {', '.join(source.columns(snap, run))}") from exc
        info = {"store": store.location.uri, "run": run, "table_version": snap.table_version, "where": where}
        rows, skipped = _WRITERS[fmt](source.sample_batches(snap, run, where=where, rows=batch_rows), out, info)
        return ExportResult(fmt, out, rows, skipped, snap.table_version)


def ingest_hf(store: Store, directory: str | os.PathLike[str], *, writer: str | None = None,
              batch_rows: int = source.BATCH_ROWS) -> int:
    """Append the events an `hf` export stands for (see `trajstore.export.hf_import`); the number appended."""
    appended = 0
    with store.writer(writer) as w:
        for events in read_export(directory, rows=batch_rows):
            appended += w.append(events).appended
    return appended


__all__ = ["FORMATS", "ExportResult", "Format", "MEMORY_LIMIT", "export", "ingest_hf"]
