"""The rollouts table: filters from a page's query string, and a search that reads only what one page shows.

A rollout's row is the `rollouts` view's, computed over exactly its own events (the snapshot is
narrowed to its rollout ids), plus `forks` (segments - sessions: each session starts one segment,
each fork adds one) and `task` (a `task_id` found in its events' meta). So the table always agrees
with `trajstore query "SELECT * FROM rollouts"`, but never aggregates the whole store to show 50 rows.

How the sealed files are chosen (statistics only, one pinned version throughout):

- filters on run, group and policy version keep the files whose min/max can hold a match
  (a rollout's version is its `min_version`, the version that sampled its oldest tokens). Every
  event of a rollout carries its run and group, but only turns carry a version, so a version
  filter keeps *some* event of each matching rollout, not always its first (often its `started`
  status); the searches below say which of the two they need;
- newest first (the default) reads the files in order of their newest event, a few at a time,
  growing the window 4x per round. After reading files whose newest events are after time T,
  every rollout that *started* after T has been seen (its first event lies in a file read), so
  the rows that started after T are certain and complete; the search stops once they fill the
  page (some event of each matching rollout in the files read is enough: every event follows its
  start). Oldest first is the mirror image and needs each rollout's first event. The next page
  starts below a cursor (started, rollout_id); newest first skips the files whose events all
  follow the cursor (this needs first events: not with a version filter), oldest first those
  whose events all precede it;
- any other order (reward, duration, turns, tokens) needs every candidate, so it reads every
  file the filters keep: fast within a version or a group, a whole-store aggregation without a
  filter (the page says how many files it read).

Limits: status, reward, task and fork filters are applied to aggregated rows; they cannot
prune files, so a rare status may read far back before the page fills.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.compute as pc

from collectors.errors import CollectorError
from trajstore.read import Snapshot, files_covering
from trajstore.schema import EVENT_SCHEMA, INT64_MAX
from trajstore.table import FileInfo

Order = Literal["newest", "oldest", "reward_desc", "reward_asc", "duration_desc", "turns_desc", "tokens_desc"]
ORDERS: tuple[str, ...] = get_args(Order)
STATUSES = ("completed", "truncated", "aborted", "failed", "started")
ORDER_SQL: dict[str, str] = {
    "newest": "started DESC, rollout_id DESC", "oldest": "started ASC, rollout_id ASC",
    "reward_desc": "reward DESC NULLS LAST, rollout_id", "reward_asc": "reward ASC NULLS LAST, rollout_id",
    "duration_desc": "duration DESC NULLS LAST, rollout_id", "turns_desc": "turns DESC, rollout_id",
    "tokens_desc": "tokens DESC, rollout_id",
}
MAX_LIMIT = 500
FIRST_WINDOW = 4  # sealed files read in the first round of a time-ordered search
# What a row needs: scalars and meta (the task id), never the token lists or request/response JSON.
ROW_COLUMNS = [f.name for f in EVENT_SCHEMA if not isinstance(f.type, (pa.ListType, pa.MapType))
               and f.name not in ("request", "response", "sampling", "request_base", "request_shared")]
_KINDS = pa.array(["turn", "reward", "status"])
_NO_TIME = datetime.min.replace(tzinfo=timezone.utc)
_END_TIME = datetime.max.replace(tzinfo=timezone.utc)


class FilterError(CollectorError, ValueError):
    """A query string the rollouts table cannot use; the message lists every problem."""


@dataclass(frozen=True)
class RolloutFilter:
    """What the rollouts table shows: filters, order, page size and the cursor of the page."""

    run: str | None = None
    group: str | None = None
    status: str | None = None
    task: str | None = None
    version_min: int | None = None
    version_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    forked: bool = False
    consumed_by: int | None = None  # only the rollouts this checkpoint version consumed
    order: Order = "newest"
    limit: int = 50
    offset: int = 0  # orders other than time
    cursor: tuple[datetime, str] | None = None  # time orders: rows strictly after this (started, rollout_id)

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> RolloutFilter:
        """Parse a page's query string; every problem is reported at once, with what to write instead."""
        problems: list[str] = []
        known = {"run", "group", "status", "task", "vmin", "vmax", "rmin", "rmax", "forked", "ckpt", "order",
                 "limit", "offset", "after", "v"}
        problems += [f"unknown parameter {k!r} (known: {', '.join(sorted(known))})" for k in query if k not in known]

        def text(name: str) -> str | None:
            value = query.get(name, "").strip()
            return value or None

        def number(name: str, kind: type, lo: float | None = None) -> Any:
            value = text(name)
            if value is None:
                return None
            try:
                out = kind(value)
            except ValueError:
                problems.append(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}")
                return None
            if kind is float and not math.isfinite(out):
                problems.append(f"{name}={value!r} is not a finite number")
                return None
            if kind is int and out > INT64_MAX:
                problems.append(f"{name}={value} is over {INT64_MAX}")
                return None
            if lo is not None and out < lo:
                problems.append(f"{name}={value!r} must be >= {lo}")
                return None
            return out

        status, order = text("status"), text("order") or "newest"
        if status is not None and status not in STATUSES:
            problems.append(f"status={status!r} is not one of {', '.join(STATUSES)}")
        if order not in ORDERS:
            problems.append(f"order={order!r} is not one of {', '.join(ORDERS)}")
        limit = number("limit", int, 1)
        if limit is not None and limit > MAX_LIMIT:
            problems.append(f"limit={limit} is over {MAX_LIMIT}; page with the next-page link instead")
        cursor = None
        if (after := text("after")) is not None:
            stamp, _, rid = after.partition("|")
            try:
                cursor = (datetime.fromisoformat(stamp).astimezone(timezone.utc), rid)
            except (ValueError, OverflowError):  # not a time, or one that leaves years 1-9999 in UTC
                problems.append(f"after={after!r} is not a cursor of this page (use the next-page link)")
            if not rid:
                problems.append(f"after={after!r} is not a cursor of this page (use the next-page link)")
        forked = text("forked")
        if forked not in (None, "0", "1", "on", "true"):
            problems.append(f"forked={forked!r} must be 1 or 0")
        f = cls(run=text("run"), group=text("group"), status=status, task=text("task"),
                version_min=number("vmin", int, 0), version_max=number("vmax", int, 0),
                reward_min=number("rmin", float), reward_max=number("rmax", float),
                forked=forked in ("1", "on", "true"), consumed_by=number("ckpt", int, 0), order=order if order in ORDERS else "newest",  # type: ignore[arg-type]
                limit=limit or 50, offset=number("offset", int, 0) or 0, cursor=cursor)
        if f.version_min is not None and f.version_max is not None and f.version_min > f.version_max:
            problems.append(f"vmin={f.version_min} is above vmax={f.version_max}")
        if problems:
            raise FilterError("; ".join(problems))
        return f

    def query(self, **changes: Any) -> dict[str, str]:
        """This filter as query-string parameters (for links), with `changes` applied."""
        f = replace(self, **changes)
        out = {"run": f.run, "group": f.group, "status": f.status, "task": f.task, "vmin": f.version_min,
               "vmax": f.version_max, "rmin": f.reward_min, "rmax": f.reward_max, "forked": "1" if f.forked else None,
               "ckpt": f.consumed_by, "order": None if f.order == "newest" else f.order, "limit": None if f.limit == 50 else f.limit,
               "offset": f.offset or None,
               "after": f"{f.cursor[0].isoformat()}|{f.cursor[1]}" if f.cursor else None}
        return {k: str(v) for k, v in out.items() if v is not None}

    @property
    def time_ordered(self) -> bool:
        return self.order in ("newest", "oldest")


