"""trajstore.prune: plain SQL reads only the sealed files its WHERE run / time terms and its
newest-first LIMIT can reach, with the same answer as a full read; anything else reads every file."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

import trajstore
from tests.conftest import S3Server
from trajstore.prune import implied_scope

UTC = timezone.utc


@pytest.mark.parametrize(("sql", "params", "scope"), [
    ("SELECT * FROM turns WHERE run = 'a' AND output_tokens > 3", None, trajstore.Scope(runs=("a",))),
    ("SELECT count(*) FROM rollouts WHERE run IN ('b', 'a')", None, trajstore.Scope(runs=("a", "b"))),
    ("SELECT * FROM groups g WHERE 'x' = g.run", None, trajstore.Scope(runs=("x",))),
    ("SELECT * FROM samples WHERE run = $run", {"run": "z"}, trajstore.Scope(runs=("z",))),
    ("SELECT * FROM events ORDER BY time DESC LIMIT 100", None, trajstore.Scope(newest=100)),
    ("SELECT event_id FROM events e WHERE e.run = 'q' ORDER BY e.time DESC, e.event_id LIMIT 3", None,
     trajstore.Scope(runs=("q",), newest=3)),
    ("SELECT * FROM events WHERE time >= '2026-01-01' AND time < TIMESTAMP '2026-02-01 12:00'", None,
     trajstore.Scope(since=datetime(2026, 1, 1, tzinfo=UTC), until=datetime(2026, 2, 1, 12, tzinfo=UTC))),
    ("SELECT * FROM events WHERE time BETWEEN $lo AND '2026-01-02T00:00:00Z'",
     {"lo": datetime(2026, 1, 1, tzinfo=UTC)},
     trajstore.Scope(since=datetime(2026, 1, 1, tzinfo=UTC), until=datetime(2026, 1, 2, tzinfo=UTC))),
])
def test_the_scope_a_query_implies(sql: str, params: Any, scope: trajstore.Scope) -> None:
    assert implied_scope(sql, params) == scope


@pytest.mark.parametrize("sql", [
    "SELECT * FROM turns WHERE run = 'a' OR run = 'b'",  # a disjunction: not a narrowing of every row
    "SELECT * FROM turns t JOIN rollouts r USING (rollout_id) WHERE t.run = 'a'",  # a join reaches other rows
    "SELECT * FROM turns WHERE run = 'a' AND rollout_id IN (SELECT rollout_id FROM rollouts)",  # a subquery
    "WITH x AS (SELECT 1) SELECT * FROM turns WHERE run = 'a'",
    "SELECT * FROM turns WHERE run = 'a' UNION ALL SELECT * FROM turns",
    "SELECT *, count(*) OVER () FROM events ORDER BY time DESC LIMIT 100",  # a window over every event
    "SELECT * FROM events WHERE kind = 'turn' ORDER BY time DESC LIMIT 100",  # newest turns, not newest events
    "SELECT * FROM events ORDER BY time DESC, run LIMIT 10",  # ties broken otherwise than the scope does
    "SELECT * FROM events ORDER BY time DESC LIMIT 10 OFFSET 5",
    "SELECT * FROM turns WHERE time > '2026-01-01'",  # a window would cut a view's rollouts
    "SELECT * FROM turns WHERE run = $missing",  # no value given: DuckDB will say so, the scope stays out
    "SELECT * FROM read_parquet('x.parquet') WHERE run = 'a'",
    "not sql at all",
])
def test_queries_that_imply_no_scope(sql: str) -> None:
    assert implied_scope(sql) is None


def rollout(run: str, b: int) -> list[dict[str, Any]]:
    rid = f"r{b}"
    common = {"run": run, "group_id": f"g{b}", "rollout_id": rid}
    return [
        {**common, "kind": "turn", "event_id": f"{rid}-t0", "segment_id": f"{rid}-s0", "turn_index": 0,
         "policy_version": 0, "prompt_ids": [1, 2, b], "output_ids": [4, 5], "output_logprobs": [-0.5, -0.25]},
        {**common, "kind": "reward", "event_id": f"{rid}-reward", "reward": float(b)},
        {**common, "kind": "status", "event_id": f"{rid}-status", "status": "completed", "group_size": 1},
    ]


def test_plain_sql_reads_only_the_files_that_can_hold_its_answer(s3_server: S3Server, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    uri = s3_server.new_uri()
    with trajstore.open_store(uri).writer("w", seal_interval=3600) as writer:
        for b in range(8):  # 8 sealed files, one rollout each: runs a (files 0-3) and b (files 4-7)
            writer.append(rollout("a" if b < 4 else "b", b))
            writer.seal()

    def fresh_host(name: str) -> trajstore.Store:
        monkeypatch.setenv("TRAJSTORE_FILE_CACHE", str(tmp_path / name))  # nothing cached: each file read is fetched
        return trajstore.open_store(uri, create=False)

    every = fresh_host("all").query("SELECT run, rollout_id, reward FROM rollouts ORDER BY rollout_id").to_pylist()
    events = fresh_host("events").query("SELECT event_id FROM events ORDER BY time DESC, event_id").to_pylist()

    store = fresh_host("run")
    sql = "SELECT run, rollout_id, reward FROM rollouts WHERE run = 'b' ORDER BY rollout_id"
    assert store.query(sql).to_pylist() == [r for r in every if r["run"] == "b"]
    assert store.table.cache is not None and store.table.cache.fetches == 4

    store = fresh_host("newest")
    sql = "SELECT event_id FROM events ORDER BY time DESC, event_id LIMIT 4"
    assert store.query(sql).to_pylist() == events[:4]
    assert store.table.cache is not None and store.table.cache.fetches == 2  # 3 events a file: 2 files hold 4

    store = fresh_host("subquery")  # not a narrowing it can prove: every file, the same answer
    sql = ("SELECT run, rollout_id, reward FROM rollouts WHERE run = 'b' "
           "AND rollout_id IN (SELECT rollout_id FROM turns) ORDER BY rollout_id")
    assert store.query(sql).to_pylist() == [r for r in every if r["run"] == "b"]
    assert store.table.cache is not None and store.table.cache.fetches == 8
