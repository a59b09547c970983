"""`Store`: the facade users hold. It wires the parts together and adds nothing of its own.

    store = open_store("runs/store")        # a directory, or s3://bucket/prefix
    store.writer(name)                       # trajstore.writer: durable, idempotent appends
    store.query(sql) / store.snapshot()      # trajstore.read: a pinned version plus live rows
    store.full_requests(event_ids)           # trajstore.requests: turns' requests whole (deltas resolved)
    store.follower()                         # trajstore.follow: polls that read only what is new
    store.shard(...)                         # trajstore.shard: the learner's next batch
    store.ingest(path)                       # trajstore.ingest: a JSON-lines file, validated whole
    store.compact() / vacuum() / verify() / stats()  # trajstore.maintenance

Nothing inside `trajstore/` imports this module: each part takes the narrow collaborators it
uses (the location, the table, the reader).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from trajstore import maintenance, owner, requests
from trajstore.errors import StoreNotFoundError
from trajstore.follow import POLL_COLUMNS, Follower
from trajstore.prune import implied_scope
from trajstore.ingest import IngestResult, ingest
from trajstore.location import Location, resolve
from trajstore.maintenance import CompactResult, Stats, VacuumResult, VerifyReport
from trajstore.read import LiveRows, Pinned, Reader, Scope, Snapshot
from trajstore.shard import Shard, make_shard
from trajstore.table import Table
from trajstore.views import Estimator
from trajstore.writer import Writer


class Store:
    """A trajectory store at a location; see `open_store`."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.table = Table(location)
        self.reader = Reader(location, self.table)

    def __repr__(self) -> str:
        return f"Store({self.location.uri!r})"

    def writer(self, name: str | None = None, **options: Any) -> Writer:
        """A writer owned by this process (default name: `unique_writer_name()`). Options: seal_bytes,
        seal_interval (seconds before appended events are sealed, i.e. visible to other machines),
        seal_on_close, seal_kinds (event kinds sealed at once in a remote store, default checkpoint and
        status: what other machines wait on), remember_ids (how many recent event ids it keeps to skip re-appends; older
        duplicates are still shown once by the views)."""
        return Writer(self.location, self.table, name or self.unique_writer_name(), **options)

    def unique_writer_name(self, prefix: str = "") -> str:
        """`<prefix><host>-<pid>-<spool id>`: no other process, on this machine or another, has it."""
        return owner.unique_name(self.location.wal_root, prefix)

    def machine_writer_name(self, prefix: str) -> str:
        """`<prefix>-<spool id>`: one name for every process of this machine (a restart reopens its write-ahead
        directory), another on any other machine (whose writer would otherwise be refused the name)."""
        return owner.machine_name(self.location.wal_root, prefix)

    def seal_orphans(self) -> dict[str, int]:
        """Seal what dead writers of this machine left unsealed (events per writer); live writers are left alone."""
        return maintenance.seal_orphans(self.location, self.table)

    def live(self) -> LiveRows:
        """This machine's write-ahead rows, not yet cut by any table version."""
        return self.reader.live()

    def pin(self, version: int | None = None, *, live: bool = True) -> Pinned:
        """A table version (latest by default) and, when `live`, the live rows it has not sealed."""
        return self.reader.pin(version, live=live)

    def snapshot(self, version: int | None = None, *, live: bool = True, memory_limit: str | None = None) -> Snapshot:
        """Pin a table version (latest by default) plus, when `live`, the live segments; query it many times.
        `memory_limit` caps DuckDB's memory for it (beyond it, sorts and aggregations spill to disk)."""
        return self.reader.snapshot(version, live=live, memory_limit=memory_limit)

    def follower(self, columns: Sequence[str] = POLL_COLUMNS) -> Follower:
        """Incremental snapshots for a process that polls: each poll reads only the files added
        since the last one (see trajstore.follow)."""
        return Follower(self.reader, columns)

    def query(self, sql: str, params: Any = None, *, version: int | None = None, scope: Scope | None = None) -> pa.Table:
        """Run SQL over the views (events, turns, samples, rollouts, groups, advantages, ...); with `scope`
        (runs, a time window, the newest N events) over those events only, reading only the files that can
        hold them. Without a scope, the one the SQL itself implies (`WHERE run = 'x'`, a newest-first LIMIT on
        events: see trajstore.prune) narrows the files read the same way."""
        return self.reader.query(sql, params, version=version,
                                 scope=scope if scope is not None else implied_scope(sql, params))

    def full_requests(self, event_ids: Sequence[str]) -> dict[str, str | None]:
        """The full request JSON of each turn (event id): a request stored as a delta of an earlier turn's is
        resolved (see trajstore.requests)."""
        return requests.resolve(self, event_ids)

    def holds_rollout(self, rollout_id: str) -> bool:
        """Whether the store holds any event of `rollout_id` (sealed, or live on this machine)."""
        return self.reader.holds_rollout(rollout_id)

    def shard(self, *, policy_version: int, max_staleness: int, max_rollouts: int = 512,
              estimator: Estimator = "grpo", run: str | None = None, exclude: Iterable[str] = (),
              max_groups: int | None = None, teacher: str | None = None) -> Shard:
        """The next training shard: complete groups whose oldest tokens are at most
        `max_staleness` versions behind `policy_version`, not consumed by any checkpoint and
        not in `exclude` (rollouts the learner holds but has not checkpointed yet), oldest
        first, up to `max_rollouts` trainable rollouts (at least one group) and at most
        `max_groups` groups; with `teacher`, each sample's logprobs from that teacher's
        annotations too. See trajstore.shard."""
        return make_shard(self.reader, policy_version=policy_version, max_staleness=max_staleness,
                          max_rollouts=max_rollouts, estimator=estimator, run=run, exclude=exclude,
                          max_groups=max_groups, teacher=teacher)

    def ingest(self, path: str | os.PathLike[str], *, writer: str | None = None) -> IngestResult:
        """Append a JSON-lines file of events, validated whole first; events already stored are skipped."""
        return ingest(self.reader, lambda: self.writer(writer), path)

    def compact(self, *, target_bytes: int = 128 << 20) -> CompactResult:
        """Seal orphaned segments and rewrite small sealed files into larger ones."""
        return maintenance.compact(self.location, self.table, target_bytes=target_bytes)

    def vacuum(self, *, retention_hours: float = maintenance.DEFAULT_RETENTION_HOURS,
               dry_run: bool = False) -> VacuumResult:
        """Delete files the table no longer references once older than the retention (see trajstore.maintenance)."""
        return maintenance.vacuum(self.location, self.table, retention_hours=retention_hours, dry_run=dry_run)

    def verify(self) -> VerifyReport:
        """Check every checksum a reader relies on; the report lists every problem."""
        return maintenance.verify(self.location, self.table)

    def stats(self) -> Stats:
        """Runs, rollouts, samples, tokens, versions and disk use."""
        return maintenance.stats(self.reader)

    def version(self) -> int:
        """The table's latest version."""
        return self.table.version()


def open_store(location: str | os.PathLike[str], *, create: bool = True,
               spool: str | os.PathLike[str] | None = None,
               storage_options: dict[str, str] | None = None) -> Store:
    """Open (and by default create) the store at a directory or `s3://bucket/prefix`. With
    `create=False` nothing is written (writers make their own write-ahead directories)."""
    loc = resolve(location, spool=spool, storage_options=storage_options)
    table = Table(loc)
    if not table.exists():
        if not create:
            raise StoreNotFoundError(f"no trajstore store at {loc.uri}; create one with `trajstore ingest` "
                                     "or open_store(location) without create=False")
        table.create_if_missing()
    elif create:
        table.upgrade_schema()  # a store made before the newest columns: its table gains them (nothing else moves)
    if create:
        loc.wal_root.mkdir(parents=True, exist_ok=True)
    return Store(loc)  # create=False writes nothing: readers (query, view) leave the store as they found it