@dataclass(frozen=True)
class Listing:
    rows: list[dict[str, Any]]
    next: RolloutFilter | None  # the next page's filter, None on the last page
    files_read: int
    files_total: int


def candidate_files(files: tuple[FileInfo, ...], f: RolloutFilter) -> list[FileInfo]:
    """The sealed files whose statistics can hold an event of a rollout the filter keeps."""
    out = list(files)
    if f.run is not None:
        out = files_covering(out, "run", [f.run])
    if f.group is not None:
        out = files_covering(out, "group_id", [f.group])
    # Pruning by version keeps some event of each kept rollout (a turn at its min_version), but not
    # necessarily its first one (often its `started` status, which has no version). Newest first
    # needs only some event; oldest first, and skipping the files above a newest-first cursor, need
    # the first event: they do without version pruning.
    by_version = f.version_min is not None or f.version_max is not None
    if by_version and f.order != "oldest":
        lo, hi = f.version_min or 0, f.version_max if f.version_max is not None else 2**62
        out = [x for x in out if not x.min or (x.min.get("policy_version") is not None
                                               and x.min["policy_version"] <= hi and x.max["policy_version"] >= lo)]
    elif f.cursor is not None and f.order == "newest":  # a file whose events all follow the cursor starts no row below it
        out = [x for x in out if not x.min or _time(x.min) <= f.cursor[0]]
    if f.cursor is not None and f.order == "oldest":
        out = [x for x in out if not x.min or _time(x.max) >= f.cursor[0]]
    return out


