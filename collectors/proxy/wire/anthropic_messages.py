"""Anthropic Messages on the wire: request validation and translation, responses, SSE, errors. Pure.

Shapes follow the `anthropic` SDK's own types (`anthropic.types`: Message, Usage, TextBlock,
ToolUseBlock, ThinkingBlock, RawMessageStartEvent, RawContentBlockStartEvent,
RawContentBlockDeltaEvent with TextDelta / InputJSONDelta / ThinkingDelta,
RawMessageDeltaEvent, RawMessageStopEvent):

- request: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages`
  whose content is a string or blocks (text; tool_use and thinking in assistant turns;
  tool_result in user turns, which become the template's tool messages; `system` messages,
  which the current API and Claude Code send between turns, stay system messages in place),
  `tools` (custom tools with an `input_schema` that is a valid JSON Schema of an object),
  `tool_choice` (auto | any | tool | none; only none changes anything, nothing constrains
  sampling), `temperature`, `top_p`, `top_k`, `stop_sequences`, `stream`, and `seed` as an
  extension. A final assistant message is a prefill: the reply continues it. Images,
  documents and server tools are refused; `metadata`, `thinking`, `context_management`,
  `output_config`, `cache_control` and other fields are accepted and not applied.
- tool_use `input` comes back as an object; the template writes it as JSON, and
  `collectors.proxy.reconcile` renders the sampled text in its place when it is unchanged.
- response: a `message` with thinking / text / tool_use blocks, `stop_reason` (end_turn,
  max_tokens, stop_sequence, tool_use), `usage` and a `trajstore` extra.
- stream: message_start, then content blocks opened as the reply is sampled (thinking and
  text deltas as they come, each tool_use whole), message_delta with the stop reason and
  usage, message_stop; a failure after the stream started is an `error` event.
- count_tokens (`/v1/messages/count_tokens`): `{"input_tokens": N}`, the rendered prompt's tokens.
- errors: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from collectors.proxy.chat import (
    ChatError,
    ChatReply,
    ChatRequest,
    Message,
    Problems,
    start_request,
    template_tools,
)
from collectors.proxy.wire.base import Event, event_data

PROTOCOL = "anthropic"
CALL_ID_PREFIX = "toolu_"
REPLY_ID_PREFIX = "msg_"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _blocks(content: Any, where: str, problems: Problems) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    problems.add(where, f"{where} must be a string or a list of content blocks")
    return []


def _text(block: dict[str, Any], key: str, where: str, problems: Problems) -> str:
    """A text-bearing block's `key` (text, thinking) as a string; anything else is a problem, not a 500."""
    value = block.get(key, "")
    if not isinstance(value, str):
        problems.add(where, f"{where}.{key} must be a string, got {type(value).__name__}")
        return ""
    return value


def _result_text(content: Any, where: str, problems: Problems) -> str:
    if content is None:
        return ""
    blocks = _blocks(content, where, problems)
    for i, b in enumerate(blocks):
        if b.get("type") != "text":
            problems.add(where, f"{where}[{i}] has type {b.get('type')!r}: only text tool results are supported")
    return "".join(_text(b, "text", f"{where}[{i}]", problems) for i, b in enumerate(blocks) if b.get("type") == "text")


def _assistant(blocks: list[dict[str, Any]], where: str, problems: Problems) -> Message:
    texts, thoughts, calls = [], [], []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            texts.append(_text(b, "text", f"{where}[{i}]", problems))
        elif kind == "thinking":
            thoughts.append(_text(b, "thinking", f"{where}[{i}]", problems))
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
                problems.add(where, f"{where}[{i}] tool_use needs a string `name` and an object `input`")
                continue
            calls.append({"type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind != "redacted_thinking":
            problems.add(where, f"{where}[{i}] has type {kind!r}, which an assistant turn cannot hold here")
    msg: Message = {"role": "assistant", "content": "".join(texts) or None}
    if any(thoughts):
        msg["reasoning_content"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict[str, Any]], where: str, problems: Problems) -> list[Message]:
    """Tool results become tool messages (first, as the API requires them first); text a user message."""
    results, texts = [], []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            texts.append(_text(b, "text", f"{where}[{i}]", problems))
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _result_text(b.get("content"), f"{where}[{i}].content", problems)})
        else:
            problems.add(where, f"{where}[{i}] has type {kind!r}: only text and tool_result blocks are supported "
                                "by this text-only policy")
    if texts or not results:
        results.append({"role": "user", "content": "".join(texts)})
    return results


