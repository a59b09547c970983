"""A writer: one process's durable, gap-free, idempotent appender to a store.

A writer owns a directory of write-ahead segments (`wal/<name>/`), held with an exclusive
`flock` that the kernel drops when the process dies, so a crashed writer's successor can
take over at once and no two processes ever write the same files. Opening a writer
recovers its segments (checksums verified, a torn tail cut at the last whole batch),
bumps its epoch and continues the sequence where the acknowledged events end.

`append` validates the whole call, assigns sequence numbers, and returns after the
segment is fsync'd. Validation and conversion (all of an append's CPU but the write) can run
first, on the caller's thread, with `prepare`; `append` then takes the `PreparedBatch`. `stage` goes
further: it also skips duplicate ids, numbers the events and encodes their segment message (all
under the writer's state lock, so numbers are handed out, and messages queued, in one order), and
`append(staged)` only writes and fsyncs. Concurrent appends from several threads share one fsync (group
commit): whichever thread holds the I/O lock writes every pending (staged) message, in numbering
order, with one system call, and syncs once.
Full segments, and segments older than `seal_interval` seconds, are sealed into the Delta
table by a background thread; `close` seals the rest. Sealing is idempotent across crashes
(see `trajstore.table`). A writer seals the batches it wrote from memory (it keeps each
segment's batches until the segment is sealed: at most `seal_bytes` and the segment before it,
about what the segments hold on disk), so a seal costs the Parquet file and the commit, not a
read of the segments again: parsing and checking a segment's messages cost as much CPU as
writing them as Parquet. A writer's segments from before a restart, and those of a seal that
failed, are read from disk and verified. Other machines see only sealed events, so for a remote store an
append holding a `checkpoint` or `status` event (what a learner or collector elsewhere waits
on) wakes the sealer at once; appends arriving during a seal share the next one, so this
costs at most one commit in flight per writer. A remote store's writer claims its name when
it opens, before acknowledging anything (`trajstore.owner`).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from trajstore import owner, wal
from trajstore.arrow_columns import numpy_column
from trajstore.durable import fsync_path, write_durably
from trajstore.errors import CorruptionError, WriterBusyError, WriterClosedError
from trajstore.events import Event
from trajstore.location import Location
from trajstore.prepared import PreparedBatch, prepare
from trajstore.schema import EVENT_SCHEMA
from trajstore.table import Table, sealed_seq

log = logging.getLogger(__name__)
_NAMES = tuple(EVENT_SCHEMA.names)  # the property builds a new list each time
_INT64 = pa.int64()
_KEEP_COLUMNS_UP_TO = 64  # batch sizes whose writer columns a writer keeps (`Writer._writer_columns`)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
URGENT_KINDS = frozenset({"checkpoint", "status"})  # others wait on them: sealed at once in a remote store


@dataclass(frozen=True)
class AppendResult:
    appended: int  # events newly stored
    duplicates: int  # events skipped because their event_id was already stored
    first_seq: int | None
    last_seq: int | None


@dataclass(frozen=True)
class Staged:
    """Events `Writer.stage` numbered and encoded, queued for the writer's next write; `Writer.append` of it
    returns `result` once they are durable."""

    writer: Writer
    result: AppendResult
    through: int  # the seq up to which the writer must be durable for `result` to hold (-1: nothing to wait for)
    urgent: bool  # holds a kind that a remote store seals at once


def check_writer_name(name: str) -> None:
    if not NAME_PATTERN.match(name):
        raise ValueError(
            f"writer name {name!r} is not allowed: use 1-100 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it names a directory and a Delta transaction id)"
        )


class _Lock:
    """An exclusive, non-blocking flock on a file; released by the kernel if the process dies."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


def acquire(directory: Path) -> _Lock:
    directory.mkdir(parents=True, exist_ok=True)
    return _Lock(directory / "LOCK")


@dataclass(frozen=True)
class SealResult:
    events: int  # events committed by this seal
    sealed_seq: int  # the writer's last sealed seq afterwards


def _name_taken(name: str, table_seq: int, own_seq: int, where: Path) -> WriterBusyError:
    return WriterBusyError(
        f"writer {name!r}: the table says its events up to seq {table_seq} are sealed, but this "
        f"process sealed up to {own_seq}; another process, probably on another machine, writes "
        f"under the same name. Give every writer of a store a unique name; the unsealed "
        f"segments in {where} were kept"
    )


