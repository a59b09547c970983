"""Storage schemes: a new object store is one entry in `trajstore.location.REMOTE_SCHEMES`."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from trajstore import location
from trajstore.location import Scheme, directory, is_remote, resolve


def test_one_entry_adds_a_scheme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A made-up `mem://` store over a local directory: stores, checkpoint directories and the learner's
    publishing default all follow from the one entry."""
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setitem(location.REMOTE_SCHEMES, "mem", Scheme(
        "mem", "mem://bucket/prefix", lambda given: dict(given), lambda options: fs,
        lambda bucket, key: f"mem://{bucket}/{key}"))
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    loc = resolve("mem://b/runs")
    assert loc.remote and loc.table_uri == "mem://b/runs/events" and loc.table_path == "b/runs/events"
    assert loc.filesystem is fs and loc.wal_root.is_relative_to(tmp_path / "spool")
    assert directory("mem://b/ckpt") == (fs, "b/ckpt")
    assert is_remote("mem://b/runs") and not is_remote(str(tmp_path))
    from learner.settings import LearnSettings

    assert LearnSettings(store="mem://b/runs", run="r", model="m", checkpoints="c").publish_uri == "mem://b/runs/checkpoints/r"


@pytest.mark.parametrize("uri, message", [("gs://b/x", "use a directory path or an s3://bucket/prefix URI"),
                                          ("s3://", "names no bucket; write s3://bucket/prefix")])
def test_unknown_schemes_are_named(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(uri)