def _system(content: Any, where: str, problems: Problems) -> Message:
    blocks = _blocks(content, where, problems)
    if any(b.get("type") != "text" for b in blocks):
        problems.add(where, f"`{where}` blocks must be text blocks")
    return {"role": "system", "content": "".join(_text(b, "text", f"{where}[{i}]", problems)
                                                 for i, b in enumerate(blocks))}


def translate_messages(system: Any, messages: Any, problems: Problems) -> list[Message]:
    out: list[Message] = []
    if system is not None:
        out.append(_system(system, "system", problems))
    if not isinstance(messages, list) or not messages:
        problems.add("messages", "`messages` must be a non-empty list of {\"role\", \"content\"} messages")
        return out
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            problems.add(where, f"{where}.role must be user, assistant or system, got {role!r}")
            continue
        if role == "system":
            out.append(_system(m.get("content"), f"{where}.content", problems))
            continue
        blocks = _blocks(m.get("content"), f"{where}.content", problems)
        if role == "assistant":
            out.append(_assistant(blocks, f"{where}.content", problems))
        else:
            out.extend(_user(blocks, f"{where}.content", problems))
    return out


def translate_tools(tools: Any, problems: Problems) -> list[dict[str, Any]] | None:
    return template_tools(
        tools, problems,
        lambda t, where: (t.get("name"), t.get("description"), t.get("input_schema"), where)
        if t.get("type") in (None, "custom") else None,
        lambda where, kind: f"{where} has type {kind!r}: only custom tools with an input_schema are supported",
        "input_schema", protocol=PROTOCOL, schema_required=True)


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None, problems: Problems) -> bool:
    if choice is None:
        return True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        names = {t["function"]["name"] for t in tools or []}
        if choice.get("name") not in names:
            problems.add("tool_choice", f"tool_choice names tool {choice.get('name')!r}, which is not in `tools`")
    elif kind not in ("auto", "any", "none"):
        problems.add("tool_choice", f"`tool_choice.type` must be auto, any, tool or none, got {choice!r}")
    return kind != "none"


def parse_count(body: Any) -> ChatRequest:
    """Validate a `/v1/messages/count_tokens` body: a messages request without `max_tokens`."""
    return parse_request({"max_tokens": 1, **body} if isinstance(body, dict) else body)


def parse_request(body: Any) -> ChatRequest:
    """Validate a decoded `/v1/messages` body; every problem is named in one 400."""
    p, model = start_request(body)
    if body.get("max_tokens") is None:
        p.add("max_tokens", "`max_tokens` is required: the most tokens to sample, e.g. 1024")
    max_tokens = p.integer(body, "max_tokens", 0, None)  # 0: Anthropic's prompt-cache warm-up, nothing sampled
    messages = translate_messages(body.get("system"), body.get("messages"), p)
    tools = translate_tools(body.get("tools"), p)
    parse_tools = _tool_choice(body.get("tool_choice"), tools, p)
    sampling = p.sampling(body, temperature_max=1.0, top_k_low=0)
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        p.add("stop_sequences", f"`stop_sequences` must be a list of non-empty strings, got {stops!r}")
        stops = []
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        p.add("stream", f"`stream` must be true or false, got {stream!r}")
    p.raise_any()
    return ChatRequest(
        protocol=PROTOCOL, model=model, messages=messages, tools=tools, parse_tools=parse_tools,
        max_tokens=max_tokens, sampling=dataclasses.replace(sampling, stop=tuple(stops)), stream=bool(stream),
        continue_final=messages[-1]["role"] == "assistant")


