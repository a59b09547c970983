"""The `trajstore` command line, run as users run it: the installed console script in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import trajstore
from trajstore.synth import generate_run

TRAJSTORE = shutil.which("trajstore") or str(Path(sys.executable).parent / "trajstore")


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps tables to the terminal width
    proc = subprocess.run([TRAJSTORE, *args], capture_output=True, text=True, timeout=120, env=env)
    if ok:
        assert proc.returncode == 0, f"trajstore {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.jsonl"
    events = generate_run(groups=3, group_size=2, seed=1)
    for e in events:  # ingest derives ids from content and accepts a missing time
        e.pop("time")
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_ingest_twice_stores_each_event_once(tmp_path: Path, events_file: Path) -> None:
    store = str(tmp_path / "s")
    n = len(events_file.read_text().splitlines())
    first = run("ingest", "--store", store, str(events_file))
    assert f"{n} events read, {n} appended" in first.stdout
    second = run("ingest", "--store", store, str(events_file))
    assert f"0 appended, {n} already stored" in second.stdout
    out = run("query", "--store", store, "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM events",
              "--format", "json")
    assert json.loads(out.stdout) == {"n": n, "d": n}


def test_ingest_reports_every_bad_line_and_writes_nothing(tmp_path: Path, events_file: Path) -> None:
    store = tmp_path / "s"
    lines = events_file.read_text().splitlines()
    turn = json.loads(next(line for line in lines if '"kind": "turn"' in line))
    short = dict(turn, output_logprobs=turn["output_logprobs"][:-1])
    negative = dict(turn, prompt_ids=[-5] + turn["prompt_ids"])
    bad = lines[:2] + ["{not json"] + [json.dumps(short)] + lines[2:4] + [json.dumps(negative)] + \
        [json.dumps({"kind": "status", "rollout_id": "r", "group_id": "g", "status": "done"})]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad) + "\n")
    proc = run("ingest", "--store", str(store), str(path), ok=False)
    assert proc.returncode != 0
    err = proc.stderr
    assert "line 3: not valid JSON" in err
    assert "line 4: output_ids has" in err and "output_logprobs has" in err
    assert "line 7: prompt_ids holds negative token ids" in err
    assert "line 8: status: 'done' is not one of" in err
    assert "nothing was written" in err
    assert trajstore.open_store(store).query("SELECT count(*) AS n FROM events").to_pylist() == [{"n": 0}]


def test_query_formats(tmp_path: Path, events_file: Path) -> None:
    store = str(tmp_path / "s")
    run("ingest", "--store", store, str(events_file))
    sql = "SELECT rollout_id, reward, segments FROM rollouts ORDER BY rollout_id"
    expected = trajstore.open_store(store).query(sql).to_pylist()
    as_json = [json.loads(line) for line in run("query", "--store", store, sql, "--format", "json").stdout.splitlines()]
    assert as_json == expected
    csv_lines = run("query", "--store", store, sql, "--format", "csv").stdout.splitlines()
    assert csv_lines[0] == '"rollout_id","reward","segments"' and len(csv_lines) == len(expected) + 1
    out = tmp_path / "r.parquet"
    run("query", "--store", store, sql, "--format", "parquet", "--output", str(out))
    assert pq.read_table(out).to_pylist() == expected
    table = run("query", "--store", store, sql).stdout
    assert expected[0]["rollout_id"] in table
    lists = run("query", "--store", store, "SELECT tokens FROM samples LIMIT 1", "--format", "csv").stdout
    assert lists.splitlines()[1].startswith('"[')


def test_query_errors_are_clear(tmp_path: Path, events_file: Path) -> None:
    store = str(tmp_path / "s")
    missing = run("query", "--store", store, "SELECT 1", ok=False)
    assert missing.returncode == 1 and "no trajstore store at" in missing.stderr
    run("ingest", "--store", store, str(events_file))
    bad = run("query", "--store", store, "SELECT nope FROM rollouts", ok=False)
    assert bad.returncode == 1 and "nope" in bad.stderr and "The views are" in bad.stderr
    no_output = run("query", "--store", store, "SELECT 1", "--format", "parquet", ok=False)
    assert "--format parquet needs --output FILE" in no_output.stderr


def test_stats_compact_verify(tmp_path: Path, events_file: Path) -> None:
    store = str(tmp_path / "s")
    for i in range(3):  # three ingests, three sealed files
        lines = events_file.read_text().splitlines()
        part = tmp_path / f"part{i}.jsonl"
        part.write_text("\n".join(lines[i::3]) + "\n")
        run("ingest", "--store", store, str(part))
    stats = run("stats", "--store", store).stdout
    assert "sealed: 3 files" in stats and "walkthrough" in stats
    assert "of samples span more than one policy version" in stats
    compact = run("compact", "--store", store).stdout
    assert "files: 3 -> 1 (3 rewritten)" in compact
    assert "ok" in run("verify", "--store", store).stdout
    # flip one byte in the middle of the sealed file: verify names it and exits 1
    (sealed,) = (tmp_path / "s" / "events").glob("compact-*.parquet")
    data = bytearray(sealed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sealed.write_bytes(bytes(data))
    bad = run("verify", "--store", store, ok=False)
    assert bad.returncode == 1 and sealed.name in bad.stdout


def test_walkthrough_runs_end_to_end(tmp_path: Path) -> None:
    out = run("walkthrough", "--store", str(tmp_path / "w"), "--groups", "6").stdout
    for step in ("1. ingest", "advantages by SQL", "the learner's next shard", "8. stats"):
        assert step in out
    again = run("walkthrough", "--store", str(tmp_path / "w"), ok=False)
    assert "is not empty" in again.stderr


@pytest.mark.parametrize("args, says", [
    (["query", "--version", "99", "SELECT 1"], "table version 99 does not exist: the versions of"),
    (["query", "--version", "-1", "SELECT 1"], "-1 is not in the range x>=0"),
    (["query", ""], "the query is empty"),
    (["query", "SELECT * FROM nope"], "The views are"),
    (["ingest", "{deep}"], "line 1: the JSON is nested too deeply"),
])
def test_mistakes_end_in_one_line_errors_not_tracebacks(tmp_path: Path, events_file: Path, args: list[str],
                                                        says: str) -> None:
    """Issue 12.15: each mistake a person makes at the command line gets a message, never a traceback."""
    store = str(tmp_path / "s")
    run("ingest", "--store", store, str(events_file))
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"kind": "status", "group_id": "g", "rollout_id": "r", "status": "completed", "meta": '
                    + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}\n")
    proc = run(args[0], "--store", store, *(a.format(deep=deep) for a in args[1:]), ok=False)
    assert proc.returncode in (1, 2), proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
