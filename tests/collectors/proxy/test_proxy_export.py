"""Exports of what the capture proxy really stored: real SDKs speak OpenAI and Anthropic tool-calling
conversations through the proxy (upstream `Scripted`, an honest fake of the PolicyClient contract, since a
random tiny model never writes a well-formed tool call), then the run is exported: the sft lines are the
conversations the agents held, the NeMo Gym lines follow its schema, and the hf export reads back exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.collectors.proxy_harness import MODEL, Harness, Scripted, anthropic_client, openai_client, running_proxy
from trajstore import Store, open_store
from trajstore.export import export, ingest_hf
from trajstore.requests import resolve

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
SCHEMA = Path(__file__).parents[2] / "trajstore" / "ng_trajectory.schema.json"


@pytest.fixture(scope="module")
def proxy(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        openai_rollout(h)
        anthropic_rollout(h)
        responses_rollout(h)
        yield h


def openai_rollout(h: Harness) -> None:
    rollout = h.open()
    c = openai_client(rollout)
    h.upstream.replies[:] = ["Let me check.\n" + WEATHER, "It is 21 degrees."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    tc = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    assert h.close(rollout, status="completed", reward=1.0).status == 200


def anthropic_rollout(h: Harness) -> None:
    rollout = h.open()
    c = anthropic_client(rollout)
    h.upstream.replies[:] = ["Checking.\n" + WEATHER, "Sunny."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.messages.create(model=MODEL, max_tokens=64, tools=A_TOOLS, messages=messages)
    use = first.content[-1]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    c.messages.create(model=MODEL, max_tokens=64, tools=A_TOOLS, messages=messages)
    assert h.close(rollout, status="completed", reward=0.0).status == 200


def responses_rollout(h: Harness) -> None:
    rollout = h.open()
    c = openai_client(rollout)
    h.upstream.replies[:] = ["<think>\nNeed data.\n</think>\n\n" + WEATHER, "Warm."]
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=R_TOOLS)
    fc = first.output[-1]
    history = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in first.output],
               {"type": "function_call_output", "call_id": fc.call_id, "output": "warm"}]
    c.responses.create(model=MODEL, input=history, tools=R_TOOLS)
    assert h.close(rollout, status="completed", reward=0.5).status == 200


def test_sft_lines_are_the_conversations_the_agents_held(proxy: Harness, tmp_path: Path) -> None:
    result = export(proxy.store, "sft", run="test", out=tmp_path / "sft.jsonl")
    assert result.rows == 3 and result.skipped == 0
    by_reply = {json.loads(line)["messages"][-1]["content"]: json.loads(line)
                for line in (tmp_path / "sft.jsonl").read_text().splitlines()}
    for line, result_text in ((by_reply["It is 21 degrees."], '{"temperature": 21}'), (by_reply["Sunny."], "sunny"),
                              (by_reply["Warm."], "warm")):
        roles = [m["role"] for m in line["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        call = line["messages"][1]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert line["messages"][2] == {"role": "tool", "tool_call_id": call["id"], "content": result_text}
        assert line["tools"][0]["function"]["name"] == "get_weather"
    only_right = export(proxy.store, "sft", run="test", out=tmp_path / "right.jsonl", where="reward >= 1")
    assert only_right.rows == 1


def test_ng_trajectory_of_proxy_turns_follows_the_schema(proxy: Harness, tmp_path: Path) -> None:
    export(proxy.store, "ng-trajectory", run="test", out=tmp_path / "ng.jsonl")
    schema = json.loads(SCHEMA.read_text())
    tokens = {r["segment_id"]: r["tokens"] for r in proxy.store.query(
        "SELECT segment_id, tokens FROM samples WHERE run = 'test'").to_pylist()}
    for text in (tmp_path / "ng.jsonl").read_text().splitlines():
        line = json.loads(text)
        jsonschema.validate(line, schema)
        kinds = [i["type"] for i in line["response"]["output"]]
        assert kinds[-3:] == ["function_call", "function_call_output", "message"]  # a leading message when it spoke
        with_tokens = [i for i in line["response"]["output"] if "generation_token_ids" in i]
        assert len(with_tokens) == 2  # one per model call
        for item in with_tokens:
            ids = item["prompt_token_ids"] + item["generation_token_ids"]
            assert tokens[line["trajstore"]["segment_id"]][:len(ids)] == ids
        assert line["responses_create_params"]["input"] == [
            {"type": "message", "role": "user", "content": "Weather in Paris?"}]


def test_hf_export_of_proxy_turns_reads_back_exactly(proxy: Harness, tmp_path: Path) -> None:
    export(proxy.store, "hf", run="test", out=tmp_path / "ds")
    copy = open_store(tmp_path / "copy")
    ingest_hf(copy, tmp_path / "ds")
    sql = ("SELECT segment_id, turn_index, prompt_ids, output_ids, output_logprobs, trainable_tokens, policy_version, "
           "finish_reason, time, sampling, request, response, meta, event_id FROM turns WHERE run = 'test' "
           "ORDER BY segment_id, turn_index")

    def rows(store: Store) -> list[dict[str, Any]]:
        """The turns with each request whole, as a value: the export carries full requests (the proxy stores a
        later call's as a delta of its session's previous call's), which read back as whole requests."""
        turns = store.query(sql).to_pylist()
        full = resolve(store, [t["event_id"] for t in turns])
        for t in turns:
            t["request"] = json.loads(full[t.pop("event_id")])
        return turns

    assert rows(copy) == rows(proxy.store)
