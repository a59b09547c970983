"""Every value the edge accepts stays readable once sealed: the schema's extremes round-trip.

A sealed file's name carries the CRC-32 of the statistics the Delta log records for it, and
every reader checks the log's statistics (as delta-rs parses them back) against it. A value
whose statistic does not survive that round trip made the whole table unreadable (issue 20:
one event at 0001-01-01 wrote its year as "1", which delta-rs read as no statistic). These
tests ingest events at the limits of every column, seal them, and read and verify them back;
what the store cannot keep must be refused at ingest with a message, not accepted.
"""

from __future__ import annotations

import json
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import InvalidEventError
from trajstore.events import LAST_TIME

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FIRST_TIME = datetime(1, 1, 1, tzinfo=timezone.utc)


def _iso(t: datetime) -> str:
    return f"{t.year:04d}-{t:%m-%dT%H:%M:%S.%f}Z"


def ingest_and_read(tmp: Path, events: list[dict[str, Any]]) -> tuple[trajstore.Store, list[dict[str, Any]]]:
    """Ingest `events` as a JSON-lines file (sealed on return), then read them back in a fresh store."""
    lines = tmp / "events.jsonl"
    lines.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    trajstore.open_store(tmp / "s").ingest(lines)
    fresh = trajstore.open_store(tmp / "s", create=False)  # nothing verified or cached in this one
    report = fresh.verify()
    assert report.ok, report.problems
    assert report.sealed_files >= 1 and report.segments == 0
    return fresh, fresh.query("SELECT * FROM events ORDER BY event_id").to_pylist()


def turn(event_id: str, when: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": event_id, "kind": "turn", "time": when, "group_id": "g", "rollout_id": f"r-{event_id}",
            "segment_id": f"s-{event_id}", "turn_index": 0, "policy_version": 0, "prompt_ids": [1, 2],
            "output_ids": [3], "output_logprobs": [-0.5], **fields}


def test_one_turn_at_each_end_of_time_keeps_the_store_readable(tmp_path: Path) -> None:
    """The issue's reproduction: an ordinary turn, then two at the first and last second of the calendar."""
    store = trajstore.open_store(tmp_path / "s")
    (tmp_path / "one.jsonl").write_text(json.dumps(turn("a", "2026-01-01T00:00:00Z")) + "\n")
    (tmp_path / "two.jsonl").write_text(json.dumps(turn("b", "0001-01-01T00:00:00Z")) + "\n"
                                        + json.dumps(turn("c", "9999-12-31T23:59:59Z")) + "\n")
    store.ingest(tmp_path / "one.jsonl")
    store.ingest(tmp_path / "two.jsonl")
    fresh = trajstore.open_store(tmp_path / "s", create=False)
    report = fresh.verify()
    assert report.ok, report.problems
    assert report.table_version == 2 and report.events_checked == 3
    rows = fresh.query("SELECT event_id, time FROM events ORDER BY event_id").to_pylist()
    assert [(r["event_id"], r["time"].year) for r in rows] == [("a", 2026), ("b", 1), ("c", 9999)]


@pytest.mark.parametrize("when, why", [
    ("9999-12-31T23:59:59.999500Z", "after 9999-12-31T23:59:59.999"),
    ("0001-01-01T00:00:00+01:00", "outside years 1-9999"),
    ("9999-12-31T23:00:00-01:00", "outside years 1-9999"),
])
def test_a_time_the_store_cannot_keep_is_refused_at_ingest(tmp_path: Path, when: str, why: str) -> None:
    (tmp_path / "e.jsonl").write_text(json.dumps(turn("a", when)) + "\n")
    store = trajstore.open_store(tmp_path / "s")
    with pytest.raises(InvalidEventError, match=why):
        store.ingest(tmp_path / "e.jsonl")
    assert store.verify().ok and store.query("SELECT count(*) AS n FROM events").column("n")[0].as_py() == 0


