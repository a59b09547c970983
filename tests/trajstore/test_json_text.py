"""The JSON columns' text: orjson writes it only where the value equals what the stdlib encoder
(`json.JSONEncoder(separators=(",", ":"), default=str)`, the store's encoder before) wrote; every
other value is written by the stdlib encoder, exactly as before."""

from __future__ import annotations

import collections
import dataclasses
import decimal
import enum
import json
import math
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from trajstore import InvalidEventError, Turn, open_store
from trajstore.events import to_columns
from trajstore.json_text import json_text

STDLIB = json.JSONEncoder(separators=(",", ":"), default=str).encode


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 3


class Mode(str, enum.Enum):
    FAST = "fast"


class Name(str):
    pass


@dataclasses.dataclass
class Point:
    x: int


def stored_request(request: Any) -> str:
    """The text `to_columns` (what `Writer.append` writes) gives a turn's request."""
    turn = Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0, prompt_ids=[1],
                output_ids=[2], output_logprobs=[-0.5], request=request)
    return to_columns([turn])["request"][0].as_py()


PLAIN = {
    "unicode": {"messages": [{"role": "user", "content": "héllo 世界 \U0001F600 \u2028"}]},
    "floats": [0.1, 1e16, 1e-7, -0.0, 1.5e300, 5e-324, 123456789.123],
    "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
    "nesting": {"a": [[{"b": None, "c": True, "d": False}]], "e": (1, 2)},
    "empty": [{}, [], ""],
    "escapes": "quote \" backslash \\ newline \n tab \t nul \x00 del \x7f",
}


@pytest.mark.parametrize("value", list(PLAIN.values()), ids=list(PLAIN))
def test_plain_values_store_the_same_json_value(value: Any) -> None:
    text = stored_request(value)
    assert json.loads(text) == json.loads(STDLIB(value))
    assert text == orjson.dumps(value).decode()  # the fast encoder wrote it (UTF-8, not \\u escapes)


FALLBACK = {
    "nan": {"temperature": math.nan},
    "infinities": [math.inf, -math.inf],
    "lone surrogate": {"content": "a\ud800b"},
    "int beyond 64 bits": [2**64, -(2**63) - 1, 10**30],
    "non-str keys": {1: "int", 1.5: "float", None: "none"},
    "bool key": {True: "bool", False: "not"},
    "str-subclass key": {Name("k"): 1},
    "int enum": [Level.HIGH],
    "plain enum": {"color": Color.RED},
    "str enum": [Mode.FAST],
    "str subclass": [Name("x")],
    "ordered dict": collections.OrderedDict(a=1),
    "numpy scalars": [np.float64(0.5), np.int64(3), np.float32(0.25)],
    "datetime": {"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)},
    "dataclass": [Point(1)],
    "decimal": [decimal.Decimal("1.10")],
    "uuid": [uuid.UUID(int=7)],
    "set": [{1}],
    "deeper than orjson's limit": json.loads("[" * 300 + "]" * 300),
}


@pytest.mark.parametrize("value", list(FALLBACK.values()), ids=list(FALLBACK))
def test_values_orjson_writes_differently_are_stored_as_before(value: Any) -> None:
    assert stored_request(value) == STDLIB(value)


def test_json_text_of_none_is_null_column() -> None:
    assert json_text(None) is None
    assert stored_request(None) is None


def test_a_dict_key_json_cannot_name_is_an_invalid_event_not_a_crash() -> None:
    with pytest.raises(InvalidEventError, match="request cannot be written as JSON"):
        stored_request({(1, 2): "tuple key"})


def test_a_circular_value_is_an_invalid_event() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidEventError, match="request cannot be written as JSON"):
        stored_request(loop)


def test_nan_in_a_json_column_is_stored_as_the_stdlib_writes_it_and_reads_back(tmp_path: Path) -> None:
    """The store keeps NaN in a JSON column as the token `NaN` (as it always did): Python's json reads it back."""
    store = open_store(tmp_path)
    with store.writer("w") as writer:
        writer.append([Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0,
                            prompt_ids=[1], output_ids=[2], output_logprobs=[-0.5],
                            request={"temperature": math.nan, "top_p": 0.5})])
    text = store.query("SELECT request FROM events").to_pylist()[0]["request"]
    assert text == '{"temperature":NaN,"top_p":0.5}'
    assert math.isnan(json.loads(text)["temperature"])


def test_json_text_is_stored_as_it_is() -> None:
    from trajstore import JSONText

    text = '{ "b" : [1, 2.50, "caf\\u00e9"],\n "a": null }'
    stored = json_text(JSONText(text))
    assert stored == text and type(stored) is str
    assert json_text({"b": [1, 2.5, "café"], "a": None}) != text  # a value is written in the encoder's own form


def test_json_text_that_is_not_json_is_refused_unless_its_maker_parsed_it() -> None:
    from trajstore import InvalidEventError, JSONText, Turn
    from trajstore.events import to_columns

    def turn(request: JSONText) -> Turn:
        return Turn(run="r", group_id="g", rollout_id="x", session_id="s", segment_id="t", turn_index=0,
                    policy_version=0, prompt_ids=[1], output_ids=[2], output_logprobs=[-0.5], finish_reason="stop",
                    request=request)

    with pytest.raises(InvalidEventError, match="request cannot be written as JSON"):
        to_columns([turn(JSONText('{"a": 1'))])
    assert to_columns([turn(JSONText(' {"a": 1} '))])["request"].to_pylist() == [' {"a": 1} ']
    assert JSONText.parsed('{"a": 1}') == '{"a": 1}' and isinstance(JSONText.parsed("1"), JSONText)
