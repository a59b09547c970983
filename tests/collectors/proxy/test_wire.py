"""The wire adapters as pure tables: request bodies in, `ChatRequest`s (or one 400 naming every problem) out;
`ChatReply`s in, response, stream and error bodies out. No model, no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from collectors.policy import SamplingParams
from collectors.proxy.chat import ChatError, ChatReply
from collectors.model.toolcalls import ToolCall
from collectors.proxy.wire import WIRES, AnthropicMessages, OpenAIChat, stream_body

OA, AN = OpenAIChat(), AnthropicMessages()
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
A_TOOL = {"name": "get_weather", "description": "Weather.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USER = {"role": "user", "content": "hi"}


def oa(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def an(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "messages": [USER], **fields}


# ---- requests that parse: (adapter, body, raw arguments, expected ChatRequest fields) -------------------------
PARSED = [
    ("openai plain", OA, oa(), {}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None,
                                     "tools": None, "stream": False, "continue_final": False}),
    ("openai developer is system", OA, oa(messages=[{"role": "developer", "content": "be brief"}, USER]), {},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ("openai text parts", OA, oa(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]), {},
     {"messages": [{"role": "user", "content": "ab"}]}),
    ("openai sampling", OA, oa(temperature=0.5, top_p=0.9, top_k=-1, seed=3, stop="X", max_tokens=9), {},
     {"sampling": SamplingParams(temperature=0.5, top_p=0.9, top_k=0, seed=3, stop=("X",)), "max_tokens": 9}),
    ("openai max_completion_tokens wins", OA, oa(max_tokens=9, max_completion_tokens=5), {}, {"max_tokens": 5}),
    ("openai tool round trip", OA, oa(tools=[TOOL], messages=[USER, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]), {},
     {"tools": [TOOL], "parse_tools": True, "messages": [
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]}),
    ("openai tool_choice none", OA, oa(tools=[TOOL], tool_choice="none"), {}, {"parse_tools": False}),
    ("openai stream with usage", OA, oa(stream=True, stream_options={"include_usage": True}), {},
     {"stream": True, "options": {"include_usage": True, "logprobs": False, "top_logprobs": 0}}),
    ("anthropic system and prefill", AN, an(system=[{"type": "text", "text": "sys"}], messages=[
        USER, {"role": "assistant", "content": "The answer is"}]), {},
     {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "The answer is"}], "continue_final": True, "max_tokens": 16}),
    ("anthropic tool_use input stays an object", AN, an(tools=[A_TOOL], messages=[USER, {
        "role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                          "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "and?"}]}]), {},
     {"tools": [TOOL], "messages": [
         {"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, {"role": "user", "content": "and?"}]}),
    ("anthropic system messages between turns stay in place", AN, an(system="sys", messages=[
        USER, {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {"type": "ephemeral"}}]}],
        thinking={"type": "adaptive"}, context_management={"edits": []}, output_config={"effort": "high"},
        metadata={"user_id": "u"}), {},
     {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                   {"role": "system", "content": "env"}], "continue_final": False}),
    ("anthropic sampling", AN, an(temperature=0.2, top_k=5, stop_sequences=["END"], seed=1), {},
     {"sampling": SamplingParams(temperature=0.2, top_k=5, stop=("END",), seed=1)}),
    ("anthropic tool_choice none", AN, an(tools=[A_TOOL], tool_choice={"type": "none"}), {}, {"parse_tools": False}),
]


@pytest.mark.parametrize(("adapter", "body", "raw", "expected"), [c[1:] for c in PARSED], ids=[c[0] for c in PARSED])
def test_requests_translate_to_the_template_format(adapter: Any, body: dict[str, Any], raw: dict[str, str],
                                                  expected: dict[str, Any]) -> None:
    req = adapter.parse_request(body)
    assert req.protocol == adapter.name and req.model == "m"
    assert {k: getattr(req, k) for k in expected} == expected


# ---- requests refused: (adapter, body, the param named first, words every message must hold) ------------------
REFUSED = [
    ("openai not an object", OA, [1], None, ["JSON object"]),
    ("openai no model", OA, {"messages": [USER]}, "model", ["`model` is required"]),
    ("openai empty messages", OA, oa(messages=[]), "messages", ["non-empty list"]),
    ("openai bad role", OA, oa(messages=[{"role": "robot", "content": "x"}]), "messages[0]", ["role must be one of"]),
    ("openai image part", OA, oa(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content", ["only text parts"]),
    ("openai user without content", OA, oa(messages=[{"role": "user"}]), "messages[0].content",
     ["messages[0].content is required"]),
    ("openai tool without content", OA, oa(messages=[USER, {"role": "tool", "content": None}]), "messages[1].content",
     ["messages[1].content is required"]),
    ("openai assistant content not text", OA, oa(messages=[USER, {"role": "assistant", "content": 7}]),
     "messages[1].content", ["messages[1].content must be a string or a list of text parts, got int"]),
    ("openai assistant problems in order", OA, oa(messages=[USER, {
        "role": "assistant", "content": [{"type": "image_url"}], "tool_calls": [{"function": {"name": 1}}],
        "function_call": {"name": "f"}}]), "messages[1].content",
     ["messages[1].content[0] has type 'image_url'", "messages[1].tool_calls[0] must be",
      "messages[1].function_call is the deprecated format"]),
    ("openai n > 1", OA, oa(n=2), "n", ["n=2"]),
    ("openai temperature", OA, oa(temperature=3), "temperature", ["from 0.0 to 2.0"]),
    ("openai every problem at once", OA, oa(temperature=-1, top_p=0, seed="x"), "temperature",
     ["temperature", "top_p", "seed"]),
    ("openai bad tool schema", OA, oa(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]),
     "tools[0].function", ["not a valid JSON Schema"]),
    ("openai tool_choice names an unknown function", OA, oa(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", ["'nope'"]),
    ("anthropic max_tokens required", AN, {"model": "m", "messages": [USER]}, "max_tokens", ["max_tokens"]),
    ("anthropic bad role", AN, an(messages=[{"role": "robot", "content": "x"}]), "messages[0]",
     ["user, assistant or system"]),
    ("anthropic image block", AN, an(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content", ["only text and tool_result"]),
    ("anthropic server tool", AN, an(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]",
     ["only custom tools"]),
    ("anthropic stop_sequences", AN, an(stop_sequences="END"), "stop_sequences", ["list of non-empty strings"]),
]


@pytest.mark.parametrize(("adapter", "body", "param", "words"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_requests_are_refused_naming_every_problem(adapter: Any, body: Any, param: str | None,
                                                       words: list[str]) -> None:
    with pytest.raises(ChatError) as err:
        adapter.parse_request(body)
    assert err.value.status == 400 and err.value.param == param
    for word in words:
        assert word in err.value.message


# ---- replies out -----------------------------------------------------------------------------------------------
def reply(content: str = "", *, calls: tuple[ToolCall, ...] = (), reasoning: str | None = None,
          finish: str = "stop", stop_sequence: str | None = None) -> ChatReply:
    return ChatReply(id="r1", model="m", created=7, content=content, reasoning=reasoning, tool_calls=calls,
                     finish=finish, stop_sequence=stop_sequence, prompt_tokens=11, output_ids=[5, 6, 7],
                     output_logprobs=[-0.1, -0.2, -0.3], token_texts=[], policy_version=2,
                     trajstore={"rollout_id": "x"})


CALL = ToolCall("get_weather", '{"city":"Oslo"}', {"city": "Oslo"}, "call_9")


def test_openai_response_and_stream_carry_the_same_reply() -> None:
    r = reply("Checking.", calls=(CALL,), reasoning="think", finish="tool_calls")
    body = OA.response(r)
    message = body["choices"][0]["message"]
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Checking." and message["reasoning_content"] == "think"
    assert message["tool_calls"] == [{"id": "call_9", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    chunks = [json.loads(line[6:]) for line in stream_body(OA, r, {"include_usage": True}).decode().split("\n\n")
              if line.startswith("data: {")]
    assert stream_body(OA, r, {}).decode().endswith("data: [DONE]\n\n")
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "think"
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
    assert args == '{"city":"Oslo"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 14


@pytest.mark.parametrize(("finish", "stop_sequence", "expected"), [
    ("stop", None, "end_turn"), ("length", None, "max_tokens"), ("tool_calls", None, "tool_use"),
    ("stop", "END", "stop_sequence")])
def test_anthropic_stop_reasons(finish: str, stop_sequence: str | None, expected: str) -> None:
    body = AN.response(reply("x", finish=finish, stop_sequence=stop_sequence))
    assert body["stop_reason"] == expected and body["stop_sequence"] == stop_sequence


def test_anthropic_response_and_stream_carry_the_same_blocks() -> None:
    r = reply("Checking.", calls=(CALL,), reasoning="think", finish="tool_calls")
    body = AN.response(r)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2] == {"type": "tool_use", "id": "call_9", "name": "get_weather", "input": {"city": "Oslo"}}
    assert body["usage"]["input_tokens"] == 11 and body["usage"]["output_tokens"] == 3
    events = [line for line in stream_body(AN, r, {}).decode().split("\n\n") if line]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    data = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    partial = [d["delta"]["partial_json"] for d in data if d.get("delta", {}).get("type") == "input_json_delta"]
    assert partial == ['{"city":"Oslo"}']


@pytest.mark.parametrize(("kind", "status", "oa_type", "an_type"), [
    ("invalid_request", 400, "invalid_request_error", "invalid_request_error"),
    ("authentication", 401, "invalid_request_error", "authentication_error"),
    ("not_found", 404, "invalid_request_error", "not_found_error"),
    ("upstream", 502, "server_error", "api_error")])
def test_errors_take_each_protocols_shape(kind: str, status: int, oa_type: str, an_type: str) -> None:
    err = ChatError("what went wrong", status=status, kind=kind, param="p")
    assert OA.error_body(err) == {"error": {"message": "what went wrong", "type": oa_type, "param": "p",
                                            "code": OA.error_body(err)["error"]["code"]}}
    assert AN.error_body(err) == {"type": "error", "error": {"type": an_type, "message": "what went wrong"}}


def test_every_adapter_has_its_own_route_and_prefixes() -> None:
    assert len({w.path for w in WIRES}) == len(WIRES) == len({w.name for w in WIRES})
    assert all(w.path.startswith("/v1/") and w.reply_prefix and w.call_prefix for w in WIRES)
