"""The read side: SQL over a store is read-only (issue 12.9).

DuckDB can write files (`COPY ... TO`, `EXPORT DATABASE`), read any file (`read_csv`), attach
databases and load extensions. A query over the store must do none of that: `COPY ... TO`
into `_delta_log/` once hid every sealed row while `verify` still said ok.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trajstore
from trajstore import QueryError, Reward, Status, Turn


def small_store(path: Path) -> trajstore.Store:
    store = trajstore.open_store(path)
    with store.writer("w") as w:
        w.append([Turn(run="r", group_id="g", rollout_id="x", segment_id="x0", turn_index=0, policy_version=0,
                       prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5]),
                  Reward(run="r", group_id="g", rollout_id="x", reward=1.0),
                  Status(run="r", group_id="g", rollout_id="x", status="completed")])
    return store


@pytest.mark.parametrize("statement", [
    "COPY (SELECT * FROM events) TO '{log}/00000000000000000099.json' (FORMAT json)",
    "COPY (SELECT 1 AS x) TO '{outside}'",
    "SELECT 1; COPY (SELECT 1 AS x) TO '{outside}'",
    "EXPORT DATABASE '{outside_dir}'",
    "ATTACH '{outside}.db' AS other",
    "SELECT * FROM read_csv('{outside_read}')",
    "SET enable_external_access = true",
    "PRAGMA enable_profiling = 'json'",
    "INSTALL httpfs",
])
def test_queries_cannot_write_read_files_or_change_settings(tmp_path: Path, statement: str) -> None:
    store = small_store(tmp_path / "s")
    log = tmp_path / "s" / "events" / "_delta_log"
    outside = tmp_path / "out.csv"
    readable = tmp_path / "secret.csv"
    readable.write_text("a\n1\n")
    before = sorted(p.name for p in log.iterdir())
    sql = statement.format(log=log, outside=outside, outside_dir=tmp_path / "exported", outside_read=readable)
    with pytest.raises(QueryError) as err:
        store.query(sql)
    assert "file system operations are disabled" in str(err.value) or "locked" in str(err.value)
    assert sorted(p.name for p in log.iterdir()) == before
    assert not outside.exists() and not (tmp_path / "exported").exists() and not Path(f"{outside}.db").exists()
    assert store.verify().ok
    assert store.query("SELECT count(*) AS n FROM events").to_pylist() == [{"n": 3}]


def test_queries_cannot_reach_the_working_directorys_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB allow-lists its temp directory even with external access off; its default is `./.tmp`."""
    store = small_store(tmp_path / "s")
    monkeypatch.chdir(tmp_path)
    shared = tmp_path / ".tmp"
    shared.mkdir()
    (shared / "planted.csv").write_text("a\n1\n")
    with pytest.raises(QueryError, match="file system operations are disabled"):
        store.query(f"COPY (SELECT * FROM events) TO '{shared / 'x.csv'}'")
    assert not (shared / "x.csv").exists()
    for name in (shared / "planted.csv", ".tmp/planted.csv"):
        with pytest.raises(QueryError, match="file system operations are disabled"):
            store.query(f"SELECT * FROM read_csv('{name}')")
    spill = store.query("SELECT current_setting('temp_directory') AS d").column("d")[0].as_py()
    assert Path(spill).is_dir() and Path(spill).stat().st_mode & 0o077 == 0  # this process's, private


def test_a_write_attempt_says_how_to_export(tmp_path: Path) -> None:
    store = small_store(tmp_path / "s")
    with pytest.raises(QueryError, match="read-only.*--output FILE"):
        store.query(f"COPY (SELECT * FROM rollouts) TO '{tmp_path / 'r.csv'}'")
    # what a statement creates lives in the snapshot's in-memory database and ends with it
    with store.snapshot() as snap:
        snap.query("CREATE TABLE scratch AS SELECT rollout_id FROM rollouts")
        assert snap.query("SELECT count(*) AS n FROM scratch").to_pylist() == [{"n": 1}]
    with pytest.raises(QueryError, match="scratch"):
        store.query("SELECT * FROM scratch")
