"""The event log's Arrow schema, loaded at import from `schemas/events.v1.json`.

The JSON file is the contract; this module only turns its type strings into Arrow types
and exposes the vocabularies (kinds, statuses, finish reasons) the validators use.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pyarrow as pa

from trajstore import arrow_memory  # noqa: F401 - Arrow's allocator, chosen before any array is made

SCHEMA_VERSION = 1

_SCALARS: dict[str, pa.DataType] = {
    "string": pa.string(),
    "bool": pa.bool_(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "timestamp[us, UTC]": pa.timestamp("us", tz="UTC"),
}


def parse_type(text: str) -> pa.DataType:
    """Turn a type string of the schema file ('list<int32>', 'map<string, float64>') into Arrow."""
    text = text.strip()
    if text in _SCALARS:
        return _SCALARS[text]
    if text.startswith("list<") and text.endswith(">"):
        return pa.list_(parse_type(text[5:-1]))
    if text.startswith("map<") and text.endswith(">"):
        key, value = text[4:-1].split(",", 1)
        return pa.map_(parse_type(key), parse_type(value))
    raise ValueError(f"unknown type {text!r} in the event schema file")


def _load(name: str) -> dict[str, Any]:
    return json.loads(resources.files("schemas").joinpath(name).read_text())


SPEC: dict[str, Any] = _load(f"events.v{SCHEMA_VERSION}.json")
JSON_SCHEMA: dict[str, Any] = _load(f"event.v{SCHEMA_VERSION}.schema.json")

EVENT_SCHEMA: pa.Schema = pa.schema(
    [pa.field(c["name"], parse_type(c["type"]), nullable=c["nullable"]) for c in SPEC["columns"]],
    metadata={"trajstore.schema": f"events.v{SCHEMA_VERSION}"},
)
COLUMNS: tuple[str, ...] = tuple(EVENT_SCHEMA.names)
INT64_MAX = 2**63 - 1  # the largest version, step or seq a column holds (and SQL's BIGINT)

KINDS: frozenset[str] = frozenset(SPEC["kinds"])
STATUSES: frozenset[str] = frozenset(SPEC["statuses"])
FINISH_REASONS: frozenset[str] = frozenset(SPEC["finish_reasons"])
TERMINAL_STATUSES: frozenset[str] = STATUSES - {"started"}
TRAINABLE_STATUSES: frozenset[str] = frozenset({"completed", "truncated"})

# Columns the store fills; a caller may not supply them.
WRITER_COLUMNS: frozenset[str] = frozenset({"writer", "writer_epoch", "writer_seq"})
COUNT_COLUMNS: frozenset[str] = frozenset({"prompt_tokens", "output_tokens", "trainable_tokens"})
JSON_COLUMNS: frozenset[str] = frozenset({"sampling", "request", "response", "meta"})
