"""A tool list an agent sends on every call is translated once per protocol, and only ever reused for an equal list."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from collectors.proxy.chat import ChatError
from collectors.proxy.wire import AnthropicMessages, OpenAIChat, OpenAIResponses

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}


def openai(tools: list[Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}


def tool(**schema: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "read", "parameters": {**SCHEMA, **schema}}}


def test_the_same_list_sent_again_is_translated_once() -> None:
    first = OpenAIChat().parse_request(json.loads(json.dumps(openai([tool()])))).tools
    again = OpenAIChat().parse_request(json.loads(json.dumps(openai([tool()])))).tools
    assert again is first and first == [tool()]


def test_a_list_is_reused_only_for_an_equal_one() -> None:
    """orjson writes NaN and infinity as null: a list holding one is never taken for (or given) another's."""
    with_null = OpenAIChat().parse_request(openai([tool(default=None)])).tools
    with_nan = OpenAIChat().parse_request(openai([tool(default=math.nan)])).tools
    assert with_null is not None and with_nan is not None
    assert with_null[0]["function"]["parameters"]["default"] is None
    assert math.isnan(with_nan[0]["function"]["parameters"]["default"])
    with_inf = OpenAIChat().parse_request(openai([tool(default=math.inf)])).tools
    assert with_inf is not None and with_inf[0]["function"]["parameters"]["default"] == math.inf


def test_a_refused_list_is_refused_every_time() -> None:
    bad = openai([{"type": "function", "function": {"name": "bad name"}}])
    for _ in range(2):
        with pytest.raises(ChatError, match=r"tools\[0\]\.function\.name must be"):
            OpenAIChat().parse_request(bad)


def test_each_protocol_translates_its_own_shape() -> None:
    """A list that two protocols both take (each reading its own fields) is translated by each."""
    both = [{"type": "function", "name": "write", "parameters": SCHEMA,
             "function": {"name": "read", "parameters": SCHEMA}}]
    chat = OpenAIChat().parse_request(openai(both)).tools
    responses = OpenAIResponses().parse_request({"model": "m", "input": "hi", "tools": both}).tools
    assert chat is not None and responses is not None
    assert chat[0]["function"]["name"] == "read" and responses[0]["function"]["name"] == "write"
    anthropic = AnthropicMessages().parse_request({"model": "m", "max_tokens": 1, "tools": [
        {"name": "read", "input_schema": SCHEMA}], "messages": [{"role": "user", "content": "hi"}]}).tools
    assert anthropic == [{"type": "function", "function": {"name": "read", "parameters": SCHEMA}}]
