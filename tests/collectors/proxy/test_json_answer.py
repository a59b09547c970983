"""The proxy's JSON answers (`collectors.proxy.app.json_answer`) and streamed events (`wire.base.event_data`):
orjson's bytes, read back as what was sent."""

from __future__ import annotations

import json

from collectors.proxy.app import json_answer
from collectors.proxy.wire.base import event_data


def test_an_answer_reads_back_as_the_value_with_its_text_as_utf8() -> None:
    value = {"content": "naïve — 漢字 \U0001f600", "n": [1, -2.5, None, True], "nested": {"k": "v\n\"q\""}}
    resp = json_answer(value, status=201)
    assert resp.status == 201 and resp.content_type == "application/json" and resp.charset == "utf-8"
    assert json.loads(resp.body) == value and "漢字".encode() in resp.body


def test_what_orjson_cannot_write_is_still_answered() -> None:
    assert json.loads(json_answer({"big": 2**70}).body) == {"big": 2**70}  # past 64 bits: the standard library
    assert json.loads(json_answer({"x": float("nan")}).body) == {"x": None}  # valid JSON, never `NaN`


def test_a_streamed_events_data_is_one_line_of_json_that_reads_back_as_the_event() -> None:
    event = {"choices": [{"delta": {"content": "line one\nline two — 漢字"}}], "big": 2**70}
    data = event_data(event)  # past 64 bits: the standard library writes it
    assert "\n" not in data and json.loads(data) == event
    assert json.loads(event_data({"t": "naïve\r\n"})) == {"t": "naïve\r\n"} and "ï" in event_data({"t": "ï"})
