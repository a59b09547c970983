"""OpenAI Responses on the wire (`POST /v1/responses`): request translation, responses, events, errors. Pure.

Shapes follow the `openai` SDK's own types (`openai.types.responses`: Response, ResponseInputItem,
ResponseOutputMessage, ResponseFunctionToolCall, ResponseReasoningItem, ResponseUsage and the
`Response*Event` stream events):

- request: `model`, `input` (a string, or items: messages with text parts, `function_call`,
  `function_call_output` and `reasoning` items; an assistant message, the reasoning before it
  and the function calls after it make one assistant turn of the template), `instructions`
  (the system message), `tools` (function tools; `parameters` a valid JSON Schema of an
  object), `tool_choice`, `temperature`, `top_p`, `max_output_tokens`, `stream`,
  `top_logprobs` with `include: ["message.output_text.logprobs"]`. The proxy keeps no
  responses, so `previous_response_id`, `conversation`, `item_reference` items and
  `background` are refused (send the whole conversation in `input`, as `store: false` clients
  do); images, files and built-in tools are refused; `reasoning`, `text`, `store`,
  `metadata`, `truncation` and other fields are accepted and not applied.
- response: `object: "response"` with `output` items (a reasoning item with the model's
  `reasoning_text`, a `message` with `output_text`, one `function_call` per tool call, whose
  `arguments` are the model's JSON text), `status` completed, or incomplete with reason
  `max_output_tokens`, `usage`, the request's settings echoed, and a `trajstore` extra.
- stream: response.created, response.in_progress, then per output item `output_item.added`,
  its content part and text (or arguments) deltas and `.done` events as the reply is sampled,
  then `response.completed` (or `response.incomplete`); every event has a `sequence_number`.
  A failure after the stream started is a `response.failed` event.
- input_tokens (`/v1/responses/input_tokens`): `{"object": "response.input_tokens", "input_tokens": N}`.
- errors: OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from collectors.policy import SamplingParams
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest, Message, Problems, start_request, template_tools
from collectors.proxy.wire.base import Event, event_data
from collectors.proxy.wire.openai_chat import error_body, logprob_entries, top_logprobs

PROTOCOL = "responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_STATELESS = ("the proxy keeps no responses: send the whole conversation in `input` (as clients with "
              "`store: false` do)")


def _text(content: Any, where: str, p: Problems) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        p.add(where, f"{where} must be a string or a list of text parts")
        return ""
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        else:
            p.add(where, f"{where}[{i}] has type {kind!r}: only text parts are supported by this text-only policy")
    return "".join(parts)


def _reasoning(item: dict[str, Any]) -> str:
    texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
    if not any(texts):
        texts = [s.get("text", "") for s in item.get("summary") or [] if isinstance(s, dict)]
    return "".join(texts)


def translate_input(instructions: Any, items: Any, p: Problems) -> list[Message]:
    """`instructions` and `input` -> template messages (see the module docstring)."""
    out: list[Message] = []
    if instructions is not None:
        if isinstance(instructions, str):
            out.append({"role": "system", "content": instructions})
        else:
            p.add("instructions", "`instructions` must be a string")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        p.add("input", "`input` must be a string or a non-empty list of input items")
        return out
    turn: Message | None = None  # the assistant turn being gathered

    def assistant() -> Message:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            p.add(where, f"{where} must be an input item object")
            continue
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            msg = assistant()
            if msg.get("tool_calls"):  # text after this turn's calls starts a new turn
                turn = None
                msg = assistant()
            msg["content"] = (msg["content"] or "") + _text(item.get("content"), f"{where}.content", p)
        elif kind == "reasoning":
            if turn is not None and (turn.get("content") or turn.get("tool_calls")):
                turn = None
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + _reasoning(item)
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(item.get("call_id"), str):
                p.add(where, f'{where} must be {{"type": "function_call", "call_id": str, "name": str, '
                             '"arguments": JSON text}')
                continue
            assistant().setdefault("tool_calls", []).append(
                {"type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            turn = None
            if kind == "message":
                role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
                if role is None:
                    p.add(where, f"{where}.role must be user, system, developer or assistant, got "
                                 f"{item.get('role')!r}")
                    continue
                out.append({"role": role, "content": _text(item.get("content"), f"{where}.content", p)})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": _text(item.get("output"), f"{where}.output", p)})
            elif kind == "item_reference":
                p.add(where, f"{where} is an item_reference: {_STATELESS}")
            else:
                p.add(where, f"{where} has type {kind!r}: only messages, function_call, function_call_output and "
                             "reasoning items are supported")
    return out


def translate_tools(tools: Any, p: Problems) -> list[dict[str, Any]] | None:
    return template_tools(
        tools, p, lambda t, where: (t.get("name"), t.get("description"), t.get("parameters"), where)
        if t.get("type") == "function" else None,
        lambda where, kind: f"{where} has type {kind!r}: only function tools are supported "
                            '({"type": "function", "name", "description", "parameters"})', "parameters", protocol=PROTOCOL)


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None, p: Problems) -> bool:
    if choice is None or choice in ("auto", "required"):
        return True
    if choice == "none":
        return False
    if isinstance(choice, dict) and choice.get("type") == "function":
        names = {t["function"]["name"] for t in tools or []}
        if choice.get("name") not in names:
            p.add("tool_choice", f"tool_choice names function {choice.get('name')!r}, which is not in `tools`")
        return True
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return True
    p.add("tool_choice", f'`tool_choice` must be "none", "auto", "required" or a function, got {choice!r}')
    return True


def parse_request(body: Any) -> ChatRequest:
    """Validate a decoded `/v1/responses` body; every problem is named in one 400."""
    p, model = start_request(body)
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            p.add(name, f"`{name}` is not supported: {_STATELESS}")
    if body.get("background"):
        p.add("background", "`background` is not supported: the proxy answers each call while it waits")
    messages = translate_input(body.get("instructions"), body.get("input"), p)
    tools = translate_tools(body.get("tools"), p)
    parse_tools = _tool_choice(body.get("tool_choice"), tools, p)
    max_tokens = p.integer(body, "max_output_tokens", 1, None)
    temperature = p.number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = p.number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0:
        p.add("top_p", "`top_p` must be above 0")
    include = body.get("include") or []
    if not isinstance(include, list):
        p.add("include", "`include` must be a list of strings")
        include = []
    logprobs = LOGPROBS_INCLUDE in include
    top = top_logprobs(body, p, logprobs=True)  # alternatives asked for are sent with the logprobs
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        p.add("stream", f"`stream` must be true or false, got {stream!r}")
    p.raise_any()
    echo = {"instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "temperature": temperature, "top_p": top_p,
            "max_output_tokens": max_tokens, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "top_logprobs": top, "store": False}
    return ChatRequest(
        protocol=PROTOCOL, model=model, messages=messages, tools=tools, parse_tools=parse_tools, max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, logprobs=top or None),
        stream=bool(stream), options={"logprobs": logprobs or bool(top), "top_logprobs": top, "echo": echo})


# ---- the reply as output items ---------------------------------------------------------------------------------
def _ids(reply: ChatReply) -> tuple[str, str]:
    suffix = reply.id.removeprefix("resp_")
    return f"rs_{suffix}", f"msg_{suffix}"


def _reasoning_item(reply: ChatReply, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _ids(reply)[0], "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(reply: ChatReply, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {"type": "message", "id": _ids(reply)[1], "status": status, "role": "assistant", "content": content}


def _call_item(reply: ChatReply, index: int, call: Any, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{reply.id.removeprefix('resp_')}_{index}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}


def _entries(reply: ChatReply) -> list[dict[str, Any]]:
    return logprob_entries(reply.token_texts, reply.output_logprobs, reply.top_logprobs, reply.top_n) \
        if reply.token_texts else []


def output_items(reply: ChatReply) -> list[dict[str, Any]]:
    items = [_reasoning_item(reply, reply.reasoning)] if reply.reasoning else []
    if reply.content or not reply.tool_calls:
        items.append(_message_item(reply, reply.content, _entries(reply), "completed"))
    items.extend(_call_item(reply, i, c, "completed") for i, c in enumerate(reply.tool_calls))
    return items


def _usage(reply: ChatReply) -> dict[str, Any]:
    return {"input_tokens": reply.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": reply.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _envelope(reply: ChatReply, options: Mapping[str, Any], status: str) -> dict[str, Any]:
    echo = options.get("echo") or {}
    return {"id": reply.id, "object": "response", "created_at": reply.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": reply.model, "output": [], "previous_response_id": None, "reasoning": {"effort": None,
                                                                                           "summary": None},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None, "user": None,
            **echo, "trajstore": reply.trajstore}


def _status(reply: ChatReply) -> str:
    return "incomplete" if reply.finish == "length" else "completed"


def response(reply: ChatReply, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `response` body."""
    return {**_envelope(reply, options or {}, _status(reply)), "output": output_items(reply), "usage": _usage(reply)}


