"""Turn the request/response JSON a collector stored into chat messages, whatever wire protocol it spoke.

The capture proxy stores each model call's request and response as the agent sent and
received them: OpenAI Chat Completions, Anthropic Messages or OpenAI Responses. Exports
speak one form, OpenAI chat messages (what TRL's SFT trainer and chat templates read):

- `{"role": "system" | "user" | "assistant" | "tool", "content": str}`;
- an assistant's tool calls as `tool_calls: [{"id", "type": "function", "function": {"name",
  "arguments": JSON text}}]` (Anthropic `tool_use` blocks and Responses `function_call` items
  become these), and each tool result as a `{"role": "tool", "tool_call_id", "content"}`
  message (Anthropic `tool_result` blocks, Responses `function_call_output` items);
- the request's tool definitions as `[{"type": "function", "function": {"name", "description",
  "parameters"}}]`.

Content made of several text parts is joined into one string; parts that are not text (images)
and reasoning (`thinking` blocks, `reasoning_content`) are dropped: exports carry what the agent
said and called. A turn with no request or response JSON (events written
without them) has no conversation: `None`.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


def _text(content: Any) -> str:
    """A content value (a string or a list of parts) as one string of its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and "text" in p)]
        return "".join(parts)
    return str(content)


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _openai_message(message: dict[str, Any]) -> Message:
    out: Message = {"role": message["role"], "content": _text(message.get("content"))}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _anthropic_messages(message: dict[str, Any]) -> list[Message]:
    """One Anthropic message as chat messages: tool results become tool messages of their own."""
    content = message.get("content")
    if not isinstance(content, list):
        return [{"role": message["role"], "content": _text(content)}]
    text, calls, results = [], [], []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(_call(block["id"], block["name"], block.get("input", {})))
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _text(block.get("content"))})
    out: list[Message] = results
    if text or calls or not results:
        msg: Message = {"role": message["role"], "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out = [*results, msg]
    return out


def _responses_items(items: Any) -> list[Message]:
    """Responses API input or output items as chat messages (function calls join the assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    for item in items or []:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item["role"]
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(_call(item["call_id"], item["name"], item.get("arguments", "")))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"))})
    return out


def _tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = []
    for tool in request.get("tools") or []:
        if tool.get("type") == "function" and "function" in tool:
            tools.append(tool)  # already chat form
        elif "input_schema" in tool or tool.get("type") == "function":
            tools.append({"type": "function", "function": {
                "name": tool["name"], "description": tool.get("description", ""),
                "parameters": tool.get("input_schema", tool.get("parameters", {}))}})
    return tools or None


def request_messages(request: dict[str, Any]) -> list[Message]:
    """The conversation a request sent, as chat messages."""
    if "input" in request or "instructions" in request:  # OpenAI Responses
        system = [{"role": "system", "content": request["instructions"]}] if request.get("instructions") else []
        return system + _responses_items(request.get("input"))
    messages = request.get("messages") or []
    if "system" in request or any(isinstance(m.get("content"), list) and any(
            isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in m["content"])
            for m in messages):  # Anthropic Messages
        system = [{"role": "system", "content": _text(request["system"])}] if request.get("system") else []
        return system + [m for message in messages for m in _anthropic_messages(message)]
    return [_openai_message(m) for m in messages]


def reply_message(response: dict[str, Any]) -> Message | None:
    """The assistant message a response carried, as one chat message (None when it carried none)."""
    if "choices" in response:  # OpenAI Chat Completions
        choices = response["choices"]
        return _openai_message({"role": "assistant", **choices[0]["message"]}) if choices else None
    if "output" in response:  # OpenAI Responses
        items = _responses_items(response["output"])
        return items[0] if items else None
    if "content" in response:  # Anthropic Messages
        return _anthropic_messages({"role": "assistant", "content": response["content"]})[-1]
    return None


def conversation(request_json: str | None, response_json: str | None
                 ) -> tuple[list[Message], Message, list[dict[str, Any]] | None] | None:
    """(the request's messages, the reply, the request's tools) of one stored turn, or None when the
    turn was stored without request or response JSON."""
    if request_json is None or response_json is None:
        return None
    request, response = json.loads(request_json), json.loads(response_json)
    if not isinstance(request, dict) or not isinstance(response, dict):
        return None
    reply = reply_message(response)
    return None if reply is None else (request_messages(request), reply, _tools(request))