def _time(stats: Mapping[str, Any], default: datetime = _NO_TIME) -> datetime:
    value = stats.get("time")
    if value is None:
        return default
    if isinstance(value, str):
        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _where(f: RolloutFilter) -> tuple[str, dict[str, Any]]:
    clauses, params = ["TRUE"], {}
    for column, name, value in (("run", "run", f.run), ("group_id", "grp", f.group), ("status", "status", f.status),
                                ("task", "task", f.task)):
        if value is not None:
            clauses.append(f"{column} = ${name}")
            params[name] = value
    for clause, name, value in (("min_version >= $vmin", "vmin", f.version_min),
                                ("min_version <= $vmax", "vmax", f.version_max),
                                ("reward >= $rmin", "rmin", f.reward_min), ("reward <= $rmax", "rmax", f.reward_max)):
        if value is not None:
            clauses.append(clause)
            params[name] = value
    if f.forked:
        clauses.append("forks > 0")
    if f.cursor is not None and f.time_ordered:
        op = "<" if f.order == "newest" else ">"
        clauses.append(f"(started {op} $cursor_time OR (started = $cursor_time AND rollout_id {op} $cursor_id))")
        params |= {"cursor_time": f.cursor[0], "cursor_id": f.cursor[1]}
    return " AND ".join(clauses), params


ROW_SQL = """
    WITH task AS (SELECT rollout_id, min(json_extract_string(meta, '$.task_id')) AS task FROM events
                  WHERE meta IS NOT NULL AND rollout_id IS NOT NULL GROUP BY rollout_id)
    SELECT r.run, r.group_id, r.rollout_id, r.reward, r.status, r.error, r.trainable, r.segments, r.sessions,
           r.segments - r.sessions AS forks, r.turns, r.tokens, r.output_tokens, r.trainable_tokens,
           r.min_version, r.max_version, r.reward_components, r.started, r.ended,
           r.duration_s AS duration, task.task
    FROM rollouts r LEFT JOIN task USING (rollout_id)
"""


def rollout_rows(snap: Snapshot, rollout_ids: list[str]) -> pa.Table:
    """The table rows of these rollouts, each over exactly its own events (the snapshot is narrowed)."""
    if not rollout_ids:
        return pa.table({})
    snap.narrow("rollout_id", rollout_ids, columns=ROW_COLUMNS)
    return snap.query(ROW_SQL)


