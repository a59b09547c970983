"""Agent frameworks, unmodified, through the capture proxy: each drives a multi-turn tool loop, and every call is
stored once, token-exact, in one segment per linear conversation.

Covered: LangChain's ChatOpenAI and ChatAnthropic, litellm (its OpenAI and Anthropic providers), pydantic-ai (which
sends tool arguments back re-serialized) and the OpenAI Agents SDK on Chat Completions (its Responses default is
in test_proxy_responses.py). The policy is `Scripted` (a random tiny model writes no tool calls); each framework
only gets the rollout's base URL and key.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.collectors.proxy_harness import MODEL, Harness, Scripted, running_proxy

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its bundled price list, no download

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
FINAL = "2 + 2 = 4."
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}


@pytest.fixture(scope="module")
def scripted(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path_factory.mktemp("store"), tiny_model) as h:
        yield h


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def one_segment(h: Harness, rollout: dict[str, Any], calls_before: int, protocol: str) -> list[str]:
    """Every call of the rollout stored once, in one segment whose tokens chain; returns how each history was
    reconciled."""
    turns = h.turns(rollout["rollout_id"])
    sent = h.upstream.sent[calls_before:]
    metas = [json.loads(t["meta"]) for t in turns]
    assert len(turns) == len(sent) == 2 and len({t["segment_id"] for t in turns}) == 1
    assert [m["fork"] for m in metas] == [None, None] and {m["protocol"] for m in metas} == {protocol}
    held: list[int] = []
    for ids, t in zip(sent, turns, strict=True):
        assert ids == held + t["prompt_ids"] and len(t["output_ids"]) == len(t["output_logprobs"])
        held = ids + t["output_ids"]
    assert [t["finish_reason"] for t in turns] == ["tool_calls", "stop"]
    return [m["history"] for m in metas]


def start(h: Harness) -> tuple[dict[str, Any], int]:
    h.upstream.replies[:] = [ADD, FINAL]
    return h.open(), len(h.upstream.sent)


def test_langchain_chat_openai_tool_loop(scripted: Harness) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    rollout, before = start(scripted)
    add_tool = tool(add)
    llm = ChatOpenAI(model=MODEL, base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"],
                     max_retries=0).bind_tools([add_tool])
    messages: list[Any] = [HumanMessage("What is 2+2?")]
    reply = llm.invoke(messages)
    assert [c["args"] for c in reply.tool_calls] == [{"a": 2, "b": 2}]
    messages += [reply, *(ToolMessage(str(add_tool.invoke(c["args"])), tool_call_id=c["id"]) for c in reply.tool_calls)]
    assert llm.invoke(messages).content == FINAL
    assert one_segment(scripted, rollout, before, "openai") == ["first", "exact"]


def test_langchain_chat_anthropic_tool_loop(scripted: Harness) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    rollout, before = start(scripted)
    add_tool = tool(add)
    llm = ChatAnthropic(model=MODEL, base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"],
                        max_retries=0, max_tokens=256).bind_tools([add_tool])
    messages: list[Any] = [HumanMessage("What is 2+2?")]
    reply = llm.invoke(messages)
    assert [c["args"] for c in reply.tool_calls] == [{"a": 2, "b": 2}]
    messages += [reply, *(ToolMessage(str(add_tool.invoke(c["args"])), tool_call_id=c["id"]) for c in reply.tool_calls)]
    assert llm.invoke(messages).text == FINAL
    assert one_segment(scripted, rollout, before, "anthropic") == ["first", "exact"]


@pytest.mark.parametrize(("provider", "protocol"), [("openai", "openai"), ("anthropic", "anthropic")])
def test_litellm_tool_loop(scripted: Harness, provider: str, protocol: str) -> None:
    import litellm

    rollout, before = start(scripted)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                               "parameters": ADD_SCHEMA}}]
    base = rollout["base_urls"][provider]
    ask: dict[str, Any] = {"model": f"{provider}/{MODEL}", "api_base": base, "api_key": rollout["api_key"],
                           "tools": tools, "max_tokens": 256, "num_retries": 0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+2?"}]
    first = litellm.completion(messages=messages, **ask).choices[0].message
    (call,) = first.tool_calls
    assert json.loads(call.function.arguments) == {"a": 2, "b": 2}
    messages += [first.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(add(**json.loads(call.function.arguments)))}]
    assert litellm.completion(messages=messages, **ask).choices[0].message.content == FINAL
    assert one_segment(scripted, rollout, before, protocol) == ["first", "exact"]


def test_pydantic_ai_sends_arguments_back_reserialized_and_the_segment_continues(scripted: Harness) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    rollout, before = start(scripted)
    provider = OpenAIProvider(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"])
    agent = Agent(OpenAIChatModel(MODEL, provider=provider), tools=[add])
    assert agent.run_sync("What is 2+2?").output == FINAL
    request = scripted.requests(rollout["rollout_id"])[1]
    sent_back = next(m for m in request["messages"] if m["role"] == "assistant")["tool_calls"][0]["function"]
    assert sent_back["arguments"] == '{"a":2,"b":2}'  # the model sampled '{"a": 2, "b": 2}'
    assert one_segment(scripted, rollout, before, "openai") == ["first", "reserialized"]


def test_openai_agents_sdk_on_chat_completions(scripted: Harness) -> None:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    rollout, before = start(scripted)

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)
        agent = Agent(name="math", instructions="Use the tool.", tools=[function_tool(add)],
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
        try:
            return await Runner.run(agent, "What is 2+2?", run_config=RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    assert asyncio.run(run()).final_output == FINAL
    assert one_segment(scripted, rollout, before, "openai") == ["first", "exact"]
