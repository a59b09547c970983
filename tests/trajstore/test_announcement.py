"""The checkpoint announcement: one typed contract the learner writes and collectors and servers read."""

from __future__ import annotations

from pathlib import Path

import pytest

from trajstore import Checkpoint, open_store
from trajstore.announcement import LATEST_SQL, Announcement, BadLoadRequest, LoadRequest

DIGEST = "ab" * 32


def test_an_announcement_reads_back_from_the_checkpoints_view_as_written(tmp_path: Path) -> None:
    first = Announcement(run="r", version=0, step=0, path="/models/tiny", base_model="/models/tiny",
                         groups_per_version=4, max_staleness=2, settings={"lr": 1e-5})
    second = Announcement(run="r", version=1, step=3, path="/ckpts/v000001", uri="s3://b/ckpts/v000001",
                          digest=DIGEST, adapter=True, base_model="/models/tiny", groups_per_version=4,
                          max_staleness=2, table_version=7, consumed=("a", "b"), metrics={"loss": 0.5})
    store = open_store(tmp_path / "store")
    with store.writer("learner") as writer:
        writer.append([first.to_event(), second.to_event()])
    rows = store.query("SELECT * FROM checkpoints ORDER BY version").to_pylist()
    assert [Announcement.from_row(row) for row in rows] == [first, second]
    assert store.query("SELECT typeof(groups_per_version), typeof(adapter), typeof(path) FROM checkpoints "
                       "LIMIT 1").to_pylist()[0] == {"typeof(groups_per_version)": "BIGINT",
                                                     "typeof(adapter)": "BOOLEAN", "typeof(path)": "VARCHAR"}
    (latest,) = store.query(LATEST_SQL, ["r"]).to_pylist()
    assert Announcement.from_row(latest).load_request() == LoadRequest(
        version=1, path="/ckpts/v000001", uri="s3://b/ckpts/v000001", digest=DIGEST)


def test_announcements_of_older_learners_stay_readable(tmp_path: Path) -> None:
    """Events written as free meta (before the type): the batch size from an older announcement,
    values of the wrong JSON type read as absent, a uri without its digest as not published."""
    store = open_store(tmp_path / "store")
    with store.writer("learner") as writer:
        writer.append([
            Checkpoint(run="r", policy_version=0, step=0, event_id="c0",
                       meta={"path": "/m", "groups_per_version": 3, "max_staleness": 1}),
            Checkpoint(run="r", policy_version=1, step=2, event_id="c1", consumed=["x"],
                       meta={"path": "/c/v1", "uri": "s3://b/v1", "groups_per_version": "3", "adapter": "yes"}),
            Checkpoint(run="other", policy_version=5, step=9, event_id="c2", meta={"groups_per_version": 0}),
        ])
    (head,) = store.query(LATEST_SQL, ["r"]).to_pylist()
    assert Announcement.from_row(head) == Announcement(run="r", version=1, step=2, path="/c/v1",
                                                       groups_per_version=3, max_staleness=1, consumed=("x",))
    (other,) = store.query(LATEST_SQL, ["other"]).to_pylist()
    assert (other["path"], other["groups_per_version"], other["max_staleness"]) == (None, None, None)


def test_a_load_request_round_trips_and_a_bad_one_names_its_field() -> None:
    for request in (LoadRequest(version=3, path="/c/v3"),
                    LoadRequest(version=3, uri="s3://b/v3", digest=DIGEST),
                    LoadRequest(version=3, path="/c/v3", uri="s3://b/v3", digest=DIGEST)):
        assert LoadRequest.from_body(request.to_body()) == request
    assert LoadRequest(version=3, path="/c/v3").to_body() == {"version": 3, "path": "/c/v3"}
    for body, param in (({"path": "/c"}, "version"), ({"version": True, "path": "/c"}, "version"),
                        ({"version": 1}, "path"), ({"version": 1, "path": ""}, "path"),
                        ({"version": 1, "digest": DIGEST}, "uri"), ({"version": 1, "uri": "s3://b/v1"}, "digest"),
                        ([1, 2], "version")):
        with pytest.raises(BadLoadRequest) as caught:
            LoadRequest.from_body(body)
        assert caught.value.param == param, body
    with pytest.raises(ValueError, match="together or neither"):
        Announcement(run="r", version=1, step=1, path=None, uri="s3://b/v1")