def _discover(snap: Snapshot, files: list[FileInfo], include_live: bool) -> set[str]:
    """Rollout ids with a turn, reward or status event in `files` (and the live rows)."""
    keep = pc.field("kind").isin(_KINDS) & pc.field("rollout_id").is_valid()
    ids: set[str] = set()
    if files:
        ids.update(pc.unique(snap.read_files(files, columns=["rollout_id"], filter=keep)
                             .column("rollout_id")).to_pylist())
    live = snap.pinned.live
    if include_live and live.num_rows:
        ids.update(x for x in pc.unique(live.filter(pc.is_in(live.column("kind"), value_set=_KINDS))
                                        .column("rollout_id")).to_pylist() if x is not None)
    return ids


def list_rollouts(snap: Snapshot, f: RolloutFilter) -> Listing:
    """One page of the rollouts table (see the module docstring for which files it reads)."""
    total = len(snap.pinned.table.files)
    files = candidate_files(snap.pinned.table.files, f)
    where, params = _where(f)
    read: set[str] = set()
    pool: list[pa.Table] = []
    seen: set[str] = set()

    def grow(window: list[FileInfo], first: bool) -> None:
        new = sorted(_discover(snap, window, first) - seen)
        seen.update(new)
        if new:
            pool.append(rollout_rows(snap, new))
            read.update(x.path for x in snap.files)
        read.update(x.path for x in window)

    if f.consumed_by is not None:  # the checkpoint event names them: read those and nothing else
        snap.narrow("kind", ["checkpoint"])
        read.update(x.path for x in snap.files)
        ids = snap.query("SELECT DISTINCT rollout_id FROM consumed WHERE version = $v AND ($run IS NULL OR run = $run)",
                         {"v": f.consumed_by, "run": f.run}).column("rollout_id").to_pylist()
        seen.update(ids)
        pool.append(rollout_rows(snap, sorted(ids)))
        read.update(x.path for x in snap.files)
        files = []
    if not f.time_ordered:
        if f.consumed_by is None:
            grow(files, True)
        rows = _select(snap, pool, where, params, f, f.offset)
        more = len(rows) > f.limit
        return Listing(rows[:f.limit], replace(f, offset=f.offset + f.limit) if more else None, len(read), total)

    newest = f.order == "newest"
    files.sort(key=(lambda x: _time(x.max, _END_TIME)) if newest else (lambda x: _time(x.min)), reverse=newest)
    start, size = 0, FIRST_WINDOW
    while True:
        if f.consumed_by is None:
            grow(files[start:start + size], start == 0)
        start += size
        size *= 4
        if start < len(files):  # rows beyond this bound may still start in unread files
            bound = _time(files[start].max, _END_TIME) if newest else _time(files[start].min)
            certain = "started > $bound" if newest else "started < $bound"
            rows = _select(snap, pool, f"{where} AND {certain}", {**params, "bound": bound}, f, 0)
        else:
            rows = _select(snap, pool, where, params, f, 0)
        if len(rows) > f.limit or start >= len(files):
            break
    more = len(rows) > f.limit
    last = rows[f.limit - 1] if more else None
    return Listing(rows[:f.limit], replace(f, cursor=(last["started"], last["rollout_id"])) if last else None,
                   len(read), total)


def _select(snap: Snapshot, pool: list[pa.Table], where: str, params: dict[str, Any], f: RolloutFilter,
            offset: int) -> list[dict[str, Any]]:
    """Filter and order the aggregated rows; one more than a page, to know whether another follows."""
    tables = [t for t in pool if t.num_rows]
    if not tables:
        return []
    snap.register("_pool", pa.concat_tables(tables))
    return snap.query(f"SELECT * FROM _pool WHERE {where} ORDER BY {ORDER_SQL[f.order]} LIMIT $n OFFSET $o",
                      {**params, "n": f.limit + 1, "o": offset}).to_pylist()
