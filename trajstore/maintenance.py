"""Keeping a store healthy: seal orphaned segments, compact small files, verify, summarize.

- `seal_orphans`: a writer that died leaves its segments behind; whoever takes its lock
  (here, non-blocking, so live writers are left alone) seals them like the writer would.
- `compact`: rewrites runs of small sealed files (in log order, so files stay time-local
  and the shard planner keeps pruning) into larger ones, committing the removes and the add
  in one Delta commit (data_change=false). A crash before the commit leaves an unreferenced
  file, never a change to the table.
- `vacuum`: deletes, through delta-rs's vacuum, the files the table no longer references:
  those compaction replaced (once their removal is older than the retention) and those a
  crash left unreferenced (a seal or compaction that wrote its file and died before its
  commit; once the file is older than the retention). The retention is at least
  `MIN_RETENTION_HOURS`, which no pinned read (a query, a shard, a learner step: seconds to
  minutes) and no running writer (a file waits at most seconds for its commit) comes near;
  the default is Delta's own week, so `query --version` can still travel a week back.
  Versions older than the retention lose the files they listed. External readers (Spark,
  Polars, DuckDB's delta reader) must read the table through its Delta log, never by
  globbing `events/*.parquet`: the directory also holds replaced and unreferenced files
  until a vacuum, which a glob counts twice.
- `verify`: reads every byte a reader could see (every live segment batch against its
  CRC, every JSON commit of the Delta log against its digest (`trajstore.deltalog`), every
  sealed file's listed statistics against its name and its pages against their checksums, the
  log's file list against the object store) and reports each problem with where it is.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties
from deltalake.transaction import RemoveAction

from trajstore import deltalog, wal
from trajstore.errors import CorruptionError
from trajstore.location import Location
from trajstore.read import Reader
from trajstore.retention import DEFAULT_RETENTION_HOURS, MAX_RETENTION_HOURS, MIN_RETENTION_HOURS
from trajstore.table import FileInfo, Table, file_crcs
from trajstore.writer import acquire, seal_segments
from trajstore.versions import NEWEST_VERSION_SQL


def seal_orphans(location: Location, table: Table) -> dict[str, int]:
    """Seal the segments of every writer on this machine that no live process holds."""
    sealed: dict[str, int] = {}
    root = location.wal_root
    if not root.is_dir():
        return sealed
    for wdir in sorted(p for p in root.iterdir() if p.is_dir()):
        segments = wal.list_segments(wdir)
        if not segments:
            continue
        try:
            lock = acquire(wdir)
        except BlockingIOError:
            continue  # a live writer owns it and seals it itself
        try:
            for read in (wal.read_segment(p) for p in segments):
                wal.truncate_torn_tail(read)
            sealed[wdir.name] = seal_segments(table, wdir.name, segments).events
        finally:
            lock.release()
    return sealed



@dataclass
class CompactResult:
    files_before: int
    files_after: int
    rewritten: int
    version: int | None
    orphans_sealed: dict[str, int] = field(default_factory=dict)


def _bins(files: list[FileInfo], target_bytes: int) -> list[list[FileInfo]]:
    """Consecutive (log-order) runs of small files, each up to about target_bytes."""
    bins: list[list[FileInfo]] = []
    current: list[FileInfo] = []
    size = 0
    for f in files:
        if f.size >= target_bytes:
            if len(current) > 1:
                bins.append(current)
            current, size = [], 0
            continue
        current.append(f)
        size += f.size
        if size >= target_bytes:
            bins.append(current)
            current, size = [], 0
    if len(current) > 1:
        bins.append(current)
    return bins


def compact(location: Location, table: Table, *, target_bytes: int = 128 << 20, seal: bool = True) -> CompactResult:
    """Seal orphaned segments, then rewrite runs of small files into ~target_bytes files."""
    orphans = seal_orphans(location, table) if seal else {}
    snap = table.snapshot()
    bins = _bins(list(snap.files), target_bytes)
    version = None
    rewritten = 0
    for group in bins:
        data = table.read(group)
        add = table.write_file(data, prefix="compact", data_change=False)
        now = int(time.time() * 1000)
        removes = [RemoveAction(f.path, False, now, f.size, {}) for f in group]
        paths = {f.path for f in group}

        def still_there(dt: Any, paths: set[str] = paths) -> bool:
            live = set(pa.table(dt.get_add_actions(flatten=False)).column("path").to_pylist())
            return paths <= live  # a concurrent compaction took them: skip this bin

        version = table.commit(removes + [add], operation="compact", precheck=still_there) or version
        rewritten += len(group)
    after = len(table.snapshot().files)
    return CompactResult(len(snap.files), after, rewritten, version, orphans)


@dataclass(frozen=True)
class CompactPolicy:
    """When a long-running compactor (`trajstore compact --follow`) merges: every `every_s` seconds it
    counts the files smaller than `target_bytes`; at `min_files` or more it merges runs of them (in
    log order) into files of about `target_bytes` (`compact`) and checkpoints the Delta log at the new
    version (delta-rs also checkpoints every 100 commits), so a fresh reader reads one checkpoint and
    the few JSON commits since. Every `vacuum_every_s` it vacuums what compaction replaced more than
    `retention_hours` ago."""

    target_bytes: int = 128 << 20
    every_s: float = 30.0
    min_files: int = 32
    retention_hours: float = DEFAULT_RETENTION_HOURS
    vacuum_every_s: float = 3600.0

    def due(self, files: Iterable[FileInfo]) -> bool:
        return sum(f.size < self.target_bytes for f in files) >= self.min_files


def compact_follow(location: Location, table: Table, policy: CompactPolicy, *, passes: int | None = None,
                   report: Callable[[CompactResult], None] = lambda r: None) -> None:
    """Keep the file count bounded: compact whenever `policy` says so, vacuum on its schedule; `passes`
    checks (None: forever). Compaction is the one-shot `compact`'s: exactly once (a bin another
    compactor took is skipped), and what it replaces stays readable by pinned reads until a vacuum."""
    vacuumed = time.monotonic()
    done = 0
    while passes is None or done < passes:
        if policy.due(table.snapshot().files):
            report(compact(location, table, target_bytes=policy.target_bytes))
            # a checkpoint at the new version: a fresh reader reads it and no JSON commit before it
            table.current().create_checkpoint()
        if time.monotonic() - vacuumed >= policy.vacuum_every_s:
            vacuum(location, table, retention_hours=policy.retention_hours)
            vacuumed = time.monotonic()
        done += 1
        if passes is None or done < passes:
            time.sleep(policy.every_s)


@dataclass
class VacuumResult:
    files: list[str]  # deleted, or that would be deleted (dry run)
    bytes: int
    dry_run: bool
    retention_hours: float


def vacuum(location: Location, table: Table, *, retention_hours: float = DEFAULT_RETENTION_HOURS,
           dry_run: bool = False) -> VacuumResult:
    """Delete the files the table no longer references and that are older than the retention."""
    if not retention_hours >= MIN_RETENTION_HOURS:
        raise ValueError(f"retention_hours must be at least {MIN_RETENTION_HOURS} (got {retention_hours}): a shorter "
                         "retention could delete a file a running writer has written but not committed yet, or one "
                         "a read pinned a moment ago still needs")
    if not retention_hours <= MAX_RETENTION_HOURS:
        raise ValueError(f"retention_hours must be at most {MAX_RETENTION_HOURS} (a century; got {retention_hours}): "
                         "to keep every file, do not vacuum")
    dt = table.current()
    hours = int(math.ceil(retention_hours))
    candidates = dt.vacuum(retention_hours=hours, dry_run=True, enforce_retention_duration=False, full=True)
    fs = location.filesystem
    sizes = {p: info.size for p, info in zip(candidates, fs.get_file_info([location.data_path(p) for p in candidates]))
             if info.type == pafs.FileType.File}
    if not dry_run and candidates:
        done = dt.vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False, full=True,
                         commit_properties=CommitProperties(custom_metadata={"trajstore.operation": "vacuum"}))
        candidates = list(done)
    return VacuumResult(sorted(candidates), sum(sizes.get(p, 0) for p in candidates), dry_run, hours)


@dataclass
class VerifyReport:
    table_version: int
    sealed_files: int
    segments: int
    events_checked: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(location: Location, table: Table) -> VerifyReport:
    """Check every live segment's checksums and every sealed file's pages; list every problem."""
    problems: list[str] = []
    events = 0
    segments = 0
    root = location.wal_root
    if root.is_dir():
        for wdir in sorted(p for p in root.iterdir() if p.is_dir()):
            paths = wal.list_segments(wdir)
            for i, path in enumerate(paths):
                segments += 1
                try:
                    read = wal.read_segment(path)
                except CorruptionError as exc:
                    problems.append(f"live segment: {exc}")
                    continue
                except OSError as exc:
                    problems.append(f"live segment {path}: cannot be read ({exc})")
                    continue
                events += sum(b.data.num_rows for b in read.batches)
                if read.torn and i < len(paths) - 1:
                    problems.append(f"live segment {path}: {read.total_bytes - read.good_bytes} bytes after the "
                                    "last whole batch in a segment that is not the writer's newest (damaged)")
    problems += deltalog.scan(location, None)
    try:
        snap = table.snapshot()
    except CorruptionError as exc:  # the file list cannot be trusted: nothing more to check against it
        problems.append(str(exc))
        return VerifyReport(-1, 0, segments, events, problems)
    fs = location.filesystem
    for f in snap.files:
        path = location.data_path(f.path)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            problems.append(f"sealed file {f.path}: listed in table version {snap.version} but missing from storage")
            continue
        if info.size != f.size:
            problems.append(f"sealed file {f.path}: {info.size} bytes on storage, the table log says {f.size}")
        crcs = file_crcs(f.path)
        if crcs is not None:
            with fs.open_input_file(path) as fh:
                whole = zlib.crc32(fh.read())
            if whole != crcs[1]:
                problems.append(f"sealed file {f.path}: its bytes fail the CRC-32 recorded in its name "
                                "(changed after writing)")
        try:
            rows = 0
            for batch in table.open_dataset([f]).to_batches():
                rows += batch.num_rows
            if rows != f.rows:
                problems.append(f"sealed file {f.path}: holds {rows} rows, the table log says {f.rows}")
            events += rows
        except CorruptionError as exc:
            problems.append(str(exc))
        except (OSError, pa.ArrowException) as exc:
            problems.append(f"sealed file {f.path}: fails its page checksums or cannot be decoded ({exc})")
    return VerifyReport(snap.version, len(snap.files), segments, events, problems)


@dataclass
class Stats:
    location: str
    table_version: int
    sealed_files: int
    sealed_bytes: int
    live_segments: int
    live_bytes: int
    summary: dict[str, Any]
    runs: list[dict[str, Any]]
    ledger: list[dict[str, Any]]  # the `token_ledger` view: every generated token per run and version


# Per run: the share of samples (segments) whose tokens were sampled by more than one policy version, across
# turns or within one (weights updated in flight, `trajstore.versions`).
SPANNING_SQL = f"""
    SELECT run, (count(*) FILTER (WHERE oldest < newest))::DOUBLE / count(*) AS share FROM (
        SELECT run, rollout_id, segment_id, min(policy_version) AS oldest, max({NEWEST_VERSION_SQL}) AS newest
        FROM turns GROUP BY run, rollout_id, segment_id)
    GROUP BY run
