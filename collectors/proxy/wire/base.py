"""The one interface every wire protocol of the capture proxy implements. Pure.

An adapter turns its protocol's request body into a `ChatRequest`, and a `ChatReply` into
its protocol's response, stream and error bodies. The proxy's routes and the capture core
only ever see these two types and this interface; adding a protocol is adding an adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from collectors.proxy.chat import ChatError, ChatReply, ChatRequest


class WireProtocol(Protocol):
    """One chat API on the wire (OpenAI Chat Completions, Anthropic Messages)."""

    name: str  # recorded in each turn's meta: "openai" | "anthropic"
    path: str  # the route under a base URL, e.g. "/v1/chat/completions"
    reply_prefix: str  # id prefix of a reply ("chatcmpl-", "msg_")
    call_prefix: str  # id prefix of a tool call ("call_", "toolu_")

    def parse_request(self, body: Any, raw_arguments: Mapping[str, str]) -> ChatRequest:
        """Validate a decoded body; every problem is named in one `ChatError` (400).

        `raw_arguments` maps the rollout's tool-call ids to the exact JSON text the model
        sampled, for protocols that send arguments back as objects."""
        ...

    def response(self, reply: ChatReply) -> dict[str, Any]:
        """The non-streamed response body."""
        ...

    def stream_body(self, reply: ChatReply, options: Mapping[str, Any]) -> bytes:
        """The whole server-sent-events body of a streamed reply."""
        ...

    def error_body(self, err: ChatError) -> dict[str, Any]:
        """The protocol's error shape."""
        ...