def seal_segments(table: Table, name: str, segments: list[Path], *, expected: int | None = None,
                  kept: Mapping[Path, Sequence[wal.Batch]] | None = None) -> SealResult:
    """Seal closed segments of writer `name` into the table.

    Only rows past the table's sealed seq for `name` are written; the commit carries the
    application transaction (name, last seq), and it is skipped when an earlier attempt
    already landed. Sealed segments are deleted afterwards. `expected` is the sealed seq the
    calling writer knows of; a table that says otherwise means the name is used elsewhere,
    and nothing is deleted. `kept`: the batches the calling writer wrote to some of the
    segments, taken instead of reading those segments again.
    """
    start = table.sealed_seq(name)
    if expected is not None and start != expected:
        raise _name_taken(name, start, expected, segments[0].parent if segments else table.location.wal_root / name)
    if not segments:
        return SealResult(0, start)
    kept = kept or {}
    batches = [b for p in segments for b in (kept[p] if p in kept else wal.read_segment(p).batches)]
    sealed_ids = [eid for b in batches if b.first_seq <= start for eid, seq in zip(
        b.data.column("event_id").to_pylist(), b.data.column("writer_seq").to_pylist()) if seq <= start]
    missing = table.missing_event_ids(sealed_ids) if sealed_ids else []
    if missing:  # the table's word that they are sealed is wrong: keep the segments
        raise CorruptionError(
            f"writer {name!r}: the table says its events up to seq {start} are sealed, but {len(missing)} of those in "
            f"its segments are not in the table (e.g. {missing[0]}): the writer's transaction version in the Delta "
            f"log is damaged. Nothing was deleted from {segments[0].parent}; restore the log from a backup")
    rows = [b.data for b in batches if b.last_seq > start]
    committed = 0
    sealed_through = start
    if rows:
        # one chunk per column: Parquet pages cut at each batch's end cost 3x the CPU and compress a third worse
        data = pa.Table.from_batches(rows, schema=EVENT_SCHEMA).combine_chunks()
        if batches[0].first_seq <= start:  # part of the first batch is sealed already
            seqs = data.column("writer_seq").to_numpy()
            data = data.filter(pa.array(seqs > start))
        last = batches[-1].last_seq
        data = _not_stored(table, data)
        adds = [table.write_file(data, prefix=f"seal-{name}")] if data.num_rows else []

        def precheck(dt: Any) -> bool:
            current = sealed_seq(dt, name)
            if current == start:
                return True
            if current >= last and all(a.path in pa.table(dt.get_add_actions()).column("path").to_pylist()
                                       for a in adds):
                return False  # an earlier attempt of this seal landed; its acknowledgement was lost
            raise _name_taken(name, current, start, segments[0].parent)

        done = table.commit(adds, operation="seal", writer_txn=(name, last), precheck=precheck)
        committed = data.num_rows if done is not None else 0
        sealed_through = last
    for p in segments:
        p.unlink(missing_ok=True)
    fsync_path(segments[0].parent)
    return SealResult(committed, sealed_through)


def _not_stored(table: Table, data: pa.Table) -> pa.Table:
    """`data` without the events the table already holds (appended again through another writer, e.g. by
    a client that re-sent them after a restart) and without repeats of one event id: each event is
    sealed once, so a reader of the Delta table alone (Spark, Polars) sees it once too."""
    ids = data.column("event_id").combine_chunks()
    keep = pc.is_in(ids, value_set=pa.array(table.missing_event_ids(ids.to_pylist()), pa.string()))
    first = pc.equal(pc.index_in(ids, value_set=ids), pa.array(np.arange(len(ids), dtype=np.int32)))
    keep = pc.and_(keep, first)  # index_in finds an id's first row: later rows of the same id are repeats
    return data if pc.all(keep).as_py() else data.filter(keep)


def sealed_event_ids(table: Table, name: str, *, after_seq: int = -1) -> list[str]:
    """Event_ids writer `name` sealed with writer_seq > after_seq, in seq order (files pruned by statistics)."""
    files = [f for f in table.snapshot().files
             if f.min.get("writer", name) <= name <= f.max.get("writer", name)
             and f.max.get("writer_seq", after_seq + 1) > after_seq]
    if not files:
        return []
    rows = table.read(files, columns=["event_id", "writer_seq"],
                      filter=(ds.field("writer") == name) & (ds.field("writer_seq") > after_seq))
    return rows.sort_by("writer_seq").column("event_id").to_pylist()


