"""The store: open a location, hand out writers, and read consistent snapshots by SQL.

A read pins one table version and adds this machine's live write-ahead segments (rows the
table has not sealed yet, cut at each writer's sealed seq), so every query sees, per
writer, a gap-free prefix of what it appended: acknowledged events are visible at once,
whether sealed or not. Segments are listed *before* the table version is read, so a
segment sealed and deleted in between is already in the table.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from trajstore import maintenance, wal
from trajstore.errors import CorruptionError, QueryError, StoreNotFoundError
from trajstore.location import Location, resolve
from trajstore.maintenance import CompactResult, Stats, VerifyReport
from trajstore.schema import EVENT_SCHEMA
from trajstore.shard import Estimator, Shard, make_shard
from trajstore.table import FileInfo, Table, TableSnapshot, sealed_seq
from trajstore.views import create_views
from trajstore.writer import Writer


@dataclass
class LiveRows:
    """Rows of this machine's write-ahead segments, per writer."""

    by_writer: dict[str, list[pa.RecordBatch]]

    def table(self, snapshot: TableSnapshot) -> pa.Table:
        batches = []
        for writer, rows in self.by_writer.items():
            cut = snapshot.sealed_seq(writer)
            for batch in rows:
                if batch.num_rows and batch.column("writer_seq")[batch.num_rows - 1].as_py() <= cut:
                    continue
                if batch.column("writer_seq")[0].as_py() <= cut:
                    seqs = batch.column("writer_seq").to_numpy()
                    batch = batch.filter(pa.array(seqs > cut))
                batches.append(batch)
        return pa.Table.from_batches(batches, schema=EVENT_SCHEMA)


# What pyarrow's Parquet reader says about damaged pages (checksums, page headers, encodings).
_DAMAGE_WORDS = ("checksum", "thrift", "corrupt", "parquet")


