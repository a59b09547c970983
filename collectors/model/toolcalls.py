"""The model's tool-call text format: the one `ToolCall` type, its one writer and its one parser. Pure.

`parse_output` splits a sampled assistant text (Hermes / Qwen format) into reasoning, content
and tool calls; `render_call` writes one call block the way the chat template does. Reading
calls back from a stored response (the proxy's answer, not the model's text) is
`collectors.model.replies`.

The format is the one `collectors.model.chat_template` renders:

    <think>\\n{reasoning}\\n</think>\\n\\n{content}\\n<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>

Rules, chosen so that the template re-renders a parsed reply to exactly the sampled text
whenever the model followed the format (a later prompt then extends the session's tokens and
the segment continues, see `collectors.proxy.segmenter`):

- reasoning: only when the text starts with `<think>`; one newline is taken off each end of
  the reasoning and up to two after `</think>`; a think block never closed (the reply was cut
  by max_tokens while thinking) is all reasoning, as vLLM's DeepSeek-R1 parser reads it, so a
  streamed thought never turns into content at the end;
- content: the text before the first complete `<tool_call>...</tool_call>` block, without the
  one newline the template writes between content and a call;
- tool calls: every complete block whose body is a JSON object with a string `name` and an
  object `arguments` (or a JSON string holding one). `arguments` keeps the model's own
  JSON text when the block is written exactly as the template writes it, so re-rendering
  reproduces it byte for byte; otherwise it is re-serialized (and the session forks with
  reason template drift on its next turn, which is what the fork counter is for);
- like vLLM's Hermes parser, when any block is not valid JSON, no call is parsed and the whole
  text (after reasoning) is content; text after the last block is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# A block exactly as the chat template writes it; group 2 is the model's raw arguments JSON.
_CANONICAL = re.compile(r'\A\n\{"name": "([^"\\]*)", "arguments": (.*)\}\n\Z', re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One tool call: `arguments` is JSON text (what OpenAI sends), `input` the decoded object (Anthropic).

    `id` is the id the agent was answered with (None for a call parsed from text)."""

    name: str
    arguments: str
    input: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """One call block as the chat template writes it for an object `arguments` (JSON with ASCII escapes)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """`<think>\\nR\\n</think>\\n\\nC` -> (R, C); `<think>\\nR` never closed (cut by max_tokens) -> (R, "");
    text without a leading `<think>` -> (None, text)."""
    if not text.startswith(THINK_OPEN):
        return None, text
    end = text.find(THINK_CLOSE)
    if end < 0:
        reasoning = text[len(THINK_OPEN):]
        return (reasoning[1:] if reasoning.startswith("\n") else reasoning), ""
    reasoning = text[len(THINK_OPEN):end]
    reasoning = reasoning[1:] if reasoning.startswith("\n") else reasoning
    reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
    rest = text[end + len(THINK_CLOSE):]
    for _ in range(2):
        rest = rest[1:] if rest.startswith("\n") else rest
    return reasoning, rest


def parse_call(body: str) -> ToolCall | None:
    """The body of one `<tool_call>` block, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    canonical = _CANONICAL.match(body)
    if canonical and canonical.group(1) == obj["name"]:
        raw = canonical.group(2)
        try:
            if json.loads(raw) == args:
                return ToolCall(obj["name"], raw, args)
        except json.JSONDecodeError:
            pass
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), args)


def parse_output(text: str, *, parse_tools: bool = True) -> ParsedOutput:
    """Split sampled text into reasoning, content and tool calls (see the module docstring)."""
    reasoning, rest = split_reasoning(text)
    blocks = list(_BLOCK.finditer(rest)) if parse_tools else []
    calls = [parse_call(m.group(1)) for m in blocks]
    if not blocks or any(c is None for c in calls):
        return ParsedOutput(rest, reasoning, ())
    content = rest[:blocks[0].start()]
    content = content[:-1] if content.endswith("\n") else content
    return ParsedOutput(content, reasoning, tuple(c for c in calls if c is not None))
