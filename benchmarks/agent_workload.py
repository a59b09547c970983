"""The workload of `benchmarks/proxy_agents.py` (and the benchmarks built on it): coding-agent-shaped sessions.

A session is 20-40 calls; each call resends the whole conversation so far: a system prompt and a dozen tool
schemas, the task, then every earlier reply (a short text and one tool call) with its tool result. The history
grows evenly to its context size at the 40th call (`build_workload`), or, with `step_tokens`, starts long and
grows by that many tokens a call. Every request body is built and serialized before the clock starts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from agent_upstream import CALL, MODEL, SAID

WORDS = ["def", "return", "self", "value", "index", "error", "request", "result", "config", "buffer", "stream", "token",
         "session", "segment", "append", "import", "from", "class", "async", "await", "with", "open", "path", "read",
         "write", "lock", "event", "store", "table", "batch", "commit", "fsync"]


def tool_schemas() -> list[dict[str, Any]]:
    """A dozen function tools with nested JSON schemas, about the size of a coding agent's."""
    tools = []
    for i, name in enumerate(["read_file", "write_file", "edit_file", "list_dir", "grep", "glob", "bash", "web_fetch",
                              "todo_write", "task", "notebook_edit", "ask_user"]):
        props: dict[str, Any] = {
            "path": {"type": "string", "description": f"Absolute path of the file {name} works on."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100000, "description": "How many lines at most."},
            "options": {"type": "object", "properties": {
                "mode": {"type": "string", "enum": ["fast", "exact", "regex", "literal"]},
                "flags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
                "additionalProperties": False}}
        for j in range(i % 4):
            props[f"extra_{j}"] = {"type": "boolean", "description": f"Extra switch {j} of {name}."}
        tools.append({"type": "function", "function": {
            "name": name, "description": f"Tool {name}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(40)),
            "parameters": {"type": "object", "properties": props, "required": ["path"]}}})
    return tools


def filler(rng: random.Random, chars: int) -> str:
    """Code-like text of about `chars` characters."""
    lines, size = [], 0
    while size < chars:
        line = "    " * rng.randrange(4) + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


# Every session's own text (its task and tool results) starts with this tag, numbered per session as the call is
# sent (`Workload.body`), so no two sessions send the same history: as distinct agents do, only the system
# prompt and the tool schemas are shared. `--shared-sessions` sends every session the very same bodies, as the
# sessions of one fan-out group (one task, several samples) do.
SESSION_TAG = b"[session #####]"


@dataclass
class Workload:
    """One context size: the serialized body of every call index, and the tokens of the longest prompt."""

    context: int
    bodies: list[bytes]  # call t resends the system prompt, the task and t replies with their tool results
    stream_bodies: list[bytes]
    last_prompt_tokens: int = 0
    added_tokens: float = 0.0  # tokens each call adds to the one before, on average
    shared: bool = False  # every session sends the same bodies (`SESSION_TAG` left as it is)

    def body(self, t: int, session: int, *, stream: bool = False) -> bytes:
        """Call `t`'s body as session `session` sends it: its tag numbered, unless sessions share their bodies."""
        raw = (self.stream_bodies if stream else self.bodies)[t]
        return raw if self.shared else raw.replace(SESSION_TAG, b"[session %05d]" % session)


def build_workload(tok: Any, context: int, max_turns: int, max_tokens: int, seed: int = 0,
                   step_tokens: int | None = None, shared: bool = False) -> Workload:
    """Bodies growing evenly to `context` tokens at call `max_turns` (a tenth of it in the system prompt); with
    `step_tokens`, every call adds about that many tokens and the task holds the rest (a session that starts
    from a long history of its own, as a resumed or forked agent does). `shared`: see `SESSION_TAG`."""
    rng = random.Random(seed)
    sample = filler(rng, 20000)
    chars_per_token = len(sample) / len(tok.encode(sample, add_special_tokens=False))
    tools = tool_schemas()
    tag = SESSION_TAG.decode()
    system = "You are a coding agent. Use the tools to inspect and change the repository.\n"
    task = f"{tag} Fix the failing test in src/app.py."
    if step_tokens is None:
        system += filler(rng, int(0.1 * context * chars_per_token))
    else:
        task += " What was done so far:\n" + filler(rng, int(max(0.0, context - step_tokens * max_turns) * chars_per_token))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    base = len(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)) \
        / chars_per_token
    step = (context - base) / max_turns if step_tokens is None else step_tokens
    step_chars = max(1, int(step * chars_per_token))
    bodies, streams = [], []
    for t in range(max_turns):
        if t:
            messages.append({"role": "assistant", "content": SAID, "tool_calls": [{
                "id": f"call_{t}", "type": "function",
                "function": {"name": CALL["name"], "arguments": json.dumps(CALL["arguments"])}}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{t}",
                             "content": f"{tag} " + filler(rng, step_chars)})
        body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": max_tokens}
        bodies.append(json.dumps(body).encode())
        streams.append(json.dumps({**body, "stream": True}).encode())
    last = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    last_tokens = len(tok.encode(last, add_special_tokens=False))
    return Workload(context, bodies, streams, last_tokens, (last_tokens - base) / max(1, max_turns - 1), shared)


def hog_body(megabytes: float, max_tokens: int) -> bytes:
    """One call whose conversation is `megabytes` of text: a rollout pasting a huge file or log."""
    rng = random.Random(7)
    big = filler(rng, int(megabytes * 1e6))
    return json.dumps({"model": MODEL, "max_tokens": max_tokens, "stream": True, "messages": [
        {"role": "user", "content": "Summarize this log:\n" + big}]}).encode()