class RecentIds:
    """The last `cap` event ids a writer stored: re-appends of them are skipped, in bounded memory.

    An older id appended again is stored again, and the `events` view still shows it once
    (the first write wins), so the bound trades a rare physical duplicate for memory that
    does not grow with the writer's lifetime.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest go first

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add_all(self, event_ids: Iterable[str]) -> None:
        ids = self._ids
        for eid in event_ids:
            ids[eid] = None
        excess = len(ids) - self.cap
        if excess > 0:
            for eid in list(itertools.islice(ids, excess)):
                del ids[eid]


class Writer:
    """Appends events durably to a store; see the module docstring. Use as a context manager."""

    def __init__(self, location: Location, table: Table, name: str, *, seal_bytes: int = 64 << 20,
                 seal_interval: float = 60.0, seal_on_close: bool = True, remember_ids: int = 262_144,
                 seal_kinds: Iterable[str] = URGENT_KINDS) -> None:
        check_writer_name(name)
        if seal_bytes <= 0 or seal_interval <= 0 or remember_ids <= 0:
            raise ValueError("seal_bytes, seal_interval and remember_ids must be positive")
        self.remember_ids = remember_ids
        self.location = location
        self.table = table
        self.name = name
        self.seal_bytes = seal_bytes
        self.seal_interval = seal_interval
        self.seal_on_close = seal_on_close
        self.seal_kinds = frozenset(seal_kinds) if location.remote else frozenset()
        self.dir = location.wal_root / name
        try:
            self._lock = acquire(self.dir)
        except BlockingIOError:
            raise WriterBusyError(
                f"writer {name!r} of {location.uri} is held by another live process; "
                "give each process its own writer name (store.writer(name=...))"
            ) from None
        self._state = threading.Lock()  # seq assignment, pending queue, known ids
        self._io = threading.Lock()  # segment writes, fsync, rotation
        self._sealing = threading.Lock()  # seals commit in seq order, one at a time
        # staged, in seq order: (message, first, last, the batch it encodes)
        self._pending: list[tuple[wal.Message, int, int, pa.RecordBatch]] = []
        self._closed_segments: list[Path] = []
        self._written: list[wal.Batch] = []  # what the open segment holds, kept for its seal (module docstring)
        self._kept: dict[Path, list[wal.Batch]] = {}  # the same of closed segments, until sealed
        self._segment: wal.SegmentWriter | None = None
        self._segment_opened = 0.0
        self._failed: BaseException | None = None
        self._closed = False
        self._urgent = False  # an urgent kind was appended: seal without waiting for the interval
        self._made_columns: dict[int, tuple[pa.Array, pa.Array]] = {}  # `_writer_columns`, by batch size
        try:
            if location.remote:
                owner.claim(table, name, owner.spool_id(location.wal_root))
            self._recover()
        except BaseException:
            self._lock.release()
            raise
        self._wake = threading.Event()
        self._sealer = threading.Thread(target=self._seal_loop, name=f"trajstore-sealer-{name}", daemon=True)
        self._sealer.start()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        segments = wal.list_segments(self.dir)
        epoch = 0
        last_seq = -1
        self._known_ids = RecentIds(self.remember_ids)
        wal_ids: list[str] = []
        for path in segments:
            read = wal.read_segment(path)
            wal.truncate_torn_tail(read)
            epoch = max(epoch, wal.parse_segment_name(path.name)[0])
            for batch in read.batches:
                last_seq = max(last_seq, batch.last_seq)
                wal_ids.extend(batch.data.column("event_id").to_pylist())
        epoch_file = self.dir / "EPOCH"
        if epoch_file.exists():
            epoch = max(epoch, int(epoch_file.read_text().strip() or 0))
        self.epoch = epoch + 1
        write_durably(epoch_file, str(self.epoch))
        sealed = self._sealed_seq = self.table.sealed_seq(self.name)
        if sealed >= 0:  # a re-sent event an earlier epoch sealed (segment gone) is still a duplicate
            self._known_ids.add_all(sealed_event_ids(self.table, self.name, after_seq=sealed - self._known_ids.cap))
        self._known_ids.add_all(wal_ids)
        self._next_seq = max(last_seq, sealed) + 1
        self._durable_seq = self._next_seq - 1
        self._closed_segments = segments  # whatever survived is sealed by the background thread

    # ------------------------------------------------------------------ append

    @staticmethod
    def prepare(events: Iterable[Event | Mapping[str, Any]] | Mapping[str, Any]) -> PreparedBatch:
        """Validate and convert events for `append`, on the caller's thread, without touching the writer.

        Raises InvalidEventError listing every problem of every event. This is all the CPU of an append but
        the write itself: a caller that prepares first keeps its conversion out of the group commit."""
        if isinstance(events, Mapping) or not isinstance(events, Sequence):
            events = list(events) if not isinstance(events, Mapping) else [events]
        return prepare(events)

    def stage(self, events: Iterable[Event | Mapping[str, Any]] | Mapping[str, Any] | PreparedBatch) -> Staged:
        """Number, convert and encode events (or a batch from `prepare`) for the next write, without waiting for
        the disk; `append(staged)` then returns once they are durable.

        This is all of an append but the write and the fsync: event ids already stored (or repeated within
        the call) are skipped, the rest get the next sequence numbers and are encoded as one segment message,
        queued in seq order. The next write of the segment, whoever makes it, writes them, so a staged batch
        never leaves a gap in the sequence; a caller that stages must still call `append(staged)` (or close the
        writer) to learn that they are durable. Raises InvalidEventError (nothing staged) when any event is
        invalid."""
        self._check_open()
        batch = events if isinstance(events, PreparedBatch) else self.prepare(events)
        if not len(batch):
            return Staged(self, AppendResult(0, 0, None, None), through=-1, urgent=False)
        columns = batch.columns
        event_ids = columns["event_id"].to_pylist()
        urgent = bool(self.seal_kinds) and not self.seal_kinds.isdisjoint(columns["kind"].to_pylist())
        with self._state:
            self._check_open()
            keep = np.ones(len(event_ids), dtype=bool)
            seen_here: set[str] = set()
            for i, eid in enumerate(event_ids):
                if eid in self._known_ids or eid in seen_here:
                    keep[i] = False
                seen_here.add(eid)
            n = int(keep.sum())
            if n == 0:  # all stored before, or numbered before and still to be written: those must be durable too
                return Staged(self, AppendResult(0, len(event_ids), None, None), through=self._next_seq - 1,
                              urgent=False)
            first = self._next_seq
            last = first + n - 1
            # encoded here, in seq order: the queue is written as it stands, by whichever flush comes next
            batch = self._batch(columns, keep, first, n)
            message = wal.encode_batch(batch, writer=self.name, epoch=self.epoch, first_seq=first, last_seq=last)
            self._next_seq = last + 1
            self._pending.append((message, first, last, batch))
            self._known_ids.add_all(seen_here)
        return Staged(self, AppendResult(n, len(event_ids) - n, first, last), through=last, urgent=urgent)

    def append(self, events: Iterable[Event | Mapping[str, Any]] | Mapping[str, Any] | PreparedBatch | Staged
               ) -> AppendResult:
        """Durably append events (or a batch from `prepare`, or one `stage` numbered); returns after fsync.
        Re-appended event_ids are skipped (returning once the events that hold them are durable).

        Raises InvalidEventError (nothing written) when any event is invalid.
        """
        staged = events if isinstance(events, Staged) else self.stage(events)
        if staged.writer is not self:
            raise ValueError(f"a batch staged by writer {staged.writer.name!r} was given to writer {self.name!r}: "
                             "append it to the writer that staged it")
        if staged.through >= 0:
            self._flush(staged.through)
        if staged.urgent:
            self._urgent = True
            self._wake.set()
        return staged.result

    def _batch(self, columns: Mapping[str, pa.Array], keep: np.ndarray, first: int, n: int) -> pa.RecordBatch:
        total = len(keep)
        if n == total:
            seqs = numpy_column(np.arange(first, first + n, dtype=np.int64), _INT64)
        else:  # duplicates keep a placeholder seq until they are filtered out below
            numbered = np.zeros(total, dtype=np.int64)
            numbered[keep] = np.arange(first, first + n, dtype=np.int64)
            seqs = numpy_column(numbered, _INT64)
        name_column, epoch_column = self._writer_columns(total)
        filled = {"writer": name_column, "writer_epoch": epoch_column, "writer_seq": seqs}
        batch = pa.RecordBatch.from_arrays([filled[name] if name in filled else columns[name] for name in _NAMES],
                                           schema=EVENT_SCHEMA)
        return batch if n == total else batch.filter(pa.array(keep))

    def _writer_columns(self, total: int) -> tuple[pa.Array, pa.Array]:
        """The `writer` and `writer_epoch` columns of `total` events: the same for every batch of that size, so the
        small sizes a live writer appends over and over are made once (the epoch never changes in a writer)."""
        made = self._made_columns.get(total)
        if made is None:
            made = (pa.array([self.name] * total, pa.string()),
                    numpy_column(np.full(total, self.epoch, np.int64), _INT64))
            if total <= _KEEP_COLUMNS_UP_TO:
                self._made_columns[total] = made
        return made

    def _flush(self, seq: int) -> None:
        with self._io:
            if self._durable_seq >= seq:
                return  # another thread's flush carried this batch
            self._check_open()
            with self._state:
                pending, self._pending = self._pending, []
            segment = None
            try:
                segment = self._open_segment(pending[0][1])
                acknowledged = segment.bytes_written
                segment.write_messages([message for message, _, _, _ in pending])
                segment.sync()
                self._written += [wal.Batch(batch, self.name, self.epoch, first, last)
                                  for _, first, last, batch in pending]
            except BaseException as exc:
                self._failed = exc
                if segment is not None:  # none of these events may reappear: cut them from the segment
                    segment.abandon(acknowledged)
                    self._segment, self._written = None, []
                raise WriterClosedError(
                    f"writer {self.name!r} could not write its segment ({exc}); events from seq "
                    f"{pending[0][1]} on were not acknowledged. Reopen the writer to recover."
                ) from exc
            self._durable_seq = pending[-1][2]
            if segment.bytes_written >= self.seal_bytes:
                self._rotate()
                self._wake.set()

    def _open_segment(self, first_seq: int) -> wal.SegmentWriter:
        if self._segment is None:
            path = self.dir / wal.segment_name(self.epoch, first_seq)
            self._segment = wal.SegmentWriter(path, writer=self.name, epoch=self.epoch)
            self._segment_opened = time.monotonic()
        return self._segment

    def _rotate(self) -> None:
        """Close the active segment (caller holds the I/O lock); it is sealed next."""
        if self._segment is not None:
            self._segment.close()
            self._closed_segments.append(self._segment.path)
            self._kept[self._segment.path], self._written = self._written, []
            self._segment = None

    def _check_open(self) -> None:
        if self._failed is not None:
            raise WriterClosedError(f"writer {self.name!r} failed earlier ({self._failed}); reopen it to recover")
        if self._closed:
            raise WriterClosedError(f"writer {self.name!r} is closed; open a new one with store.writer()")

    # ------------------------------------------------------------------ sealing

    def seal(self) -> int:
        """Seal everything appended so far into the table; returns the events committed."""
        return self._seal(rotate=True)

    def _seal(self, *, rotate: bool) -> int:
        with self._sealing:  # take and commit in one critical section, so seals land in seq order
            with self._io:
                if rotate:
                    self._rotate()
                segments, self._closed_segments = self._closed_segments, []
            try:
                result = seal_segments(self.table, self.name, segments, expected=self._sealed_seq, kept=self._kept)
                self._sealed_seq = result.sealed_seq
                return result.events
            except BaseException:
                with self._io:  # keep them for the next attempt, read from disk then: memory stays bounded
                    self._closed_segments = segments + self._closed_segments
                raise
            finally:
                for path in segments:
                    self._kept.pop(path, None)

    def _next_wait(self) -> float:
        """Seconds until the open segment is due (at most 5: failed seals are retried that often)."""
        if self._segment is None:
            return min(self.seal_interval, 5.0)
        return min(max(self.seal_interval - (time.monotonic() - self._segment_opened), 0.01), 5.0)

    def _seal_loop(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=self._next_wait())
            self._wake.clear()
            if self._closed:
                return
            with self._io:
                urgent, self._urgent = self._urgent, False
                age = time.monotonic() - self._segment_opened
                if self._segment is not None and (urgent or age >= self.seal_interval):
                    self._rotate()
                due = bool(self._closed_segments)
            if due:
                try:
                    self._seal(rotate=False)
                except WriterBusyError as exc:  # the name is taken elsewhere: stop, keep the segments
                    self._failed = exc
                    log.error("writer %s stopped: %s", self.name, exc)
                    return
                except Exception as exc:  # noqa: BLE001 - the object store or the network failing (delta-rs's own
                    # errors are no OSError): the segments stay, the next turn of the loop retries
                    log.warning("writer %s: background seal failed, will retry: %s", self.name, exc)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Seal what was appended (unless seal_on_close=False) and release the writer."""
        if self._closed:
            return
        if self._failed is None and self._pending:  # staged, never appended: written as the next append would
            try:
                self._flush(self._next_seq - 1)
            except WriterClosedError:  # the writer failed: closed below, as any failed writer
                pass
        self._closed = True
        self._wake.set()
        self._sealer.join()
        try:
            if self._failed is None and self.seal_on_close:
                self.seal()
            elif self._segment is not None:
                self._segment.close()
                self._segment = None
        finally:
            self._lock.release()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
