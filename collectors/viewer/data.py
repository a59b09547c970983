"""What the viewer's pages read: one pinned snapshot per request, narrowed to the events a page shows.

- `Source` holds the store (opened with create=False: the viewer never writes), pins table
  versions (a pinned old version never changes, so its file list is kept), and decodes tokens
  with a checkpoint's tokenizer when one is known.
- Runs (`runs_summary`): the one page that aggregates everything, by definition (reward by
  policy version is over every rollout of a run). Its rollout part reads scalar columns only
  and is cached per (table version, live rows); the learner part (metric and checkpoint events)
  reads only the files whose `kind` statistics can hold them.
- A group, an episode and its tokens read only the files whose statistics can hold that group
  or rollout id, and agree exactly with the views over the whole store.
- The rollouts table is `collectors.viewer.listing`.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from collectors.errors import CollectorError
from collectors.replay import Decode, Episode, build_episode, episode_rows, token_rows, tokenizer_decode
from collectors.viewer.listing import ROW_SQL
from trajstore import ESTIMATOR_TITLES, GROUP_ESTIMATORS, Snapshot, Store
from trajstore.read import Pinned
from trajstore.schema import EVENT_SCHEMA
from trajstore.table import TableSnapshot

# What the runs page aggregates: the `rollouts` view's inputs, no token lists, JSON or meta.
RUN_COLUMNS = ("event_id", "kind", "time", "writer", "writer_seq", "run", "group_id", "rollout_id", "session_id",
               "segment_id", "policy_version", "prompt_tokens", "output_tokens", "trainable_tokens", "reward",
               "reward_name", "status", "group_size")
PINNED_CACHE = 8
IDLE_SNAPSHOTS = 4  # DuckDB connections with their views, kept between requests  # pinned old versions kept (their file lists); each is a few kB per sealed file
# Learner curves by step: (title, metric names) of the `metrics` view; names a run lacks are left out.
STEP_CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward by learner step", ("reward_mean",)),
    ("loss", ("loss",)),
    ("KL: behaviour vs current, and to the reference", ("mismatch_kl_k3", "mismatch_kl_k1", "kl_ref")),
    ("clip fraction", ("clip_fraction",)),
    ("importance weights", ("is_weight_mean", "is_weight_min", "is_weight_max")),
    ("staleness (versions)", ("staleness_mean", "staleness_max")),
    ("training tokens/s", ("tokens_per_s",)),
    ("entropy and grad norm", ("entropy", "grad_norm")),
)


_EMPTY = Pinned(TableSnapshot(-1, (), {}), EVENT_SCHEMA.empty_table())


class NotFound(CollectorError):
    """The page's rollout, group or table version is not in the store (a 404; a request asked
    wrongly is `collectors.serving.BadRequest`, a 400)."""


@dataclass
class RunSummary:
    run: str
    totals: dict[str, Any]
    by_version: list[dict[str, Any]] = field(default_factory=list)
    components: dict[str, dict[int, float]] = field(default_factory=dict)  # name -> version -> mean
    steps: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


class Source:
    """The store as the viewer reads it (read-only); see the module docstring."""

    def __init__(self, store: Store, *, model: str | Path | None = None) -> None:
        self.store = store
        self.model = str(model) if model else None
        self._decode: Decode | None = None
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._pinned: OrderedDict[int, Pinned] = OrderedDict()
        self._idle: list[Snapshot] = []
        self._runs: tuple[tuple[int, int], list[RunSummary]] | None = None
        self._follower = store.follower(RUN_COLUMNS)

    # -------------------------------------------------------------- versions

    @contextmanager
    def snapshot(self, version: int | None) -> Iterator[Snapshot]:
        """A snapshot of `version` (latest plus live rows when None) that reads nothing until narrowed.
        Snapshots are pooled and repinned: one per concurrent request, never shared while in use."""
        pinned = self._pin(version)
        with self._lock:
            snap = self._idle.pop() if self._idle else None
        if snap is None:
            snap = Snapshot(self.store.table, pinned, files=())
        else:
            snap.repin(pinned, files=())
        try:
            yield snap
        finally:
            snap.repin(_EMPTY, files=())  # drop the request's rows
            with self._lock:
                if len(self._idle) < IDLE_SNAPSHOTS:
                    self._idle.append(snap)
                    snap = None
            if snap is not None:
                snap.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for snap in idle:
            snap.close()

    def _pin(self, version: int | None) -> Pinned:
        if version is None:
            pinned = self.store.pin()
        else:
            latest = self.store.version()
            if not 0 <= version <= latest:
                raise NotFound(f"table version {version} is not in the store: its versions are 0 to {latest}; "
                               "drop ?v= for the latest")
            with self._lock:
                pinned = self._pinned.get(version)
            if pinned is None:
                try:
                    pinned = self.store.pin(version, live=False)
                except Exception as exc:  # delta-rs: a version whose log files a vacuum removed  # noqa: BLE001
                    raise NotFound(f"table version {version} cannot be read any more ({exc}); pick a newer one")
                with self._lock:
                    self._pinned[version] = pinned
                    while len(self._pinned) > PINNED_CACHE:
                        self._pinned.popitem(last=False)
        return pinned

    # -------------------------------------------------------------- tokens

    def decode(self) -> Decode | None:
        """The tokenizer's decode: --model, else the newest checkpoint of the store found on this disk."""
        with self._tokenizer_lock:  # not self._lock: finding the model takes a pooled snapshot
            if self._decode is None and self.model is None:
                self.model = self._find_model()
            if self._decode is None and self.model is not None:
                self._decode = tokenizer_decode(self.model)
            return self._decode

    def _find_model(self) -> str | None:
        with self.snapshot(None) as snap:
            snap.narrow("kind", ["checkpoint"])
            rows = snap.query("SELECT path, base_model FROM checkpoints ORDER BY time DESC").to_pylist()
        for row in rows:
            for path in (row["path"], row["base_model"]):
                if path and (Path(path) / "tokenizer_config.json").is_file():
                    return path
        return None

    # -------------------------------------------------------------- runs

    def runs(self, snap: Snapshot, *, latest: bool = False) -> list[RunSummary]:
        """Every run's totals and curves (cached per table version and live rows). For the latest version
        the rollout part comes from a follower, which reads only the files added since its last read."""
        key = (snap.table_version, snap.pinned.live.num_rows)
        with self._lock:
            if self._runs is not None and self._runs[0] == key:
                return self._runs[1]
        runs = runs_summary(snap, self._follower.rows() if latest else None)
        with self._lock:
            self._runs = (key, runs)
        return runs


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def runs_summary(snap: Snapshot, rows: pa.Table | None = None) -> list[RunSummary]:
    """Totals, reward (and each component) by policy version, learner metrics by step, checkpoints;
    `rows`: the RUN_COLUMNS of every event, already read (a follower's), else read here."""
    if rows is None:
        snap.project(RUN_COLUMNS)
    else:
        snap.use_rows(rows)
    snap.register("_r", snap.query("SELECT * EXCLUDE (error) FROM rollouts"))  # aggregated once, read four times
    totals = snap.query("""
        SELECT run, count(*) AS rollouts, count(*) FILTER (WHERE trainable) AS trainable,
               count(DISTINCT group_id) AS groups,
               sum(tokens)::BIGINT AS tokens, sum(output_tokens)::BIGINT AS output_tokens,
               count(*) FILTER (WHERE status = 'failed') AS failed,
               count(*) FILTER (WHERE status = 'aborted') AS aborted,
               count(*) FILTER (WHERE status IS NULL OR status = 'started') AS in_flight,
               avg(reward) FILTER (WHERE trainable) AS reward, min(min_version) AS min_version,
               max(max_version) AS max_version, sum(segments - sessions)::BIGINT AS forks,
               min(started) AS started, max(ended) AS ended
        FROM _r GROUP BY run ORDER BY max(ended) DESC NULLS LAST, run
    """).to_pylist()
    runs = {r["run"]: RunSummary(r["run"], {k: _clean(v) for k, v in r.items()}) for r in totals}
    for row in snap.query("""
        SELECT run, min_version AS version, count(*) AS rollouts, count(*) FILTER (WHERE trainable) AS trainable,
               avg(reward) FILTER (WHERE trainable) AS reward, sum(output_tokens)::BIGINT AS output_tokens,
               avg(turns) AS turns, sum(segments - sessions)::BIGINT AS forks,
               count(*) FILTER (WHERE status = 'failed') AS failed
        FROM _r WHERE min_version IS NOT NULL GROUP BY ALL ORDER BY run, version
    """).to_pylist():
        runs[row["run"]].by_version.append({k: _clean(v) for k, v in row.items()})
    for row in snap.query("""
        WITH c AS (SELECT rollout_id, reward_name, last(reward ORDER BY time, writer, writer_seq) AS value
                   FROM events WHERE kind = 'reward' AND segment_id IS NULL GROUP BY ALL)
        SELECT r.run, r.min_version AS version, coalesce(c.reward_name, 'reward') AS name, avg(c.value) AS mean
        FROM c JOIN _r r USING (rollout_id) WHERE r.trainable AND r.min_version IS NOT NULL
        GROUP BY ALL ORDER BY 1, 3, 2
    """).to_pylist():
        runs[row["run"]].components.setdefault(row["name"], {})[row["version"]] = row["mean"]
    snap.narrow("kind", ["checkpoint", "metric"])
    for row in snap.query("SELECT run, step, name, value FROM metrics WHERE step IS NOT NULL "
                          "ORDER BY run, step, time").to_pylist():
        if row["value"] is not None and math.isfinite(row["value"]):
            run = runs.setdefault(row["run"], RunSummary(row["run"], {}))  # a learner may log before any rollout
            run.steps.setdefault(row["name"], []).append((row["step"], row["value"]))
    for row in snap.query("SELECT run, version, step, time, table_version, consumed_rollouts, metrics, path, adapter "
                          "FROM checkpoints ORDER BY run, version, time").to_pylist():
        run = runs.setdefault(row["run"], RunSummary(row["run"], {}))
        metrics = dict(row["metrics"] or [])
        run.checkpoints.append({"version": row["version"], "step": row["step"], "time": row["time"],
                                "table_version": row["table_version"], "consumed": row["consumed_rollouts"],
                                "path": row["path"], "adapter": row["adapter"],
                                "loss": _clean(metrics.get("loss")), "reward_mean": _clean(metrics.get("reward_mean"))})
    return list(runs.values())


