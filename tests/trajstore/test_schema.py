"""The event contract agrees with itself: the Arrow schema (schemas/events.v1.json as
`trajstore.EVENT_SCHEMA`), the JSON Schema of one event (schemas/event.v1.schema.json), the
typed dataclasses of `trajstore.events` and the Delta table a store creates.

A JSON line that the JSON Schema accepts must be one the store accepts, and the other way
round for the invalid examples; both are checked with the real `jsonschema` validator and
the real `trajstore.events.to_columns`.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

import trajstore
from trajstore import EVENT_SCHEMA, InvalidEventError, routes
from trajstore.events import EVENT_TYPES, REQUIRED, SUPPLIABLE, to_columns
from trajstore.schema import (
    COUNT_COLUMNS,
    FINISH_REASONS,
    JSON_COLUMNS,
    JSON_SCHEMA,
    KINDS,
    SPEC,
    STATUSES,
    WRITER_COLUMNS,
)

PROPERTIES: dict[str, Any] = JSON_SCHEMA["properties"]
VALIDATOR = jsonschema.Draft202012Validator(JSON_SCHEMA, format_checker=jsonschema.FormatChecker())
STORE_FILLED = WRITER_COLUMNS | COUNT_COLUMNS
_INT_RANGE = {pa.int16(): (-(2**15), 2**15 - 1), pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1)}


def json_types(prop: dict[str, Any]) -> set[str]:
    """The JSON types a property allows (from `type`, or from the values of an `enum`)."""
    if "type" in prop:
        t = prop["type"]
        return {t} if isinstance(t, str) else set(t)
    names = {type(None): "null", str: "string", bool: "boolean", int: "integer", float: "number"}
    return {names[type(v)] for v in prop["enum"]}


def jsonschema_ok(event: dict[str, Any]) -> bool:
    return VALIDATOR.is_valid(event)


def store_ok(event: dict[str, Any]) -> bool:
    try:
        to_columns([copy.deepcopy(event)])
    except InvalidEventError:
        return False
    return True


# Full examples of every kind: every field the kind can carry, as a JSON line would hold it.
FULL: dict[str, dict[str, Any]] = {
    "turn": {
        "event_id": "e-turn-1", "kind": "turn", "time": "2026-01-31T12:00:00Z", "run": "exp",
        "group_id": "g1", "rollout_id": "r1", "session_id": "main", "segment_id": "s1",
        "turn_index": 0, "policy_version": 3, "prompt_ids": [1, 2, 3], "output_ids": [4, 5],
        "output_logprobs": [-0.5, 0.0], "output_mask": [True, False], "finish_reason": "stop",
        "sampling": {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": 7},
        "request": {"messages": [{"role": "user", "content": "hi"}]}, "response": "hello",
        "meta": {"task": "t-1"}, "output_version_starts": [0, 1], "output_version_values": [3, 4],
        "request_base": "e-earlier", "request_shared": 1,
    },
    "reward": {"kind": "reward", "group_id": "g1", "rollout_id": "r1", "segment_id": "s1",
               "reward": 0.5, "reward_name": "format", "meta": {"judge": "regex"}},
    "status": {"kind": "status", "group_id": "g1", "rollout_id": "r1", "status": "failed",
               "error": "tool crashed", "group_size": 4},
    "checkpoint": {"kind": "checkpoint", "policy_version": 4, "step": 10, "table_version": 7,
                   "consumed": ["r1", "r2"], "metrics": {"loss": 0.25}, "meta": {"path": "/ckpt/4"}},
    "metric": {"kind": "metric", "step": 10, "metrics": {"loss": 0.25, "clip_frac": 0.0},
               "policy_version": 3, "table_version": 7, "consumed": ["r1"]},
    "teacher": {"kind": "teacher", "group_id": "g1", "rollout_id": "r1", "segment_id": "s1", "turn_index": 0,
                "policy_version": 3, "teacher": "big", "teacher_logprobs": [-0.25, -2.0],
                "meta": {"model": "/models/big"}},
}
MINIMAL: dict[str, dict[str, Any]] = {
    kind: {"kind": kind, **{name: FULL[kind][name] for name in REQUIRED[kind]}} for kind in KINDS
}


def test_json_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(JSON_SCHEMA)


def test_arrow_schema_is_the_schema_file() -> None:
    assert EVENT_SCHEMA.names == [c["name"] for c in SPEC["columns"]]
    assert len(set(EVENT_SCHEMA.names)) == len(EVENT_SCHEMA.names)
    for column in SPEC["columns"]:
        assert EVENT_SCHEMA.field(column["name"]).nullable == column["nullable"], column["name"]
    assert EVENT_SCHEMA.field("prompt_ids").type == pa.list_(pa.int32())
    assert EVENT_SCHEMA.field("output_logprobs").type == pa.list_(pa.float32())
    assert EVENT_SCHEMA.field("output_mask").type == pa.list_(pa.bool_())
    assert EVENT_SCHEMA.field("time").type == pa.timestamp("us", tz="UTC")
    assert EVENT_SCHEMA.field("metrics").type == pa.map_(pa.string(), pa.float64())


def test_every_column_is_suppliable_or_store_filled() -> None:
    columns = set(EVENT_SCHEMA.names)
    assert STORE_FILLED <= columns
    assert set(PROPERTIES) == columns - STORE_FILLED == SUPPLIABLE
    # The JSON Schema says which columns the store fills, so a producer knows to leave them out.
    for name in STORE_FILLED:
        assert name in JSON_SCHEMA["description"]
    assert JSON_SCHEMA["additionalProperties"] is False


def test_vocabularies_agree() -> None:
    assert set(PROPERTIES["kind"]["enum"]) == KINDS == set(REQUIRED) == set(EVENT_TYPES) == set(SPEC["kinds"])
    assert set(PROPERTIES["status"]["enum"]) == STATUSES
    assert set(PROPERTIES["finish_reason"]["enum"]) - {None} == FINISH_REASONS


def test_required_per_kind_agrees() -> None:
    from_json: dict[str, set[str]] = {}
    for rule in JSON_SCHEMA["allOf"]:
        kind = rule["if"]["properties"]["kind"]["const"]
        from_json[kind] = set(rule["then"]["required"])
    assert from_json == {kind: set(names) for kind, names in REQUIRED.items()}
    assert JSON_SCHEMA["required"] == ["kind"]


@pytest.mark.parametrize("name", sorted(SUPPLIABLE))
def test_json_type_is_compatible_with_the_arrow_type(name: str) -> None:
    prop = PROPERTIES[name]
    field = EVENT_SCHEMA.field(name)
    typ = field.type
    allowed = json_types(prop)
    if not field.nullable:
        assert "null" not in allowed, f"{name} is not nullable in Arrow"
    allowed.discard("null")
    if name in JSON_COLUMNS:  # stored as JSON text
        assert typ == pa.string() and allowed and allowed <= {"object", "array", "string"}
    elif name == "time":
        assert pa.types.is_timestamp(typ) and allowed == {"string"} and prop["format"] == "date-time"
    elif pa.types.is_string(typ):
        assert allowed == {"string"}
    elif pa.types.is_integer(typ):
        assert allowed == {"integer"}
        lo, hi = _INT_RANGE[typ]
        assert prop.get("minimum", lo) >= 0, f"{name}: the store takes no negative {name}"
        # every integer the JSON Schema accepts must fit the column
        assert "maximum" in prop and prop["maximum"] <= hi, f"{name} ({typ}) needs a maximum <= {hi}"
    elif pa.types.is_floating(typ):
        assert allowed == {"number"}
    elif pa.types.is_list(typ):
        assert allowed == {"array"}
        items = prop["items"]
        value = typ.value_type
        item_types = json_types(items)
        if pa.types.is_integer(value):
            least = routes.ABSENT if name == "routed_experts" else 0  # token ids and counts are >= 0; routes -1 absent
            assert item_types == {"integer"} and items["minimum"] == least and items["maximum"] <= _INT_RANGE[value][1]
        elif pa.types.is_floating(value):
            assert item_types == {"number"}
        elif pa.types.is_boolean(value):
            assert item_types == {"boolean"}
        else:
            assert pa.types.is_string(value) and item_types == {"string"}
    elif pa.types.is_map(typ):
        assert allowed == {"object"} and pa.types.is_string(typ.key_type)
        assert json_types(prop["additionalProperties"]) == {"number"} and pa.types.is_floating(typ.item_type)
    else:
        pytest.fail(f"no JSON counterpart known for {name}: {typ}")


# ------------------------------------------------------------------ dataclasses


def _hint_parts(hint: Any) -> list[Any]:
    """Flatten Optional/Union hints into their members."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [p for arg in typing.get_args(hint) for p in _hint_parts(arg)]
    return [hint]


