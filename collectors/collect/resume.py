"""Resuming a run: what the store says was already collected, and what is left to do.

Each rollout the runner opens records `task_id`, `epoch`, `slot` and `attempt` in its started
status (meta). From those, every (task, epoch) maps to its group:

- complete (each slot 0..n-1 has a usable rollout): nothing to do;
- partly done: the same group id again, only the slots without a usable rollout, each at
  its next attempt number;
- never started: a new group, every slot at attempt 0.

A usable rollout is completed or truncated and rewarded (when the run has a reward).
Rollouts left `started` by a collector that died (kill -9, lost machine) are *orphans*: the
runner closes them as aborted before it starts, so their groups can be judged again. This
assumes one collector per run and task file: a second live collector's open rollouts would
look the same.

`plan_group` and `plans` are pure; `read_history` is the one store query.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from collectors.collect.tasks import task_id
from trajstore import Store
from trajstore.schema import TRAINABLE_STATUSES

HISTORY_SQL = """
    WITH started AS (
        SELECT rollout_id, any_value(group_id) AS group_id,
               any_value(json_extract_string(meta, '$.task_id')) AS task_id,
               any_value(TRY_CAST(json_extract(meta, '$.epoch') AS BIGINT)) AS epoch,
               any_value(TRY_CAST(json_extract(meta, '$.slot') AS BIGINT)) AS slot,
               any_value(TRY_CAST(json_extract(meta, '$.attempt') AS BIGINT)) AS attempt
        FROM events WHERE kind = 'status' AND status = 'started' AND run = ? GROUP BY rollout_id)
    SELECT started.*, r.status, r.reward IS NOT NULL AS rewarded, r.min_version
    FROM started JOIN rollouts r USING (rollout_id)
    WHERE started.task_id IS NOT NULL AND started.epoch IS NOT NULL AND started.slot IS NOT NULL
"""


@dataclass(frozen=True)
class PastRollout:
    group_id: str
    rollout_id: str
    task_id: str
    epoch: int
    slot: int
    attempt: int
    status: str | None  # the latest status; `started` while it runs (or its collector died)
    rewarded: bool
    min_version: int | None = None

    def usable(self, needs_reward: bool) -> bool:
        return self.status in TRAINABLE_STATUSES and (self.rewarded or not needs_reward)


@dataclass(frozen=True)
class GroupPlan:
    """The work left for one (task, epoch)."""

    task: dict[str, Any]
    task_id: str
    epoch: int
    group_id: str | None  # None: mint a new group id
    todo: tuple[tuple[int, int], ...]  # (slot, attempt) to run
    done_slots: int = 0  # slots that already have a usable rollout
    oldest_version: int | None = None  # oldest version of those rollouts' turns (admission needs it)


def read_history(store: Store, run: str) -> list[PastRollout]:
    """Every rollout of `run` the runner opened, with its latest status."""
    rows = store.query(HISTORY_SQL, [run]).to_pylist()
    return [PastRollout(r["group_id"], r["rollout_id"], r["task_id"], int(r["epoch"]), int(r["slot"]),
                        int(r["attempt"] or 0), r["status"], bool(r["rewarded"]), r["min_version"]) for r in rows]


def orphans(history: Iterable[PastRollout], task_ids: set[str]) -> list[PastRollout]:
    """Rollouts of these tasks that were opened and never closed."""
    return [r for r in history if r.status == "started" and r.task_id in task_ids]


def plan_group(past: Sequence[PastRollout], task: dict[str, Any], epoch: int, n: int,
               needs_reward: bool) -> GroupPlan:
    """What to run for one (task, epoch) given its past rollouts (any of its groups)."""
    tid = task_id(task)
    by_group: dict[str, list[PastRollout]] = defaultdict(list)
    for r in past:
        by_group[r.group_id].append(r)
    if not by_group:
        return GroupPlan(task, tid, epoch, None, tuple((slot, 0) for slot in range(n)))

    def usable_slots(rows: list[PastRollout]) -> set[int]:
        return {r.slot for r in rows if r.usable(needs_reward) and r.slot < n}

    # the group closest to complete; among equals the newest (ids are time-ordered)
    group_id = max(by_group, key=lambda g: (len(usable_slots(by_group[g])), g))
    rows = by_group[group_id]
    usable = usable_slots(rows)
    next_attempt = {slot: max((r.attempt for r in rows if r.slot == slot), default=-1) + 1 for slot in range(n)}
    versions = [r.min_version for r in rows if r.usable(needs_reward) and r.min_version is not None]
    return GroupPlan(task, tid, epoch, group_id, tuple((s, next_attempt[s]) for s in range(n) if s not in usable),
                     done_slots=len(usable), oldest_version=min(versions) if versions else None)


def plans(tasks: Sequence[dict[str, Any]], history: Iterable[PastRollout], *, n: int, epochs: int | None,
          needs_reward: bool) -> Iterator[GroupPlan]:
    """Every (task, epoch) in order, epoch by epoch (`epochs=None`: forever)."""
    index: dict[tuple[str, int], list[PastRollout]] = defaultdict(list)
    for r in history:
        index[(r.task_id, r.epoch)].append(r)
    for epoch in (range(epochs) if epochs is not None else count()):
        for task in tasks:
            yield plan_group(index.get((task_id(task), epoch), []), task, epoch, n, needs_reward)