# ------------------------------------------------------------------ group


def group_view(snap: Snapshot, group_id: str, decode: Decode | None) -> dict[str, Any]:
    """A group's rollouts side by side: rewards by component, advantages (over the group), last answers."""
    snap.narrow("group_id", [group_id])
    group = snap.query("SELECT * FROM groups WHERE group_id = $g", {"g": group_id}).to_pylist()
    if not group:
        raise NotFound(f"no group {group_id!r} in the store; open one from the rollouts table (/rollouts)")
    rows = snap.query(f"""
        SELECT x.*, {", ".join(f"a.{name}" for name in GROUP_ESTIMATORS)}
        FROM ({ROW_SQL}) x LEFT JOIN advantages a USING (rollout_id)
        ORDER BY x.started, x.rollout_id""").to_pylist()
    components: dict[str, dict[str, float]] = {}
    for c in snap.query("""
        SELECT rollout_id, reward_name, last(reward ORDER BY time, writer, writer_seq) AS value FROM events
        WHERE kind = 'reward' AND segment_id IS NULL GROUP BY ALL ORDER BY reward_name""").to_pylist():
        components.setdefault(c["rollout_id"], {})[c["reward_name"] or "reward"] = c["value"]
    last = {r["rollout_id"]: r["ids"] for r in snap.query(
        "SELECT rollout_id, arg_max(output_ids, (time, turn_index)) AS ids FROM turns GROUP BY rollout_id").to_pylist()}
    for row in rows:
        row["components"] = components.get(row["rollout_id"], {})
        ids = last.get(row["rollout_id"]) or []
        row["last_output"] = decode(ids) if decode else " ".join(map(str, ids))
    return {"group": {k: _clean(v) for k, v in group[0].items()}, "rollouts": rows,
            "component_names": sorted({n for c in components.values() for n in c}),
            "estimators": {name: ESTIMATOR_TITLES[name] for name in GROUP_ESTIMATORS}}


