"""The `ng-trajectory` export: NeMo Gym's rollout JSON lines, one per sample, with token ids for training.

NeMo Gym's rollout collection writes one JSON object per rollout: the task's
`responses_create_params` (an OpenAI Responses request: `input` items, `tools`, sampling
parameters), the agent's final `response` (a Responses object whose `output` items are the
model's messages and function calls and the tools' outputs), the verifier's `reward`, and
any task fields. For training, each model-produced output item may carry the call's
`prompt_token_ids`, `generation_token_ids` and `generation_log_probs`. A trajstore sample maps:

- `responses_create_params.input` <- the first turn's request messages (`trajstore.export.chat`
  form, as Responses input items); `tools` <- its tools; `temperature`, `top_p`,
  `max_output_tokens` <- its sampling parameters;
- `response.output` <- each turn's reply (a `message` item, `function_call` items for tool
  calls), then the tool results and user messages the next turn's request added
  (`function_call_output` / `message` items); the last item of each turn carries the turn's
  token fields: `prompt_token_ids` the whole prompt of that call (the sample's tokens before
  the turn's output), `generation_token_ids`/`generation_log_probs` its output ids and
  behaviour logprobs; `response.model` <- the request's model, `created_at` <- the last turn's time;
- `reward` <- the rollout's reward (0.0 when it has none: failed or unscored);
- `trajstore` <- where it came from (run, group, rollout, segment, status, reward components,
  policy versions, advantages), a task field NeMo Gym passes through.

A turn stored without request/response JSON becomes one assistant `message` item with empty
text and its token fields (the store holds token ids, not text).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

from trajstore.export.chat import Message, conversation
from trajstore.views import ESTIMATORS


def _input_items(messages: list[Message]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items (tool calls and results as function items)."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m.get("tool_call_id", ""), "output": m["content"]})
            continue
        if m["content"] or not m.get("tool_calls"):
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
        items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                   "arguments": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
    return items


def _output_items(reply: Message, ref: str) -> list[dict[str, Any]]:
    """The model's reply as Responses output items."""
    items: list[dict[str, Any]] = []
    if reply["content"] or not reply.get("tool_calls"):
        items.append({"id": f"msg_{ref}", "type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": reply["content"], "annotations": []}]})
    items += [{"id": f"fc_{ref}_{i}", "type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
               "arguments": c["function"]["arguments"], "status": "completed"}
              for i, c in enumerate(reply.get("tool_calls", []))]
    return items


def _responses_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description", ""),
             "parameters": t["function"].get("parameters", {}), "strict": False} for t in tools or []]


def trajectory(row: dict[str, Any]) -> dict[str, Any]:
    """One export row as a NeMo Gym rollout line."""
    chats = [conversation(q, r) for q, r in zip(row["turn_requests"], row["turn_responses"])]
    output: list[dict[str, Any]] = []
    at = 0
    for i, (n_prompt, n_out) in enumerate(zip(row["turn_prompt_tokens"], row["turn_output_tokens"])):
        ref = f"{row['segment_id']}_{i}"
        chat = chats[i]
        items = _output_items(chat[1], ref) if chat else _output_items({"role": "assistant", "content": ""}, ref)
        start = at + n_prompt
        items[-1] |= {"prompt_token_ids": row["tokens"][:start],
                      "generation_token_ids": row["tokens"][start:start + n_out],
                      "generation_log_probs": row["logprobs"][start:start + n_out]}
        output += items
        at = start + n_out
        nxt = chats[i + 1] if i + 1 < len(chats) else None
        if chat and nxt:  # what the next call's request added after this reply: tool results, user turns
            output += _input_items(nxt[0][len(chat[0]) + 1:])
    first = chats[0]
    sampling = json.loads(row["turn_sampling"][0] or "{}")
    request = json.loads(row["turn_requests"][0] or "{}")
    params = {"input": _input_items(first[0]) if first else [], "tools": _responses_tools(first[2] if first else None)}
    params |= {k: sampling[s] for k, s in (("temperature", "temperature"), ("top_p", "top_p"),
                                          ("max_output_tokens", "max_tokens")) if sampling.get(s) is not None}
    return {
        "responses_create_params": params,
        "response": {"id": f"resp_{row['segment_id']}", "object": "response",
                     "created_at": row["turn_times"][-1].timestamp(), "model": request.get("model") or "",
                     "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": params["tools"]},
        "reward": row["reward"] if row["reward"] is not None else 0.0,
        "trajstore": {k: row[k] for k in ("run", "group_id", "rollout_id", "session_id", "segment_id", "status",
                                          "reward_components", "min_version", "max_version", *ESTIMATORS)},
    }


def write_trajectories(batches: Iterable[pa.RecordBatch], out: Path) -> int:
    """Write one NeMo Gym rollout line per row of every batch to `out`; the number of lines."""
    lines = 0
    with open(out, "w", encoding="utf-8") as f:
        for batch in batches:
            for row in batch.to_pylist():
                f.write(json.dumps(trajectory(row), ensure_ascii=False) + "\n")
                lines += 1
    return lines
