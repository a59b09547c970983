"""A small run whose turns carry request/response JSON shaped as the capture proxy stores them.

Half the rollouts spoke OpenAI Chat Completions, half Anthropic Messages; each is two model
calls: a tool call, the tool's result, then an answer. Rollout k of a group answers right
(reward 1) when k is even.
"""

from __future__ import annotations

import random
from typing import Any

TOOLS_OPENAI = [{"type": "function", "function": {"name": "python", "description": "run code",
                                                  "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]
TOOLS_ANTHROPIC = [{"name": "python", "description": "run code",
                    "input_schema": {"type": "object", "properties": {"code": {"type": "string"}}}}]


def _openai(call: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    first = [{"role": "system", "content": "You can run Python."}, {"role": "user", "content": "What is 1+1?"}]
    call_msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call, "type": "function", "function": {"name": "python", "arguments": "{\"code\": \"1+1\"}"}}]}
    second = [*first, call_msg, {"role": "tool", "tool_call_id": call, "content": "2"}]
    return [({"model": "tiny", "messages": first, "tools": TOOLS_OPENAI},
             {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
                 {"index": 0, "message": call_msg, "finish_reason": "tool_calls"}]}),
            ({"model": "tiny", "messages": second, "tools": TOOLS_OPENAI},
             {"id": "chatcmpl-2", "object": "chat.completion", "choices": [
                 {"index": 0, "message": {"role": "assistant", "content": "1+1 = 2"}, "finish_reason": "stop"}]})]


def _anthropic(call: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    first = [{"role": "user", "content": "What is 1+1?"}]
    use = {"type": "tool_use", "id": call, "name": "python", "input": {"code": "1+1"}}
    second = [*first, {"role": "assistant", "content": [use]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": "2"}]}]
    return [({"model": "tiny", "system": "You can run Python.", "messages": first, "tools": TOOLS_ANTHROPIC,
              "max_tokens": 64},
             {"id": "msg_1", "type": "message", "role": "assistant", "content": [use], "stop_reason": "tool_use"}),
            ({"model": "tiny", "system": "You can run Python.", "messages": second, "tools": TOOLS_ANTHROPIC,
              "max_tokens": 64},
             {"id": "msg_2", "type": "message", "role": "assistant",
              "content": [{"type": "text", "text": "1+1 = 2"}], "stop_reason": "end_turn"})]


def chat_run(run: str = "chat", groups: int = 2, group_size: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """The run's events (turn, reward, status), as `trajstore ingest` JSON lines hold them."""
    rng = random.Random(seed)
    events: list[dict[str, Any]] = []
    for g in range(groups):
        for k in range(group_size):
            rid = f"{run}-g{g}-r{k}"
            base = {"run": run, "group_id": f"{run}-g{g}", "rollout_id": rid}
            calls = (_openai if k % 2 else _anthropic)(f"call_{g}_{k}")
            for i, (request, response) in enumerate(calls):
                n_out = rng.randrange(4, 12)
                events.append(dict(
                    base, kind="turn", session_id=f"{rid}-main", segment_id=f"{rid}-s0", turn_index=i,
                    policy_version=g, prompt_ids=[rng.randrange(1000) for _ in range(rng.randrange(3, 20))],
                    output_ids=[rng.randrange(1000) for _ in range(n_out)],
                    output_logprobs=[-rng.random() for _ in range(n_out)],
                    output_mask=[j > 0 for j in range(n_out)] if i == 0 else None,
                    finish_reason="tool_calls" if i == 0 else "stop",
                    sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 64},
                    request=request, response=response, meta={"protocol": "openai" if k % 2 else "anthropic"}))
            events.append(dict(base, kind="reward", reward_name="correct", reward=float(k % 2 == 0)))
            events.append(dict(base, kind="reward", reward_name="format", reward=0.1))
            events.append(dict(base, kind="status", status="completed", group_size=group_size))
    return events