_times = st.one_of(
    st.sampled_from([FIRST_TIME, LAST_TIME, FIRST_TIME + timedelta(microseconds=1),
                     LAST_TIME - timedelta(microseconds=1), datetime(1970, 1, 1, tzinfo=timezone.utc),
                     datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)]),
    st.datetimes(min_value=FIRST_TIME.replace(tzinfo=None), max_value=LAST_TIME.replace(tzinfo=None))
    .map(lambda t: t.replace(tzinfo=timezone.utc)),
)
# Names: empty (where the schema allows it), NUL, astral characters, and huge.
_names = st.one_of(st.text(min_size=1, max_size=20), st.sampled_from(["\x00", "\U0010ffff", "~" * 100_000,
                                                                       "\x00" * 5000 + "z"]))
_ids = st.text(min_size=1, max_size=128)
_int64 = st.one_of(st.sampled_from([0, 1, INT64_MAX]), st.integers(0, INT64_MAX))
_int32 = st.one_of(st.sampled_from([0, INT32_MAX]), st.integers(0, INT32_MAX))
_finite = st.one_of(st.sampled_from([1.7976931348623157e308, -1.7976931348623157e308, 5e-324, -5e-324,
                                     2.2250738585072014e-308, -0.0, 0.0]),
                    st.floats(allow_nan=False, allow_infinity=False))
_optional_text = st.one_of(st.just(""), st.text(max_size=10), st.just("é" * 200_000))


@st.composite
def extreme_events(draw: st.DrawFn) -> list[dict[str, Any]]:
    """One of each kind, every column that takes a value at an extreme drawn for it."""
    common = {"run": draw(_names), "group_id": draw(_names), "rollout_id": draw(_names)}
    times = [_iso(draw(_times)) for _ in range(5)]
    token = draw(st.sampled_from([0, INT32_MAX]))
    return [
        {"event_id": "1" + draw(_ids)[:127], "kind": "turn", "time": times[0], **common,
         "session_id": draw(_names), "segment_id": draw(_names), "turn_index": draw(_int32),
         "policy_version": draw(_int64), "prompt_ids": [token] * draw(st.integers(0, 3)),
         "output_ids": [token], "output_logprobs": [draw(st.sampled_from([0.0, -0.0, -3.4e38, -1e-45]))],
         "error": draw(_optional_text), "meta": {"k": draw(_optional_text)}},
        {"event_id": "2" + draw(_ids)[:127], "kind": "reward", "time": times[1], **common,
         "reward": draw(_finite), "reward_name": draw(_names)},
        {"event_id": "3" + draw(_ids)[:127], "kind": "status", "time": times[2], **common,
         "status": "completed", "group_size": draw(st.integers(1, INT32_MAX))},
        {"event_id": "4" + draw(_ids)[:127], "kind": "checkpoint", "time": times[3], "run": common["run"],
         "policy_version": draw(_int64), "step": draw(_int64), "table_version": draw(_int64),
         "consumed": [draw(_names)], "metrics": {"loss": draw(_finite)}},
        {"event_id": "5" + draw(_ids)[:127], "kind": "metric", "time": times[4], "run": common["run"],
         "step": draw(_int64), "metrics": {"x": draw(_finite)}},
    ]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(events=extreme_events())
def test_extreme_values_survive_sealing_and_read_back(events: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:  # every value drawn is within the schema: none is refused
        _, rows = ingest_and_read(Path(tmp), events)
    by_id = {r["event_id"]: r for r in rows}
    assert sorted(by_id) == sorted(e["event_id"] for e in events)
    for e in events:
        row = by_id[e["event_id"]]
        for name, value in e.items():
            got = row[name]
            if name == "time":
                assert _iso(got) == value
            elif name == "meta":
                assert json.loads(got) == value
            elif name == "metrics":
                assert dict(got) == value
            elif name == "reward":
                assert got == value and str(got) == str(value)  # -0.0 stays -0.0
            elif name == "output_logprobs":
                assert got == pytest.approx(value, rel=1e-6, abs=1e-45)  # stored as float32
            else:
                assert got == value, name
