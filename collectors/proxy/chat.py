"""The capture proxy's protocol-neutral chat request and reply, and its error. Pure.

The wire adapters (`collectors.proxy.wire`) translate their formats to a `ChatRequest`
(messages and tools in the chat template's format) and build their responses from a
`ChatReply`; the proxy in between only deals with these.

Template message format (what `collectors.model.chat_template` renders):
    {"role": "system" | "user" | "assistant" | "tool", "content": str | None,
     "reasoning_content": str (assistant, optional),
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": JSON text}}]}
Template tool format: OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from collectors.errors import CollectorError
from collectors.model.toolcalls import ToolCall
from collectors.policy import SEED_MAX, SEED_MIN, TOP_K_MAX, SamplingParams
from collectors.proxy.frozen import freeze

if TYPE_CHECKING:
    from collectors.serving import BodyText

Message = dict[str, Any]


class ChatError(CollectorError):
    """A request the proxy refuses or cannot serve; each protocol renders it in its own error shape.

    `kind` is one of: invalid_request (400, 413, 415), authentication (401), permission (403),
    not_found (404), conflict (409), upstream (502), internal (500).
    """

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat call in the template's terms."""

    protocol: str  # openai | anthropic | responses
    model: str | None
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    parse_tools: bool  # False for tool_choice none (tool-call text stays content)
    max_tokens: int | None  # None: fill the context up to the proxy's default
    # temperature, top_p, top_k, seed, stop; its max_tokens is set by the proxy from `max_tokens` and the room left
    sampling: SamplingParams = SamplingParams()
    stream: bool = False
    continue_final: bool = False  # the last message is an assistant prefill to continue
    options: dict[str, Any] = field(default_factory=dict)  # protocol-specific (include_usage, logprobs, top_logprobs)
    # the size of the JSON body it was translated from: its text has at most this many characters (every string of
    # `messages` and `tools` is one of the body's, each character at least one byte there, or a constant such as a
    # role, shorter than the JSON around it); None when unknown
    body_bytes: int | None = None
    # the body when it is strict JSON: its text is stored as the turn's `request` as it is (None: the decoded value
    # is written as JSON instead)
    body_json: BodyText | None = None

    def sampling_for(self, max_tokens: int) -> SamplingParams:
        """The sampling parameters of this call, sampling at most `max_tokens`."""
        return dataclasses.replace(self.sampling, max_tokens=max_tokens)


@dataclass(frozen=True)
class ChatReply:
    """One sampled reply, ready to be written in either protocol."""

    id: str
    model: str
    created: int
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish: str  # stop | length | tool_calls | abort
    stop_sequence: str | None  # the stop string that ended the text, if one did
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    token_texts: list[str]  # the decoded text of each output token (OpenAI logprobs)
    policy_version: int
    trajstore: dict[str, Any] = field(default_factory=dict)  # rollout, segment, turn: echoed to the agent
    top_logprobs: list[dict[str, float]] | None = None  # per output token, when asked: {token text: logprob}
    top_n: int = 0  # how many alternatives per token the agent asked for

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Problems:
    """Collects every problem of a request, so one 400 names them all (the first names `param`)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, param: str, message: str) -> None:
        self.items.append((param, message))

    def raise_any(self) -> None:
        if self.items:
            raise ChatError("; ".join(m for _, m in self.items), param=self.items[0][0])

    def number(self, body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
        value = body.get(name)
        if value is None:
            return default
        if not is_number(value) or not low <= value <= high:
            self.add(name, f"`{name}` must be a number from {low} to {high}, got {value!r}")
            return default
        return float(value)

    def integer(self, body: dict[str, Any], name: str, low: int, default: int | None,
                high: int | None = None) -> int | None:
        value = body.get(name)
        if value is None:
            return default
        if not is_int(value) or value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            self.add(name, f"`{name}` must be an integer {bound}, got {value!r}")
            return default
        return int(value)

    def sampling(self, body: dict[str, Any], *, temperature_max: float, top_k_low: int) -> SamplingParams:
        """temperature, top_p, top_k and seed, each checked against the range every edge uses
        (`collectors.policy.contract`), so no value fails upstream or in someone else's batch."""
        temperature = self.number(body, "temperature", 0.0, temperature_max, 1.0)
        top_p = self.number(body, "top_p", 0.0, 1.0, 1.0)
        if top_p == 0:
            self.add("top_p", "`top_p` must be above 0")
        top_k = self.integer(body, "top_k", top_k_low, 0, TOP_K_MAX) or 0
        seed = self.integer(body, "seed", SEED_MIN, None, SEED_MAX)
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)


def start_request(body: Any) -> tuple[Problems, str]:
    """The checks every protocol's request starts with: a JSON object naming a `model`."""
    if not isinstance(body, dict):
        raise ChatError(f"the request body must be a JSON object, not {type(body).__name__}")
    problems = Problems()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        problems.add("model", "`model` is required: the served model's name (see GET /v1/models)")
    return problems, model


