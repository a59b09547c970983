"""The read side of a store: pin a table version, add this machine's live rows, query by SQL.

A read pins one table version and adds this machine's live write-ahead segments (rows the
table has not sealed yet, cut at each writer's sealed seq), so every query sees, per
writer, a gap-free prefix of what it appended: acknowledged events are visible at once,
whether sealed or not. Segments are listed *before* the table version is read, so a
segment sealed and deleted in between is already in the table.

Reads are read-only: once a snapshot's views are set up, DuckDB's external access is turned
off and its configuration locked, so no SQL can write or read files (`COPY ... TO`, `ATTACH`,
`read_csv`, `EXPORT DATABASE`, extensions), or turn that back on. DuckDB keeps its temp
directory (where big sorts and joins spill) readable and writable even then, and its default
is `.tmp` in the working directory: each process spills into its own private directory
instead (mode 0700, removed at exit), so SQL cannot reach a shared one. Results leave the store
only through the caller (`trajstore query --output`). What a statement can still create
(a table, a view) lives in the snapshot's own in-memory database and ends with it.

Errors are told apart by what failed, never by the words of a message: a statement DuckDB
cannot parse, bind or run is a `QueryError` carrying DuckDB's message; a `CorruptionError`
is raised only when a checksum or a format check of the pinned files says so.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from trajstore import wal
from trajstore.errors import CorruptionError, QueryError
from trajstore.location import Location
from trajstore.schema import EVENT_SCHEMA
from trajstore.table import FileInfo, Table, TableSnapshot, files_covering
from trajstore.views import VIEW_NAMES, create_views

# DuckDB errors a statement itself causes, found before or without reading a byte of data.
_STATEMENT_ERRORS = (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                     duckdb.SyntaxException, duckdb.ConversionException, duckdb.OutOfRangeException,
                     duckdb.TypeMismatchException, duckdb.NotImplementedException,
                     duckdb.ConstraintException, duckdb.DataError, duckdb.InterruptException)


def rows_where(table: Table, files: Sequence[FileInfo], live: pa.Table, column: str, values: Sequence[str],
               columns: Sequence[str] | None = None) -> pa.Table:
    """Rows of sealed `files` and `live` rows whose `column` is one of `values`, with every schema
    column (those not in `columns` are null, so the views still bind). Choose `files` with
    `files_covering` first: this reads what it is given."""
    keep = pa.array(list(values), pa.string())
    sealed = table.read(files, filter=pc.field(column).isin(keep), columns=columns)
    return with_all_columns(sealed, live.filter(pc.is_in(live.column(column), value_set=keep)), columns)


def with_all_columns(sealed: pa.Table, live: pa.Table, columns: Sequence[str] | None) -> pa.Table:
    if columns is not None:
        live = live.select(list(columns))
    data = pa.concat_tables([sealed, live.cast(sealed.schema)])
    for f in EVENT_SCHEMA:  # views bind every column; unread ones are null
        if f.name not in data.column_names:
            data = data.append_column(f, pa.nulls(data.num_rows, f.type))
    return data.select(EVENT_SCHEMA.names)


@dataclass
class LiveRows:
    """Rows of this machine's write-ahead segments, per writer."""

    by_writer: dict[str, list[pa.RecordBatch]]

    def hidden_ids(self, snapshot: TableSnapshot) -> list[str]:
        """Event ids of live rows that `snapshot` says are sealed (the table must hold them)."""
        ids: list[str] = []
        for writer, rows in self.by_writer.items():
            cut = snapshot.sealed_seq(writer)
            for batch in rows:
                if batch.num_rows and batch.column("writer_seq")[0].as_py() <= cut:
                    seqs = batch.column("writer_seq").to_numpy()
                    ids += batch.column("event_id").filter(pa.array(seqs <= cut)).to_pylist()
        return ids

    def table(self, snapshot: TableSnapshot) -> pa.Table:
        """The rows `snapshot` has not sealed: each writer's batches cut after its sealed seq."""
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


