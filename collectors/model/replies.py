"""Reading the model's reply back from a stored response: its text and its tool calls. Pure.

A turn's `response` is what the proxy answered the agent (an OpenAI chat completion or an
Anthropic message); replay and re-scoring read the calls and the text from it, whichever wire
it was.
"""

from __future__ import annotations

import json
from typing import Any

from collectors.model.toolcalls import ToolCall


def _message(response: Any) -> dict[str, Any] | None:
    """The assistant message of a stored response: OpenAI's first choice's message, else the response itself."""
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    return response


def _decoded(arguments: Any) -> tuple[str, dict[str, Any]]:
    """(JSON text, object) of arguments sent as text (OpenAI) or as an object (Anthropic)."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments, {}
        return arguments, value if isinstance(value, dict) else {}
    value = arguments if isinstance(arguments, dict) else {}
    return json.dumps(value, ensure_ascii=False), value


def response_calls(response: Any) -> list[ToolCall]:
    """Tool calls of a stored response: OpenAI `tool_calls` or Anthropic `tool_use` blocks."""
    message = _message(response)
    if message is None:
        return []
    calls: list[ToolCall] = []
    listed = message.get("tool_calls")
    for call in listed if isinstance(listed, list) else []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            text, value = _decoded(fn.get("arguments", {}))
            calls.append(ToolCall(fn["name"], text, value, call.get("id")))
    content = message.get("content")
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use" and isinstance(block.get("name"), str):
            text, value = _decoded(block.get("input", {}))
            calls.append(ToolCall(block["name"], text, value, block.get("id")))
    return calls


def response_text(response: Any) -> str:
    """The assistant text of a stored response (OpenAI message content, or Anthropic text blocks)."""
    body = json.loads(response) if isinstance(response, str) else response
    message = _message(body)
    content = message.get("content") if message is not None else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""

