"""The one interface every wire protocol of the capture proxy implements. Pure.

An adapter turns its protocol's request body into a `ChatRequest`, and a `ChatReply` into
its protocol's response, stream and error bodies. The proxy's routes and the capture core
only ever see these two types and this interface; adding a protocol is adding an adapter.

A stream is written while the reply is sampled: `stream_writer(head, options)` gets the reply's
head (a `ChatReply` with its id, model, prompt tokens and trajstore info, nothing sampled yet)
and returns a `StreamWriter` that turns the pieces of `collectors.proxy.streaming` into the
protocol's server-sent events, then closes the stream with the final reply (or an error).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from collectors.proxy.chat import ChatError, ChatReply, ChatRequest


def event_data(value: Any) -> str:
    """The JSON of a streamed event's `data:` line: orjson's (text as UTF-8, one line; a token's event in a tenth
    of the standard library's time, and a stream sends one per token), the standard library's for what orjson
    refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False)

Event = tuple[Any, ...]  # ("reasoning" | "content", text) or ("tool_call", index, ToolCall)


class StreamWriter(Protocol):
    """The server-sent events of one streamed reply, in order: `start`, pieces, then `finish` or `error`."""

    def start(self) -> bytes:
        ...

    def piece(self, event: Event) -> bytes:
        """Reasoning or content text, or one whole tool call."""
        ...

    def tokens(self, texts: list[str], logprobs: list[float], top: list[dict[str, float]] | None) -> bytes:
        """Logprobs of tokens sampled since the last call (protocols without logprobs write nothing)."""
        ...

    def finish(self, reply: ChatReply) -> bytes:
        ...

    def error(self, err: ChatError) -> bytes:
        """Ends a stream that cannot be completed (the upstream failed after the stream started)."""
        ...


class WireProtocol(Protocol):
    """One chat API on the wire (OpenAI Chat Completions, Anthropic Messages, OpenAI Responses)."""

    name: str  # recorded in each turn's meta: "openai" | "anthropic" | "responses"
    conversation: str  # the body's conversation list, resent whole each call ("messages", "input"): stored as a delta
    path: str  # the route under a base URL, e.g. "/v1/chat/completions"
    count_path: str | None  # the route that counts a request's input tokens, if the protocol has one
    reply_prefix: str  # id prefix of a reply ("chatcmpl-", "msg_", "resp_")
    call_prefix: str  # id prefix of a tool call ("call_", "toolu_")

    def parse_request(self, body: Any) -> ChatRequest:
        """Validate a decoded body; every problem is named in one `ChatError` (400)."""
        ...

    def parse_count(self, body: Any) -> ChatRequest:
        """Validate a body sent to `count_path`."""
        ...

    def response(self, reply: ChatReply, options: Mapping[str, Any]) -> dict[str, Any]:
        """The non-streamed response body (`options`: the request's, see `ChatRequest.options`)."""
        ...

    def stream_writer(self, head: ChatReply, options: Mapping[str, Any]) -> StreamWriter:
        ...

    def count_response(self, tokens: int) -> dict[str, Any]:
        """The body answering `count_path` for a request whose prompt is `tokens` tokens."""
        ...

    def error_body(self, err: ChatError) -> dict[str, Any]:
        """The protocol's error shape."""
        ...


def stream_body(wire: WireProtocol, reply: ChatReply, options: Mapping[str, Any]) -> bytes:
    """The whole stream of a reply known in full (a reply with nothing sampled; tests)."""
    head = dataclasses.replace(reply, content="", reasoning=None, tool_calls=(), output_ids=[], output_logprobs=[],
                               token_texts=[], top_logprobs=None)
    writer = wire.stream_writer(head, options)
    parts = [writer.start()]
    if reply.reasoning:
        parts.append(writer.piece(("reasoning", reply.reasoning)))
    if reply.content:
        parts.append(writer.piece(("content", reply.content)))
    parts.extend(writer.piece(("tool_call", i, c)) for i, c in enumerate(reply.tool_calls))
    if reply.token_texts:
        parts.append(writer.tokens(reply.token_texts, reply.output_logprobs, reply.top_logprobs))
    parts.append(writer.finish(reply))
    return b"".join(parts)
