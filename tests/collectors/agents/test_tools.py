"""Tool schemas from signatures and docstrings, and `call_tool`'s promise: always text, never an exception."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Literal, Optional

import pytest

from collectors.agents.tools import (
    ToolSchemaError,
    call_tool,
    load_tools,
    tool_schema,
    tools_by_name,
    truncate,
    validate,
)


def search(query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast", lang: str | None = None,
           tags: list[str] | None = None, weights: dict[str, float] | None = None, strict: bool = False,
           scale: float = 1.0, raw: list = [], extra: dict = {},  # noqa: B006 - defaults shown in the schema
           opts: dict[str, Any] | None = None) -> list[str]:
    """Search the index for documents.

    Longer explanation that is not part of the description.

    Args:
        query: What to look for,
            over two lines.
        limit (int): How many results.
        mode: Which matcher.
        lang: A language code.

    Returns:
        The matching titles.
    """
    return [query] * limit


def no_doc(x: int, level: Optional[Literal[1, 2]] = None) -> int:  # noqa: UP045 - Optional is supported too
    return x


def nothing() -> None:
    """Do nothing at all."""


async def slow_echo(text: str) -> str:
    """Echo, asynchronously."""
    await asyncio.sleep(0)
    return text


def boom(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"cannot do {reason}")


def thread_name() -> dict[str, Any]:
    """Where a sync tool runs."""
    return {"thread": threading.current_thread().name, "main": threading.current_thread() is threading.main_thread()}


def test_schema_of_every_supported_annotation_and_the_docstring() -> None:
    fn = tool_schema(search)["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the index for documents."
    params = fn["parameters"]
    assert params["required"] == ["query"]
    assert params["properties"] == {
        "query": {"type": "string", "description": "What to look for, over two lines."},
        "limit": {"type": "integer", "description": "How many results.", "default": 5},
        "mode": {"type": "string", "enum": ["fast", "exact"], "description": "Which matcher.", "default": "fast"},
        "lang": {"type": ["string", "null"], "description": "A language code.", "default": None},
        "tags": {"type": ["array", "null"], "items": {"type": "string"}, "default": None},
        "weights": {"type": ["object", "null"], "additionalProperties": {"type": "number"}, "default": None},
        "strict": {"type": "boolean", "default": False},
        "scale": {"type": "number", "default": 1.0},
        "raw": {"type": "array", "default": []},
        "extra": {"type": "object", "default": {}},
        "opts": {"type": ["object", "null"], "additionalProperties": {}, "default": None},
    }
    assert tool_schema(no_doc) == {"type": "function", "function": {"name": "no_doc", "parameters": {
        "type": "object", "required": ["x"], "properties": {
            "x": {"type": "integer"}, "level": {"type": ["integer", "null"], "enum": [1, 2, None], "default": None}}}}}
    assert tool_schema(nothing)["function"] == {"name": "nothing", "description": "Do nothing at all.",
                                                "parameters": {"type": "object", "properties": {}, "required": []}}


def test_schema_text_is_deterministic_and_a_caller_cannot_change_it() -> None:
    first = json.dumps(tool_schema(search))
    tool_schema(search)["function"]["parameters"]["properties"].clear()
    assert json.dumps(tool_schema(search)) == first
    # the key order is the rendering order: type, function{name, description, parameters}, signature order
    assert list(json.loads(first)["function"]) == ["name", "description", "parameters"]
    assert list(json.loads(first)["function"]["parameters"]["properties"])[:3] == ["query", "limit", "mode"]


def untyped(x):  # type: ignore[no-untyped-def]
    return x


def with_set(items: set[str]) -> None:
    pass


def with_union(x: int | str) -> None:
    pass


def with_int_keys(x: dict[int, str]) -> None:
    pass


def with_mixed_literal(x: Literal["a", 1]) -> None:
    pass


def with_varargs(*xs: int) -> None:
    pass


def with_nested_bad(x: list[tuple[int, int]]) -> None:
    pass


@pytest.mark.parametrize(("fn", "words"), [
    (untyped, ["untyped", "'x'", "no type annotation", "str, int"]),
    (with_set, ["with_set", "'items'", "set[str] is not supported", "list[X]"]),
    (with_union, ["'x'", "union", "X | None"]),
    (with_int_keys, ["non-string keys"]),
    (with_mixed_literal, ["one type"]),
    (with_varargs, ["'xs'", "named arguments only"]),
    (with_nested_bad, ["'x'", "tuple[int, int] is not supported"]),
    (lambda x: x, ["<lambda>", "def name"]),
])
def test_unsupported_annotations_name_the_parameter_and_what_is_supported(fn: Any, words: list[str]) -> None:
    with pytest.raises(ToolSchemaError) as err:
        tool_schema(fn)
    for word in words:
        assert word in str(err.value)


def call(tools: list[Any], name: str, arguments: str, limit: int = 1000) -> str:
    return asyncio.run(call_tool(tools_by_name(tools), name, arguments, max_output_chars=limit))


def test_sync_and_async_tools_and_their_results_as_text() -> None:
    assert call([search], "search", '{"query": "q", "limit": 2}') == '["q", "q"]'
    assert call([slow_echo], "slow_echo", '{"text": "hé"}') == "hé"
    assert call([nothing], "nothing", "") == "null"  # no arguments may come as an empty string
    where = json.loads(call([thread_name], "thread_name", "{}"))
    assert not where["main"]  # a sync tool runs in a worker thread, off the event loop


def test_every_failure_comes_back_as_an_error_result() -> None:
    tools = [search, boom]
    assert call(tools, "nope", "{}") == "error: unknown tool 'nope'; the available tools are: boom, search"
    bad_json = call(tools, "search", '{"query": ')
    assert bad_json.startswith("error: the arguments of 'search' are not valid JSON")
    assert call(tools, "search", '["q"]') == "error: the arguments of 'search' must be a JSON object, not list"
    assert call(tools, "boom", '{"reason": "this"}') == "error: ValueError: cannot do this"


def test_arguments_are_validated_and_every_problem_is_listed() -> None:
    out = call([search], "search", json.dumps({"limit": True, "mode": "slow", "tags": ["a", 3], "zzz": 1,
                                               "weights": {"w": "x"}, "scale": 2}))
    assert out.startswith("error: invalid arguments for 'search': ")
    for problem in ("'query' is a required property", "argument 'limit': True is not of type 'integer'",
                    "argument 'mode': 'slow' is not one of ['fast', 'exact']",
                    "argument 'tags[1]': 3 is not of type 'string'",
                    "Additional properties are not allowed ('zzz' was unexpected)",
                    "argument 'weights.w': 'x' is not of type 'number'"):
        assert problem in out
    assert "argument 'scale'" not in out  # an integer is a valid number
    assert call([search], "search", '{"query": "q", "lang": null, "limit": 1}') == '["q"]'


def test_long_output_is_cut_with_a_marker() -> None:
    out = call([slow_echo], "slow_echo", json.dumps({"text": "x" * 500}), limit=100)
    assert out == "x" * 64 + "\n[... truncated 436 more characters]" and len(out) == 100
    assert truncate("short", 10) == "short"
    long_error = call([boom], "boom", json.dumps({"reason": "y" * 500}), limit=80)
    assert long_error.startswith("error: ValueError: cannot do y") and len(long_error) == 80


def test_validate_alone() -> None:
    params = tool_schema(no_doc)["function"]["parameters"]
    assert validate(params, {"x": 1, "level": 2}) == []
    assert validate(params, {"x": 1.5, "level": 3}) == ["argument 'level': 3 is not one of [1, 2, None]",
                                                        "argument 'x': 1.5 is not of type 'integer'"]


def test_load_tools_by_import_path() -> None:
    tools = load_tools("tests.collectors.agents.test_tools:search, tests.collectors.agents.test_tools:boom")
    assert tools == [search, boom]
    with pytest.raises(ToolSchemaError, match="both named 'search'"):
        load_tools("tests.collectors.agents.test_tools:search,tests.collectors.agents.test_tools:search")
    with pytest.raises(ToolSchemaError, match="not a function"):
        load_tools("tests.collectors.agents.test_tools:TEXT")
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_tools("tests.collectors.agents.test_tools:missing")


TEXT = "not callable"
