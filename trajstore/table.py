"""The cold tier: sealed zstd Parquet files committed to a Delta Lake table.

trajstore writes the Parquet files itself (pyarrow, zstd, *page checksums*) and commits
them with delta-rs (`create_write_transaction`), instead of letting delta-rs write them,
for two reasons: DuckDB does not verify Parquet page checksums and returns flipped bytes as
data, while pyarrow's scanner verifies them on every read (`open_dataset` below); and the
per-file min/max statistics the shard planner prunes with are computed here, exactly.

A seal commits the file together with a Delta application transaction (app id = writer,
version = last sealed writer_seq), so a seal whose acknowledgement a crash swallowed is
recognised on restart and never committed twice. Commits retry on conflicts.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction

from trajstore import deltalog, ids
from trajstore.filecache import SealedFileCache
from trajstore.durable import fsync_path
from trajstore.errors import CommitConflictError, CorruptionError, StoreNotFoundError, VersionNotFoundError
from trajstore.location import Location
from trajstore.page_headers import PageHeaderError, headers_crc
from trajstore.schema import EVENT_SCHEMA

# Columns whose min/max the planner prunes with (cheap scalars; no JSON text, no lists).
STATS_COLUMNS = (
    "event_id", "kind", "time", "writer", "writer_epoch", "writer_seq", "run", "group_id", "rollout_id",
    "session_id", "segment_id", "turn_index", "policy_version", "reward", "reward_name",
    "status", "step", "table_version", "group_size",
)
ROW_GROUP_ROWS = 16_384
# Dictionary-encoded, with min/max in the file, where values repeat or prune (names, ids, kinds, the sampling JSON).
# Not the lists: a token id as a 12-18 bit dictionary index is what zstd cannot shrink, and plain int32 + zstd is
# smaller (0.90 against 0.99 bytes a token on this repository's own code) and hashes nothing; nor the request and
# response JSON, one per call.
SCALAR_COLUMNS = [f.name for f in EVENT_SCHEMA if not pa.types.is_nested(f.type)
                  and f.name not in ("request", "response")]
COMMIT_ATTEMPTS = 30


@dataclass(frozen=True)
class FileInfo:
    """One sealed Parquet file of a snapshot with its statistics."""

    path: str  # relative to the table root
    size: int
    rows: int
    min: dict[str, Any] = field(default_factory=dict)
    max: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TableSnapshot:
    """One pinned table version: its files and, per writer asked about, the last sealed seq."""

    version: int
    files: tuple[FileInfo, ...]
    sealed: dict[str, int]

    def sealed_seq(self, writer: str) -> int:
        """The last writer_seq of `writer` committed in this snapshot (-1 if none)."""
        return self.sealed.get(writer, -1)


def sealed_seq(dt: DeltaTable, writer: str) -> int:
    version = dt.transaction_version(writer)
    return -1 if version is None else int(version)


def _stat_value(value: Any) -> Any:
    return deltalog.stat_time(value) if isinstance(value, datetime) else value


def file_stats(table: pa.Table) -> dict[str, Any]:
    """Delta `add` statistics: record count, per-column min/max and null counts."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name in STATS_COLUMNS:
        col = table.column(name)
        nulls[name] = col.null_count
        if col.null_count == len(col):
            continue
        mm = pc.min_max(col).as_py()
        lo, hi = mm["min"], mm["max"]
        if name == "time":  # Delta keeps milliseconds: floor the min, ceil the max
            hi = hi + timedelta(microseconds=(1000 - hi.microsecond % 1000) % 1000)
        mins[name] = _stat_value(lo)
        maxs[name] = _stat_value(hi)
    return {"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _retry(what: str, attempt: Callable[[], Any], on_conflict: Callable[[], None] = lambda: None) -> Any:
    delay = 0.01
    for _ in range(COMMIT_ATTEMPTS):
        try:
            return attempt()
        except CommitFailedError:
            on_conflict()
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    raise CommitConflictError(
        f"{what}: the table changed under the commit {COMMIT_ATTEMPTS} times in a row; "
        "too many writers are committing at once, so seal less often (larger seal_bytes) and retry"
    )


class Table:
    """The Delta table of one store: write sealed files, commit them, read snapshots."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._dt: DeltaTable | None = None
        self._lock = threading.RLock()  # one DeltaTable object, shared by the sealer and readers
        # The latest version's files, and every known file's statistics by path: a sealed file
        # never changes, so a new version only parses the statistics of the files it added.
        self._files: tuple[int, tuple[FileInfo, ...]] | None = None
        self._known: dict[str, FileInfo] = {}
        self._verified: set[str] = set()  # sealed files whose footer and headers matched their name's CRCs
        self._fragments: dict[str, ds.ParquetFileFragment] = {}  # sealed files' fragments (footers once read)
        self._log = deltalog.LogChecker(location)
        self.conflicts = 0  # commits retried because another writer committed first (benchmarks read it)
        # A remote store's sealed files are read through a local on-disk cache (trajstore.filecache):
        # fetched whole once per host, their whole-file CRC checked, never asked for again.
        self._cache = SealedFileCache(location.filesystem, location.uri) if location.remote else None

    # ------------------------------------------------------------------ open / create

    def create_if_missing(self) -> None:
        if not self.location.remote:
            os.makedirs(self.location.table_path, exist_ok=True)
        try:
            DeltaTable.create(
                self.location.table_uri, EVENT_SCHEMA, mode="ignore", name="trajstore_events",
                storage_options=self.location.storage_options or None,
                configuration={"delta.appendOnly": "false"},
                commit_properties=CommitProperties(custom_metadata={deltalog.OPERATION_KEY: "create",
                                                                    deltalog.DIGESTS_KEY: "1"}),
            )
        except CommitFailedError:
            # Another process created it between our check and our commit of version 0.
            if not self.exists():
                raise

    def upgrade_schema(self) -> bool:
        """Append the columns added to the event schema since this table was created (nullable, at the
        end, in one metadata-only commit); True when it did. Reading never needs it (sealed files
        without a column read as null, `trajstore.wal` widens older segments); it keeps the table's
        own schema, which other Delta readers go by, equal to `EVENT_SCHEMA`."""
        dt = self._current()
        have = dt.schema().to_arrow().names
        if list(have) == EVENT_SCHEMA.names[:len(have)] and len(have) < len(EVENT_SCHEMA):
            from deltalake.schema import Field  # the Delta field type, only on the rare upgrade

            new = [Field.from_arrow(f) for f in list(EVENT_SCHEMA)[len(have):]]
            try:
                dt.alter.add_columns(new, commit_properties=CommitProperties(
                    custom_metadata={deltalog.OPERATION_KEY: "upgrade schema"}))
            except (CommitFailedError, DeltaError):
                # another process upgraded it first; anything else is reported by the next read
                return False
            return True
        return False

    def exists(self) -> bool:
        return DeltaTable.is_deltatable(self.location.table_uri, self.location.storage_options or None)

    def _current(self) -> DeltaTable:
        """The latest table state (cached; brought up to date incrementally), its new log entries checked."""
        with self._lock:
            if self._dt is None:
                try:
                    self._dt = self._delta("open", lambda: DeltaTable(
                        self.location.table_uri, storage_options=self.location.storage_options or None))
                except TableNotFoundError as exc:
                    raise StoreNotFoundError(
                        f"no trajstore store at {self.location.uri}: create one by appending "
                        f"(`trajstore ingest --store {self.location.uri} FILE`) or check the path"
                    ) from exc
            else:
                self._delta("update", self._dt.update_incremental)
            self._log.check_through(self._dt.version())
            return self._dt

    def _delta(self, what: str, call: Callable[[], Any]) -> Any:
        """A delta-rs call whose failure to parse the log becomes a CorruptionError naming the entry."""
        try:
            return call()
        except (TableNotFoundError, CommitFailedError):
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DeltaError, or a Rust panic (pyo3's PanicException is a BaseException)
            if not isinstance(exc, DeltaError) and type(exc).__name__ != "PanicException":
                raise
            found = deltalog.find_damage(self.location)
            raise CorruptionError(found or f"delta-rs could not {what} the table at {self.location.table_uri}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; its log may be "
                                  "damaged (`trajstore verify` checks it)") from exc

    def current(self) -> DeltaTable:
        """The latest delta-rs table, its log checked (for maintenance that delta-rs does itself)."""
        return self._current()

    def version(self) -> int:
        """The latest version."""
        return self._current().version()

    def sealed_seq(self, writer: str) -> int:
        """The last writer_seq of `writer` committed in the latest version (-1 if none)."""
        return sealed_seq(self._current(), writer)

    def snapshot(self, version: int | None = None, writers: tuple[str, ...] | list[str] = ()) -> TableSnapshot:
        """Pin a version (the latest by default); `writers` are the ones whose sealed seq is wanted."""
        if version is None:
            dt = self._current()
            with self._lock:  # the cached table moves on with the next update; read it whole now
                if self._files is None or self._files[0] != dt.version():
                    files = self._delta("list the files of", lambda: _files_of(dt, self.location, self._known))
                    self._known = {f.path: f for f in files}
                    # fragments of files compacted away are dropped (a read pinned before remakes its own)
                    self._fragments = {p: frag for p, frag in self._fragments.items() if p in self._known}
                    self._files = (dt.version(), tuple(files))
                sealed = self._delta("read the writers' progress in", lambda: {w: sealed_seq(dt, w) for w in writers})
                return TableSnapshot(self._files[0], self._files[1], sealed)
        latest = self.version()
        if not 0 <= version <= latest:
            raise VersionNotFoundError(f"table version {version} does not exist: the versions of {self.location.uri} "
                                       f"run from 0 to {latest}")
        try:
            dt = DeltaTable(self.location.table_uri, version=version,
                            storage_options=self.location.storage_options or None)
        except DeltaError as exc:
            raise VersionNotFoundError(f"table version {version} of {self.location.uri} can no longer be read: its log "
                                       f"entries were cleaned up ({exc}); query a version from the latest checkpoint "
                                       "on") from exc
        return self._delta("read", lambda: TableSnapshot(dt.version(), tuple(_files_of(dt, self.location)),
                                                         {w: sealed_seq(dt, w) for w in writers}))

    def missing_event_ids(self, event_ids: Iterable[str], files: Iterable[FileInfo] | None = None) -> list[str]:
        """Those of `event_ids` that no sealed file (of `files`, default: the latest version's) holds;
        reads only the files whose event_id statistics can hold them."""
        wanted = sorted(set(event_ids))
        if not wanted:
            return []
        covering = files_covering(self.snapshot().files if files is None else files, "event_id", wanted)
        found: set[str] = set()
        if covering:
            keep = pa.array(wanted, pa.string())
            found = set(self.read(covering, columns=["event_id"], filter=pc.field("event_id").isin(keep))
                        .column("event_id").to_pylist())
        return [e for e in wanted if e not in found]

    # ------------------------------------------------------------------ write / commit

    def write_file(self, data: pa.Table, *, prefix: str, data_change: bool = True) -> AddAction:
        """Write one zstd Parquet file with page checksums; durable before it is committed.

        Parquet checksums a page's data but neither its header nor the file's footer (the schema,
        row groups and offsets), so the file's name carries the CRC-32 of its footer, of its page
        headers (`trajstore.page_headers`) and of the whole file: readers check the footer and the
        headers before first use, `trajstore verify` checks the whole file. The name also carries
        the CRC-32 of the statistics the log records for it (`trajstore.deltalog`).
        """
        data = data.cast(EVENT_SCHEMA) if data.schema != EVENT_SCHEMA else data
        sink = pa.BufferOutputStream()
        pq.write_table(data, sink, compression="zstd", write_page_checksum=True, use_dictionary=SCALAR_COLUMNS,
                       row_group_size=ROW_GROUP_ROWS, write_statistics=SCALAR_COLUMNS,
                       write_page_index=False, bloom_filter_options=None)  # pages only up to the footer: headers_crc
        body = memoryview(sink.getvalue())
        stats = file_stats(data)
        scrc = deltalog.stats_crc(len(body), stats["numRecords"], stats["minValues"], stats["maxValues"])
        hcrc = headers_crc(lambda at, n: body[at:at + n], 4, len(body) - _footer_span(body))
        name = (f"{prefix}-{ids.new_id()}-f{zlib.crc32(body[-_footer_span(body):]):08x}c{zlib.crc32(body):08x}"
                f"s{scrc:08x}h{hcrc:08x}.zstd.parquet")
        path = self.location.data_path(name)
        with self.location.filesystem.open_output_stream(path) as out:
            out.write(body)
        if not self.location.remote:
            fsync_path(path)
        self._verified.add(name)
        return AddAction(name, len(body), {}, int(time.time() * 1000), data_change,
                         json.dumps(stats, ensure_ascii=False))

    def commit(self, actions: list[AddAction | RemoveAction], *, operation: str,
               writer_txn: tuple[str, int] | None = None,
               precheck: Callable[[DeltaTable], bool] | None = None) -> int | None:
        """Commit actions atomically (retrying on conflicts); returns the new version.

        `precheck(table)` runs against the latest table before every attempt; when it returns
        False the commit is skipped (already done by an earlier, unacknowledged attempt) and
        None is returned.
        """
        relied = deltalog.commit_actions(actions, writer_txn)
        props = CommitProperties(
            custom_metadata={deltalog.OPERATION_KEY: operation, deltalog.DIGEST_KEY: deltalog.digest(relied)},
            app_transactions=[Transaction(writer_txn[0], writer_txn[1])] if writer_txn else None,
        )

        def attempt() -> int | None:
            with self._lock:
                dt = self._current()
                if precheck is not None and not precheck(dt):
                    return None
                dt.create_write_transaction(actions, mode="append", schema=EVENT_SCHEMA, commit_properties=props)
                return self._current().version()

        def conflict() -> None:
            self.conflicts += 1

        return _retry(f"{operation} commit to {self.location.table_uri}", attempt, conflict)

    # ------------------------------------------------------------------ read

    def check_sealed(self, f: FileInfo) -> None:
        """Check a sealed file's footer and page headers against the CRC-32s in its name (once per file and
        process); the pages' data is checked by their own checksums as they are read."""
        if f.path in self._verified or self._cache is not None:  # the cache checks the whole file's CRC
            return
        crcs = file_crcs(f.path)
        if crcs is not None:
            with self.location.filesystem.open_input_file(self.location.data_path(f.path)) as fh:
                size = fh.size()
                tail = fh.read_at(min(8, size), max(size - 8, 0))
                span = _footer_span(tail, size)
                footer = fh.read_at(span, size - span) if span else b""
                if not span or zlib.crc32(footer) != crcs[0]:
                    raise CorruptionError(f"sealed file {f.path}: its Parquet footer fails the CRC-32 recorded in its "
                                          f"name, so its schema or offsets changed after writing. {self._fix}")
                expected = _headers_crc_of(f.path)
                if expected is not None and _read_headers_crc(fh, size - span) != expected:
                    raise CorruptionError(f"sealed file {f.path}: its Parquet page headers fail the CRC-32 recorded "
                                          "in its name, so the count, encoding or size of a page changed after "
                                          f"writing. {self._fix}")
        self._verified.add(f.path)

    def open_dataset(self, files: list[FileInfo] | tuple[FileInfo, ...]) -> ds.Dataset:
        """A pyarrow dataset over sealed files that verifies footers and page checksums as it reads.

        Sealed files never change, so each file's fragment is made once per process, with the size
        the Delta log records: a later scan neither asks the object store for the size (a HEAD per
        file) nor reads the footer again (pyarrow keeps it in the fragment once read). A remote
        store's files are read from the local cache, which fetches the missing ones first."""
        for f in files:
            self.check_sealed(f)
        fs, paths = self.location.filesystem, [self.location.data_path(f.path) for f in files]
        if self._cache is not None:  # fetched now, before the scan (see trajstore.filecache)
            fs = _LOCAL
            paths = self._cache.local_paths([(p, f.size, (file_crcs(f.path) or (None, None))[1])
                                             for p, f in zip(paths, files)])
        with self._lock:
            fragments = []
            for f, path in zip(files, paths):
                fragment = self._fragments.get(f.path)
                if fragment is None:
                    fragment = _FORMAT.make_fragment(path, fs, file_size=f.size)
                    fragment.ensure_complete_metadata()  # its footer, read once: later scans reuse it
                    self._fragments[f.path] = fragment
                fragments.append(fragment)
        return ds.FileSystemDataset(fragments, schema=EVENT_SCHEMA, format=_FORMAT, filesystem=fs)

    @property
    def cache(self) -> SealedFileCache | None:
        """The local cache of a remote store's sealed files (None for a local store)."""
        return self._cache

    def read(self, files: Iterable[FileInfo], *, columns: Sequence[str] | None = None,
             filter: ds.Expression | None = None) -> pa.Table:  # noqa: A002 - pyarrow's name
        """Rows of sealed `files` (footers and page checksums verified). A damaged file raises
        CorruptionError naming it and the fix (`damage`), whoever reads: query, replay, the
        learner's shards, the viewer and maintenance report damage the same way."""
        files = list(files)
        try:
            return self.open_dataset(files).to_table(columns=list(columns) if columns is not None else None,
                                                     filter=filter)
        except (OSError, pa.ArrowException) as exc:
            found = self.damage(files)
            if found is None:
                raise
            raise CorruptionError(found) from exc

    def damage(self, files: Iterable[FileInfo]) -> str | None:
        """What is wrong with the first damaged one of `files`, by its checksums, with the fix; None
        when all of them read whole."""
        for f in files:
            try:
                for _ in self.open_dataset([f]).to_batches():
                    pass
            except CorruptionError as exc:
                return str(exc)
            except (OSError, pa.ArrowException) as exc:
                return (f"sealed file {f.path} fails its page checksums or cannot be decoded ({exc}); it was "
                        f"damaged after writing. {self._fix}")
        return None

    @property
    def _fix(self) -> str:
        return (f"`trajstore verify --store {self.location.uri}` lists every damaged file; restore them from "
                "a backup")


_LOCAL = pafs.LocalFileSystem()
_FORMAT = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)
_CRC_NAME = re.compile(r"-f([0-9a-f]{8})c([0-9a-f]{8})(?:s([0-9a-f]{8}))?(?:h([0-9a-f]{8}))?\.zstd\.parquet$")


