"""Event validation and the columns the store fills at write time.

Invalid events are rejected with InvalidEventError whose `problems` name every problem of
the call, by event index, and nothing of a rejected call reaches the store. Valid events get
their token counts (prompt_tokens, output_tokens, trainable_tokens) computed from the
token lists as they are written.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import Checkpoint, InvalidEventError, Metric, Reward, Status, Turn
from trajstore.events import REQUIRED, to_columns


def turn(**overrides: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "kind": "turn", "group_id": "g", "rollout_id": "r", "segment_id": "s", "turn_index": 0,
        "policy_version": 0, "prompt_ids": [1, 2, 3], "output_ids": [4, 5],
        "output_logprobs": [-0.5, -0.25],
    }
    for name, value in overrides.items():  # None leaves the field out
        if value is None:
            event.pop(name, None)
        else:
            event[name] = value
    return event


SAMPLES: dict[str, dict[str, Any]] = {
    "turn": turn(),
    "reward": {"kind": "reward", "group_id": "g", "rollout_id": "r", "reward": 1.0},
    "status": {"kind": "status", "group_id": "g", "rollout_id": "r", "status": "completed"},
    "checkpoint": {"kind": "checkpoint", "policy_version": 1, "step": 1},
    "metric": {"kind": "metric", "step": 1, "metrics": {"loss": 0.5}},
    "teacher": {"kind": "teacher", "group_id": "g", "rollout_id": "r", "segment_id": "s", "turn_index": 0,
                "policy_version": 0, "teacher": "big", "teacher_logprobs": [-0.5, -1.0]},
}


def problems_of(events: list[Any]) -> list[tuple[int, str]]:
    with pytest.raises(InvalidEventError) as info:
        to_columns(events)
    assert info.value.problems, "an InvalidEventError without problems"
    return info.value.problems


def assert_problem(problems: list[tuple[int, str]], index: int, *fragments: str) -> None:
    for i, message in problems:
        if i == index and all(f in message for f in fragments):
            return
    pytest.fail(f"no problem for event {index} mentioning {fragments}; got {problems}")


def count(store: trajstore.Store) -> int:
    return store.query("SELECT count(*) AS n FROM events").column("n")[0].as_py()


# ------------------------------------------------------------------ one problem at a time


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"output_logprobs": [-0.5]}, "output_logprobs has 1"),
        ({"output_logprobs": [-0.5, -0.1, -0.2]}, "output_logprobs has 3"),
        ({"output_mask": [True]}, "output_mask has 1"),
        ({"output_mask": [True, False, True]}, "output_mask has 3"),
        ({"output_ids": [4], "output_logprobs": [-0.5], "output_mask": [True, True]}, "output_mask has 2"),
    ],
)
def test_unequal_output_lengths_are_rejected(overrides: dict[str, Any], fragment: str) -> None:
    assert_problem(problems_of([turn(**overrides)]), 0, fragment, "must be equal")
    with pytest.raises(InvalidEventError):
        to_columns([Turn(**{k: v for k, v in turn(**overrides).items() if k != "kind"})])


@pytest.mark.parametrize("field", ["prompt_ids", "output_ids"])
@pytest.mark.parametrize("container", [list, np.array])
def test_negative_token_ids_are_rejected(field: str, container: Any) -> None:
    bad = turn(**{field: container([3, -1])})
    assert_problem(problems_of([bad]), 0, field)
    with pytest.raises(InvalidEventError, match=field):
        to_columns([Turn(**{k: v for k, v in bad.items() if k != "kind"})])


REQUIRED_CASES = [(kind, name) for kind in sorted(REQUIRED) for name in REQUIRED[kind]]


@pytest.mark.parametrize("kind, name", REQUIRED_CASES, ids=[f"{k}-{n}" for k, n in REQUIRED_CASES])
@pytest.mark.parametrize("how", ["missing", "null"])
def test_missing_required_fields_are_rejected(kind: str, name: str, how: str) -> None:
    event = dict(SAMPLES[kind])
    if how == "missing":
        event.pop(name)
    else:
        event[name] = None
    problems = problems_of([event])
    assert_problem(problems, 0, f"needs '{name}'")


@pytest.mark.parametrize(
    "event, fragment",
    [
        ({**SAMPLES["metric"], "kind": "note"}, "kind 'note'"),
        ({k: v for k, v in SAMPLES["metric"].items() if k != "kind"}, "kind None"),
        ({**SAMPLES["status"], "status": "done"}, "status 'done'"),
        (turn(finish_reason="eos"), "finish_reason 'eos'"),
        ({**SAMPLES["reward"], "score": 2}, "unknown field"),
    ],
)
def test_unknown_vocabulary_is_rejected(event: dict[str, Any], fragment: str) -> None:
    assert_problem(problems_of([event]), 0, fragment)


def test_typed_events_are_checked_at_the_store_edge_like_dicts() -> None:
    with pytest.raises(InvalidEventError, match="status 'done'"):
        to_columns([Status(group_id="g", rollout_id="r", status="done")])
    with pytest.raises(InvalidEventError, match="finish_reason 'eos'"):
        to_columns([Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0,
                         prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], finish_reason="eos")])


def test_a_lone_surrogate_in_a_text_column_is_an_invalid_event_naming_it() -> None:
    """A Python str may hold "\\ud800", which no UTF-8 column can: refused by name, with the event's other text
    columns converted as usual (before, a bare UnicodeEncodeError escaped the append)."""
    events = [turn(session_id="fine"), turn(session_id="a\ud800"), turn(rollout_id="b\udfff")]
    with pytest.raises(InvalidEventError) as err:
        to_columns(events)
    text = str(err.value)
    assert "event 1: session_id holds a lone UTF-16 surrogate" in text and "event 2: rollout_id" in text
    assert "event 0" not in text
    columns = to_columns([turn(session_id="naïve 東京", meta={"note": "é" * 300_000}), turn(session_id=None)])
    assert columns["session_id"].to_pylist() == ["naïve 東京", None] and columns["session_id"].type == pa.string()
    assert json.loads(columns["meta"][0].as_py()) == {"note": "é" * 300_000}


@pytest.mark.parametrize("name", ["writer", "writer_epoch", "writer_seq",
                                  "prompt_tokens", "output_tokens", "trainable_tokens"])
def test_store_filled_fields_cannot_be_supplied(name: str) -> None:
    assert_problem(problems_of([turn(**{name: 3})]), 0, name, "filled by the store")


@pytest.mark.parametrize("value", [math.nan, 0.5, 1.0])
@pytest.mark.parametrize("container", [list, np.array])
def test_nan_and_positive_logprobs_are_rejected(value: float, container: Any) -> None:
    bad = turn(output_logprobs=container([-0.5, value]))
    assert_problem(problems_of([bad]), 0, "output_logprobs", "log probabilities")
    with pytest.raises(InvalidEventError, match="log probabilities"):
        to_columns([Turn(**{k: v for k, v in bad.items() if k != "kind"})])


def test_a_logprob_of_zero_and_minus_infinity_are_accepted() -> None:
    columns = to_columns([turn(output_logprobs=[0.0, -math.inf])])
    assert columns["output_logprobs"].to_pylist() == [[0.0, -math.inf]]


def test_a_typed_event_reports_all_of_its_problems() -> None:
    with pytest.raises(InvalidEventError) as info:
        to_columns([Turn(group_id="", rollout_id="r", segment_id="s", turn_index=-1, policy_version=0,
                         prompt_ids=[1, -2], output_ids=[4, 5], output_logprobs=[-0.5], finish_reason="eos")])
    messages = " | ".join(m for _, m in info.value.problems)
    for fragment in ("group_id", "turn_index", "prompt_ids", "output_logprobs has 1", "finish_reason"):
        assert fragment in messages, (fragment, messages)


# ------------------------------------------------------------------ many events, one call


def test_every_problem_of_a_call_is_listed_and_nothing_is_written(store: trajstore.Store) -> None:
    with store.writer("events-w") as writer:
        first = writer.append([SAMPLES["reward"]])
        assert count(store) == 1
        call = [
            turn(event_id="ok-0"),                                               # 0 valid
            turn(rollout_id=None, output_logprobs=[-0.5]),                       # 1 two problems
            {**SAMPLES["reward"], "event_id": "ok-2"},                          # 2 valid
            {**SAMPLES["status"], "status": "done"},                             # 3 vocabulary
            turn(prompt_ids=[7, -7]),                                            # 4 token values
            turn(output_logprobs=[-0.5, math.nan]),                              # 5 token values
            {**SAMPLES["reward"], "writer_seq": 9},                              # 6 store-filled
            turn(output_ids=np.array([1, -1]), output_logprobs=np.array([-0.1, 0.3])),  # 7 two problems
            {**SAMPLES["checkpoint"], "event_id": "ok-8"},                       # 8 valid
        ]
        with pytest.raises(InvalidEventError) as info:
            writer.append(call)
        problems = info.value.problems
        assert_problem(problems, 1, "needs 'rollout_id'")
        assert_problem(problems, 1, "output_logprobs has 1")
        assert_problem(problems, 3, "status 'done'")
        assert_problem(problems, 4, "prompt_ids")
        assert_problem(problems, 5, "output_logprobs", "log probabilities")
        assert_problem(problems, 6, "writer_seq", "filled by the store")
        assert_problem(problems, 7, "output_ids")
        assert_problem(problems, 7, "output_logprobs", "log probabilities")
        assert {i for i, _ in problems} == {1, 3, 4, 5, 6, 7}
        assert str(len(problems)) in str(info.value) and "nothing was written" in str(info.value)

        assert count(store) == 1
        ids = store.query("SELECT event_id FROM events").column("event_id").to_pylist()
        assert not {"ok-0", "ok-2", "ok-8"} & set(ids)
        # The rejected call took no sequence numbers: the next append continues the sequence.
        after = writer.append([c for i, c in enumerate(call) if i in (0, 2, 8)])
        assert (after.first_seq, after.last_seq) == (first.last_seq + 1, first.last_seq + 3)
    seqs = store.query("SELECT writer_seq FROM events ORDER BY writer_seq").column("writer_seq").to_pylist()
    assert seqs == [0, 1, 2, 3]


def test_a_call_with_only_value_problems_lists_each_bad_row() -> None:
    call = [turn(), turn(prompt_ids=[-1]), turn(), turn(output_ids=[-3, 4]),
            turn(output_logprobs=[math.nan, -1.0]), turn()]
    problems = problems_of(call)
    assert {i for i, _ in problems} == {1, 3, 4}


def test_a_non_event_in_a_call_is_a_problem_not_a_crash() -> None:
    problems = problems_of([turn(), "not an event", turn(rollout_id=None)])
    assert_problem(problems, 1, "str")
    assert_problem(problems, 2, "rollout_id")


# ------------------------------------------------------------------ filled at write time


def test_token_counts_are_filled_at_write_time(store: trajstore.Store) -> None:
    events = [
        turn(event_id="no-mask", prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-1.0, -2.0]),
        turn(event_id="masked", prompt_ids=[9], output_ids=[4, 5, 6, 7], output_logprobs=[-1.0] * 4,
             output_mask=[True, False, False, True]),
        turn(event_id="all-off", prompt_ids=[], output_ids=[8], output_logprobs=[-0.1], output_mask=[False]),
        turn(event_id="all-on", prompt_ids=list(range(100)), output_ids=[8, 9], output_logprobs=[-0.1, -0.2],
             output_mask=[True, True]),
        {**SAMPLES["reward"], "event_id": "no-tokens"},
    ]
    with store.writer("counts-w") as writer:
        writer.append(events)
    rows = store.query(
        "SELECT event_id, prompt_tokens, output_tokens, trainable_tokens FROM events ORDER BY event_id"
    ).to_pylist()
    got = {r["event_id"]: (r["prompt_tokens"], r["output_tokens"], r["trainable_tokens"]) for r in rows}
    assert got == {
        "no-mask": (3, 2, 2),
        "masked": (1, 4, 2),
        "all-off": (0, 1, 0),
        "all-on": (100, 2, 2),
        "no-tokens": (None, None, None),
    }


def test_missing_ids_run_reward_name_and_time_get_defaults() -> None:
    before = datetime.now(timezone.utc)
    columns = to_columns([SAMPLES["reward"], SAMPLES["reward"], turn(time="2026-01-31T12:00:00"),
                          {**SAMPLES["status"], "time": datetime(2026, 1, 31, 13, tzinfo=timezone(timedelta(hours=1)))}])
    after = datetime.now(timezone.utc)
    ids = columns["event_id"].to_pylist()
    assert all(ids) and len(set(ids)) == 4
    assert columns["run"].to_pylist() == ["default"] * 4
    assert columns["reward_name"].to_pylist() == ["reward", "reward", None, None]
    times = columns["time"].to_pylist()
    assert before <= times[0] <= after and times[0] == times[1]
    assert times[2] == datetime(2026, 1, 31, 12, tzinfo=timezone.utc)  # no zone means UTC
    assert times[3] == datetime(2026, 1, 31, 12, tzinfo=timezone.utc)


# ------------------------------------------------------------------ numpy input


def test_numpy_token_lists_are_stored_exactly(store: trajstore.Store) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 2**31 - 1, size=50, dtype=np.int64)
    output = rng.integers(0, 150_000, size=20).astype(np.uint32)
    logprobs = -rng.random(20).astype(np.float32)
    mask = rng.random(20) < 0.5
    with store.writer("numpy-w") as writer:
        writer.append([
            Turn(event_id="typed", group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0,
                 prompt_ids=prompt, output_ids=output, output_logprobs=logprobs, output_mask=mask),
            turn(event_id="dict", prompt_ids=prompt.astype(np.int32), output_ids=output.astype(np.int64),
                 output_logprobs=logprobs.astype(np.float64), output_mask=None),
            turn(event_id="list", prompt_ids=prompt.tolist(), output_ids=output.tolist(),
                 output_logprobs=logprobs.tolist(), output_mask=mask.tolist()),
        ])
    rows = {r["event_id"]: r for r in store.query("SELECT * FROM turns").to_pylist()}
    for name in ("typed", "dict", "list"):
        row = rows[name]
        assert row["prompt_ids"] == prompt.tolist()
        assert row["output_ids"] == output.tolist()
        np.testing.assert_array_equal(np.array(row["output_logprobs"], dtype=np.float32), logprobs)
        assert row["prompt_tokens"] == 50 and row["output_tokens"] == 20
    assert rows["typed"]["output_mask"] == mask.tolist() == rows["list"]["output_mask"]
    assert rows["typed"]["trainable_tokens"] == int(mask.sum())
    assert rows["dict"]["output_mask"] is None and rows["dict"]["trainable_tokens"] == 20


@pytest.mark.parametrize(
    "ids",
    [np.array([2**32 + 5]), np.array([2**31]), np.array([1.5, 2.0]), np.array([-(2**32) + 3])],
    ids=["wraps-to-5", "int32-overflow", "fractional", "wraps-to-3"],
)
def test_numpy_token_ids_out_of_range_are_rejected_not_wrapped(ids: np.ndarray) -> None:
    problems = problems_of([turn(prompt_ids=ids), turn()])
    assert {i for i, _ in problems} == {0}
    assert_problem(problems, 0, "prompt_ids")
    with pytest.raises(InvalidEventError, match="prompt_ids"):
        to_columns([Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0,
                         prompt_ids=ids, output_ids=[1], output_logprobs=[-1.0])])


def test_typed_events_of_every_kind_round_trip(store: trajstore.Store) -> None:
    events = [
        Turn(event_id="t", group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=2,
             prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], sampling={"temperature": 0.7},
             request={"messages": []}, response="ok", meta={"task": 1}),
        Reward(event_id="rw", group_id="g", rollout_id="r", reward=0.5, reward_name="format"),
        Status(event_id="st", group_id="g", rollout_id="r", status="failed", error="boom", group_size=2),
        Checkpoint(event_id="ck", policy_version=3, step=7, consumed=["r"], metrics={"loss": 0.1}),
        Metric(event_id="mt", step=7, metrics={"loss": 0.1, "kl": 0.01}, consumed=["r"]),
    ]
    with store.writer("typed-w") as writer:
        assert writer.append(events).appended == 5
    rows = {r["event_id"]: r for r in store.query("SELECT * FROM events").to_pylist()}
    assert rows["t"]["sampling"] == '{"temperature":0.7}' and rows["t"]["response"] == '"ok"'
    assert rows["rw"]["reward"] == 0.5 and rows["rw"]["reward_name"] == "format"
    assert (rows["st"]["status"], rows["st"]["error"], rows["st"]["group_size"]) == ("failed", "boom", 2)
    assert rows["ck"]["consumed"] == ["r"] and rows["ck"]["policy_version"] == 3
    assert dict(rows["mt"]["metrics"]) == {"loss": 0.1, "kl": 0.01}


@pytest.mark.parametrize("tail", [-3, "x", 1.5, 2**40, True, None])
def test_a_long_token_list_is_checked_as_a_short_one(tail: Any) -> None:
    """Lists past `LONG_LISTS` ids are converted a slice at a time; the same values are refused for the same reason."""
    from trajstore.tokens import LONG_LISTS

    short, long = [1, tail], [1] * (LONG_LISTS + 5) + [tail]
    reasons = []
    for ids in (short, long):
        with pytest.raises(InvalidEventError) as err:
            to_columns([turn(prompt_ids=ids)])
        reasons.append(str(err.value).splitlines()[-1].split(": ", 2)[-1].split(" (item")[0])
    assert reasons[0] == reasons[1]


@pytest.mark.parametrize("tail", [7, -3, "x", 2**40, True, None])
def test_a_long_token_list_beside_numpy_rows_is_stored_or_refused_as_it_is_alone(tail: Any) -> None:
    """The capture proxy stores a continued call's prompt delta as numpy (its packed bytes) and a new segment's
    prompt as a Python list: in one append, the list, converted a slice at a time, keeps every check."""
    from trajstore.tokens import LONG_LISTS

    long = [1] * (LONG_LISTS + 5) + [tail]
    packed = np.frombuffer(np.array([5, 6], "<i4").tobytes(), dtype="<i4")
    outcomes = []
    for events in ([turn(prompt_ids=long)], [turn(prompt_ids=packed), turn(prompt_ids=long)]):
        try:
            columns = to_columns(events)
        except InvalidEventError as exc:
            outcomes.append(str(exc).splitlines()[-1].split(": ", 2)[-1].split(" (item")[0])
        else:
            outcomes.append(columns["prompt_ids"][-1].values.to_numpy().tolist())
            assert columns["prompt_ids"][0].as_py() == ([5, 6] if len(events) == 2 else long)
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] == long) == (tail == 7)


def test_a_long_token_list_is_stored_whole_and_exact() -> None:
    """A million ids (converted a slice at a time) and long logprob and mask lists come back exactly."""
    ids = list(range(1_000_000))
    mask = [i % 3 == 0 for i in range(200_000)]
    columns = to_columns([turn(prompt_ids=ids, output_ids=[1] * 200_000, output_logprobs=[-0.5] * 200_000,
                               output_mask=mask), turn()])
    assert columns["prompt_ids"][0].values.to_numpy().tolist() == ids
    assert columns["prompt_ids"].type == pa.list_(pa.int32()) and columns["prompt_tokens"].to_pylist() == [1_000_000, 3]
    assert columns["output_logprobs"].type == pa.list_(pa.float32())
    assert columns["output_mask"][0].as_py() == mask and columns["trainable_tokens"].to_pylist()[0] == sum(mask)


# The conversions a captured turn takes (`tokens._from_exact_lists`, `arrow_columns.string_columns`,
# `arrow_columns.time_column` and the plain int columns) skip Arrow's checked conversion for speed; these pin them
# to what it stores, byte for byte, and to the same refusals.

def _ipc_bytes(column: pa.Array) -> bytes:
    """A column as the segment stores it (an IPC record batch body): NaNs and null rows compared exactly too."""
    return pa.RecordBatch.from_arrays([column], names=["c"]).serialize().to_pybytes()


def _checked_list_column(name: str, values: list[Any], typ: pa.ListType) -> tuple[pa.Array | None, list[Any]]:
    """The checked way of converting a column of Python lists: Arrow's inference, then row by row."""
    from trajstore import tokens

    element = tokens.ELEMENT[name]
    column, problems = tokens._from_python(name, values, typ, element)
    if column is None and not problems:
        column, problems = tokens._from_rows(name, values, typ, element)
    return column, problems


