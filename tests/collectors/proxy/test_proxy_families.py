"""Llama 3 and harmony models through the capture proxy with the real openai SDK: tool loops parsed,
streamed (SSE tool-call deltas), stored token-exact and reconciled into one segment with each family's
special tokens.

The upstream is `Scripted` (given texts returned as sampled tokens of the family's tokenizer, ended by the
family's stop token), because a random tiny model never writes a well-formed call; the proxy, templates,
tokenizers, SDK and store are real.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from collectors.model.build import ModelSize, init_model
from collectors.model.families import FAMILIES
from tests.collectors.proxy_harness import MODEL, Harness, Scripted, openai_client, running_proxy

SIZE = ModelSize(vocab_size=1024, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                 max_positions=2048)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# per family: a sampled call (with its own stop token), a sampled final answer, and what the agent is told
REPLIES = {
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city":"Paris"}}<|eom_id|>',
               "It is 21 degrees.<|eot_id|>", None),
    "harmony": ("<|channel|>analysis<|message|>Need data.<|end|><|start|>assistant to=functions.get_weather"
                '<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
                "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is 21 degrees.<|return|>", "Need data."),
}


@pytest.fixture(scope="module", params=["llama3", "harmony"])
def family_proxy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, Harness]]:
    path = tmp_path_factory.mktemp("models") / request.param
    init_model(path, SIZE, family=request.param)
    upstream = Scripted(AutoTokenizer.from_pretrained(path), stops=FAMILIES[request.param].stops)
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), path) as h:
        yield request.param, h


def metas(h: Harness, rollout: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(t["meta"]) | {"segment_id": t["segment_id"]} for t in h.turns(rollout["rollout_id"])]


def test_sdk_tool_loop_is_parsed_and_stays_one_segment(family_proxy: tuple[str, Harness]) -> None:
    family, proxy = family_proxy
    call_text, final_text, reasoning = REPLIES[family]
    proxy.upstream.replies[:] = [call_text, final_text]
    rollout = proxy.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and tc.function.arguments == '{"city":"Paris"}'
    assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning
    # the SDK's copy of the reply goes back re-serialized (no python tag, no channels): reconciled, not a fork
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'}]
    second = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "It is 21 degrees."
    m = metas(proxy, rollout)
    assert m[1]["fork"] is None and m[1]["segment_id"] == m[0]["segment_id"]
    assert m[1]["history"] in ("exact", "reserialized") and all(x["output_retokenizes"] for x in m)
    turns = proxy.turns(rollout["rollout_id"])
    decode = proxy.proxy.capture.renderer.decode
    assert decode(turns[0]["output_ids"]) == call_text  # the family's stop token is stored with the reply
    tool_turn = {"llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 21}<|eot_id|>'
                           "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 "harmony": '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                            '{"temperature": 21}<|end|><|start|>assistant'}[family]
    assert decode(turns[1]["prompt_ids"]) == tool_turn  # only the new text: the sampled call tokens were kept


def test_anthropic_sdk_tool_loop_stays_one_segment(family_proxy: tuple[str, Harness]) -> None:
    from tests.collectors.proxy_harness import anthropic_client

    family, proxy = family_proxy
    proxy.upstream.replies[:] = [REPLIES[family][0], REPLIES[family][1]]
    rollout = proxy.open()
    c = anthropic_client(rollout)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=messages)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    # the input comes back as an object, the thinking block (harmony's analysis) with it
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21"}]}]
    second = c.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=messages)
    assert second.stop_reason == "end_turn" and second.content[-1].text == "It is 21 degrees."
    m = metas(proxy, rollout)
    assert m[1]["fork"] is None and m[1]["segment_id"] == m[0]["segment_id"]


def test_streamed_tool_call_arrives_as_sse_deltas(family_proxy: tuple[str, Harness]) -> None:
    family, proxy = family_proxy
    proxy.upstream.replies[:] = [REPLIES[family][0]]
    rollout = proxy.open()
    c = openai_client(rollout)
    deltas: list[Any] = []
    finishes: list[str] = []
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       max_tokens=64, stream=True)
    for chunk in stream:
        if chunk.choices:
            deltas.append(chunk.choices[0].delta)
            finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments], joined from the deltas as the SDK's users do
    for tc in (tc for d in deltas for tc in (d.tool_calls or [])):
        name, args = calls.setdefault(tc.index, ["", ""])
        calls[tc.index] = [name + (tc.function.name or ""), args + (tc.function.arguments or "")]
    assert list(calls.values()) == [["get_weather", '{"city":"Paris"}']]
    assert finishes == ["tool_calls"]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == (REPLIES[family][2] or "")
    (turn,) = proxy.turns(rollout["rollout_id"])
    assert proxy.proxy.capture.renderer.decode(turn["output_ids"]) == REPLIES[family][0]


def test_streamed_final_answer_streams_text_before_the_end(family_proxy: tuple[str, Harness]) -> None:
    family, proxy = family_proxy
    proxy.upstream.replies[:] = [REPLIES[family][1]]
    rollout = proxy.open()
    c = openai_client(rollout)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                       max_tokens=64, stream=True)
    pieces = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == "It is 21 degrees." and len(pieces) > 1  # token by token, not one piece at the end


def test_an_edited_call_is_a_history_rewrite_not_reconciled(family_proxy: tuple[str, Harness]) -> None:
    family, proxy = family_proxy
    proxy.upstream.replies[:] = [REPLIES[family][0], REPLIES[family][1]]
    rollout = proxy.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    message = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64).choices[0].message
    sent = message.model_dump(exclude_none=True)
    sent["tool_calls"][0]["function"]["arguments"] = '{"city": "Lyon"}'
    messages += [sent, {"role": "tool", "tool_call_id": sent["tool_calls"][0]["id"], "content": "rain"}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    m = metas(proxy, rollout)
    assert m[1]["history"] == "rewritten" and m[1]["fork"] is not None and m[1]["segment_id"] != m[0]["segment_id"]


def test_tool_format_is_checked_and_overrides_the_template(tiny_model: Path) -> None:
    from collectors.proxy.app import ProxyConfig
    from collectors.proxy.render import ChatRenderer

    (problem,) = ProxyConfig(model_dir=str(tiny_model), tool_format="mistral").problems()
    assert "tool_format must be one of hermes, llama3, harmony" in problem and "'mistral'" in problem
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert ChatRenderer(tok).format == "hermes" and ChatRenderer(tok, "llama3").format == "llama3"


@pytest.fixture(scope="module", params=["llama3", "harmony"])
def sampled_proxy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[str, Harness]]:
    """The family's random tiny model sampling on the embedded server, the proxy recording every sample."""
    import torch

    from collectors.embedded.app import serve_in_thread
    from collectors.policy import EmbeddedClient
    from tests.collectors.proxy_harness import Recording

    path = tmp_path_factory.mktemp("models") / request.param
    init_model(path, SIZE, family=request.param)
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(path, threads=1, max_batch=4, device="cpu") as server, \
                running_proxy(Recording(EmbeddedClient(server.url)), tmp_path_factory.mktemp("store"), path) as h:
            yield request.param, h
    finally:
        torch.set_num_threads(threads)


def test_sampled_replies_of_each_family_are_stored_exactly_streamed_or_not(
        sampled_proxy: tuple[str, Harness]) -> None:
    """Whatever the random model writes (control tokens in odd places, half a harmony header), every turn is
    stored with the sampled ids and logprobs, the family's stop ids end the replies, and streaming and
    the stored reply agree."""
    from tests.collectors.proxy_harness import assert_exact

    family, proxy = sampled_proxy
    rollout = proxy.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    for turn in range(4):
        kw = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 24, "seed": turn}
        if turn % 2:
            content, calls = "", []
            for chunk in c.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                    calls += chunk.choices[0].delta.tool_calls or []
            stored = json.loads(proxy.turns(rollout["rollout_id"])[-1]["response"])["choices"][0]["message"]
            assert content == (stored.get("content") or "")  # what streamed is what was stored
        else:
            message = c.chat.completions.create(**kw).choices[0].message
            content, calls = message.content or "", message.tool_calls or []
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": "And tomorrow?"})
    turns = assert_exact(proxy, rollout["rollout_id"])
    stops = {proxy.proxy.capture.renderer.tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family].stops}
    assert all(t["output_ids"][-1] in stops for t in turns if t["finish_reason"] in ("stop", "tool_calls"))
