"""Tool-call and reasoning parsing on crafted text, and the template re-rendering parsed replies exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from collectors.policy import Sample, SamplingParams
from collectors.proxy.chat import ChatReply, ChatRequest
from collectors.proxy.render import ChatRenderer, text_ids
from collectors.model.toolcalls import parse_output
from collectors.proxy.wire import OpenAIChat

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    out = parse_output("Hello there.\nHow are you?")
    assert out.content == "Hello there.\nHow are you?" and out.reasoning is None and out.tool_calls == ()


def test_content_then_a_call() -> None:
    out = parse_output("Let me check.\n" + CALL)
    assert out.content == "Let me check."
    (call,) = out.tool_calls
    assert call.name == "get_weather" and call.input == {"city": "Paris", "unit": "celsius"}
    assert call.arguments == '{"city": "Paris", "unit": "celsius"}'


def test_the_models_own_argument_text_is_kept_when_the_block_is_canonical() -> None:
    out = parse_output('<tool_call>\n{"name": "f", "arguments": {"a":1,  "b": [1,2]}}\n</tool_call>')
    assert out.content == "" and out.tool_calls[0].arguments == '{"a":1,  "b": [1,2]}'
    assert out.tool_calls[0].input == {"a": 1, "b": [1, 2]}


def test_a_block_in_another_layout_is_reserialized() -> None:
    out = parse_output('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert out.tool_calls[0].name == "f" and out.tool_calls[0].arguments == '{"a": 1}'


def test_arguments_given_as_a_json_string() -> None:
    out = parse_output('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 2}"}\n</tool_call>')
    assert out.tool_calls[0].input == {"a": 2}


def test_several_calls_and_reasoning() -> None:
    text = "<think>\nI need the weather twice.\n</think>\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    out = parse_output(text)
    assert out.reasoning == "I need the weather twice." and out.content == ""
    assert [c.input["city"] for c in out.tool_calls] == ["Paris", "Oslo"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # broken JSON
    '<tool_call>\n["f", {"a": 1}]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',  # unclosed (cut by max_tokens)
])
def test_malformed_calls_leave_the_text_as_content(text: str) -> None:
    out = parse_output("Sure.\n" + text)
    assert out.tool_calls == () and out.content == "Sure.\n" + text


def test_one_bad_block_keeps_all_text() -> None:
    text = CALL + "\n<tool_call>\nnot json\n</tool_call>"
    assert parse_output(text).tool_calls == () and parse_output(text).content == text


def test_tool_parsing_can_be_off() -> None:
    assert parse_output(CALL, parse_tools=False).content == CALL


def test_unterminated_think_is_all_reasoning() -> None:
    out = parse_output("<think>\nstill thinking")
    assert out.reasoning == "still thinking" and out.content == "" and out.tool_calls == ()


@pytest.fixture(scope="module")
def renderer(tiny_model: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]


def sent_back(renderer: ChatRenderer, req: ChatRequest, reply: ChatReply) -> str:
    """The next call's prompt when the agent sends the reply back as the OpenAI SDK got it, then asks on."""
    message = OpenAIChat.response(reply)["choices"][0]["message"]
    body = {"model": "m", "messages": [*req.messages, message, {"role": "user", "content": "thanks"}],
            "tools": req.tools}
    return renderer.prompt_text(OpenAIChat.parse_request(body))


@pytest.mark.parametrize("text", [
    "Just text, no calls.",
    "Let me check.\n" + CALL,
    CALL,
    CALL + "\n" + CALL.replace("Paris", "Lima"),
    "<think>\nHmm.\n</think>\n\nIt is sunny.",
    "<think>\nplan\n</think>\n\nOn it.\n" + CALL,
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>',
])
def test_the_template_re_renders_a_reply_sent_back_to_the_sampled_text(renderer: ChatRenderer, text: str) -> None:
    """What makes tool-call turns continue a segment: the next prompt starts with prompt + the sampled text."""
    tok = renderer.tokenizer
    req = ChatRequest(protocol="openai", model="m", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                      parse_tools=True, max_tokens=64)
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    sample = Sample(prompt_ids=[1], output_ids=ids, output_logprobs=[-1.0] * len(ids), text=text,
                    finish_reason="stop", policy_version=0)
    reply = renderer.reply(sample, req, text, prompt_tokens=1, reply_id="r", call_id=lambda: "call_1", model="m",
                           created=0, trajstore={})
    assert sent_back(renderer, req, reply).startswith(renderer.prompt_text(req) + renderer.decode(ids))
    assert reply.finish == ("tool_calls" if "<tool_call>" in text else "stop")


def test_a_reply_cut_by_a_stop_string_does_not_re_render(renderer: ChatRenderer) -> None:
    tok = renderer.tokenizer
    req = ChatRequest(protocol="openai", model="m", messages=[{"role": "user", "content": "hi"}], tools=None,
                      parse_tools=True, max_tokens=64, sampling=SamplingParams(stop=("STOP",)))
    ids = tok.encode("hello STOP and more", add_special_tokens=False)
    sample = Sample(prompt_ids=[1], output_ids=ids, output_logprobs=[-1.0] * len(ids), text="hello ",
                    finish_reason="stop", policy_version=0, stop_reason="STOP")
    reply = renderer.reply(sample, req, renderer.decode(text_ids(sample)), prompt_tokens=1, reply_id="r",
                           call_id=lambda: "c", model="m", created=0, trajstore={})
    assert reply.content == "hello " and reply.stop_sequence == "STOP"
    prompt = renderer.prompt_text(req)
    after = sent_back(renderer, req, reply)
    assert after.startswith(prompt + "hello <|im_end|>") and not after.startswith(prompt + renderer.decode(ids))