_ODD_IDS = st.sampled_from([-1, 2**31, 2**32, 2**63, -(2**63) - 1, 2**70, True, False, 1.0, 1.5, None, "7",
                            np.int64(3)])
_TOKEN_ITEMS = st.one_of(st.integers(0, 2**31 - 1), st.integers(-(2**70), 2**70), _ODD_IDS)
_ODD_LOGPROBS = st.sampled_from([0, -3, 2**70, True, None, "-0.5", np.float32(-0.5), np.float64(-0.5), math.nan,
                                 -math.inf, math.inf, 1e300, -1e300, -3.4028235677973366e38, -1e-46])
_LOGPROB_ITEMS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e-37, 0.0), _ODD_LOGPROBS)


def _rows(odd: st.SearchStrategy[Any], pure: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """1-3 rows of a column: None, a list of clean values (the common case), clean values but one odd one (what a
    fast path must not take for clean), or anything."""
    one_odd = st.builds(lambda clean, item, at: [*clean[:at], item, *clean[at:]],
                        st.lists(pure, max_size=20), odd, st.integers(0, 20))
    anything = st.lists(st.one_of(pure, odd), max_size=8)
    row = st.one_of(st.none(), st.lists(pure, max_size=40), one_odd, anything, st.lists(pure, max_size=8).map(tuple))
    return st.lists(row, min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_short_token_lists_are_stored_exactly_as_the_checked_conversion_stores_them(data: st.DataObject) -> None:
    """Random ids and logprobs (out of range, bools, NaN, floats float32 cannot hold, None rows and items,
    mixed rows): `list_column` stores the same bytes, or refuses with the same problems, as the checked way."""
    from trajstore.tokens import list_column

    name, odd, pure = data.draw(st.sampled_from([
        ("prompt_ids", _TOKEN_ITEMS, st.integers(0, 2**31 - 1)),
        ("support_sizes", _ODD_IDS, st.integers(0, 600)),
        ("output_logprobs", _ODD_LOGPROBS, st.floats(max_value=0.0, allow_nan=False)),
        ("teacher_logprobs", _LOGPROB_ITEMS, st.floats(width=32)),
    ]))
    values = data.draw(_rows(odd, pure))
    typ = pa.list_(pa.int32()) if name.endswith(("ids", "sizes")) else pa.list_(pa.float32())
    column, problems = list_column(name, values, typ)
    expected, expected_problems = _checked_list_column(name, values, typ)
    assert problems == expected_problems
    assert (column is None) == (expected is None)
    if column is not None:
        assert column.type == typ and _ipc_bytes(column) == _ipc_bytes(expected)


@pytest.mark.parametrize("name", ["prompt_ids", "output_logprobs"])
@pytest.mark.parametrize("odd", [2**31, 2**32, 2**32 + 5, 2**63, 2**64 + 1, -1, -(2**32) + 5, True, False, 1.0, 0, -3,
                                 np.int64(3), np.float64(-0.5), "7", None, math.nan, math.inf, 1e300, -1e300])
def test_one_odd_value_among_clean_ones_is_stored_or_refused_as_the_checked_conversion_does(name: str, odd: Any) -> None:
    """The boundaries of the fast conversion, each among clean values of the other rows and its own."""
    from trajstore.tokens import list_column

    clean = [1, 2] if name == "prompt_ids" else [-0.5, -0.25]
    typ = pa.list_(pa.int32()) if name == "prompt_ids" else pa.list_(pa.float32())
    values = [clean, [*clean, odd], None]
    column, problems = list_column(name, values, typ)
    expected, expected_problems = _checked_list_column(name, values, typ)
    assert problems == expected_problems and (column is None) == (expected is None)
    if column is not None:
        assert _ipc_bytes(column) == _ipc_bytes(expected)


@pytest.mark.parametrize("values", [[[1, 2, 3]], [[0, 2**31 - 1], None, []], [None, (5,)], [[-0.5, -1e-40, -1e300]]])
def test_plain_token_lists_take_the_numpy_conversion(values: list[Any]) -> None:
    """The lists a captured turn holds do take the fast conversion the test above pins (so that it tests it)."""
    from trajstore.tokens import _from_exact_lists

    is_float = isinstance(next(v for v in values if v)[0], float)
    typ = pa.list_(pa.float32()) if is_float else pa.list_(pa.int32())
    assert _from_exact_lists(values, typ, "float" if is_float else "int") is not None


@settings(max_examples=200, deadline=None)
@given(columns=st.lists(st.lists(st.one_of(st.none(), st.text(), st.text(alphabet="aé東\U0001F600\x00", max_size=5)),
                                 min_size=2, max_size=2), min_size=1, max_size=5))
def test_text_columns_hold_what_arrow_converts(columns: list[list[str | None]]) -> None:
    """Text columns, converted together from their UTF-8 bytes, equal the slices of Arrow's conversion of them all."""
    from trajstore.arrow_columns import string_columns

    strings = [(f"c{i}", values) for i, values in enumerate(columns)]
    converted = pa.array([v for values in columns for v in values], pa.string())
    got = string_columns(strings, 2)
    for k, (name, values) in enumerate(strings):
        assert got[name].type == pa.string() and _ipc_bytes(got[name]) == _ipc_bytes(converted.slice(2 * k, 2))


@settings(max_examples=200, deadline=None)
@given(times=st.lists(st.datetimes(timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=-5)), None]))
                      .filter(lambda t: datetime(1, 1, 2) <= t.replace(tzinfo=None) <= datetime(9999, 12, 30)),
                      min_size=1, max_size=3),
       ints=st.lists(st.integers(1, 2**31 - 1), min_size=3, max_size=3))
def test_times_and_int_columns_hold_what_arrow_converts(times: list[datetime], ints: list[int]) -> None:
    """A call's times (with or without a zone) and plain int columns come out as Arrow's conversion of them."""
    from trajstore.events import _TYPES, _to_time

    now = datetime.now(timezone.utc)
    events = [turn(time=t.isoformat(), turn_index=ints[i % 3], policy_version=ints[(i + 1) % 3] * 2**20,
                   group_size=ints[(i + 2) % 3]) for i, t in enumerate(times)]
    columns = to_columns(events, now=now)
    expected_times = pa.array([_to_time(t.isoformat(), now) for t in times], _TYPES["time"])
    assert _ipc_bytes(columns["time"]) == _ipc_bytes(expected_times)
    for name in ("turn_index", "policy_version", "group_size"):
        expected = pa.array([e[name] for e in events], _TYPES[name])
        assert _ipc_bytes(columns[name]) == _ipc_bytes(expected), name


@pytest.mark.parametrize("name, value", [("policy_version", 2**63), ("policy_version", 2**70)])
def test_an_int_beyond_its_column_is_refused_naming_it(name: str, value: int) -> None:
    assert_problem(problems_of([turn(**{name: value})]), 0, name, "cannot be stored as int64")
