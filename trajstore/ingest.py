"""Ingest a JSON-lines file of events: validate all of it, then append it in one call.

Each line is one event shaped by `schemas/event.v1.schema.json`. The whole file is checked
before anything is written; every bad line is reported with its number and reason. A line
without `event_id` gets one derived from its content (`trajstore.ids.content_id`), so
ingesting the same file twice stores each event once.

The JSON Schema check runs with the per-element schemas of the token lists left out:
`jsonschema` walks lists one Python call per element (minutes for a large file), while the
same element checks (integer ids >= 0, logprobs <= 0) run vectorized in
`trajstore.events.to_columns`, which every event passes through anyway.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from jsonschema import Draft202012Validator, FormatChecker

from trajstore.errors import InvalidEventError
from trajstore.events import to_columns
from trajstore.ids import content_id
from trajstore.read import Reader
from trajstore.schema import JSON_SCHEMA
from trajstore.writer import Writer

_LIST_FIELDS = ("prompt_ids", "output_ids", "output_logprobs", "output_mask")


def _structure_schema() -> dict[str, Any]:
    schema = copy.deepcopy(JSON_SCHEMA)
    for name in _LIST_FIELDS:
        schema["properties"][name].pop("items", None)
    return schema


_VALIDATOR = Draft202012Validator(_structure_schema(), format_checker=FormatChecker())


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


@dataclass(frozen=True)
class IngestResult:
    lines: int
    appended: int
    duplicates: int
    table_version: int


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse and validate a JSON-lines file; raise InvalidEventError naming every bad line."""
    problems: list[tuple[int, str]] = []
    events: list[dict[str, Any]] = []
    line_numbers: list[int] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append((number, f"not valid JSON ({exc.msg} at column {exc.colno})"))
                continue
            except RecursionError:
                problems.append((number, "the JSON is nested too deeply to read (hundreds of levels); flatten it"))
                continue
            if not isinstance(obj, dict):
                problems.append((number, "each line must be one JSON object (an event)"))
                continue
            errors = sorted(_VALIDATOR.iter_errors(obj), key=lambda e: list(e.absolute_path))
            if errors:
                problems.extend((number, _describe(e)) for e in errors)
                continue
            if "event_id" not in obj:
                obj["event_id"] = content_id(obj)
            events.append(obj)
            line_numbers.append(number)
    # Cross-field and element checks, vectorized. Structural problems stop `to_columns`
    # before its element checks, so the lines without them are checked again on their own.
    remaining = list(range(len(events)))
    while remaining:
        try:
            to_columns([events[i] for i in remaining])
            break
        except InvalidEventError as exc:
            problems.extend((line_numbers[remaining[i]], msg) for i, msg in exc.problems)
            failed = {remaining[i] for i, _ in exc.problems}
            remaining = [i for i in remaining if i not in failed]
    if problems:
        raise InvalidEventError(sorted(problems), what="line")
    if not events:
        raise InvalidEventError([(0, f"{os.fspath(path)} holds no events")], what="file")
    return events


def ingest(reader: Reader, open_writer: Callable[[], Writer], path: str | os.PathLike[str]) -> IngestResult:
    """Validate the whole file, then append what the store does not hold yet in one call and seal it.

    `open_writer()` is called only when there is something to append."""
    events = read_events(path)
    ids = pa.table({"event_id": pa.array([e["event_id"] for e in events], pa.string())})
    with reader.snapshot() as snap:  # skip what any writer already stored
        snap.register("_ids", ids)
        stored = set(snap.query("SELECT event_id FROM _raw SEMI JOIN _ids USING (event_id)")
                     .column("event_id").to_pylist())
    fresh = [e for e in events if e["event_id"] not in stored]
    appended = duplicates = 0
    if fresh:
        with open_writer() as w:
            result = w.append(fresh)
        appended, duplicates = result.appended, result.duplicates
    return IngestResult(len(events), appended, duplicates + len(events) - len(fresh), reader.table.version())
