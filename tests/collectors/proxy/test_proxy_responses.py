"""The OpenAI Responses API (`/v1/responses`) through the capture proxy: the real `openai` SDK, plain and
streamed, function calls round-tripped, input tokens counted; and the OpenAI Agents SDK in its default mode.

The upstream is `Scripted` for the tool loops (a random tiny model writes no tool calls) and the embedded
server, recorded, for the token-exact check of plain text turns.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.collectors.proxy_harness import MODEL, Harness, Scripted, assert_exact, call, openai_client, running_proxy

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def metas(h: Harness, rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(t["meta"]) | {"segment_id": t["segment_id"]} for t in h.turns(rollout["rollout_id"])]


def test_text_turns_are_stored_exactly_and_continue_one_segment(proxy: Harness) -> None:
    rollout = proxy.open()
    c = openai_client(rollout)
    first = c.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=8)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    second = c.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=6, input=[
        {"role": "user", "content": "Hello there"}, *[o.model_dump(exclude_none=True) for o in first.output],
        {"role": "user", "content": [{"type": "input_text", "text": "More?"}]}])
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len(turns) == 2 and turns[0]["segment_id"] == turns[1]["segment_id"]
    assert [json.loads(t["meta"])["history"] for t in turns] == ["first", "exact"]
    assert first.usage.output_tokens == len(turns[0]["output_ids"]) and first.output_text == json.loads(
        turns[0]["response"])["output"][0]["content"][0]["text"]
    assert second.usage.input_tokens == len(proxy.upstream.calls[-1][0])
    if turns[0]["finish_reason"] == "length":
        assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    prompt = proxy.proxy.capture.renderer.decode(turns[0]["prompt_ids"])
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n" \
                     "<|im_start|>assistant\n"


def test_function_call_round_trip_plain_and_streamed(scripted: Harness) -> None:
    rollout = scripted.open()
    c = openai_client(rollout)
    scripted.upstream.replies[:] = ["<think>\nNeed data.\n</think>\n\n" + WEATHER, "It is 21 degrees in Paris."]
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS)
    kinds = [o.type for o in first.output]
    assert kinds == ["reasoning", "function_call"] and first.status == "completed"
    fc = first.output[1]
    assert fc.name == "get_weather" and fc.arguments == '{"city": "Paris"}' and fc.call_id.startswith("call_")
    assert first.output[0].content[0].text == "Need data."
    history = [{"role": "user", "content": "Weather in Paris?"},
               *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temperature": 21}'}]
    with c.responses.stream(model=MODEL, input=history, tools=TOOLS) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    assert "response.output_text.delta" in events and final.output_text == "It is 21 degrees in Paris."
    m = metas(scripted, rollout)
    assert [x["history"] for x in m] == ["first", "exact"] and m[1]["fork"] is None
    assert m[0]["protocol"] == "responses" and m[1]["stream"] is True
    stored = json.loads(scripted.turns(rollout["rollout_id"])[1]["response"])
    assert stored["output"][0]["content"][0]["text"] == final.output_text and stored["id"] == final.id
    delta = scripted.proxy.capture.renderer.decode(scripted.turns(rollout["rollout_id"])[1]["prompt_ids"])
    assert delta == '\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n' \
                    "<|im_start|>assistant\n"


def test_streamed_function_call_events_and_input_tokens(scripted: Harness) -> None:
    rollout = scripted.open()
    c = openai_client(rollout)
    scripted.upstream.replies[:] = ["Checking.\n" + WEATHER]
    counted = c.responses.input_tokens.count(model=MODEL, input="Paris?", tools=TOOLS)
    with c.responses.stream(model=MODEL, input="Paris?", tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == '{"city": "Paris"}'
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Checking."
    assert counted.input_tokens == final.usage.input_tokens == len(scripted.upstream.sent[-1])


def test_stateless_and_unsupported_requests_are_refused_in_openai_shape(scripted: Harness) -> None:
    rollout = scripted.open()
    c = openai_client(rollout)
    with pytest.raises(openai.BadRequestError, match="keeps no responses") as err:
        c.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        c.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    before = scripted.count()
    r = call(rollout["base_urls"]["openai"] + "/responses", {"model": MODEL, "input": [{"type": "item_reference",
                                                                                        "id": "x"}]},
             key=rollout["api_key"])
    assert r.status == 400 and "item_reference" in r.body["error"]["message"]
    assert r.body["error"]["type"] == "invalid_request_error" and scripted.count() == before


def test_the_agents_sdk_in_its_default_mode_runs_a_tool_loop(scripted: Harness) -> None:
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    rollout = scripted.open()
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        seen.append(city)
        return f"21 degrees in {city}"

    scripted.upstream.replies[:] = [WEATHER, "It is 21 degrees in Paris."] * 2

    async def run(streamed: bool) -> Any:
        client = openai.AsyncOpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client))
        config = RunConfig(tracing_disabled=True)
        try:
            if not streamed:
                return await Runner.run(agent, "Weather in Paris?", run_config=config)
            result = Runner.run_streamed(agent, "Weather in Paris?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result
        finally:
            await client.close()

    for streamed in (False, True):
        result = asyncio.run(run(streamed))
        assert result.final_output == "It is 21 degrees in Paris."
    assert seen == ["Paris", "Paris"]
    m = metas(scripted, rollout)
    assert len(m) == 4 and m[0]["segment_id"] == m[1]["segment_id"] and m[2]["segment_id"] == m[3]["segment_id"]
    assert [x["history"] for x in m] == ["first", "exact", "rewritten", "exact"]  # the second run starts afresh
    assert [x["stream"] for x in m] == [False, False, True, True] and all(x["protocol"] == "responses" for x in m)


def test_logprobs_with_top_alternatives_come_from_the_policy_server(proxy: Harness) -> None:
    rollout = proxy.open()
    r = openai_client(rollout).responses.create(model=MODEL, input="Hi", max_output_tokens=6, top_logprobs=2,
                                                include=["message.output_text.logprobs"])
    (turn,) = assert_exact(proxy, rollout["rollout_id"])
    entries = r.output[0].content[0].logprobs
    assert [e.logprob for e in entries] == pytest.approx(turn["output_logprobs"], abs=1e-6)
    assert all(1 <= len(e.top_logprobs) <= 2 for e in entries)
