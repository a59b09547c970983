"""Incremental snapshots: a process that polls the store reads only what changed since its last poll.

A `Follower` keeps, per sealed file of the version it last read, that file's rows (a fixed set
of columns: by default every column but the token lists and the request/response JSON, which
polls never need). A poll moves the table forward through the Delta log entries after the
version it holds (delta-rs's incremental update: a listing and the new entries), reads the
files those entries add, drops the files they remove, and points one long-lived DuckDB
connection's views at the rows it holds plus this machine's live rows. The files it already
read are never read again, so a poll with nothing new costs a constant number of object-store
requests however many files the store holds; its CPU cost is one query over rows in memory.

Compaction swaps many small files for one large one with the same rows: the follower reads the
large file once and drops the small ones (the views count each event once by event_id anyway).

It holds its columns of every event of the store in memory: a follower is for the polls of a
long-running process (`collect`'s version and group polls, the viewer's run summary), not for
reading token lists; those go through `Snapshot.narrow`, which reads only the files that can
hold the rows asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pyarrow as pa

from trajstore.read import Pinned, Reader, Snapshot, with_all_columns
from trajstore.schema import EVENT_SCHEMA

MAX_CHUNKS = 8

# What polls read: everything but the per-token lists (tokens, logprobs, MoE routes, kept sets, a teacher's
# scores) and the raw request/response JSON (with the links of a request stored as a delta).
POLL_COLUMNS: tuple[str, ...] = tuple(
    name for name in EVENT_SCHEMA.names
    if name not in ("prompt_ids", "output_ids", "output_logprobs", "output_mask", "request", "response", "sampling",
                    "request_base", "request_shared", "request_kept",
                    "routed_experts", "routed_experts_shape", "support_sizes", "support_ids", "teacher_logprobs")
)


class Follower:
    """Reads the latest version of a store again and again, paying only for what is new."""

    def __init__(self, reader: Reader, columns: Sequence[str] = POLL_COLUMNS) -> None:
        self._reader = reader
        self.columns = tuple(columns)
        self._rows: dict[str, pa.Table] = {}  # per sealed file of the version last read: its rows
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._combined: tuple[set[str], list[pa.Table]] | None = None  # those files' rows, in few chunks
        self.files_read = 0  # sealed files read so far (tests and benchmarks read it)

    def _sealed(self, pinned: Pinned) -> pa.Table:
        files = pinned.table.files
        new = [f for f in files if f.path not in self._rows]
        if new:
            for f in new:  # through Table.read: a damaged file is the store's one damage report
                self._rows[f.path] = self._reader.table.read([f], columns=self.columns)
            self.files_read += len(new)
        if len(self._rows) > len(files):  # files compacted away (or a version without them)
            keep = {f.path for f in files}
            self._rows = {p: rows for p, rows in self._rows.items() if p in keep}
        # Few large chunks: DuckDB scans an Arrow table of thousands of small chunks ~10x slower. New
        # files become one more chunk; past MAX_CHUNKS, or when files went away, it is rebuilt whole.
        paths = {f.path for f in files}
        if self._combined is None or not self._combined[0] <= paths or len(self._combined[1]) >= MAX_CHUNKS:
            self._combined = (set(), [])
        held, chunks = self._combined
        added = [self._rows[f.path] for f in files if f.path not in held]
        if added:
            chunks.append(pa.concat_tables(added).combine_chunks())
            held |= {f.path for f in files}
        empty = pa.table({c: pa.array([], EVENT_SCHEMA.field(c).type) for c in self.columns})
        return pa.concat_tables(chunks) if chunks else empty

    def rows(self) -> pa.Table:
        """Every event of the latest version plus live rows (this follower's columns; the rest null)."""
        with self._lock:
            return self._rows_now()[1]

    def _rows_now(self) -> tuple[Pinned, pa.Table]:
        pinned = self._reader.pin()
        return pinned, with_all_columns(self._sealed(pinned), pinned.live, self.columns)

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """The latest version (plus live rows) over the views, read incrementally. The snapshot is
        the follower's own, reused by the next poll: use it inside the `with` block only."""
        with self._lock:
            pinned, rows = self._rows_now()
            if self._snap is None:
                self._snap = Snapshot(self._reader.table, pinned, files=())
            else:
                self._snap.repin(pinned, files=())
            self._snap.use_rows(rows)
            yield self._snap

    def close(self) -> None:
        with self._lock:
            if self._snap is not None:
                self._snap.close()
                self._snap = None
            self._rows = {}
            self._combined = None