def stop_reason(reply: ChatReply) -> str:
    return "stop_sequence" if reply.stop_sequence else STOP_REASONS.get(reply.finish, "end_turn")


def content_blocks(reply: ChatReply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    blocks.extend({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in reply.tool_calls)
    return blocks


def _usage(reply: ChatReply) -> dict[str, Any]:
    return {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def response(reply: ChatReply, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `message` body."""
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model,
            "content": content_blocks(reply), "stop_reason": stop_reason(reply), "stop_sequence": reply.stop_sequence,
            "usage": _usage(reply), "trajstore": reply.trajstore}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {event_data({'type': name, **data})}\n\n"


class EventWriter:
    """The message event stream of one reply (see the module docstring)."""

    def __init__(self, head: ChatReply, options: Mapping[str, Any] | None = None) -> None:
        self.head = head
        self.index = -1  # of the open content block
        self.open: str | None = None  # its type
        self.text_block = False

    def start(self) -> bytes:
        h = self.head
        message = {"id": h.id, "type": "message", "role": "assistant", "model": h.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {**_usage(h), "output_tokens": 0}}
        return _event("message_start", {"message": message}).encode()

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _event("content_block_stop", {"index": self.index})

    def _block(self, kind: str, block: dict[str, Any]) -> str:
        out = self._close()
        self.index += 1
        self.open = kind
        self.text_block = self.text_block or kind == "text"
        return out + _event("content_block_start", {"index": self.index, "content_block": block})

    def piece(self, event: Event) -> bytes:
        kind = event[0]
        out = ""
        if kind == "reasoning":
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out += _event("content_block_delta", {"index": self.index,
                                                  "delta": {"type": "thinking_delta", "thinking": event[1]}})
        elif kind == "content":
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out += _event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta",
                                                                                 "text": event[1]}})
        else:
            call = event[2]
            out += self._block("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            out += _event("content_block_delta", {"index": self.index, "delta": {"type": "input_json_delta",
                                                                                 "partial_json": call.arguments}})
            out += self._close()
        return out.encode()

    def tokens(self, texts: list[str], logprobs: list[float], top: list[dict[str, float]] | None) -> bytes:
        return b""  # the Messages API has no logprobs

    def finish(self, reply: ChatReply) -> bytes:
        out = self._close()
        if not self.text_block and not reply.tool_calls:  # as `content_blocks`: a reply always has a text block
            out += self._block("text", {"type": "text", "text": ""}) + self._close()
        out += _event("message_delta", {"delta": {"stop_reason": stop_reason(reply),
                                                  "stop_sequence": reply.stop_sequence},
                                        "usage": {"output_tokens": reply.completion_tokens},
                                        "trajstore": reply.trajstore})
        return (out + _event("message_stop", {})).encode()

    def error(self, err: ChatError) -> bytes:
        return _event("error", {"error": error_body(err)["error"]}).encode()


_ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
                "permission": "permission_error",
                "not_found": "not_found_error", "conflict": "invalid_request_error", "upstream": "api_error",
                "internal": "api_error"}


def error_body(err: ChatError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.kind, "api_error"), "message": err.message}}


class AnthropicMessages:
    """Anthropic Messages behind `collectors.proxy.wire.base.WireProtocol`."""

    name = PROTOCOL
    conversation = "messages"  # the list each call resends whole (a turn may store it as a delta)
    path = "/v1/messages"
    count_path = "/v1/messages/count_tokens"
    reply_prefix = REPLY_ID_PREFIX
    call_prefix = CALL_ID_PREFIX
    parse_request = staticmethod(parse_request)
    parse_count = staticmethod(parse_count)
    response = staticmethod(response)
    stream_writer = EventWriter
    error_body = staticmethod(error_body)

    @staticmethod
    def count_response(tokens: int) -> dict[str, Any]:
        return {"input_tokens": tokens}
