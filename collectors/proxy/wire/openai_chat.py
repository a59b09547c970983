"""OpenAI Chat Completions on the wire: request validation and translation, responses, SSE, errors. Pure.

Shapes follow the `openai` SDK's own types (`openai.types.chat`: ChatCompletion,
ChatCompletionChunk, ChoiceDeltaToolCall, CompletionUsage) and vLLM's extensions:

- request: `model`, `messages` (system / developer / user / assistant with `tool_calls` and
  optional `reasoning_content` or `reasoning` / tool), `tools` (function tools; `parameters`
  must be a valid JSON Schema of an object), `tool_choice` (none | auto | required | a named
  function; only `none` changes anything: no sampling is constrained, so required and named
  choices sample like auto), `temperature`, `top_p`, `top_k` (vLLM), `max_tokens` /
  `max_completion_tokens`, `stop`, `seed`, `stream`, `stream_options.include_usage`,
  `logprobs` with `top_logprobs` (0-20, the policy server's alternatives per token). `n` > 1
  and non-text content parts are refused; penalties, `response_format` and other fields are
  accepted and not applied (the stored request keeps them).
- response: `chat.completion` with `message.tool_calls` (arguments are the model's JSON text),
  `message.reasoning_content` (vLLM's field) when the model thought, `usage`, and a
  `trajstore` object (rollout, segment, turn, policy version) that SDKs keep as an extra.
- stream: `chat.completion.chunk` events written as the reply is sampled (role, then reasoning
  and content deltas, logprobs as the tokens arrive, then per tool call a delta with id and
  name and one with the arguments), a final chunk with `finish_reason`, a usage chunk with
  empty `choices` when asked, then `data: [DONE]`; a failure after the stream started is a
  chunk `{"error": {...}}` (which the SDK raises) and no `[DONE]`.
- errors: `{"error": {"message", "type", "param", "code"}}`.
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
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            problems.add(f"messages[{i}]", f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}")
            continue
        content = m.get("content")
        if type(content) is not str and not (content is None and role == "assistant"):
            content = _text(content, f"messages[{i}].content", problems, nullable=role == "assistant")
        if role == "assistant":
            msg: Message = {"role": "assistant", "content": content}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls", problems)
            if m.get("function_call"):
                problems.add(f"messages[{i}]", f"messages[{i}].function_call is the deprecated format; send "
                                               "tool_calls")
        elif role == "tool":
            msg = {"role": "tool", "content": content, "tool_call_id": m.get("tool_call_id")}
        else:
            msg = {"role": "system" if role == "developer" else role, "content": content}
        out.append(msg)
    return out


def translate_tools(tools: Any, problems: Problems) -> list[dict[str, Any]] | None:
    def fields(tool: dict[str, Any], where: str) -> tuple[Any, Any, Any, str] | None:
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            return None
        return fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function"

    return template_tools(tools, problems, fields, lambda where, kind: (
        f'{where} must be {{"type": "function", "function": {{"name", "description", "parameters"}}}} '
        "(custom tools are not supported)"), "parameters", protocol=PROTOCOL)


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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default --max-logprobs


def top_logprobs(body: dict[str, Any], p: Problems, *, logprobs: bool) -> int:
    """`top_logprobs` (0-20), which needs logprobs on; the policy server returns that many alternatives."""
    top = p.integer(body, "top_logprobs", 0, 0) or 0
    if top > MAX_TOP_LOGPROBS:
        p.add("top_logprobs", f"`top_logprobs` must be at most {MAX_TOP_LOGPROBS}, got {top}")
    if top and not logprobs:
        p.add("top_logprobs", "`top_logprobs` needs logprobs: send \"logprobs\": true with it")
    return min(top, MAX_TOP_LOGPROBS)


def parse_request(body: Any) -> ChatRequest:
    """Validate a decoded `/v1/chat/completions` body; every problem is named in one 400."""
    p, model = start_request(body)
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
    logprobs = bool(body.get("logprobs"))
    top = top_logprobs(body, p, logprobs=logprobs)
    p.raise_any()
    return ChatRequest(
        protocol=PROTOCOL, model=model, messages=messages, tools=tools, parse_tools=parse_tools,
        max_tokens=max_tokens, sampling=dataclasses.replace(sampling, stop=tuple(stops), logprobs=top or None),
        stream=bool(stream),
        options={"include_usage": bool(options.get("include_usage")), "logprobs": logprobs, "top_logprobs": top})


def _usage(reply: ChatReply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def logprob_entries(texts: list[str], logprobs: list[float], top: list[dict[str, float]] | None,
                    n: int) -> list[dict[str, Any]]:
    """OpenAI's per-token logprobs (`ChatCompletionTokenLogprob`, also the Responses API's): each token with its
    `n` most likely alternatives, as the policy server reported them."""
    def alternatives(i: int) -> list[dict[str, Any]]:
        ranked = sorted((top[i] if top else {}).items(), key=lambda kv: -kv[1])[:n]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked]
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": alternatives(i) if n else []}
            for i, (t, lp) in enumerate(zip(texts, logprobs, strict=True))]


def _logprobs(reply: ChatReply, n: int) -> dict[str, Any] | None:
    if not reply.token_texts:
        return None
    return {"content": logprob_entries(reply.token_texts, reply.output_logprobs, reply.top_logprobs, n),
            "refusal": None}


def _calls(reply: ChatReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls]


def response(reply: ChatReply, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `chat.completion` body."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else ""),
                               "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _calls(reply)
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    return {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": _logprobs(reply, reply.top_n),
                         "finish_reason": reply.finish}],
            "usage": _usage(reply), "system_fingerprint": None, "trajstore": reply.trajstore}


def _sse(data: Any) -> bytes:
    return f"data: {event_data(data)}\n\n".encode()


class ChunkWriter:
    """The `chat.completion.chunk` stream of one reply (see the module docstring)."""

    def __init__(self, head: ChatReply, options: Mapping[str, Any]) -> None:
        self.include_usage = bool(options.get("include_usage"))
        self.top = int(options.get("top_logprobs") or 0)
        self.head: dict[str, Any] = {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                                     "model": head.model}
        if self.include_usage:
            self.head["usage"] = None

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               **extra: Any) -> bytes:
        return _sse({**self.head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish}], **extra})

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def piece(self, event: Event) -> bytes:
        if event[0] == "reasoning":
            return self._chunk({"reasoning_content": event[1]})
        if event[0] == "content":
            return self._chunk({"content": event[1]})
        _, i, call = event
        return self._chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]}) + \
            self._chunk({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})

    def tokens(self, texts: list[str], logprobs: list[float], top: list[dict[str, float]] | None) -> bytes:
        entries = logprob_entries(texts, logprobs, top, self.top)
        return self._chunk({}, logprobs={"content": entries, "refusal": None}) if entries else b""

    def finish(self, reply: ChatReply) -> bytes:
        out = self._chunk({}, reply.finish, trajstore=reply.trajstore)
        if self.include_usage:
            out += _sse({**self.head, "choices": [], "usage": _usage(reply)})
        return out + b"data: [DONE]\n\n"

    def error(self, err: ChatError) -> bytes:
        return _sse(error_body(err))


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
    conversation = "messages"  # the list each call resends whole (a turn may store it as a delta)
    path = "/v1/chat/completions"
    count_path = None  # Chat Completions has no token-counting route
    reply_prefix = REPLY_ID_PREFIX
    call_prefix = CALL_ID_PREFIX
    parse_request = staticmethod(parse_request)
    parse_count = staticmethod(parse_request)
    response = staticmethod(response)
    stream_writer = ChunkWriter
    error_body = staticmethod(error_body)

    @staticmethod
    def count_response(tokens: int) -> dict[str, Any]:
        raise AssertionError("Chat Completions has no count_tokens route")