# An agent sends the same tool list on every call, and checking a JSON Schema against its metaschema costs
# milliseconds per tool (more than rendering a long history): each distinct schema is checked once, keyed by its
# canonical JSON text. Bounded, so that a caller inventing schemas cannot grow it without end.
_SCHEMA_CHECKS: OrderedDict[bytes, str | None] = OrderedDict()
SCHEMA_CACHE_SIZE = 4096


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes `schema` an invalid JSON Schema (None: valid); each distinct schema is checked once."""
    try:
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # what orjson cannot write (integers past 64 bits): uncached
        return _check_schema(schema)
    if key in _SCHEMA_CHECKS:
        _SCHEMA_CHECKS.move_to_end(key)
        return _SCHEMA_CHECKS[key]
    problem = _SCHEMA_CHECKS[key] = _check_schema(schema)
    if len(_SCHEMA_CHECKS) > SCHEMA_CACHE_SIZE:
        _SCHEMA_CHECKS.popitem(last=False)
    return problem


def _check_schema(schema: dict[str, Any]) -> str | None:
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return f"{exc.message} (at {'/'.join(map(str, exc.path)) or 'the top level'})"
    return None


TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def template_tool(name: Any, description: Any, schema: Any, problems: Problems, param: str,
                  schema_field: str) -> dict[str, Any]:
    """Validate one tool definition and return it in the template's (OpenAI) format."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        problems.add(param, f"{param}.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if description is not None and not isinstance(description, str):
        problems.add(param, f"{param}.description must be a string, got {type(description).__name__}")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if schema is not None:
        if not isinstance(schema, dict):
            problems.add(param, f"{param}.{schema_field} must be a JSON Schema object, got {type(schema).__name__}")
        elif schema.get("type", "object") != "object":
            problems.add(param, f"{param}.{schema_field} must describe an object (\"type\": \"object\"), "
                                f"got type {schema.get('type')!r}")
        else:
            problem = schema_problem(schema)
            if problem is not None:
                problems.add(param, f"{param}.{schema_field} is not a valid JSON Schema: {problem}")
        function["parameters"] = schema
    return {"type": "function", "function": function}


# (name, description, schema, where the definition is) of a tool a protocol supports; None for one it does not
ToolFields = Callable[[dict[str, Any], str], "tuple[Any, Any, Any, str] | None"]


# An agent sends the same tool list on every call: a valid list is translated once per protocol, found by its JSON
# text (its keys in the order sent: a template writes them in that order) and taken when equal to the list it was
# made from (orjson writes NaN as null; NaN equals nothing, so such a list is translated each time). The entry keeps
# frozen copies (`collectors.proxy.frozen`) of that list and of its translation, which every call that sends the
# list shares: a caller that changes its own list afterwards changes neither, and a change to the translation
# raises instead of reaching the other calls. Bounded, as above.
_TOOL_LISTS: OrderedDict[bytes, tuple[list[Any], list[dict[str, Any]] | None]] = OrderedDict()
TOOL_LIST_CACHE_SIZE = 256


def template_tools(tools: Any, problems: Problems, fields: ToolFields, refusal: Callable[[str, Any], str],
                   schema_field: str, *, protocol: str, schema_required: bool = False) -> list[dict[str, Any]] | None:
    """Validate a request's tool list into template tools (`protocol`'s shape: `fields` reads a tool);
    `refusal(where, type)` says what is supported."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        problems.add("tools", "`tools` must be a list of tools")
        return None
    try:
        key: bytes | None = protocol.encode() + b"\0" + orjson.dumps(tools)
    except (TypeError, orjson.JSONEncodeError):  # what orjson cannot write (integers past 64 bits): uncached
        key = None
    if key is not None and key in _TOOL_LISTS and _TOOL_LISTS[key][0] == tools:
        _TOOL_LISTS.move_to_end(key)
        return _TOOL_LISTS[key][1]
    known = len(problems.items)
    translated = _template_tools(tools, problems, fields, refusal, schema_field, schema_required)
    if key is not None and len(problems.items) == known:  # only a valid list: a refused one is named each time
        translated = freeze(translated)
        _TOOL_LISTS[key] = (freeze(tools), translated)
        if len(_TOOL_LISTS) > TOOL_LIST_CACHE_SIZE:
            _TOOL_LISTS.popitem(last=False)
    return translated


def _template_tools(tools: list[Any], problems: Problems, fields: ToolFields, refusal: Callable[[str, Any], str],
                    schema_field: str, schema_required: bool) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        got = fields(tool, where) if isinstance(tool, dict) else None
        if got is None:
            problems.add(where, refusal(where, tool.get("type") if isinstance(tool, dict) else type(tool).__name__))
            continue
        name, description, schema, at = got
        if schema_required and schema is None:
            problems.add(where, f"{at}.{schema_field} is required (a JSON Schema object)")
        out.append(template_tool(name, description, schema, problems, at, schema_field))
    return out or None
