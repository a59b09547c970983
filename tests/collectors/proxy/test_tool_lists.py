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


def fresh(value: Any) -> Any:
    """`value` as a new body decodes it: equal, sharing no object with it."""
    return json.loads(json.dumps(value))


def test_lists_that_differ_only_in_a_schema_or_an_order_get_their_own_translation() -> None:
    """Same names, another schema; the same tools in another order; the same schema with its keys in another order
    (a template writes them in the order sent): each is translated as sent, never another list's translation."""
    read, write = tool(), {"type": "function", "function": {"name": "write", "parameters": SCHEMA}}
    base = OpenAIChat().parse_request(openai(fresh([read, write]))).tools
    other_schema = OpenAIChat().parse_request(openai(fresh([tool(required=["path"]), write]))).tools
    swapped = OpenAIChat().parse_request(openai(fresh([write, read]))).tools
    reordered_schema = {"properties": SCHEMA["properties"], "type": "object"}
    reordered = OpenAIChat().parse_request(openai(fresh([
        {"type": "function", "function": {"name": "read", "parameters": reordered_schema}}, write]))).tools
    assert base == [read, write] and other_schema == [tool(required=["path"]), write] and swapped == [write, read]
    assert reordered is not None and list(reordered[0]["function"]["parameters"]) == ["properties", "type"]
    assert list(base[0]["function"]["parameters"]) == ["type", "properties"]  # its own translation, not reordered's


def test_a_list_the_caller_changes_after_a_call_changes_no_translation() -> None:
    """The translation shares nothing with the caller's list: editing that list (an SDK building the next call's
    body in place) changes neither the tools of the call already made nor those of a later call that sends the
    original list again, and a call that sends the edited list gets the edited tools."""
    tools = fresh([tool(description="first")])
    first = OpenAIChat().parse_request(openai(tools)).tools
    tools[0]["function"]["parameters"]["properties"]["path"]["type"] = "integer"
    tools.append({"type": "function", "function": {"name": "write", "parameters": SCHEMA}})
    assert first == [tool(description="first")]
    assert OpenAIChat().parse_request(openai(fresh([tool(description="first")]))).tools == [tool(description="first")]
    edited = OpenAIChat().parse_request(openai(tools)).tools
    assert edited is not None and len(edited) == 2
    assert edited[0]["function"]["parameters"]["properties"]["path"]["type"] == "integer"


def test_a_shared_translation_cannot_be_changed_by_one_of_its_callers() -> None:
    """Every in-place change to a translation that later calls share raises, at any depth, so no call sees tools
    that another call changed; a copy is the caller's own to change."""
    import copy

    shared = OpenAIChat().parse_request(openai(fresh([tool(description="shared")]))).tools
    assert shared is not None
    changes = [lambda: shared.append(tool()), lambda: shared.pop(), lambda: shared.__setitem__(0, tool()),
               lambda: shared[0].__setitem__("type", "custom"), lambda: shared[0]["function"].update(name="x"),
               lambda: shared[0]["function"]["parameters"]["properties"].pop("path"),
               lambda: shared[0]["function"]["parameters"]["properties"]["path"].clear()]
    for change in changes:
        with pytest.raises(TypeError, match="shared by every call"):
            change()
    mine = copy.deepcopy(shared)
    mine[0]["function"]["parameters"]["properties"]["path"]["type"] = "integer"
    mine.append(tool())
    again = OpenAIChat().parse_request(openai(fresh([tool(description="shared")]))).tools
    assert again is shared and again == [tool(description="shared")]
    assert json.dumps(again) == json.dumps([tool(description="shared")])  # written as the plain list is


def test_each_protocol_shares_a_frozen_translation() -> None:
    """The Anthropic and Responses adapters' translations are shared and frozen the same way."""
    anthropic = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"name": "read", "input_schema": SCHEMA}]}
    responses = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "read", "parameters": SCHEMA}]}
    for wire, body in ((AnthropicMessages(), anthropic), (OpenAIResponses(), responses)):
        first = wire.parse_request(fresh(body)).tools
        assert first is not None and wire.parse_request(fresh(body)).tools is first
        with pytest.raises(TypeError):
            first[0]["function"]["parameters"]["properties"]["path"]["type"] = "integer"
