"""Tools for agents: plain Python functions, their JSON schemas, and calling them on a model's behalf.

A tool is any function (sync or async) with annotated parameters and a Google-style docstring:

    def add(a: int, b: int = 0) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first number.
            b: the second number.
        \"\"\"
        return a + b

`tool_schema(add)` gives the OpenAI function-tool object the chat template renders into the
prompt. Its output is deterministic (keys in a fixed order, parameters in signature order):
the same tools must render to the same tokens in training data and in collection.

Supported annotations: str, int, float, bool, list, list[X], dict, dict[str, X], Literal[...]
(of str/int/float/bool), `X | None` / Optional[X], and Any (any JSON value, no "type"). A parameter with a default is not
required; its default is shown to the model when it is JSON (None included).

`call_tool` runs one call the model asked for and ALWAYS returns text: a model's mistake (an
unknown tool, bad JSON, wrong arguments) or a tool's exception becomes an `error: ...` tool
result the model can read and recover from, never an exception that ends the rollout.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from jsonschema import Draft202012Validator

from collectors.agents.context import load_object
from collectors.errors import CollectorError

Tool = Callable[..., Any]
_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
SUPPORTED = "str, int, float, bool, list, list[X], dict, dict[str, X], Literal[...], X | None, Any"


class ToolSchemaError(CollectorError, TypeError):
    """A function cannot be offered as a tool: an unannotated or unsupported parameter."""


def tool_schema(fn: Tool) -> dict[str, Any]:
    """The OpenAI function-tool object for `fn`: name, docstring description, JSON Schema of its parameters."""
    try:
        schema = _cached_schema(fn)
    except TypeError as exc:
        if isinstance(exc, ToolSchemaError):
            raise
        schema = _schema(fn)  # an unhashable callable: nothing to cache it by
    return copy.deepcopy(schema)  # callers may edit their copy; the cached one must stay as rendered


def _schema(fn: Tool) -> dict[str, Any]:
    name = getattr(fn, "__name__", None)
    if not name or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolSchemaError(f"tool {fn!r} needs a name of 1-64 letters, digits, _ or - (it is {name!r}); "
                              "give it a def name instead of a lambda or partial")
    description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # a NameError in a string annotation, a bad forward reference
        raise ToolSchemaError(f"tool {name!r}: its annotations cannot be resolved ({exc}); "
                              "import every type its annotations name in its module") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ToolSchemaError(f"tool {name!r}: parameter {param.name!r} is {param.kind.description}; a tool "
                                  "takes named arguments only (the model sends a JSON object), so give it plain "
                                  "parameters")
        if param.name not in hints:
            raise ToolSchemaError(f"tool {name!r}: parameter {param.name!r} has no type annotation; annotate it "
                                  f"with one of: {SUPPORTED}")
        try:
            prop = _type_schema(hints[param.name])
        except ToolSchemaError as exc:
            raise ToolSchemaError(f"tool {name!r}: parameter {param.name!r}: {exc}; supported annotations: "
                                  f"{SUPPORTED}") from None
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif _is_json(param.default):
            prop["default"] = param.default
        properties[param.name] = prop
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": function}


_cached_schema = functools.lru_cache(maxsize=1024)(_schema)


def _type_schema(tp: Any) -> dict[str, Any]:
    """JSON Schema of one annotation; raises ToolSchemaError (without the parameter name) when unsupported."""
    if tp is Any:
        return {}  # any JSON value; mostly as dict[str, Any]
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0])} if args else {"type": "array"}
    if tp is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise ToolSchemaError(f"{_show(tp)} has non-string keys, which JSON objects cannot have")
        return {"type": "object", "additionalProperties": _type_schema(args[1])}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
            raise ToolSchemaError(f"{_show(tp)} must list values of one type among str, int, float, bool")
        return {"type": _SCALARS[next(iter(kinds))], "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(rest) == len(args):
            raise ToolSchemaError(f"{_show(tp)} is a union; only `X | None` (Optional[X]) is supported")
        schema = _type_schema(rest[0])
        if "type" not in schema:
            return schema  # Any already admits null
        schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        return schema
    raise ToolSchemaError(f"{_show(tp)} is not supported")


def _show(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph as one line, {parameter: description} from a Google-style `Args:` section)."""
    lines = doc.splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip():
            break
        if re.fullmatch(r"\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):\s*", line):
            break
        first.append(line.strip())
    args: dict[str, str] = {}
    section_indent: int | None = None
    current: str | None = None
    item_indent = 0
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if section_indent is None:
            if re.fullmatch(r"\s*(Args|Arguments|Parameters):\s*", line):
                section_indent = indent
            continue
        if not line.strip():
            continue
        if indent <= section_indent:
            break  # the next section (Returns:, Raises:, ...) ends the argument list
        entry = re.fullmatch(r"\s*\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if entry and (current is None or indent <= item_indent):
            current, item_indent = entry.group(1), indent
            args[current] = entry.group(2).strip()
        elif current is not None:
            args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(first), args


def load_tools(spec: str) -> list[Tool]:
    """`"module:name,module:name2"` -> the functions; each gets its schema checked now, not mid-rollout."""
    tools = [load_object(part.strip(), what="tool") for part in spec.split(",") if part.strip()]
    names: dict[str, str] = {}
    for part, tool in zip((p.strip() for p in spec.split(",") if p.strip()), tools, strict=True):
        if not callable(tool):
            raise ToolSchemaError(f"tool {part!r} is a {type(tool).__name__}, not a function")
        name = tool_schema(tool)["function"]["name"]
        if name in names:
            raise ToolSchemaError(f"tools {names[name]!r} and {part!r} are both named {name!r}; the model calls "
                                  "tools by name, so rename one")
        names[name] = part
    return tools


def tools_by_name(tools: list[Tool]) -> dict[str, Tool]:
    """{schema name: function}, the mapping `call_tool` takes."""
    return {tool_schema(t)["function"]["name"]: t for t in tools}


async def call_tool(tools: Mapping[str, Tool], name: str, arguments_json: str, *, max_output_chars: int) -> str:
    """Run one tool call the model made; the result (or an `error: ...` text) as the tool message content."""
    try:
        text = await _call(tools, name, arguments_json)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model must see what went wrong; the rollout goes on
        text = f"error: {type(exc).__name__}: {exc}"
    return truncate(text, max_output_chars)


async def _call(tools: Mapping[str, Tool], name: str, arguments_json: str) -> str:
    fn = tools.get(name)
    if fn is None:
        available = ", ".join(sorted(tools)) or "none"
        return f"error: unknown tool {name!r}; the available tools are: {available}"
    try:
        arguments = json.loads(arguments_json) if arguments_json.strip() else {}
    except json.JSONDecodeError as exc:
        return f"error: the arguments of {name!r} are not valid JSON ({exc}); send one JSON object"
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name!r} must be a JSON object, not {type(arguments).__name__}"
    problems = validate(tool_schema(fn)["function"]["parameters"], arguments)
    if problems:
        return f"error: invalid arguments for {name!r}: " + "; ".join(problems)
    if inspect.iscoroutinefunction(fn):
        result = await fn(**arguments)
    else:
        # a sync tool may block (a subprocess, a file); a thread keeps the other rollouts running
        result = await asyncio.to_thread(fn, **arguments)
        if inspect.isawaitable(result):
            result = await result
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


def validate(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> list[str]:
    """Every problem of `arguments` against a tool's parameters schema (JSON Schema, checked by `jsonschema`).

    Arguments the function does not take are refused too: the model sees their names."""
    schema = {**parameters, "additionalProperties": False}
    problems = []
    for error in sorted(Draft202012Validator(schema).iter_errors(arguments), key=lambda e: list(e.path)):
        where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                        for i, p in enumerate(error.path))
        problems.append(f"argument {where!r}: {error.message}" if where else error.message)
    return problems


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, the cut said at the end so the model knows output is missing."""
    if len(text) <= max_chars:
        return text
    marker = f"\n[... truncated {len(text) - max_chars} more characters]"
    keep = max(0, max_chars - len(marker))
    marker = f"\n[... truncated {len(text) - keep} more characters]"
    return text[:keep] + marker
