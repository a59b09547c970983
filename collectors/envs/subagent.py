"""An example agent with a sub-agent and context compaction: one rollout, three trainable segments.

What one episode does, all through the capture proxy (OpenAI SDK):

1. main session: `[system, user: the question]` -> a plan;
2. sub-agent (`ctx.session("sub")`, its own session): `[system, user: research the topic]`
   -> notes;
3. main session again, with a COMPACTED history `[system, user: summary of the plan and the
   notes + the question]` instead of extending calls 1's conversation -> the answer.

Call 3's prompt does not start with what the main session already holds (call 1's prompt and
reply), so the proxy forks it into a new segment (reason `history_rewrite`). The rollout
therefore has exactly 3 segments (2 in session "main", 1 in session "sub"), all sharing its
rollout_id and its reward; the learner counts the rollout once.

`reward` is deterministic and text-only: `{"on_topic": 1.0}` when the answer names the task's
topic (case-insensitive), else 0.0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from collectors.agents import AgentContext, RolloutInfo

SYSTEM = "You are a concise assistant."
TOPICS = ("volcanoes", "tides", "bees", "glaciers", "comets", "coral", "deserts", "lightning")
QUESTIONS = ("Why do {t} matter?", "Explain {t} in one sentence.", "What is surprising about {t}?")
SUMMARY_CHARS = 200  # how much of the plan and of the notes the compacted context keeps


@dataclass(frozen=True)
class SubagentResult:
    plan: str
    notes: str
    answer: str


def tasks(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` questions about a topic each, the same for the same seed (`prompt` is what a task file
    for `trajstore collect` needs; the agent reads `question`)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        topic = rng.choice(TOPICS)
        question = rng.choice(QUESTIONS).format(t=topic)
        out.append({"id": f"subagent-{seed}-{i}", "topic": topic, "question": question, "prompt": question})
    return out


async def _ask(ctx: AgentContext, messages: list[dict[str, Any]]) -> str:
    response = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages,
                                                        max_tokens=ctx.max_tokens, **ctx.sampling)
    choice = response.choices[0]
    if choice.finish_reason == "length":
        ctx.truncate("max_tokens")  # still answered below: the episode goes on with what it got
    return choice.message.content or ""


async def agent(task: dict[str, Any], ctx: AgentContext) -> SubagentResult:
    """Plan, delegate research to a sub-agent, then answer from a compacted context (3 segments)."""
    system = {"role": "system", "content": SYSTEM}
    plan = await _ask(ctx, [system, {"role": "user", "content": f"Plan how to answer: {task['question']}"}])
    notes = await _ask(ctx.session("sub"), [system, {"role": "user", "content": f"Research {task['topic']}."}])
    summary = (f"Summary so far. Plan: {plan[:SUMMARY_CHARS]}\nResearch notes: {notes[:SUMMARY_CHARS]}\n\n"
               f"Now answer: {task['question']}")
    answer = await _ask(ctx, [system, {"role": "user", "content": summary}])
    return SubagentResult(plan=plan, notes=notes, answer=answer)


def reward(task: dict[str, Any], result: SubagentResult, rollout: RolloutInfo) -> dict[str, float]:
    """`{"on_topic": 1.0}` when the final answer names the task's topic, else 0.0."""
    return {"on_topic": 1.0 if task["topic"].lower() in result.answer.lower() else 0.0}
