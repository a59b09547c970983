"""Small agents and rewards for the `trajstore collect` tests, plugged in as `tests.collectors.agents_for_tests:NAME`.

Behaviour is chosen by task fields, so one run can mix healthy and faulty rollouts:

    "turns": 2           the agent makes a second model call on the same conversation
    "fault": "raise"     the agent raises on the slot's first attempt
    "fault": "hang"      the agent hangs (until cancelled) on the first attempt
    "fault": "reward"    the reward raises on the first attempt
    "fault": "always"    the agent raises on every attempt
    "fault": "truncate"  the agent calls ctx.truncate("max_turns")
    "block": true        after its model call the agent waits for the file $TRAJSTORE_TEST_GATE
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from collectors.agents import AgentContext, RolloutInfo
from collectors.collect.tasks import chat_messages
from trajstore import Store


async def _call(ctx: AgentContext, messages: list[dict[str, Any]]) -> str:
    reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, max_tokens=ctx.max_tokens,
                                                     **ctx.sampling)
    return reply.choices[0].message.content or ""


async def chat(task: dict[str, Any], ctx: AgentContext) -> dict[str, Any]:
    """One or two model calls; returns what the reward needs to check the rollout's context."""
    files = {name: (ctx.workdir / name).read_text() for name in task.get("files", {})}
    messages = chat_messages(task)
    text = await _call(ctx, messages)
    if task.get("turns", 1) == 2:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        text = await _call(ctx, messages)
    return {"text": text, "files": files, "rollout_id": ctx.rollout.rollout_id}


async def faulty(task: dict[str, Any], ctx: AgentContext) -> dict[str, Any]:
    fault, first = task.get("fault"), ctx.rollout.attempt == 0
    if fault == "always" or (fault == "raise" and first):
        raise RuntimeError(f"boom in the agent (task {task['id']}, attempt {ctx.rollout.attempt})")
    if fault == "hang" and first:
        await _call(ctx, chat_messages(task))  # a turn is stored, then it never returns
        await asyncio.Event().wait()
    result = await chat(task, ctx)
    if fault == "truncate":
        ctx.truncate("max_turns")
    return result


async def blocking(task: dict[str, Any], ctx: AgentContext) -> dict[str, Any]:
    result = await chat(task, ctx)
    gate = Path(os.environ["TRAJSTORE_TEST_GATE"])
    while task.get("block") and not gate.exists():
        await asyncio.sleep(0.05)
    return result


async def anthropic_chat(task: dict[str, Any], ctx: AgentContext) -> str:
    reply = await ctx.anthropic.messages.create(model=ctx.model, max_tokens=ctx.max_tokens,
                                                messages=chat_messages(task))
    return "".join(block.text for block in reply.content if block.type == "text")


def score(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> dict[str, float]:
    """Two components: a deterministic function of the text and the slot (so groups have spread)."""
    if task.get("fault") == "reward" and rollout.attempt == 0:
        raise ValueError(f"reward cannot score task {task['id']}")
    text = result["text"] if isinstance(result, dict) else str(result)
    return {"length": (len(text) % 5) / 4, "slot": rollout.slot / 10}


async def async_score(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> float:
    await asyncio.sleep(0)
    return 1.0 if rollout.agent_exit == 0 else 0.0


def rescore(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> float:
    """For `trajstore reward`: 2.0 when the stored result still has its text."""
    return 2.0 if isinstance(result, dict) and "text" in result else -1.0


# ---------------------------------------------------------------- helpers shared by the collect tests

def write_tasks(path: Path, tasks: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return str(path)


def rollout_rows(store: Store, run: str) -> list[dict[str, Any]]:
    """Each rollout of `run` with its started meta (task_id, epoch, slot, attempt, ...) and final meta."""
    rows = store.query("""
        WITH s AS (SELECT rollout_id, any_value(meta) AS started_meta FROM events
                   WHERE kind = 'status' AND status = 'started' GROUP BY rollout_id),
             f AS (SELECT rollout_id, last(meta ORDER BY time, writer_seq) AS final_meta FROM events
                   WHERE kind = 'status' AND status <> 'started' GROUP BY rollout_id)
        SELECT r.*, s.started_meta, f.final_meta FROM rollouts r JOIN s USING (rollout_id)
        LEFT JOIN f USING (rollout_id) WHERE r.run = ? ORDER BY r.started""", [run]).to_pylist()
    for row in rows:
        row["started_meta"] = json.loads(row["started_meta"])
        row["final_meta"] = json.loads(row["final_meta"]) if row["final_meta"] else {}
    return rows


def usable_by_task(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, list[int]]]:
    """(task_id, epoch) -> {group_id: sorted slots of its usable rollouts}."""
    out: dict[tuple[str, int], dict[str, list[int]]] = {}
    for row in rows:
        meta = row["started_meta"]
        groups = out.setdefault((meta["task_id"], meta["epoch"]), {})
        slots = groups.setdefault(row["group_id"], [])
        if row["trainable"]:
            slots.append(meta["slot"])
    return {k: {g: sorted(s) for g, s in v.items()} for k, v in out.items()}


async def opaque(task: dict[str, Any], ctx: AgentContext) -> object:
    """Makes one call and returns something that cannot be stored as JSON."""
    await _call(ctx, chat_messages(task))
    return object()


def last_reply_length(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> float:
    """For re-scoring rollouts whose result was not stored: `result` is then the last reply's text."""
    assert isinstance(result, str), result
    return float(len(result)) + (100.0 if len(task.get("context", "")) > 8192 else 0.0)