# ------------------------------------------------------------------ episode


@dataclass(frozen=True)
class EpisodeView:
    episode: Episode
    row: dict[str, Any]  # the rollouts table's row of it
    task: Any  # the task the collector recorded with its started status, if any
    timeline: list[dict[str, Any]]  # reward and status events, oldest first
    forks: dict[str, dict[str, Any]]  # segment id -> why it forked (reason, previous segment), from the proxy's meta


def episode_view(snap: Snapshot, rollout_id: str, decode: Decode | None) -> EpisodeView:
    turns, others = episode_rows(snap, rollout_id)
    if not turns and not others:
        raise NotFound(f"no rollout {rollout_id!r} in the store; find rollout ids in the rollouts table (/rollouts)")
    episode = build_episode(rollout_id, turns, others, decode=decode)
    row = snap.query(ROW_SQL + " WHERE r.rollout_id = $r", {"r": rollout_id}).to_pylist()
    task = None
    for ev in others:
        meta = json.loads(ev["meta"]) if isinstance(ev.get("meta"), str) else ev.get("meta")
        if isinstance(meta, dict) and task is None and ("task" in meta or "task_id" in meta):
            task = meta.get("task") or {"task_id": meta.get("task_id")}
    timeline = [{k: ev[k] for k in ("time", "kind", "reward_name", "reward", "segment_id", "status", "error")}
                for ev in others]
    forks = {}
    for seg in episode.segments:
        meta = seg.turns[0].meta if seg.turns else None
        if isinstance(meta, dict) and meta.get("fork"):
            forks[seg.segment_id] = {"reason": meta["fork"], "previous": meta.get("previous_segment")}
    return EpisodeView(episode, row[0] if row else {}, task, timeline, forks)


def episode_tokens(snap: Snapshot, rollout_id: str, decode: Decode | None) -> list[dict[str, Any]]:
    """Every turn's tokens: id, text (each decoded alone), kind (prompt, sampled, sampled_masked), logprob."""
    turns, others = episode_rows(snap, rollout_id)
    if not turns and not others:
        raise NotFound(f"no rollout {rollout_id!r} in the store")
    episode = build_episode(rollout_id, turns, others, decode=None)
    return [{"segment_id": s.segment_id, "turn_index": t.turn_index, "tokens": token_rows(t, decode)}
            for s in episode.segments for t in s.turns]


def jsonable(value: Any) -> Any:
    """Plain JSON for the API: times as ISO 8601, non-finite floats as null."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return _clean(value)
    if hasattr(value, "total_seconds"):
        return value.total_seconds()
    return value
