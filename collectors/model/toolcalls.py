"""The model's tool-call text formats: the one `ToolCall` type, its writer and its parsers. Pure.

`parse_output` splits a sampled assistant text into reasoning, content and tool calls in one
of `FORMATS` (the model family's, `detect_format` reads it from a chat template);
`render_call` writes one Hermes call block the way the chat template does. Reading calls back
from a stored response (the proxy's answer, not the model's text) is
`collectors.model.replies`.

- hermes (Qwen2.5, Hermes; the default), below;
- llama3 (Llama 3.x JSON calls), as vLLM's `llama3_json` parser reads them: a reply that
  starts with `{` (after an optional `<|python_tag|>`) and is one JSON object, or several
  joined by `;`, each with a string `name` and an object `parameters` (or `arguments`), is
  tool calls; anything else is content. A call written exactly as the template writes it
  (`{"name": "N", "parameters": ARGS}`) keeps ARGS as the model's own JSON text. No reasoning;
- harmony (gpt-oss): channels and recipients, read by `openai-harmony`'s parser
  (`collectors.model.harmony`).

The Hermes format is the one `collectors.model.chat_template` renders:

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

FORMATS = ("hermes", "llama3", "harmony")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PYTHON_TAG = "<|python_tag|>"
_LLAMA3_CANONICAL = re.compile(r'\A\{"name": "([^"\\]*)", "parameters": (.*)\}\Z', re.DOTALL)
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
    args = _arguments_object(obj.get("arguments", {}))
    if args is None:
        return None
    canonical = _CANONICAL.match(body)
    raw = canonical.group(2) if canonical and canonical.group(1) == obj["name"] else None
    return ToolCall(obj["name"], _kept(raw, args), args)


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template writes: harmony, llama3, or hermes (also when unknown)."""
    template = template or ""
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return "llama3"
    return "hermes"


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}")
    return name


def _arguments_object(args: Any) -> dict[str, Any] | None:
    """Arguments as an object: an object, or a JSON string holding one; None otherwise."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


def _kept(raw: str | None, args: dict[str, Any]) -> str:
    """The model's own arguments text `raw` when it means `args`, else a re-serialization."""
    try:
        if raw is not None and json.loads(raw) == args:
            return raw
    except json.JSONDecodeError:
        pass
    return json.dumps(args, ensure_ascii=False)


def _llama3_calls(body: str) -> list[ToolCall] | None:
    """JSON call objects joined by `;` filling all of `body`, or None when it is anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(body) - len(body[at:].lstrip())
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        params = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else None
        args = _arguments_object(params)
        if args is None or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        canonical = _LLAMA3_CANONICAL.match(body[at:end])
        raw = canonical.group(2) if canonical and canonical.group(1) == obj["name"] else None
        calls.append(ToolCall(obj["name"], _kept(raw, args), args))
        rest = body[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(body) - len(rest) + 1


def _parse_llama3(text: str, parse_tools: bool) -> ParsedOutput:
    body = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
    calls = _llama3_calls(body) if parse_tools and body.lstrip().startswith("{") else None
    return ParsedOutput("", None, tuple(calls)) if calls else ParsedOutput(text, None, ())


def _parse_harmony(text: str, parse_tools: bool) -> ParsedOutput:
    from collectors.model.harmony import parse_harmony  # loads openai-harmony and its vocabulary

    reasoning, content, raw_calls = parse_harmony(text, parse_tools)
    calls = []
    for name, raw in raw_calls:
        args = _arguments_object(raw)
        if args is None:  # not a JSON object: what the model wrote stays visible, as text
            content = f"{content}\n\n{raw}" if content else raw
            continue
        calls.append(ToolCall(name, _kept(raw, args), args))
    return ParsedOutput(content, reasoning, tuple(calls))


def parse_output(text: str, *, parse_tools: bool = True, fmt: str = "hermes") -> ParsedOutput:
    """Split sampled text into reasoning, content and tool calls in format `fmt` (see the module docstring)."""
    if fmt == "llama3":
        return _parse_llama3(text, parse_tools)
    if fmt == "harmony":
        return _parse_harmony(text, parse_tools)
    reasoning, rest = split_reasoning(text)
    blocks = list(_BLOCK.finditer(rest)) if parse_tools else []
    calls = [parse_call(m.group(1)) for m in blocks]
    if not blocks or any(c is None for c in calls):
        return ParsedOutput(rest, reasoning, ())
    content = rest[:blocks[0].start()]
    content = content[:-1] if content.endswith("\n") else content
    return ParsedOutput(content, reasoning, tuple(c for c in calls if c is not None))
