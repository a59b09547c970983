"""The real `anthropic` SDK (sync and async, streaming and not) through the capture proxy to the embedded server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic

from tests.collectors.proxy_harness import MODEL, Harness, anthropic_client, assert_exact


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_sync_multi_turn_with_system_blocks_is_one_exact_segment(proxy: Harness) -> None:
    rollout = proxy.open(group_id="a-chat")
    c = anthropic_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Hello, who are you?"}]}]
    replies = []
    for i in range(3):
        m = c.messages.create(model=MODEL, max_tokens=10, system=[{"type": "text", "text": "You are terse."}],
                              messages=messages, extra_body={"seed": 10 + i, "temperature": 1.0})
        replies.append(m)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": f"Next {i}"}]
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert len(turns) == 3 and len({t["segment_id"] for t in turns}) == 1
    for m, t in zip(replies, turns, strict=True):
        assert m.type == "message" and m.role == "assistant" and m.model == MODEL
        assert m.usage.output_tokens == len(t["output_ids"])
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[t["finish_reason"]]
    assert json.loads(turns[0]["meta"])["protocol"] == "anthropic"


def test_async_streaming_events_and_continuation(proxy: Harness) -> None:
    rollout = proxy.open()

    async def chat() -> tuple[list[Any], Any, Any]:
        c = anthropic.AsyncAnthropic(base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"],
                                     max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a line."}]
        events = [e async for e in await c.messages.create(model=MODEL, max_tokens=9, messages=messages,
                                                            stream=True, extra_body={"seed": 3})]
        async with c.messages.stream(model=MODEL, max_tokens=9, extra_body={"seed": 4}, messages=[
                *messages, {"role": "assistant", "content": "".join(
                    e.delta.text for e in events if e.type == "content_block_delta")},
                {"role": "user", "content": "More."}]) as stream:
            final = await stream.get_final_message()
        plain = await c.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
        await c.close()
        return events, final, plain

    events, final, plain = asyncio.run(chat())
    turns = assert_exact(proxy, rollout["rollout_id"])
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert [e.type for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2].usage.output_tokens == len(turns[0]["output_ids"])
    assert final.usage.output_tokens == len(turns[1]["output_ids"]) and final.content[0].type == "text"
    assert turns[1]["segment_id"] == turns[0]["segment_id"] and turns[1]["turn_index"] == 1
    # a fresh conversation in the same session is a rewrite: a fork, a new segment, same rollout
    assert turns[2]["segment_id"] != turns[0]["segment_id"]
    assert json.loads(turns[2]["meta"])["fork"] == "history_rewrite"
    assert plain.usage.input_tokens == len(turns[2]["prompt_ids"])


def test_sync_stream_and_tool_result_history(proxy: Harness, tiny_model: Path) -> None:
    rollout = proxy.open()
    tools = [{"name": "read_file", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Show README"},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "README.md"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "# trajstore"}]}]
    with anthropic_client(rollout).messages.stream(model=MODEL, max_tokens=8, tools=tools, messages=messages) as stream:
        final = stream.get_final_message()
    (turn,) = assert_exact(proxy, rollout["rollout_id"])
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model).decode(turn["prompt_ids"])
    assert '"name": "read_file", "description": "Read a file", "parameters": {"type": "object"' in prompt
    assert 'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>' in prompt
    assert "<tool_response>\n# trajstore\n</tool_response>" in prompt
    assert final.usage.input_tokens == len(turn["prompt_ids"])


def test_prefill_continues_the_assistant_message(proxy: Harness) -> None:
    rollout = proxy.open()
    anthropic_client(rollout).messages.create(model=MODEL, max_tokens=5, messages=[
        {"role": "user", "content": "Answer in JSON"}, {"role": "assistant", "content": '{"answer":'}])
    (turn,) = assert_exact(proxy, rollout["rollout_id"])
    assert proxy.proxy.capture.renderer.decode(turn["prompt_ids"]).endswith('<|im_start|>assistant\n{"answer":')
