"""OpenAI Chat Completions on the wire: request validation and translation, responses, SSE, errors. Pure.

Shapes follow the `openai` SDK's own types (`openai.types.chat`: ChatCompletion,
ChatCompletionChunk, ChoiceDeltaToolCall, CompletionUsage) and vLLM's extensions:

- request: `model`, `messages` (system / developer / user / assistant with `tool_calls` and
  optional `reasoning_content` or `reasoning` / tool), `tools` (function tools; `parameters`
  must be a valid JSON Schema of an object), `tool_choice` (none | auto | required | a named
  function; only `none` changes anything: no sampling is constrained, so required and named
  choices sample like auto), `temperature`, `top_p`, `top_k` (vLLM), `max_tokens` /
  `max_completion_tokens`, `stop`, `seed`, `stream`, `stream_options.include_usage`,
  `logprobs`. `n` > 1 and non-text content parts are refused; penalties, `response_format`
  and other fields are accepted and not applied (the stored request keeps them).
- response: `chat.completion` with `message.tool_calls` (arguments are the model's JSON text),
  `message.reasoning_content` (vLLM's field) when the model thought, `usage`, and a
  `trajstore` object (rollout, segment, turn, policy version) that SDKs keep as an extra.
- stream: one complete body of `chat.completion.chunk` events (role, reasoning, content,
  then per tool call a delta with id and name and one with the arguments), a final chunk
  with `finish_reason`, a usage chunk with empty `choices` when asked, then `data: [DONE]`.
- errors: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from collectors.proxy.chat import ChatError, ChatReply, ChatRequest, Message, Problems, template_tool

PROTOCOL = "openai"
CALL_ID_PREFIX = "call_"
REPLY_ID_PREFIX = "chatcmpl-"
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str, problems: Problems, *, nullable: bool = False) -> str | None:
    """A message content (a string or a list of text parts) as text."""
    if content is None:
        if not nullable:
            problems.add(where, f"{where} is required")
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "refusal") and isinstance(part.get(kind), str):
                parts.append(part[kind])
            else:
                problems.add(where, f"{where}[{i}] has type {kind!r}: only text parts are supported by this "
                                    "text-only policy")
        return "".join(parts)
    problems.add(where, f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    return None


def _tool_calls(calls: Any, where: str, problems: Problems) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        problems.add(where, f"{where} must be a list of tool calls")
        return []
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name, args = (fn.get("name"), fn.get("arguments")) if isinstance(fn, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(args, (str, dict)):
            problems.add(where, f'{where}[{i}] must be {{"id": ..., "type": "function", "function": '
                                '{"name": str, "arguments": JSON text}}')
            continue
        out.append({"type": "function", "function": {"name": name, "arguments": args}})
    return out


def translate_messages(messages: Any, problems: Problems) -> list[Message]:
    """OpenAI messages -> template messages."""
    if not isinstance(messages, list) or not messages:
        problems.add("messages", "`messages` must be a non-empty list of chat messages")
        return []
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            problems.add(where, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
            continue
        if role == "assistant":
            msg: Message = {"role": "assistant",
                            "content": _text(m.get("content"), f"{where}.content", problems, nullable=True)}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls", problems)
            if m.get("function_call"):
                problems.add(where, f"{where}.function_call is the deprecated format; send tool_calls")
        elif role == "tool":
            msg = {"role": "tool", "content": _text(m.get("content"), f"{where}.content", problems),
                   "tool_call_id": m.get("tool_call_id")}
        else:
            msg = {"role": "system" if role == "developer" else role,
                   "content": _text(m.get("content"), f"{where}.content", problems)}
        out.append(msg)
    return out


def translate_tools(tools: Any, problems: Problems) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        problems.add("tools", "`tools` must be a list of function tools")
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            problems.add(where, f'{where} must be {{"type": "function", "function": {{"name", "description", '
                                '"parameters"}}}} (custom tools are not supported)')
            continue
        out.append(template_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), problems,
                                 f"{where}.function", "parameters"))
    return out or None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None, problems: Problems) -> bool:
    """Whether tool calls are parsed out of the reply."""
    names = {t["function"]["name"] for t in tools or []}
    if choice is None or choice in ("auto", "required"):
        return True
    if choice == "none":
        return False
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            problems.add("tool_choice", f"tool_choice names function {name!r}, which is not in `tools` "
                                        f"({', '.join(sorted(names)) or 'none given'})")
        return True
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return True
    problems.add("tool_choice", f'`tool_choice` must be "none", "auto", "required" or a named function, got {choice!r}')
    return True


def parse_request(body: Any, raw_arguments: Mapping[str, str] | None = None) -> ChatRequest:
    """Validate a decoded `/v1/chat/completions` body; every problem is named in one 400.

    `raw_arguments` is unused: OpenAI agents send tool-call arguments back as the JSON text they got.
    """
    if not isinstance(body, dict):
        raise ChatError(f"the request body must be a JSON object, not {type(body).__name__}")
    p = Problems()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        p.add("model", "`model` is required: the served model's name (see GET /v1/models)")
    messages = translate_messages(body.get("messages"), p)
    tools = translate_tools(body.get("tools"), p)
    parse_tools = _tool_choice(body.get("tool_choice"), tools, p)
    max_tokens = p.integer(body, "max_completion_tokens", 1, None)
    if max_tokens is None:
        max_tokens = p.integer(body, "max_tokens", 1, None)
    sampling = p.sampling(body, temperature_max=2.0, top_k_low=-1)  # top_k: vLLM's; -1 and 0 both mean off
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        p.add("stop", f"`stop` must be a non-empty string or a list of them, got {stop!r}")
        stops = []
    if body.get("n") not in (None, 1):
        p.add("n", f"n={body.get('n')!r} is not supported: send one request per sample")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        p.add("stream", f"`stream` must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        p.add("stream_options", "`stream_options` must be an object such as {\"include_usage\": true}")
        options = {}
    p.raise_any()
    return ChatRequest(
        protocol=PROTOCOL, model=model, messages=messages, tools=tools, parse_tools=parse_tools,
        max_tokens=max_tokens, sampling=dataclasses.replace(sampling, stop=tuple(stops)), stream=bool(stream),
        options={"include_usage": bool(options.get("include_usage")), "logprobs": bool(body.get("logprobs"))})


def _usage(reply: ChatReply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _logprobs(reply: ChatReply) -> dict[str, Any] | None:
    if not reply.token_texts:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(reply.token_texts, reply.output_logprobs, strict=True)], "refusal": None}


def _calls(reply: ChatReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls]


def response(reply: ChatReply) -> dict[str, Any]:
    """The `chat.completion` body."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else ""),
                               "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _calls(reply)
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    return {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "message": message, "logprobs": _logprobs(reply),
                         "finish_reason": reply.finish}],
            "usage": _usage(reply), "system_fingerprint": None, "trajstore": reply.trajstore}