class EventWriter:
    """The Responses event stream of one reply (see the module docstring)."""

    def __init__(self, head: ChatReply, options: Mapping[str, Any]) -> None:
        self.head, self.options = head, options
        self.seq = 0
        self.index = -1  # output index of the open item
        self.open: str | None = None  # "reasoning" | "message"
        self.text = {"reasoning": "", "message": ""}
        self.logprobs: list[dict[str, Any]] = []
        self.message_done = False

    def _event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {event_data(body)}\n\n".encode()

    def start(self) -> bytes:
        snapshot = _envelope(self.head, self.options, "in_progress")
        return self._event("response.created", response=snapshot) + \
            self._event("response.in_progress", response=snapshot)

    def _open(self, kind: str) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        rs, msg = _ids(self.head)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": rs, "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item, part = _message_item(self.head, "", [], "in_progress"), _text_part("", [])
        return out + self._event("response.output_item.added", output_index=self.index, item=item) + \
            self._event("response.content_part.added", item_id=item["id"], output_index=self.index, content_index=0,
                        part=part)

    def _close(self) -> bytes:
        kind, self.open = self.open, None
        if kind is None:
            return b""
        text = self.text[kind]
        if kind == "reasoning":
            item, part = _reasoning_item(self.head, text), {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=self.index,
                               content_index=0, text=text)
        else:
            self.message_done = True
            item = _message_item(self.head, text, self.logprobs, "completed")
            part = item["content"][0]
            done = self._event("response.output_text.done", item_id=item["id"], output_index=self.index,
                               content_index=0, text=text, logprobs=self.logprobs)
        return done + self._event("response.content_part.done", item_id=item["id"], output_index=self.index,
                                  content_index=0, part=part) + \
            self._event("response.output_item.done", output_index=self.index, item=item)

    def piece(self, event: Event) -> bytes:
        if event[0] in ("reasoning", "content"):
            kind = "reasoning" if event[0] == "reasoning" else "message"
            out = self._open(kind) if self.open != kind else b""
            self.text[kind] += event[1]
            item_id = _ids(self.head)[0 if kind == "reasoning" else 1]
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            return out + self._event(name, item_id=item_id, output_index=self.index, content_index=0,
                                     delta=event[1], **extra)
        _, i, call = event
        out = self._close()
        self.index += 1
        added = _call_item(self.head, i, call, "in_progress")
        return out + self._event("response.output_item.added", output_index=self.index, item=added) + \
            self._event("response.function_call_arguments.delta", item_id=added["id"], output_index=self.index,
                        delta=call.arguments) + \
            self._event("response.function_call_arguments.done", item_id=added["id"], output_index=self.index,
                        name=call.name, arguments=call.arguments) + \
            self._event("response.output_item.done", output_index=self.index,
                        item=_call_item(self.head, i, call, "completed"))

    def tokens(self, texts: list[str], logprobs: list[float], top: list[dict[str, float]] | None) -> bytes:
        self.logprobs += logprob_entries(texts, logprobs, top, int(self.options.get("top_logprobs") or 0))
        return b""  # sent with the text's done event and in the final response

    def finish(self, reply: ChatReply) -> bytes:
        out = self._close()
        if not self.message_done and not reply.tool_calls:  # as `output_items`: a reply without calls has a message
            out += self._open("message") + self._close()
        status = _status(reply)
        return out + self._event(f"response.{status}", response=response(reply, self.options))

    def error(self, err: ChatError) -> bytes:
        failed = {**_envelope(self.head, self.options, "failed"),
                  "error": {"code": "server_error", "message": err.message}}
        return self._event("response.failed", response=failed)


def count_response(tokens: int) -> dict[str, Any]:
    return {"object": "response.input_tokens", "input_tokens": tokens}


class OpenAIResponses:
    """OpenAI Responses behind `collectors.proxy.wire.base.WireProtocol`."""

    name = PROTOCOL
    conversation = "input"  # the list each call resends whole (a turn may store it as a delta)
    path = "/v1/responses"
    count_path = "/v1/responses/input_tokens"
    reply_prefix = "resp_"
    call_prefix = "call_"
    parse_request = staticmethod(parse_request)
    parse_count = staticmethod(parse_request)
    response = staticmethod(response)
    stream_writer = EventWriter
    count_response = staticmethod(count_response)
    error_body = staticmethod(error_body)
