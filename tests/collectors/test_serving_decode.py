"""A request body decodes to exactly what `json` reads, and is refused with `json`'s messages, whichever decoder
reads it (orjson for what it takes, `json` for the rest)."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.serving import BadRequest, as_json_reads, decode_json

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8")),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20)


def typed(value: Any) -> Any:
    """`value` with each number's type kept (1 and 1.0 compare equal, but are stored differently)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(value=JSON, ascii_only=st.booleans())
def test_a_body_decodes_to_what_json_reads(value: Any, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert typed(decode_json(raw)) == typed(json.loads(raw))


@pytest.mark.parametrize("raw", [
    b"123456789012345678901234567890", b'{"seed": -9223372036854775809}', b"[18446744073709551616]",  # past 64 bits
    b"NaN", b'{"t": Infinity}', b"1e400",  # json's extensions and overflow
    b'\xef\xbb\xbf{"a": 1}', '{"a": "é"}'.encode("utf-16"),  # byte order mark, UTF-16
    b'{"a": "\\ud83d\\ude00"}',  # a surrogate pair
])
def test_what_orjson_refuses_or_reads_otherwise_is_readas_json_reads_it(raw: bytes) -> None:
    assert typed(decode_json(raw)) == typed(json.loads(raw))


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"a": "\\ud800"}', "a holds a lone UTF-16 surrogate"),
    (b'{"a": "\xed\xa0\x80"}', "a holds a lone UTF-16 surrogate"),  # an encoded surrogate, which json passes through
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (b'{"a": }', "not valid JSON: Expecting value: line 1 column 7 (char 6)"),
    (b'{"a": "\xff"}', "not valid JSON"),
    (b"", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_bad_body_is_refused_with_jsons_message(raw: bytes, says: str) -> None:
    with pytest.raises(BadRequest, match=None) as err:
        decode_json(raw)
    assert says in err.value.message


@pytest.mark.parametrize("depth", [900, 950, 1000, 1024])
def test_nesting_json_may_refuse_is_left_to_json(depth: int) -> None:
    """orjson reads 1024 levels; `json` about 1000 less the caller's stack: such a body is json's to take or not."""
    nested = orjson.loads(b"[" * depth + b"]" * depth)
    assert not as_json_reads(nested) and not as_json_reads({"a": [nested]})
    assert as_json_reads(orjson.loads(b"[" * 100 + b"]" * 100))


@pytest.mark.parametrize(("value", "reads"), [
    (2.0 ** 63, False), (-(2.0 ** 63), False), (1e300, False), ({"a": [1, {"b": 1.5e19}]}, False),
    (9.2e18, True), ({"a": [1, {"b": 2 ** 63}]}, True), ("1e19", True),
])
def test_a_float_that_may_be_an_integer_past_64_bits_is_left_to_json(value: Any, reads: bool) -> None:
    assert as_json_reads(value) == reads


def test_the_body_text_comes_back_only_when_it_is_strict_json() -> None:
    from collectors.serving import decode_json_text

    raw = '{ "a" : [1, 2.5], "b": "caf\u00e9" }'.encode()
    value, body = decode_json_text(raw)
    assert value == {"a": [1, 2.5], "b": "café"} and len(body) == len(raw) and body.text() == raw.decode()
    assert body.text() is body.text()  # made once
    for loose in (b'{"a": NaN}', b'\xef\xbb\xbf{"a": 1}', b'{"a": 123456789012345678901234567890}'):
        value, text = decode_json_text(loose)
        assert text is None and value is not None  # read by json (as before), written again from the value