def stream_body(reply: ChatReply, options: Mapping[str, Any]) -> bytes:
    """The whole SSE body of a streamed reply (the sample is complete before streaming starts)."""
    include_usage = bool(options.get("include_usage"))
    head = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created, "model": reply.model}
    if include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                                     "finish_reason": finish}], **extra}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.reasoning:
        chunks.append(chunk({"reasoning_content": reply.reasoning}))
    if reply.content:
        chunks.append(chunk({"content": reply.content}, logprobs=_logprobs(reply)))
    for i, call in enumerate(reply.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}))
        chunks.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}))
    chunks.append(chunk({}, reply.finish, trajstore=reply.trajstore))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    lines = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks]
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


_ERROR_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("invalid_request_error", "forbidden"),
    "not_found": ("invalid_request_error", "model_not_found"),
    "conflict": ("invalid_request_error", "conflict"),
    "upstream": ("server_error", "upstream_error"),
    "internal": ("server_error", None),
}


def error_body(err: ChatError) -> dict[str, Any]:
    kind, code = _ERROR_TYPES.get(err.kind, ("server_error", None))
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}


class OpenAIChat:
    """OpenAI Chat Completions behind `collectors.proxy.wire.base.WireProtocol`."""

    name = PROTOCOL
    path = "/v1/chat/completions"
    reply_prefix = REPLY_ID_PREFIX
    call_prefix = CALL_ID_PREFIX
    parse_request = staticmethod(parse_request)
    response = staticmethod(response)
    stream_body = staticmethod(stream_body)
    error_body = staticmethod(error_body)