"""


def stats(reader: Reader) -> Stats:
    """Runs, rollouts, samples, tokens, versions and disk use of a store."""
    location = reader.location
    with reader.snapshot() as snap:
        runs = snap.query(
            """
            SELECT r.run, count(*) AS rollouts, count(*) FILTER (WHERE trainable) AS trainable,
                   sum(segments)::BIGINT AS samples, sum(turns)::BIGINT AS turns, sum(tokens)::BIGINT AS tokens,
                   sum(trainable_tokens)::BIGINT AS trainable_tokens, min(min_version) AS min_version,
                   max(max_version) AS max_version, count(DISTINCT group_id) AS groups,
                   avg(reward) AS mean_reward
            FROM rollouts r GROUP BY r.run ORDER BY r.run
            """
        ).to_pylist()
        spanning = {row["run"]: row["share"] for row in snap.query(SPANNING_SQL).to_pylist()}
        for row in runs:  # samples whose tokens came from more than one policy version (weights changed mid-sample)
            row["multi_version_samples"] = spanning.get(row["run"])
        summary = snap.query(
            "SELECT count(*) AS events, count(*) FILTER (WHERE kind = 'checkpoint') AS checkpoints, "
            "max(policy_version) FILTER (WHERE kind = 'checkpoint') AS latest_checkpoint FROM events"
        ).to_pylist()[0]
        ledger = snap.query("SELECT * FROM token_ledger ORDER BY run, version").to_pylist()
        files = snap.files
        version = snap.table_version
    live_paths = [p for w in (location.wal_root.iterdir() if location.wal_root.is_dir() else [])
                  if w.is_dir() for p in wal.list_segments(w)]
    return Stats(
        location=location.uri,
        table_version=version,
        sealed_files=len(files),
        sealed_bytes=sum(f.size for f in files),
        live_segments=len(live_paths),
        live_bytes=sum(p.stat().st_size for p in live_paths if p.exists()),
        summary=summary,
        runs=runs,
        ledger=ledger,
    )