@dataclass(frozen=True)
class Scope:
    """The events a query sees, narrowed so that only the sealed files whose Delta statistics can
    hold them are read: runs, a time window [since, until], and at most the `newest` events (by
    time) of what remains. The views then say exactly what they say over those events (a rollout
    cut by the window is seen in part)."""

    runs: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    newest: int | None = None

    def files(self, files: Iterable[FileInfo]) -> list[FileInfo]:
        out = files_covering(files, "run", sorted(self.runs)) if self.runs else list(files)
        return [f for f in out if not f.min or (
            (self.since is None or _stat_time(f.max.get("time"), _END) >= self.since)
            and (self.until is None or _stat_time(f.min.get("time"), _START) <= self.until))]

    def rows(self, data: pa.Table) -> pa.Table:
        keep = None
        for cond in ((pc.is_in(data.column("run"), value_set=pa.array(self.runs, pa.string())) if self.runs else None),
                     (pc.greater_equal(data.column("time"), self.since) if self.since else None),
                     (pc.less_equal(data.column("time"), self.until) if self.until else None)):
            if cond is not None:
                keep = cond if keep is None else pc.and_(keep, cond)
        return data if keep is None else data.filter(keep)


_START = datetime.min.replace(tzinfo=timezone.utc)
_END = datetime.max.replace(tzinfo=timezone.utc)


