"""A generated agent run, shaped like what collectors write, for the walkthrough and benchmarks.

Each group is one task sampled `group_size` times. A rollout is a multi-turn tool-using
episode: the first turn's prompt is the whole chat, later turns add a tool observation as
the prompt delta. Some rollouts compact their context (the next turn starts a new segment
with a whole, shorter prompt) and some call a sub-agent (its own session and segment), so
rollouts fan out into several samples as real agents do. Rewards are a correctness
component plus a format component; a few rollouts fail (no reward) or are truncated.
Everything is deterministic in `seed`.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from typing import Any


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _logprobs(rng: random.Random, n: int) -> list[float]:
    return [-abs(rng.gauss(0.0, 1.2)) for _ in range(n)]


def generate_run(*, run: str = "walkthrough", groups: int = 8, group_size: int = 4, versions: int = 3,
                 vocab: int = 32_000, seed: int = 0, start: datetime | None = None) -> list[dict[str, Any]]:
    """Events (plain dicts, as JSON lines of `trajstore ingest` hold them) of one generated run."""
    rng = random.Random(seed)
    clock = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
    events: list[dict[str, Any]] = []

    def stamp() -> str:
        nonlocal clock
        clock += timedelta(milliseconds=rng.randrange(50, 400))
        return clock.isoformat().replace("+00:00", "Z")

    for g in range(groups):
        group_id = f"{run}-g{g:03d}"
        version = g * versions // groups
        task = {"task_id": f"task-{g:03d}", "difficulty": rng.choice(["easy", "medium", "hard"])}
        skill = {"easy": 0.8, "medium": 0.5, "hard": 0.25}[task["difficulty"]] + 0.1 * version
        for k in range(group_size):
            rollout_id = f"{group_id}-r{k}"
            base = dict(run=run, group_id=group_id, rollout_id=rollout_id)
            sessions = [("main", rng.randrange(2, 5))]
            if rng.random() < 0.25:
                sessions.append(("subagent", rng.randrange(1, 3)))
            for session, n_turns in sessions:
                session_id = f"{rollout_id}-{session}"
                segment = 0
                turn_index = 0
                for t in range(n_turns):
                    fork = t > 0 and rng.random() < 0.2  # context compaction: a new segment, whole prompt
                    if fork:
                        segment += 1
                        turn_index = 0
                    first = turn_index == 0
                    prompt = _tokens(rng, rng.randrange(40, 90) if first else rng.randrange(5, 30), vocab)
                    n_out = rng.randrange(8, 40)
                    mask = None
                    if rng.random() < 0.1:  # e.g. a tool-call preamble the trainer should not learn
                        mask = [i >= 2 for i in range(n_out)]
                    tool_call = t < n_turns - 1
                    events.append(dict(
                        base, kind="turn", session_id=session_id,
                        segment_id=f"{session_id}-s{segment}", turn_index=turn_index,
                        policy_version=version, prompt_ids=prompt, output_ids=_tokens(rng, n_out, vocab),
                        output_logprobs=_logprobs(rng, n_out), output_mask=mask,
                        finish_reason="tool_calls" if tool_call else "stop",
                        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 64, "seed": rng.randrange(2**31)},
                        meta={**task, "tool": "python" if tool_call else None},
                        time=stamp(),
                    ))
                    turn_index += 1
            fate = rng.random()
            if fate < 0.05:
                events.append(dict(base, kind="status", status="failed", error="tool sandbox timed out",
                                   group_size=group_size, time=stamp()))
                continue
            correct = 1.0 if rng.random() < skill else 0.0
            events.append(dict(base, kind="reward", reward_name="correct", reward=correct, time=stamp()))
            events.append(dict(base, kind="reward", reward_name="format", reward=rng.choice([0.0, 0.1]),
                               time=stamp()))
            status = "truncated" if fate < 0.12 else "completed"
            events.append(dict(base, kind="status", status=status, group_size=group_size, time=stamp()))
    return events