def file_crcs(name: str) -> tuple[int, int] | None:
    """(footer CRC-32, whole-file CRC-32) from a sealed file's name; None for names without them."""
    m = _CRC_NAME.search(name)
    return (int(m.group(1), 16), int(m.group(2), 16)) if m else None


def _headers_crc_of(name: str) -> int | None:
    """The page headers' CRC-32 from a sealed file's name; None for names without it (sealed before it was kept)."""
    m = _CRC_NAME.search(name)
    return int(m.group(4), 16) if m and m.group(4) else None


def _read_headers_crc(fh: pa.NativeFile, footer_at: int) -> int | None:
    """CRC-32 of the page headers of the open sealed file `fh`, whose footer starts at `footer_at`; None
    when they cannot be walked."""
    try:
        return headers_crc(lambda at, n: fh.read_at(n, at), 4, footer_at)
    except (PageHeaderError, OSError, pa.ArrowException):
        return None


def _check_stats(f: FileInfo, location: Location) -> None:
    """The log's size and statistics of a sealed file against the CRC in its name (names since issue 12)."""
    m = _CRC_NAME.search(f.path)
    if m and m.group(3) and deltalog.stats_crc(f.size, f.rows, f.min, f.max) != int(m.group(3), 16):
        raise CorruptionError(
            f"the Delta log's entry for sealed file {f.path} is damaged: its size, row count or statistics do not "
            f"match the CRC-32 in the file's name, so the table's file list cannot be trusted (a changed statistic "
            f"would make training shards skip the file). Restore the log from a backup; `trajstore verify "
            f"--store {location.uri}` lists every damaged entry")


