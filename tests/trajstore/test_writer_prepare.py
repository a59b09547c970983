"""`Writer.prepare` then `Writer.append(prepared)`: the two-step append keeps every guarantee of `append(events)`."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajstore import (
    InvalidEventError,
    PreparedBatch,
    Status,
    Turn,
    WriterClosedError,
    open_store,
)


def turn(rollout: str, event_id: str | None = None) -> Turn:
    return Turn(run="t", group_id="g", rollout_id=rollout, segment_id="s", turn_index=0, policy_version=0,
                prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25], event_id=event_id,
                request={"messages": [{"role": "user", "content": "hé"}]}, meta={"x": 1.5})


def rows(path: Path) -> list[dict]:
    return open_store(path).query(
        "SELECT event_id, rollout_id, prompt_ids, output_logprobs, request, meta, writer_seq FROM events "
        "ORDER BY writer_seq").to_pylist()


def test_a_prepared_batch_is_stored_exactly_as_the_events_would_be(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with open_store(a).writer("w") as writer:
        writer.append([turn("r0", "e0"), turn("r1", "e1")])
    with open_store(b).writer("w") as writer:
        prepared = writer.prepare([turn("r0", "e0"), turn("r1", "e1")])
        assert isinstance(prepared, PreparedBatch) and len(prepared) == 2
        result = writer.append(prepared)
        assert (result.appended, result.first_seq, result.last_seq) == (2, 0, 1)
    assert rows(a) == rows(b)


def test_preparing_refuses_invalid_events_before_anything_is_written(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        with pytest.raises(InvalidEventError, match="needs 'status'"):
            writer.prepare([turn("ok"), {"kind": "status", "group_id": "g", "rollout_id": "bad"}])
        writer.append([turn("after")])
    assert [r["rollout_id"] for r in rows(tmp_path)] == ["after"]


def test_duplicates_are_skipped_within_and_across_prepared_batches(tmp_path: Path) -> None:
    with open_store(tmp_path).writer("w") as writer:
        prepared = writer.prepare([turn("r0")])  # the event id is given here, once
        assert writer.append(prepared).appended == 1
        assert writer.append(prepared).duplicates == 1  # re-sent: skipped
        joined = PreparedBatch.join([writer.prepare([turn("r1", "e1")]), writer.prepare([turn("r1", "e1")]),
                                     writer.prepare([Status(group_id="g", rollout_id="r2", status="started")])])
        result = writer.append(joined)
        assert (result.appended, result.duplicates) == (2, 1)
    assert [r["rollout_id"] for r in rows(tmp_path)] == ["r0", "r1", "r2"]


def test_a_prepared_batch_is_refused_by_a_closed_writer(tmp_path: Path) -> None:
    writer = open_store(tmp_path).writer("w")
    prepared = writer.prepare([turn("r0")])
    writer.close()
    with pytest.raises(WriterClosedError):
        writer.append(prepared)