def _sequence_of(hint_parts: list[Any]) -> set[Any]:
    return {typing.get_args(p)[0] for p in hint_parts
            if typing.get_origin(p) in (Sequence, list, tuple) and typing.get_args(p)}


def _hint_fits(name: str, hint: Any, typ: pa.DataType) -> bool:
    parts = _hint_parts(hint)
    if any(p is Any for p in parts):
        return name in JSON_COLUMNS
    if name in JSON_COLUMNS:
        return any(typing.get_origin(p) is Mapping for p in parts)
    if name == "time":
        return datetime in parts and str in parts
    if pa.types.is_string(typ):
        return str in parts
    if pa.types.is_integer(typ):
        return int in parts
    if pa.types.is_floating(typ):
        return float in parts
    if pa.types.is_list(typ):
        element = {pa.int16(): int, pa.int32(): int, pa.int64(): int, pa.float32(): float, pa.bool_(): bool,
                   pa.string(): str}[typ.value_type]
        return element in _sequence_of(parts)
    if pa.types.is_map(typ):
        return any(typing.get_origin(p) is Mapping and typing.get_args(p) == (str, float) for p in parts)
    return False


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dataclass_fields_match_the_contract(kind: str) -> None:
    cls = EVENT_TYPES[kind]
    assert cls.kind == kind
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) <= set(PROPERTIES) - {"kind"}
    assert not set(fields) & STORE_FILLED
    required = {n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == set(REQUIRED[kind])
    hints = typing.get_type_hints(cls)
    for name in fields:
        assert _hint_fits(name, hints[name], EVENT_SCHEMA.field(name).type), (kind, name, hints[name])
        if name not in required and fields[name].default is None:
            parts = _hint_parts(hints[name])
            assert type(None) in parts or Any in parts, f"{kind}.{name} defaults to None but is not Optional"


def test_dataclasses_cover_every_suppliable_column() -> None:
    covered = {f.name for cls in EVENT_TYPES.values() for f in dataclasses.fields(cls)}
    assert covered | {"kind"} == SUPPLIABLE


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dataclass_record_is_a_valid_json_line(kind: str) -> None:
    line = FULL[kind]
    event = EVENT_TYPES[kind](**{k: v for k, v in line.items() if k != "kind"})
    record = {k: v for k, v in event.record().items() if v is not None}
    assert {k: record[k] for k in line} == line
    assert set(record) - set(line) <= {"run"}  # the only default a dataclass fills in
    assert jsonschema_ok(record)


# ------------------------------------------------------------------ validating events


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", ["full", "minimal"])
def test_valid_examples_pass_both_validators(kind: str, shape: str) -> None:
    event = (FULL if shape == "full" else MINIMAL)[kind]
    VALIDATOR.validate(event)
    columns = to_columns([copy.deepcopy(event)])
    assert columns["kind"].to_pylist() == [kind]


def _without(event: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != name}


INVALID: list[tuple[str, dict[str, Any]]] = [
    *[(f"{kind} without {name}", _without(FULL[kind], name)) for kind in sorted(KINDS) for name in REQUIRED[kind]],
    ("unknown kind", {**FULL["metric"], "kind": "note"}),
    ("no kind", _without(FULL["metric"], "kind")),
    ("unknown status", {**FULL["status"], "status": "done"}),
    ("unknown finish_reason", {**FULL["turn"], "finish_reason": "eos"}),
    ("unknown field", {**FULL["reward"], "score": 1.0}),
    *[(f"store-filled {name}", {**FULL["turn"], name: 1}) for name in sorted(STORE_FILLED)],
    ("negative prompt id", {**FULL["turn"], "prompt_ids": [1, -2, 3]}),
    ("negative output id", {**FULL["turn"], "output_ids": [-4, 5]}),
    ("token id beyond int32", {**FULL["turn"], "prompt_ids": [2**31]}),
    ("positive logprob", {**FULL["turn"], "output_logprobs": [-0.5, 0.5]}),
    ("string token id", {**FULL["turn"], "output_ids": ["4", 5]}),
    ("fractional token id", {**FULL["turn"], "output_ids": [4.5, 5]}),
    ("boolean token id", {**FULL["turn"], "output_ids": [True, 5]}),
    ("mask of numbers", {**FULL["turn"], "output_mask": [1, "x"]}),
    ("negative turn_index", {**FULL["turn"], "turn_index": -1}),
    ("turn_index beyond int32", {**FULL["turn"], "turn_index": 2**31}),
    ("negative policy_version", {**FULL["turn"], "policy_version": -1}),
    ("policy_version beyond int64", {**FULL["turn"], "policy_version": 2**63}),
    ("step beyond int64", {**FULL["metric"], "step": 2**63}),
    ("table_version beyond int64", {**FULL["metric"], "table_version": 2**63}),
    ("group_size zero", {**FULL["status"], "group_size": 0}),
    ("group_size beyond int32", {**FULL["status"], "group_size": 2**31}),
    ("empty rollout_id", {**FULL["reward"], "rollout_id": ""}),
    ("reward as text", {**FULL["reward"], "reward": "1.0"}),
    ("metrics of text", {**FULL["metric"], "metrics": {"loss": "low"}}),
    ("consumed as text", {**FULL["checkpoint"], "consumed": "r1"}),
    ("prompt_ids as text", {**FULL["turn"], "prompt_ids": "1 2 3"}),
    ("positive teacher logprob", {**FULL["teacher"], "teacher_logprobs": [-0.5, 0.5]}),
    ("teacher logprobs of text", {**FULL["teacher"], "teacher_logprobs": ["-0.5"]}),
    ("empty teacher name", {**FULL["teacher"], "teacher": ""}),
]


@pytest.mark.parametrize("event", [e for _, e in INVALID], ids=[n for n, _ in INVALID])
def test_invalid_examples_fail_both_validators(event: dict[str, Any]) -> None:
    assert not jsonschema_ok(event), "the JSON Schema accepts it"
    assert not store_ok(event), "the store accepts it"


def test_json_schema_bounds_are_the_store_bounds() -> None:
    """At the edge of each integer column the two validators agree on both sides."""
    for name in sorted(SUPPLIABLE):
        typ = EVENT_SCHEMA.field(name).type
        if not pa.types.is_integer(typ):
            continue
        kind = next(k for k in sorted(KINDS) if name in FULL[k])
        top = PROPERTIES[name]["maximum"]
        for value, ok in ((top, True), (top + 1, False)):
            event = {**FULL[kind], name: value}
            assert jsonschema_ok(event) is ok, (name, value)
            assert store_ok(event) is ok, (name, value)


def test_numpy_token_lists_validate_like_json_lists() -> None:
    line = FULL["turn"]
    as_numpy = {**line, "prompt_ids": np.array(line["prompt_ids"], dtype=np.int64),
                "output_ids": np.array(line["output_ids"], dtype=np.int32),
                "output_logprobs": np.array(line["output_logprobs"], dtype=np.float32),
                "output_mask": np.array(line["output_mask"])}
    a, b = to_columns([copy.deepcopy(line)]), to_columns([as_numpy])
    for name in ("prompt_ids", "output_ids", "output_logprobs", "output_mask",
                 "prompt_tokens", "output_tokens", "trainable_tokens"):
        assert a[name].to_pylist() == b[name].to_pylist(), name


# ------------------------------------------------------------------ the stored table


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Type equality that ignores the names of list items and map entries."""
    if pa.types.is_list(a) and pa.types.is_list(b):
        return _same_type(a.value_type, b.value_type)
    if pa.types.is_map(a) and pa.types.is_map(b):
        return _same_type(a.key_type, b.key_type) and _same_type(a.item_type, b.item_type)
    return a == b


def test_store_table_and_views_carry_the_event_schema(store: trajstore.Store) -> None:
    location = store.location
    delta = pa.schema(DeltaTable(location.table_uri, storage_options=location.storage_options or None)
                      .schema().to_arrow())
    assert delta.names == EVENT_SCHEMA.names
    for field in EVENT_SCHEMA:
        assert _same_type(delta.field(field.name).type, field.type), field.name
        assert delta.field(field.name).nullable == field.nullable, field.name

    events = [EVENT_TYPES[k](**{n: v for n, v in FULL[k].items() if n != "kind"}) for k in sorted(KINDS)]
    with store.writer("schema-w") as writer:
        writer.append(events)
        live = store.query("SELECT * FROM events ORDER BY writer_seq")
        writer.seal()
        sealed = store.query("SELECT * FROM events ORDER BY writer_seq")
    for table in (live, sealed):
        assert table.schema.names == EVENT_SCHEMA.names
        for field in EVENT_SCHEMA:
            assert _same_type(table.schema.field(field.name).type, field.type), field.name
    assert live.to_pylist() == sealed.to_pylist()
    assert sealed.column("kind").to_pylist() == sorted(KINDS)


OLD_STORE = Path(__file__).parent / "data" / "store_v1_before_teacher"


def test_a_store_written_before_the_teacher_columns_still_reads_and_grows(tmp_path: Path) -> None:
    """A store the previous schema wrote (tests/trajstore/data: one sealed file and one unsealed
    write-ahead segment, made by the code before `teacher` and `teacher_logprobs` were appended)
    reads as before, takes the new kind, and its table gains the new columns."""
    shutil.copytree(OLD_STORE, tmp_path / "store")
    store = trajstore.open_store(tmp_path / "store")
    delta = DeltaTable(store.location.table_uri).schema().to_arrow()
    assert list(delta.names) == EVENT_SCHEMA.names  # upgraded on open, by a metadata-only commit
    samples = store.query("SELECT rollout_id, tokens FROM samples ORDER BY rollout_id").to_pylist()
    assert samples == [{"rollout_id": "r1", "tokens": [1, 2, 3, 4, 5, 7, 4, 5]},
                       {"rollout_id": "r2", "tokens": [1, 2, 3, 4, 5]}]  # r2 lives in the old segment only
    with store.writer("new-w") as writer:
        writer.append([trajstore.Teacher(run="old", group_id="g1", rollout_id="r2", segment_id="r2-s0", turn_index=0,
                                         policy_version=0, teacher="big", teacher_logprobs=[-0.5, -0.25])])
    store.compact()  # rewrites the old file and seals the old segment under the new schema
    assert store.verify().problems == []
    rows = store.query("SELECT rollout_id, teacher_logprobs, complete FROM teacher_logprobs").to_pylist()
    assert rows == [{"rollout_id": "r2", "teacher_logprobs": [0.0, 0.0, 0.0, -0.5, -0.25], "complete": True}]
    assert store.query("SELECT count(*) AS n FROM events").column("n")[0].as_py() == 8