def _footer_span(tail: bytes | memoryview, size: int | None = None) -> int:
    """Bytes the footer takes at the end of a Parquet file (metadata, its length, b'PAR1'); 0 if malformed."""
    size = len(tail) if size is None else size
    if len(tail) < 8 or bytes(tail[-4:]) != b"PAR1":
        return 0
    span = int.from_bytes(bytes(tail[-8:-4]), "little") + 8
    return span if 8 < span <= size else 0


def files_covering(files: Iterable[FileInfo], column: str, values: list[str]) -> list[FileInfo]:
    """Files whose [min, max] of `column` contains at least one of the sorted `values`."""
    out = []
    for f in files:
        if not f.min:  # a file without statistics: it may hold anything
            out.append(f)
            continue
        lo, hi = f.min.get(column), f.max.get(column)
        if lo is None or hi is None:
            if column == "event_id":  # never null: files sealed before its statistics were kept may hold any
                out.append(f)
            continue  # statistics say the column is all null here
        i = bisect.bisect_left(values, lo)
        if i < len(values) and values[i] <= hi:
            out.append(f)
    return out


def _files_of(dt: DeltaTable, location: Location, known: dict[str, FileInfo] | None = None) -> list[FileInfo]:
    """The files of `dt` with their statistics, oldest first; `known` ones are reused, not parsed (nor
    checked against their names) again."""
    actions = pa.table(dt.get_add_actions(flatten=True))
    if actions.num_rows == 0:
        return []
    known = known or {}
    paths = actions.column("path").to_pylist()
    fresh = [i for i, path in enumerate(paths) if path not in known]
    parsed = {}
    if fresh:  # column by column: a row-wise to_pylist() of every statistic is 10x slower
        new = actions.take(fresh)
        mins: list[dict[str, Any]] = [{} for _ in fresh]
        maxs: list[dict[str, Any]] = [{} for _ in fresh]
        for c in STATS_COLUMNS:
            for bound, out_dicts in ((f"min.{c}", mins), (f"max.{c}", maxs)):
                if bound not in new.column_names:
                    continue
                for d, value in zip(out_dicts, new.column(bound).to_pylist()):
                    if value is not None:
                        d[c] = value
        for path, size, rows, lo, hi in zip(new.column("path").to_pylist(), new.column("size_bytes").to_pylist(),
                                            new.column("num_records").to_pylist(), mins, maxs):
            parsed[path] = info = FileInfo(path, size, rows, lo, hi)
            _check_stats(info, location)
    out = [known.get(path) or parsed[path] for path in paths]
    # Oldest first: sealed files are appended in time order, so this keeps scans in log order.
    out.sort(key=_log_order)
    return out


_NO_TIME = datetime.min.replace(tzinfo=timezone.utc)


def _log_order(f: FileInfo) -> tuple[datetime, str]:
    return f.min.get("time") or _NO_TIME, f.path
