"""`check_fits` counts a request's text only when its body is large enough to be refused: the body's size bounds
the characters of the text every wire translates it to, so skipping the count never lets through what it refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from collectors.proxy import render
from collectors.proxy.chat import ChatError
from collectors.proxy.render import ChatRenderer, _text_chars
from collectors.proxy.wire import AnthropicMessages, OpenAIChat, OpenAIResponses

TEXT = st.text(st.characters(codec="utf-8"), max_size=8)
NAME = st.sampled_from(["f", "read"])
ARGS = st.dictionaries(st.sampled_from("ab"), st.one_of(TEXT, st.integers(), st.lists(TEXT, max_size=2)), max_size=2)
SCHEMA = st.fixed_dictionaries({"type": st.just("object")}, optional={"description": TEXT})

OPENAI = st.fixed_dictionaries({"model": st.just("m"), "messages": st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": st.one_of(
        TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), TEXT)}, optional={
        "reasoning_content": TEXT, "tool_calls": st.lists(st.fixed_dictionaries({"type": st.just("function"),
            "function": st.fixed_dictionaries({"name": NAME, "arguments": st.one_of(TEXT, ARGS)})}), max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": TEXT}, optional={"tool_call_id": TEXT})),
    min_size=1, max_size=5)}, optional={"tools": st.lists(st.fixed_dictionaries({"type": st.just("function"),
        "function": st.fixed_dictionaries({"name": NAME}, optional={"description": TEXT, "parameters": SCHEMA})}),
        max_size=2)})

BLOCK_USER = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                       st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT}, optional={
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": TEXT}), max_size=2))}))
BLOCK_ASSISTANT = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                            st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT}),
                            st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": NAME,
                                                   "input": ARGS}))
ANTHROPIC = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.just(1), "messages": st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(TEXT, st.lists(BLOCK_USER, max_size=3))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(TEXT, st.lists(BLOCK_ASSISTANT,
                                                                                              max_size=3))})),
    min_size=1, max_size=5)}, optional={"system": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": TEXT}), max_size=2)), "tools": st.lists(st.fixed_dictionaries(
        {"name": NAME, "input_schema": SCHEMA}, optional={"description": TEXT}), max_size=2)})

ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": st.one_of(
        TEXT, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT}),
                       max_size=2))}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": NAME, "arguments": TEXT}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(st.fixed_dictionaries(
        {"type": st.just("summary_text"), "text": TEXT}), max_size=2)}))
RESPONSES = st.fixed_dictionaries({"model": st.just("m"), "input": st.one_of(TEXT, st.lists(ITEM, min_size=1,
                                                                                              max_size=5))},
                                  optional={"instructions": TEXT})


@pytest.mark.parametrize(("wire", "bodies"), [(OpenAIChat(), OPENAI), (AnthropicMessages(), ANTHROPIC),
                                              (OpenAIResponses(), RESPONSES)], ids=["openai", "anthropic", "responses"])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_body_holds_at_least_as_many_bytes_as_its_text_has_characters(wire: Any, bodies: Any,
                                                                        data: st.DataObject) -> None:
    body = data.draw(bodies)
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()  # as small as JSON writes it
    try:
        req = wire.parse_request(json.loads(raw))
    except ChatError:
        assume(False)
    assert _text_chars([req.messages, req.tools]) <= len(raw)


def test_the_body_size_skips_the_count_only_where_it_could_not_refuse(tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model))
    text = "x" * 10_000
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    req = dataclasses.replace(OpenAIChat().parse_request(json.loads(raw)), body_bytes=len(raw))
    over = len(text) // renderer.longest_token_chars - 1  # the text alone needs more tokens than this
    with pytest.raises(ChatError, match="the prompt is at least"):
        renderer.check_fits(req, over)  # the body is large enough: counted and refused, as without its size
    with pytest.raises(ChatError, match="the prompt is at least"):
        renderer.check_fits(dataclasses.replace(req, body_bytes=None), over)
    counts: list[int] = []
    monkeypatch.setattr(render, "_text_chars", lambda value: counts.append(1) or _text_chars(value))
    room = -(-len(raw) // renderer.longest_token_chars)  # tokens the whole body could be, at most
    renderer.check_fits(req, room)
    assert not counts  # nothing it could refuse: not counted
    renderer.check_fits(req, room - 1)
    assert counts  # counted (and let through: the text is less than the body)
