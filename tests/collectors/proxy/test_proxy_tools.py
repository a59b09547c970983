"""Tool calls and reasoning the model writes, through both SDKs and back: parsed, streamed, and round-tripped.

A random tiny model never writes a well-formed `<tool_call>`, so the upstream here is
`Scripted`: it returns given texts as sampled tokens (an honest fake of the PolicyClient
contract). Everything else is real: the proxy, the template, the tokenizer, the SDKs, the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.collectors.proxy_harness import (
    MODEL,
    Harness,
    Scripted,
    anthropic_client,
    call,
    openai_client,
    running_proxy,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def proxy(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def script(h: Harness, *texts: str) -> None:
    h.upstream.replies[:] = list(texts)


def metas(h: Harness, rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(t["meta"]) | {"segment_id": t["segment_id"], "turn_index": t["turn_index"]}
            for t in h.turns(rollout["rollout_id"])]


def test_openai_tool_call_round_trip_stays_one_segment(proxy: Harness) -> None:
    rollout = proxy.open()
    c = openai_client(rollout)
    script(proxy, "Let me check.\n" + WEATHER, "It is 21 degrees.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (tc,) = choice.message.tool_calls
    assert tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert tc.function.arguments == '{"city":"Paris"}'
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'}]
    second = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "It is 21 degrees."
    m = metas(proxy, rollout)
    assert [x["turn_index"] for x in m] == [0, 1] and m[0]["segment_id"] == m[1]["segment_id"]
    assert m[1]["fork"] is None
    turns = proxy.turns(rollout["rollout_id"])
    assert turns[0]["finish_reason"] == "tool_calls"
    delta = proxy.proxy.capture.renderer.decode(turns[1]["prompt_ids"])
    assert delta == '\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n' \
                    "<|im_start|>assistant\n"


def test_openai_streamed_tool_call_deltas(proxy: Harness) -> None:
    rollout = proxy.open()
    c = openai_client(rollout)
    script(proxy, WEATHER + "\n" + WEATHER.replace("Paris", "Oslo"))
    with c.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Two cities"}], tools=TOOLS,
                                   max_tokens=64) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Paris", "Oslo"]


def test_openai_reasoning_is_returned_and_kept_in_the_template(proxy: Harness) -> None:
    rollout = proxy.open()
    c = openai_client(rollout)
    script(proxy, "<think>\nThe user greets.\n</think>\n\nHello!", "Fine.")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
    message = r.choices[0].message
    assert message.content == "Hello!" and message.model_extra["reasoning_content"] == "The user greets."
    c.chat.completions.create(model=MODEL, max_tokens=64, messages=[
        {"role": "user", "content": "Hi"}, message.model_dump(exclude_none=True), {"role": "user", "content": "How?"}])
    m = metas(proxy, rollout)
    assert m[1]["fork"] is None and m[1]["segment_id"] == m[0]["segment_id"]


def test_anthropic_tool_use_round_trip_keeps_the_sampled_argument_text(proxy: Harness) -> None:
    rollout = proxy.open()
    c = anthropic_client(rollout)
    script(proxy, "<think>\nNeed data.\n</think>\n\nChecking.\n" + WEATHER, "Sunny.", "x")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.messages.create(model=MODEL, max_tokens=64, tools=A_TOOLS, messages=messages)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    use = first.content[2]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = c.messages.create(model=MODEL, max_tokens=64, tools=A_TOOLS, messages=messages)
    assert second.stop_reason == "end_turn" and second.content[0].text == "Sunny."
    m = metas(proxy, rollout)
    # '{"city":"Paris"}' comes back as an object; the proxy renders the sampled text, so no fork
    assert m[1]["fork"] is None and m[1]["segment_id"] == m[0]["segment_id"]
    # an agent that edits the call's input rewrote history: a fork, a new segment in the same rollout
    messages[1]["content"][2]["input"] = {"city": "Lyon"}
    c.messages.create(model=MODEL, max_tokens=64, tools=A_TOOLS, messages=messages)
    assert metas(proxy, rollout)[2]["fork"] == "history_rewrite"


def test_anthropic_streamed_tool_use(proxy: Harness) -> None:
    rollout = proxy.open()
    c = anthropic_client(rollout)
    script(proxy, WEATHER)
    with c.messages.stream(model=MODEL, max_tokens=64, tools=A_TOOLS,
                           messages=[{"role": "user", "content": "Paris?"}]) as stream:
        events = [e for e in stream]
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and deltas[0].partial_json == '{"city":"Paris"}'
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_a_reply_sent_back_reserialized_continues_with_the_sampled_tokens(proxy: Harness) -> None:
    """pydantic-ai style: the sampled JSON comes back compact, the reasoning dropped; same meaning, so the segment
    continues and the policy is sent its own sampled tokens. An edited argument is a real rewrite: a fork."""
    rollout = proxy.open()
    before = call(proxy.url + "/stats").body
    c = openai_client(rollout)
    sampled = ('<think>\nRome.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
               '</tool_call>')
    script(proxy, sampled, "ok", "again")
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Rome?"}], tools=TOOLS,
                                  max_tokens=64)
    tc = r.choices[0].message.tool_calls[0]
    assert tc.function.arguments == '{"city": "Rome"}'
    resent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]}
    history = [{"role": "user", "content": "Rome?"}, resent, {"role": "tool", "tool_call_id": tc.id, "content": "warm"}]
    c.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=64, messages=history)
    m = metas(proxy, rollout)
    assert m[1]["fork"] is None and m[1]["segment_id"] == m[0]["segment_id"] and m[1]["history"] == "reserialized"
    sent_first, sent_second = proxy.upstream.sent[-2:]
    turns = proxy.turns(rollout["rollout_id"])
    assert sent_second == sent_first + turns[0]["output_ids"] + turns[1]["prompt_ids"]  # the sampled ids, spliced
    resent["tool_calls"][0]["function"]["arguments"] = '{"city":"Milan"}'
    c.chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=64, messages=history)
    m = metas(proxy, rollout)
    assert m[2]["fork"] == "history_rewrite" and m[2]["history"] == "rewritten"
    after = call(proxy.url + "/stats").body
    assert after["history"]["reserialized"] == before["history"].get("reserialized", 0) + 1
    assert after["history"]["rewritten"] == before["history"].get("rewritten", 0) + 1
    summary = call(f"{proxy.url}/rollouts/{rollout['rollout_id']}", key=rollout["api_key"]).body
    assert summary["segments"] == 2 and summary["forks"] == 1
