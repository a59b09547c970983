"""Faults in a collection run, each beside healthy rollouts: agents that raise or hang, commands that
print garbage and exit 1 or hang with a child process, rewards that raise. The run goes on, every
fault is recorded with its error, retries fill the slots and healthy groups are untouched."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from collectors.collect.runner import collect
from collectors.collect.settings import CollectSettings
from collectors.embedded.app import RunningServer
from tests.collectors.agents_for_tests import rollout_rows, usable_by_task, write_tasks
from trajstore import open_store

A = "tests.collectors.agents_for_tests"
SCRIPTS = Path(__file__).parents[1] / "scripts"
HANG_S = 3.0  # the hanging tasks' own timeout_s; every other rollout has a minute


def settings_for(tmp_path: Path, server: RunningServer, tiny_model: Path, tasks: list[dict], **kw: object
                 ) -> CollectSettings:
    return replace(CollectSettings(store=str(tmp_path / "store"), run="faults", server=server.url,
                                   tasks=write_tasks(tmp_path / "tasks.jsonl", tasks), model=str(tiny_model),
                                   max_tokens=8, seed=3, rollout_timeout=60, workdir=str(tmp_path / "work"),
                                   display="off", n=2, retries=2), **kw)


def by_task(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["started_meta"]["task_id"], []).append(row)
    return out


def gone(pid: int) -> bool:
    """The process no longer runs (it may linger as a zombie until its new parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_python_agent_and_reward_faults_are_recorded_and_retried(server: RunningServer, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    tasks = [{"id": "ok", "prompt": "hello"}, {"id": "raise", "prompt": "a", "fault": "raise"},
             {"id": "hang", "prompt": "b", "fault": "hang", "timeout_s": HANG_S}, {"id": "reward", "prompt": "c", "fault": "reward"},
             {"id": "always", "prompt": "d", "fault": "always"}, {"id": "truncate", "prompt": "e", "fault": "truncate"}]
    settings = settings_for(tmp_path, server, tiny_model, tasks, agent=f"{A}:faulty", reward=f"{A}:score")
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 5 and summary.groups_incomplete == 1  # "always" never succeeds
    assert summary.rollouts["failed"] == 2 + 2 + 6 and summary.rollouts["aborted"] == 2
    assert summary.retries == 2 + 2 + 2 + 4

    store = open_store(settings.store)
    rows = by_task(rollout_rows(store, "faults"))
    usable = usable_by_task([r for rs in rows.values() for r in rs])
    for tid in ("ok", "raise", "hang", "reward", "truncate"):
        assert list(usable[(tid, 0)].values()) == [[0, 1]], tid
        assert len(usable[(tid, 0)]) == 1  # one group per task: retries stay in it
    for tid in ("ok", "truncate"):  # healthy groups: first attempts only
        assert all(r["started_meta"]["attempt"] == 0 and r["trainable"] for r in rows[tid])

    def attempts(tid: str, attempt: int) -> list[dict]:
        return [r for r in rows[tid] if r["started_meta"]["attempt"] == attempt]

    for r in attempts("raise", 0):
        assert r["status"] == "failed" and "RuntimeError: boom in the agent (task raise, attempt 0)" in r["error"]
        assert "Traceback" in r["final_meta"]["traceback"] and r["reward"] is None
        assert Path(r["started_meta"]["workdir"]).is_dir()  # kept for debugging
    for r in attempts("hang", 0):
        assert r["status"] == "aborted" and r["error"] == f"timed out after {HANG_S:g} s (the task's timeout_s)"
        assert r["turns"] == 1  # the call it made before hanging is stored
    for r in attempts("reward", 0):
        assert r["status"] == "failed" and "the reward raised ValueError: reward cannot score task reward" in r["error"]
        assert r["reward"] is None and r["turns"] == 1
    assert all(r["trainable"] for tid in ("raise", "hang", "reward") for r in attempts(tid, 1))
    always = rows["always"]
    assert sorted((r["started_meta"]["slot"], r["started_meta"]["attempt"]) for r in always) == [
        (s, a) for s in (0, 1) for a in (0, 1, 2)]
    assert all(r["status"] == "failed" for r in always)
    assert all(r["status"] == "truncated" and r["final_meta"]["truncated"] == "max_turns" for r in rows["truncate"])
    complete = store.query("SELECT group_id, complete FROM groups WHERE run = 'faults'").to_pylist()
    incomplete = [g["group_id"] for g in complete if not g["complete"]]
    assert incomplete == [always[0]["group_id"]]  # the learner sees the retried groups as complete


def test_agent_commands_are_captured_and_their_faults_recorded(server: RunningServer, tiny_model: Path,
                                                               tmp_path: Path) -> None:
    tasks = [{"id": "ok1", "prompt": "hi"}, {"id": "ok2", "prompt": "there"},
             {"id": "garbage", "prompt": "x", "fault": "garbage"}, {"id": "hang", "prompt": "y", "fault": "hang",
                                                                               "timeout_s": HANG_S}]
    settings = settings_for(tmp_path, server, tiny_model, tasks, retries=1, reward=f"{A}:async_score",
                            agent_cmd=f"{sys.executable} {SCRIPTS / 'openai_agent.py'}")
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 4 and summary.rollouts["failed"] == 2 and summary.rollouts["aborted"] == 2

    store = open_store(settings.store)
    rows = by_task(rollout_rows(store, "faults"))
    turns = {t["rollout_id"]: t for t in store.query(
        "SELECT rollout_id, response, meta FROM turns WHERE run = 'faults'").to_pylist()}
    for row in [r for rs in rows.values() for r in rs if r["trainable"]]:
        final = row["final_meta"]
        assert row["reward"] == 1.0 and final["agent_exit"] == 0
        assert f"rollout {row['rollout_id']} done" in final["agent_output"]  # it ran as this rollout
        if row["started_meta"]["task_id"] == "hang":  # the retry answers without a model call
            assert final["result"] == "recovered\n" and row["turns"] == 0
            continue
        # the command's model call is stored under its own rollout, and it printed that reply
        reply = json.loads(turns[row["rollout_id"]]["response"])
        assert row["turns"] == 1 and final["result"].rstrip("\n") == reply["choices"][0]["message"]["content"]
    for row in (r for r in rows["garbage"] if r["started_meta"]["attempt"] == 0):
        assert row["status"] == "failed" and row["turns"] == 0 and row["final_meta"]["agent_exit"] == 1
        assert row["error"].startswith("the agent command exited with status 1: ")
        assert "garbage" in row["error"] and "Traceback: the agent broke" in row["error"]
    for row in (r for r in rows["hang"] if r["started_meta"]["attempt"] == 0):
        assert row["status"] == "aborted" and "timed out" in row["error"]
        pids = [int(p) for p in (Path(row["started_meta"]["workdir"]) / "pids").read_text().split()]
        assert len(pids) == 2 and all(gone(pid) for pid in pids), "the command and its child must be killed"
    assert usable_by_task([r for rs in rows.values() for r in rs])[("hang", 0)].popitem()[1] == [0, 1]


def test_anthropic_sdk_command_with_a_reward_command(server: RunningServer, tiny_model: Path,
                                                     tmp_path: Path) -> None:
    settings = settings_for(tmp_path, server, tiny_model, [{"id": "a", "prompt": "Hello"}],
                            agent_cmd=f"{sys.executable} {SCRIPTS / 'anthropic_agent.py'}",
                            reward_cmd='test "$TRAJSTORE_SLOT" = 0 && test -s "$TRAJSTORE_RESULT_FILE"')
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 1
    store = open_store(settings.store)
    rows = sorted(rollout_rows(store, "faults"), key=lambda r: r["started_meta"]["slot"])
    assert [r["reward"] for r in rows] == [1.0, 0.0] and [r["final_meta"]["reward_exit"] for r in rows][1] == 1
    protocols = store.query("SELECT DISTINCT json_extract_string(meta, '$.protocol') AS p FROM turns").to_pylist()
    assert protocols == [{"p": "anthropic"}] and all(r["turns"] == 1 for r in rows)
    assert os.environ.get("ANTHROPIC_BASE_URL") is None  # the rollout's variables never leak into the runner


SECRETS = {"AWS_SECRET_ACCESS_KEY": "aws-secret-1", "TRAJSTORE_CONTROL_TOKEN": "control-token-0123456789",
           "HF_TOKEN": "hf-secret-2", "MY_SETTING": "mine", "TEAM_A": "a", "TEAM_B": "b"}


def _command_envs(tmp_path: Path, server: RunningServer, tiny_model: Path, name: str,
                  **kw: object) -> tuple[dict[str, str], dict[str, str]]:
    """The environments an agent command and a reward command of one rollout saw."""
    (tmp_path / name).mkdir()
    settings = settings_for(tmp_path / name, server, tiny_model, [{"id": "t", "prompt": "hi"}], n=1, retries=0,
                            keep_workdirs=True, agent_cmd="env -0 > agent.env; echo done",
                            reward_cmd="env -0 > reward.env", **kw)
    assert asyncio.run(collect(settings)).groups_complete == 1
    (workdir,) = [d for d in (tmp_path / name / "work").iterdir() if d.is_dir()]

    def read(file: str) -> dict[str, str]:
        pairs = (entry.split("=", 1) for entry in (workdir / file).read_text().split("\0") if entry)
        return dict(pairs)

    return read("agent.env"), read("reward.env")


def test_commands_see_no_secret_of_the_collector(server: RunningServer, tiny_model: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--agent-cmd and --reward-cmd ran with the collector's whole environment (cloud credentials, the control
    token); they now see an allow-list, the rollout's own variables, and what --pass-env / --inherit-env add."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    for seen in _command_envs(tmp_path, server, tiny_model, "scrubbed"):
        assert not set(SECRETS) & set(seen), sorted(seen)
        assert seen["PATH"] == os.environ["PATH"] and seen["OPENAI_BASE_URL"].startswith("http://")
        assert seen["OPENAI_API_KEY"].startswith("ts-") and seen["TRAJSTORE_TASK_ID"] == "t"
    for seen in _command_envs(tmp_path, server, tiny_model, "passed", pass_env=("MY_SETTING", "TEAM_*")):
        assert {k: seen.get(k) for k in SECRETS} == {**dict.fromkeys(SECRETS), "MY_SETTING": "mine", "TEAM_A": "a",
                                                     "TEAM_B": "b"}
    for seen in _command_envs(tmp_path, server, tiny_model, "inherited", inherit_env=True):
        assert seen["AWS_SECRET_ACCESS_KEY"] == "aws-secret-1" and seen["HF_TOKEN"] == "hf-secret-2"
        assert "TRAJSTORE_CONTROL_TOKEN" not in seen  # only a --pass-env naming it passes it


def test_pass_env_names_are_checked(tmp_path: Path, server: RunningServer, tiny_model: Path) -> None:
    bad = settings_for(tmp_path, server, tiny_model, [{"id": "t", "prompt": "hi"}], agent_cmd="true",
                       pass_env=("AWS KEY", "A*B"))
    assert [p for p in bad.problems() if "--pass-env" in p] == [
        "--pass-env 'AWS KEY' is not a variable name (letters, digits, _; a trailing * passes every name it starts)",
        "--pass-env 'A*B' is not a variable name (letters, digits, _; a trailing * passes every name it starts)"]
    python_agent = replace(bad, agent_cmd=None, agent=f"{A}:faulty", reward=f"{A}:score", pass_env=("X",))
    assert any("give one of those" in p for p in python_agent.problems())
