"""The real `openai` SDK (sync and async, streaming and not) through the capture proxy to the embedded server.

Every stored turn is checked token for token against what the server sampled (the `Recording`
upstream keeps the server's own response JSON), and a session's turns must chain: the stored
prompt deltas and outputs of a segment concatenate to exactly the ids sent upstream.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.collectors.proxy_harness import MODEL, Harness, assert_exact, async_openai_client, openai_client


def test_sync_multi_turn_chat_is_one_exact_segment(proxy: Harness) -> None:
    rollout = proxy.open(group_id="chat", meta={"task": "t1"})
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello there, what is new?"}]
    replies = []
    for i in range(3):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=i, temperature=1.0)
        replies.append(r)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And then {i}?"}]
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len(turns) == 3 and len({t["segment_id"] for t in turns}) == 1
    assert [t["turn_index"] for t in turns] == [0, 1, 2] and all(t["session_id"] == "main" for t in turns)
    for r, t in zip(replies, turns, strict=True):
        assert r.usage.completion_tokens == len(t["output_ids"]) and r.choices[0].finish_reason == t["finish_reason"]
        assert r.model_extra["trajstore"]["segment_id"] == t["segment_id"]
    # the random model's text rarely re-tokenizes to its ids: spliced, not forked (see collectors.proxy.segmenter)
    assert any(not json.loads(t["meta"])["output_retokenizes"] for t in turns)
    sample = proxy.store.query("SELECT * FROM samples WHERE rollout_id = ?", [rollout["rollout_id"]]).to_pylist()
    (s,) = sample
    sent, last = proxy.upstream.calls[-1]
    assert s["tokens"] == sent + last.output_ids
    assert s["loss_mask"] == [m for t in turns for m in [False] * len(t["prompt_ids"]) + [True] * len(t["output_ids"])]
    assert proxy.close(rollout).status == 200


def test_async_streaming_with_usage_continues_the_segment(proxy: Harness) -> None:
    rollout = proxy.open()

    async def chat() -> tuple[str, list[Any]]:
        c = async_openai_client(rollout)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
        chunks = [ch async for ch in await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, seed=5, stream=True,
            stream_options={"include_usage": True})]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        second = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=6)
        await c.close()
        return text, [chunks, second]

    text, (chunks, second) = asyncio.run(chat())
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert [t["turn_index"] for t in turns] == [0, 1] and turns[0]["segment_id"] == turns[1]["segment_id"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(turns[0]["output_ids"])
    assert chunks[-2].choices[0].finish_reason == turns[0]["finish_reason"]
    assert text == json.loads(turns[0]["response"])["choices"][0]["message"]["content"]
    assert second.usage.prompt_tokens == len(proxy.upstream.calls[-1][0])


def test_sync_streaming_and_async_plain_calls(proxy: Harness) -> None:
    rollout = proxy.open()
    chunks = list(openai_client(rollout).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, seed=1, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].usage is None and chunks[-1].choices[0].finish_reason in ("stop", "length")

    async def plain() -> Any:
        c = async_openai_client(rollout)
        try:
            return await c.chat.completions.create(
                model=MODEL, max_tokens=8, seed=2, logprobs=True,
                messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text},
                          {"role": "user", "content": "Again"}])
        finally:
            await c.close()

    second = asyncio.run(plain())
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len({t["segment_id"] for t in turns}) == 1
    lps = [e.logprob for e in second.choices[0].logprobs.content]
    assert lps == pytest.approx(turns[1]["output_logprobs"], abs=1e-6)


def test_tool_call_history_round_trip(proxy: Harness, tiny_model: Path) -> None:
    """The SDK sends tools, an assistant tool call and its result; the template renders them into the prompt."""
    rollout = proxy.open()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    c = openai_client(rollout)
    r = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=8, seed=3)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Thanks"}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8, seed=4)
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len({t["segment_id"] for t in turns}) == 1
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model).decode(turns[0]["prompt_ids"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in prompt
    assert json.loads(turns[0]["request"])["tools"] == tools
