"""Scoring rollouts: a reward function or a test command, and `trajstore reward` re-scoring stored rollouts.

A reward function (`module:function`, sync or async) is called as
`reward(task, result, rollout: RolloutInfo)` and returns a float (one component named
`reward`, or `--name`) or a dict of named components; each component becomes one reward
event and the rollout's reward is their sum. A reward command runs in the rollout's
directory after the agent: exit status 0 scores 1.0, anything else 0.0.

Re-scoring (`rescore`) appends new reward events to finished rollouts; a newer event of the
same reward name supersedes the older one in the `rollouts` view, so scores can be fixed
after the fact without touching anything else.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.agents.context import RolloutInfo, load_object
from collectors.collect.agent_cmd import run_command
from collectors.collect.tasks import load_tasks, task_id
from collectors.errors import CollectorError
from collectors.model.replies import response_text
from trajstore import Reward, Store


class RewardError(CollectorError, ValueError):
    """A reward returned something that is not a score."""


def components(value: Any, name: str = "reward") -> dict[str, float]:
    """A reward function's return value as {name: finite float}; RewardError says what was wrong."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = {name: value}
    if not isinstance(value, Mapping) or not value:
        raise RewardError(f"a reward must return a number or a non-empty dict of name -> number, got {value!r}")
    out = {}
    for key, v in value.items():
        if not isinstance(key, str) or not key:
            raise RewardError(f"reward component names must be non-empty strings, got {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward component {key!r} must be a finite number, got {v!r}")
        out[key] = float(v)
    return out


async def call_reward(fn: Callable[..., Any], task: dict[str, Any], result: Any, info: RolloutInfo,
                      name: str = "reward") -> dict[str, float]:
    """Call a sync or async reward; a sync one runs in a thread so it cannot stall other rollouts."""
    if inspect.iscoroutinefunction(fn):
        value = await fn(task, result, info)
    else:
        value = await asyncio.to_thread(fn, task, result, info)
        if inspect.isawaitable(value):
            value = await value
    return components(value, name)


async def command_reward(command: str, workdir: Path, env: Mapping[str, str]) -> tuple[dict[str, float], dict[str, Any]]:
    """Run a test command in the rollout's directory: exit 0 -> 1.0, else 0.0; its output tail goes to meta."""
    result = await run_command(command, cwd=workdir, env=env)
    score = 1.0 if result.exit_code == 0 else 0.0
    return {"reward": score}, {"reward_exit": result.exit_code, "reward_output": result.tail}


# Rewards shipped with trajstore that --reward also takes by a short name.
NAMED_REWARDS = {
    "math_verify": "collectors.envs.math_verify:reward",
    "reasoning_gym": "collectors.envs.reasoning_gym:reward",
}


def load_reward(spec: str) -> Callable[..., Any]:
    """A reward function from `module:fn` (or a file path), or one of NAMED_REWARDS by its name."""
    if ":" not in spec and spec not in NAMED_REWARDS:
        raise ValueError(f"reward {spec!r} must be written module:name (e.g. my_env:reward) or be one of "
                         f"{', '.join(sorted(NAMED_REWARDS))}")
    fn = load_object(NAMED_REWARDS.get(spec, spec), what="reward")
    if not callable(fn):
        raise TypeError(f"reward {spec!r} is a {type(fn).__name__}, not a function reward(task, result, rollout)")
    return fn


# ---------------------------------------------------------------- re-scoring stored rollouts

_RESCORE_SQL = """
    WITH r AS (SELECT * FROM rollouts WHERE run = $run AND ({where})),
    started AS (SELECT rollout_id, any_value(meta) AS meta FROM events
                WHERE kind = 'status' AND status = 'started' AND run = $run GROUP BY rollout_id),
    final AS (SELECT rollout_id, last(meta ORDER BY time, writer, writer_seq) AS meta FROM events
              WHERE kind = 'status' AND status <> 'started' AND run = $run GROUP BY rollout_id),
    last_turn AS (SELECT rollout_id, last(response ORDER BY coalesce(session_id, 'main') = 'main', time, writer_seq)
                  AS response FROM turns WHERE run = $run GROUP BY rollout_id)
    SELECT r.rollout_id, r.group_id, r.status, started.meta AS started_meta, final.meta AS final_meta,
           last_turn.response
    FROM r LEFT JOIN started USING (rollout_id) LEFT JOIN final USING (rollout_id)
    LEFT JOIN last_turn USING (rollout_id)
    ORDER BY r.rollout_id
"""
DEFAULT_WHERE = "status IN ('completed', 'truncated')"


@dataclass
class RescoreSummary:
    scored: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (rollout_id, why)
    reward_sum: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.reward_sum / self.scored if self.scored else None


def _json(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def rescore(store: Store, run: str, reward: str, *, tasks_file: str | None = None, name: str = "reward",
            where: str | None = None, writer: str | None = None) -> RescoreSummary:
    """Score `run`'s finished rollouts again with `reward` and append the new reward events.

    The task comes from the rollout's started status (the runner stores small tasks there) or
    from `tasks_file` by id; the result from the final status (`result`) or, failing that, the
    text of the rollout's last turn."""
    fn = load_reward(reward)
    by_id = {task_id(t): t for t in load_tasks(tasks_file)} if tasks_file else {}
    rows = store.query(_RESCORE_SQL.format(where=where or DEFAULT_WHERE), {"run": run}).to_pylist()
    summary, events = RescoreSummary(), []

    async def score_all() -> None:
        for row in rows:
            started, final = _json(row["started_meta"]), _json(row["final_meta"])
            task = started.get("task") if isinstance(started.get("task"), dict) \
                else by_id.get(str(started.get("task_id")))
            if task is None:
                why = f"task {started.get('task_id')!r} is neither stored with the rollout nor in --tasks"
                summary.skipped.append((row["rollout_id"], why))
                continue
            result = final["result"] if "result" in final else response_text(row["response"])
            info = RolloutInfo(run=run, group_id=row["group_id"], rollout_id=row["rollout_id"],
                               slot=int(started.get("slot", 0)), attempt=int(started.get("attempt", 0)),
                               workdir=Path(started.get("workdir", ".")),
                               policy_version=int(started.get("policy_version", 0)),
                               agent_output=final.get("agent_output"), agent_exit=final.get("agent_exit"))
            try:
                scores = await call_reward(fn, task, result, info, name)
            except Exception as exc:  # noqa: BLE001 - one bad rollout must not stop the others
                summary.skipped.append((row["rollout_id"], f"reward raised {type(exc).__name__}: {exc}"))
                continue
            events.extend(Reward(run=run, group_id=row["group_id"], rollout_id=row["rollout_id"], reward=v,
                                 reward_name=k, meta={"rescored_by": reward}) for k, v in scores.items())
            summary.scored += 1
            summary.reward_sum += sum(scores.values())

    asyncio.run(score_all())
    if events:
        with store.writer(writer or store.unique_writer_name("reward-")) as w:
            w.append(events)
    return summary