def _stat_time(value: Any, default: datetime) -> datetime:
    """A Delta time statistic (a datetime, or ISO text with 'Z') as a UTC datetime; `default` when absent."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if not isinstance(value, datetime):
        return default
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class Pinned:
    """One table version and the live rows it has not sealed: what a consistent read sees."""

    table: TableSnapshot
    live: pa.Table

    @property
    def version(self) -> int:
        return self.table.version


@functools.cache
def _spill_directory() -> str:
    """This process's private directory for DuckDB's spills, made on first use and removed at exit."""
    path = tempfile.mkdtemp(prefix="trajstore-duckdb-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class Snapshot:
    """One consistent view of the store over DuckDB: a pinned version plus live rows. Query it many times.

    `files` are the sealed files to read (all of the version's by default); `use_rows` swaps
    in pre-filtered raw rows (the shard planner). `memory_limit` (DuckDB's syntax, "512MB") caps
    what DuckDB holds at once: aggregations and sorts beyond it spill to the private temp
    directory, so a streaming reader (`batches`) stays within it however large the store is.
    """

    def __init__(self, table: Table, pinned: Pinned, *, files: Iterable[FileInfo] | None = None,
                 memory_limit: str | None = None) -> None:
        self._table = table
        self._con = duckdb.connect()
        self._con.execute("SET TimeZone = 'UTC'")
        self._con.execute("SET temp_directory = ?", [_spill_directory()])  # not the shared ./.tmp
        if memory_limit is not None:
            self._con.execute("SET memory_limit = ?", [memory_limit])
            self._con.execute("SET preserve_insertion_order = false")  # lets big results stream and spill
        self.repin(pinned, files=files)
        create_views(self._con)
        self._con.execute("SET enable_external_access = false")  # no file or network I/O from SQL ...
        self._con.execute("SET lock_configuration = true")  # ... and no SQL that turns it back on

    def repin(self, pinned: Pinned, *, files: Iterable[FileInfo] | None = None) -> None:
        """Point this snapshot's connection and views at another pinned version (and its live rows).
        Setting up a connection with its views costs ~0.1 s, more than a narrowed query: a server
        answering many small reads keeps a few snapshots and repins them (the viewer does)."""
        self.pinned = pinned
        self.table_version = pinned.version
        self.files = tuple(pinned.table.files if files is None else files)
        self._con.execute("DROP VIEW IF EXISTS _raw")
        self._con.register("_sealed", self._table.open_dataset(self.files))
        self._con.register("_live", pinned.live)
        self._con.execute("CREATE TEMP VIEW _raw AS SELECT * FROM _sealed UNION ALL BY NAME SELECT * FROM _live")

    def query(self, sql: str, params: Any = None) -> pa.Table:
        """Run SQL over the views; a `pyarrow.Table`."""
        with self._mapped_errors():
            return self._relation(sql, params).to_arrow_table()

    def batches(self, sql: str, params: Any = None, *, rows: int = 1024) -> Iterator[pa.RecordBatch]:
        """Run SQL over the views and yield its result in record batches of at most `rows` rows, as
        DuckDB produces them: the whole result is never held (with `memory_limit`, neither are the
        aggregations behind it). An empty result is one empty batch, so a caller always learns the schema."""
        with self._mapped_errors():
            reader = self._relation(sql, params).to_arrow_reader(rows)
            empty = True
            for batch in reader:
                empty = False
                yield batch
            if empty:
                yield pa.RecordBatch.from_pylist([], schema=reader.schema)

    def _relation(self, sql: str, params: Any) -> duckdb.DuckDBPyRelation:
        if not isinstance(sql, str) or not sql.strip():
            raise QueryError("the query is empty; give a SQL statement such as \"SELECT * FROM rollouts LIMIT 5\"")
        rel = self._con.sql(sql, params=params) if params is not None else self._con.sql(sql)
        if rel is None:
            raise QueryError(f"the statement returned no rows to show: {sql.strip()[:200]!r}. The store is "
                             "read through SELECT (or WITH ... SELECT) statements over its views")
        return rel

    @contextlib.contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        """DuckDB's errors as the store's: a statement's own fault, read-only refusals, or damage."""
        try:
            yield
        except duckdb.PermissionException as exc:
            raise QueryError(self._query_failed(exc) + "\nQueries over the store are read-only: they cannot write or "
                             "read files, attach databases or change settings. Export a result with `trajstore query "
                             "SQL --format csv|json|parquet --output FILE` (or store.query() in Python).") from exc
        except _STATEMENT_ERRORS as exc:
            raise QueryError(self._query_failed(exc)) from exc
        except duckdb.Error as exc:
            damage = self._table.damage(self.files)
            if damage is not None:
                raise CorruptionError(damage) from exc
            raise QueryError(self._query_failed(exc)) from exc

    @staticmethod
    def _query_failed(exc: Exception) -> str:
        return f"query failed: {exc}\nThe views are: {', '.join(VIEW_NAMES)}."

    def read_files(self, files: Iterable[FileInfo], *, columns: Sequence[str],
                   filter: pc.Expression | None = None) -> pa.Table:  # noqa: A002 - pyarrow's name
        """Columns of some of the pinned version's sealed files, read directly (checksums verified), without the views."""
        return self._table.read(files, columns=columns, filter=filter)

    def register(self, name: str, data: pa.Table) -> None:
        self._con.register(name, data)

    def use_rows(self, rows: pa.Table) -> None:
        """Point the views at `rows` instead (raw rows of the same pinned version, pre-filtered
        by the shard planner), keeping the connection and its views: setting up a connection
        costs more than the planner's small queries."""
        self._con.execute("DROP VIEW IF EXISTS _raw")
        self._con.register("_raw", rows)
        self.files = ()

    def narrow(self, column: str, values: Iterable[str], *, columns: Sequence[str] | None = None) -> pa.Table:
        """Point the views at the pinned version's events whose `column` is one of `values` (all of
        them when that is every event of a rollout, group or run, so the views say exactly what they
        say over the whole store), reading only the sealed files whose statistics can hold them.
        `columns` limits what is read (the rest are null). Returns the rows."""
        wanted = sorted(set(values))
        files = files_covering(self.pinned.table.files, column, wanted)
        rows = rows_where(self._table, files, self.pinned.live, column, wanted, columns)
        self.use_rows(rows)
        self.files = tuple(files)  # what was read
        return rows

    def scope(self, scope: Scope) -> pa.Table:
        """Point the views at the pinned version's events in `scope`, reading only the sealed files
        whose statistics can hold them. Newest first, files are read in order of their newest
        event: first as many as hold `newest` rows by the log's row counts, then 4x more per round,
        until no unread file can hold an event newer than the `newest`-th found. Returns the rows."""
        files = scope.files(self.pinned.table.files)
        live = scope.rows(self.pinned.live)
        if scope.newest is None:
            rows = with_all_columns(scope.rows(self._table.read(files)), live, None)
            read = files
        else:
            files.sort(key=lambda f: _stat_time(f.max.get("time"), _END) if f.min else _END, reverse=True)
            # the first round: enough files to hold `newest` rows by the log's row counts (live rows too)
            need, take = scope.newest - live.num_rows, 0
            while need > 0 and take < len(files):
                need -= files[take].rows
                take += 1
            found, take = [live], max(take, 1)
            read = []
            while True:
                batch, files = files[:take], files[take:]
                read += batch
                if batch:
                    found.append(scope.rows(self._table.read(batch)).cast(EVENT_SCHEMA))
                rows = pa.concat_tables(found)
                if not files:
                    break
                if rows.num_rows >= scope.newest:
                    cut = pc.select_k_unstable(rows, scope.newest, [("time", "descending")])
                    nth = rows.column("time")[cut[-1].as_py()].as_py()
                    if all(_stat_time(f.max.get("time"), _END) < nth for f in files if f.min):
                        break
                take *= 4
            order = pc.sort_indices(rows, [("time", "descending"), ("event_id", "ascending")])
            rows = rows.take(order[:scope.newest])
        self.use_rows(rows)
        self.files = tuple(read)
        return rows

    def project(self, columns: Sequence[str]) -> pa.Table:
        """Point the views at every event of the pinned version, reading only `columns` (the rest are
        null): for aggregations over a whole run that need no token lists or JSON. Returns the rows."""
        files = self.pinned.table.files
        rows = with_all_columns(self._table.read(files, columns=columns), self.pinned.live, columns)
        self.use_rows(rows)
        self.files = tuple(files)
        return rows

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Reader:
    """Reads one store: this machine's live segments (cached by size and mtime, growing ones read
    incrementally) and pinned versions."""

    def __init__(self, location: Location, table: Table) -> None:
        self.location = location
        self.table = table
        self._cache_lock = threading.Lock()
        self._segment_cache: dict[Path, tuple[int, int, wal.SegmentRead]] = {}

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
        # a growing segment is read from where the last read's whole batches ended (it only ever
        # grows, or shrinks when recovery cuts a torn tail: then it is read again whole)
        previous = hit[2] if hit and st.st_size > hit[2].total_bytes else None
        try:
            read = wal.read_segment(path, previous)
        except FileNotFoundError:
            return None  # sealed and deleted since listing: the table has it
        with self._cache_lock:
            self._segment_cache[path] = (*key, read)
        return read

    def live(self) -> LiveRows:
        """This machine's write-ahead rows (all of them; cut per pinned version)."""
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

    def pin(self, version: int | None = None, *, live: bool = True) -> Pinned:
        """A table version (latest by default) and, when `live`, the live rows it has not sealed.

        The segments are read before the version is pinned (see the module docstring)."""
        rows = self.live() if live and version is None else LiveRows({})
        table = self.table.snapshot(version, writers=list(rows.by_writer))
        hidden = rows.hidden_ids(table)
        if hidden:  # sealed and not deleted yet (a moment's overlap); only hidden if the table really has them
            missing = self.table.missing_event_ids(hidden, table.files)
            if missing:
                raise CorruptionError(
                    f"table version {table.version} says writers {sorted(rows.by_writer)} sealed events that it does "
                    f"not hold ({len(missing)} of them, e.g. {missing[0]}): a writer's transaction version in the Delta "
                    "log is damaged. They stay in the write-ahead log; restore the log from a backup (`trajstore "
                    "verify` names the entries)")
        return Pinned(table, rows.table(table))

    def snapshot(self, version: int | None = None, *, live: bool = True, memory_limit: str | None = None) -> Snapshot:
        """Pin a table version (latest by default) plus, when `live`, the live segments."""
        return Snapshot(self.table, self.pin(version, live=live), memory_limit=memory_limit)

    def query(self, sql: str, params: Any = None, *, version: int | None = None, scope: Scope | None = None) -> pa.Table:
        """SQL over the views of a pinned version; with `scope`, over its events in that scope only."""
        with Snapshot(self.table, self.pin(version), files=() if scope else None) as snap:
            if scope is not None:
                snap.scope(scope)
            return snap.query(sql, params)

    def holds_rollout(self, rollout_id: str) -> bool:
        """Whether any event of `rollout_id` is stored (sealed, or live on this machine). Reads only the
        sealed files whose rollout_id statistics can hold it."""
        pinned = self.pin()
        if pc.any(pc.equal(pinned.live.column("rollout_id"), rollout_id)).as_py():
            return True
        files = files_covering(pinned.table.files, "rollout_id", [rollout_id])
        if not files:
            return False
        found = self.table.read(files, columns=["rollout_id"], filter=ds.field("rollout_id") == rollout_id)
        return found.num_rows > 0