class Snapshot:
    """One consistent view of the store: a pinned table version plus live rows. Query it many times.

    `files` are the sealed files to read (all of the version's by default) and `live` the
    live rows; `use_rows` swaps in pre-filtered raw rows (the shard planner).
    """

    def __init__(self, store: Store, table: TableSnapshot, live: pa.Table | None = None, *,
                 files: Iterable[FileInfo] | None = None) -> None:
        self.store = store
        self.table_version = table.version
        self.files = tuple(table.files if files is None else files)
        self._con = duckdb.connect()
        self._con.execute("SET TimeZone = 'UTC'")
        self._con.register("_sealed", store.table.open_dataset(self.files))
        self._con.register("_live", live if live is not None else EVENT_SCHEMA.empty_table())
        self._con.execute("CREATE TEMP VIEW _raw AS SELECT * FROM _sealed UNION ALL BY NAME SELECT * FROM _live")
        create_views(self._con)

    def query(self, sql: str, params: Any = None) -> pa.Table:
        try:
            return self._con.sql(sql, params=params).to_arrow_table() if params is not None \
                else self._con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            text = str(exc).lower()
            if isinstance(exc.__cause__, CorruptionError) or any(w in text for w in _DAMAGE_WORDS):
                raise CorruptionError(f"a sealed file could not be read back intact: {exc}. "
                                      "Run `trajstore verify` for a full report.") from exc
            raise QueryError(f"query failed: {exc}\nThe views are: events, turns, samples, rollouts, "
                             "groups, advantages, checkpoints, consumed, metrics, step_rollouts.") from exc

    def register(self, name: str, data: pa.Table) -> None:
        self._con.register(name, data)

    def use_rows(self, rows: pa.Table) -> None:
        """Point the views at `rows` instead (raw rows of the same pinned version, pre-filtered
        by the shard planner), keeping the connection and its views: setting up a connection
        costs more than the planner's small queries."""
        self._con.execute("DROP VIEW IF EXISTS _raw")
        self._con.register("_raw", rows)
        self.files = ()

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Store:
    """A trajectory store at a location; see `open_store`."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.table = Table(location)
        self._cache_lock = threading.Lock()
        self._segment_cache: dict[Path, tuple[int, int, wal.SegmentRead]] = {}

    def __repr__(self) -> str:
        return f"Store({self.location.uri!r})"

    # ------------------------------------------------------------------ writing

    def writer(self, name: str | None = None, **options: Any) -> Writer:
        """A writer owned by this process (default name: `<host>-<pid>`). Options: seal_bytes,
        seal_interval (seconds), seal_on_close, remember_ids (how many recent event ids it
        keeps to skip re-appends; older duplicates are still shown once by the views)."""
        return Writer(self, name or f"{socket.gethostname()}-{os.getpid()}", **options)

    def table_sealed_seq(self, writer: str) -> int:
        return sealed_seq(self.table._current(), writer)

    # ------------------------------------------------------------------ reading

    def _read_segment(self, path: Path) -> wal.SegmentRead | None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        key = (st.st_size, st.st_mtime_ns)
        with self._cache_lock:
            hit = self._segment_cache.get(path)
        if hit and hit[:2] == key:
            return hit[2]
        try:
            read = wal.read_segment(path)
        except FileNotFoundError:
            return None  # sealed and deleted since listing: the table has it
        with self._cache_lock:
            self._segment_cache[path] = (*key, read)
        return read

    def live(self) -> LiveRows:
        """This machine's write-ahead rows (all of them; cut per snapshot)."""
        by_writer: dict[str, list[pa.RecordBatch]] = {}
        root = self.location.wal_root
        seen: set[Path] = set()
        if root.is_dir():
            for wdir in sorted(p for p in root.iterdir() if p.is_dir()):
                for path in wal.list_segments(wdir):
                    seen.add(path)
                    read = self._read_segment(path)
                    if read is not None and read.batches:
                        by_writer.setdefault(wdir.name, []).extend(b.data for b in read.batches)
        with self._cache_lock:
            for stale in set(self._segment_cache) - seen:
                del self._segment_cache[stale]
        return LiveRows(by_writer)

    def pin(self, version: int | None = None, *, live: bool = True) -> tuple[TableSnapshot, pa.Table]:
        """A table version (latest by default) and, when `live`, the live rows it has not sealed.

        The segments are read before the version is pinned (see the module docstring)."""
        rows = self.live() if live and version is None else LiveRows({})
        table = self.table.snapshot(version, writers=list(rows.by_writer))
        return table, rows.table(table)

    def snapshot(self, version: int | None = None, *, live: bool = True) -> Snapshot:
        """Pin a table version (latest by default) plus, when `live`, the live segments."""
        table, rows = self.pin(version, live=live)
        return Snapshot(self, table, rows)

    def query(self, sql: str, params: Any = None, *, version: int | None = None) -> pa.Table:
        """Run SQL over the views (events, turns, samples, rollouts, groups, advantages, ...)."""
        with self.snapshot(version) as snap:
            return snap.query(sql, params)

    def shard(self, *, policy_version: int, max_staleness: int, max_rollouts: int = 512,
              estimator: Estimator = "grpo", run: str | None = None, exclude: Iterable[str] = (),
              max_groups: int | None = None) -> Shard:
        """The next training shard: complete groups whose oldest tokens are at most
        `max_staleness` versions behind `policy_version`, not consumed by any checkpoint and
        not in `exclude` (rollouts the learner holds but has not checkpointed yet), oldest
        first, up to `max_rollouts` trainable rollouts (at least one group) and at most
        `max_groups` groups. See trajstore.shard."""
        return make_shard(self, policy_version=policy_version, max_staleness=max_staleness,
                          max_rollouts=max_rollouts, estimator=estimator, run=run, exclude=exclude,
                          max_groups=max_groups)

    def compact(self, *, target_bytes: int = 128 << 20) -> CompactResult:
        """Seal orphaned segments and rewrite small sealed files into larger ones."""
        return maintenance.compact(self, target_bytes=target_bytes)

    def verify(self) -> VerifyReport:
        """Check every checksum a reader relies on; the report lists every problem."""
        return maintenance.verify(self)

    def stats(self) -> Stats:
        """Runs, rollouts, samples, tokens, versions and disk use."""
        return maintenance.stats(self)

    def version(self) -> int:
        return self.table._current().version()


def open_store(location: str | os.PathLike[str], *, create: bool = True,
               spool: str | os.PathLike[str] | None = None,
               storage_options: dict[str, str] | None = None) -> Store:
    """Open (and by default create) the store at a directory or `s3://bucket/prefix`."""
    loc = resolve(location, spool=spool, storage_options=storage_options)
    table = Table(loc)
    if not table.exists():
        if not create:
            raise StoreNotFoundError(f"no trajstore store at {loc.uri}; create one with `trajstore ingest` "
                                     "or open_store(location) without create=False")
        table.create_if_missing()
    loc.wal_root.mkdir(parents=True, exist_ok=True)
    return Store(loc)
