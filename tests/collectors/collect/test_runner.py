"""`collectors.collect.runner.collect` end to end on the embedded server and the tiny model, plus its pure parts."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from collectors.collect.resume import PastRollout, plan_group
from collectors.collect.rewards import RewardError, components, rescore
from collectors.collect.runner import collect
from collectors.collect.settings import CollectSettings
from collectors.collect.progress import summary_table
from collectors.collect.tasks import TaskFileError, load_tasks, task_id
from collectors.embedded.app import RunningServer
from collectors.policy import PolicyServerUnreachable
from collectors.model.replies import response_text
from tests.collectors.agents_for_tests import rollout_rows, usable_by_task, write_tasks
from trajstore import Checkpoint, Status, open_store

A = "tests.collectors.agents_for_tests"


def base_settings(tmp_path: Path, server: RunningServer, tiny_model: Path, tasks: list[dict], **kw: object
                  ) -> CollectSettings:
    settings = CollectSettings(store=str(tmp_path / "store"), run="exp",
                               tasks=write_tasks(tmp_path / "tasks.jsonl", tasks), server=server.url,
                               model=str(tiny_model), max_tokens=8, seed=7, rollout_timeout=60,
                               workdir=str(tmp_path / "work"), display="off", agent=f"{A}:chat", reward=f"{A}:score")
    return replace(settings, **kw)


TASKS = [
    {"id": "add", "prompt": "What is 2+3?", "answer": "5", "turns": 2},
    {"id": "files", "prompt": "Read notes.txt", "files": {"notes.txt": "hello", "sub/dir/a.py": "x = 1\n"}},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3"}]},
]


def test_every_group_completes_with_turns_rewards_and_statuses(server: RunningServer, tiny_model: Path,
                                                               tmp_path: Path) -> None:
    settings = base_settings(tmp_path, server, tiny_model, TASKS, n=4)
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 3 and summary.groups_incomplete == 0 and not summary.interrupted
    assert summary.rollouts.get("completed", 0) + summary.rollouts.get("truncated", 0) == 12
    assert summary.retries == 0 and summary.output_tokens > 0 and summary.mean_reward is not None

    store = open_store(settings.store)
    rows = rollout_rows(store, "exp")
    assert len(rows) == 12
    ids = {task_id(t) for t in TASKS}
    assert usable_by_task(rows) == {(tid, 0): {g: [0, 1, 2, 3]} for tid, g in
                                    {(r["started_meta"]["task_id"], r["group_id"]) for r in rows}}
    assert {r["started_meta"]["task_id"] for r in rows} == ids
    for row in rows:
        meta, final = row["started_meta"], row["final_meta"]
        assert row["trainable"] and row["status"] in ("completed", "truncated") and row["group_size"] == 4
        assert row["turns"] == (2 if meta["task_id"] == "add" else 1)
        assert row["reward_components"] == 2 and row["reward"] == pytest.approx(
            final["result"]["text"].__len__() % 5 / 4 + meta["slot"] / 10)
        assert meta["attempt"] == 0 and meta["epoch"] == 0 and task_id(meta["task"]) == meta["task_id"]
        assert final["result"]["rollout_id"] == row["rollout_id"]
        if meta["task_id"] == "files":  # the agent read the task's files from its own directory
            assert final["result"]["files"] == TASKS[1]["files"]
        assert not Path(meta["workdir"]).exists()  # usable rollouts' directories are removed
    turns = store.query("SELECT rollout_id, finish_reason, policy_version, session_id FROM turns").to_pylist()
    last = {t["rollout_id"]: t["finish_reason"] for t in turns}
    for row in rows:  # truncated exactly when the last model call stopped at max_tokens
        assert (row["status"] == "truncated") == (last[row["rollout_id"]] == "length")
        assert row["final_meta"].get("truncated") == ("max_tokens" if row["status"] == "truncated" else None)
    assert {t["policy_version"] for t in turns} == {0}
    groups = store.query("SELECT complete, size, trainable FROM groups WHERE run = 'exp'").to_pylist()
    assert groups == [{"complete": True, "size": 4, "trainable": 4}] * 3  # what the learner will see
    # seeded: every slot its own draw, so the four rollouts of a group are not copies
    texts = [r["final_meta"]["result"]["text"] for r in rows if r["started_meta"]["task_id"] == "files"]
    assert len(set(texts)) > 1

    again = asyncio.run(collect(settings))  # nothing left to do: complete groups are never redone
    assert again.groups_skipped == 3 and again.rollouts == {} and again.groups_complete == 0
    assert len(rollout_rows(store, "exp")) == 12


def test_epochs_make_one_group_per_task_and_pass(server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    settings = base_settings(tmp_path, server, tiny_model, TASKS[:2], n=2, epochs=2, concurrency=3)
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 4
    by_task = usable_by_task(rollout_rows(open_store(settings.store), "exp"))
    assert sorted(by_task) == [("add", 0), ("add", 1), ("files", 0), ("files", 1)]
    assert all(list(groups.values()) == [[0, 1]] for groups in by_task.values())
    assert len({g for groups in by_task.values() for g in groups}) == 4


def test_resume_closes_orphans_and_reuses_their_group(server: RunningServer, tiny_model: Path,
                                                      tmp_path: Path) -> None:
    """A collector killed mid-rollout leaves a `started` rollout: the next run closes it as aborted and
    fills its group (same group id) with the next attempt of that slot."""
    settings = base_settings(tmp_path, server, tiny_model, TASKS[:1], n=2)
    store = open_store(settings.store)
    with store.writer("dead-collector") as w:
        w.append([Status(run="exp", group_id="g-old", rollout_id="r-orphan", status="started", group_size=2,
                         meta={"task_id": "add", "epoch": 0, "slot": 1, "attempt": 0})])
    summary = asyncio.run(collect(settings))
    assert summary.orphans_closed == 1 and summary.groups_complete == 1
    rows = rollout_rows(store, "exp")
    orphan = next(r for r in rows if r["rollout_id"] == "r-orphan")
    assert orphan["status"] == "aborted" and "closed when the run resumed" in orphan["error"]
    assert usable_by_task(rows) == {("add", 0): {"g-old": [0, 1]}}
    attempts = {r["started_meta"]["slot"]: r["started_meta"]["attempt"] for r in rows if r["trainable"]}
    assert attempts == {0: 0, 1: 1}


# ---------------------------------------------------------------- pure parts

def past(group: str, slot: int, attempt: int, status: str | None, rewarded: bool = True,
         version: int | None = 0) -> PastRollout:
    return PastRollout(group, f"{group}-{slot}-{attempt}", "t", 0, slot, attempt, status, rewarded, version)


def test_plan_group_reuses_the_fullest_group_and_counts_attempts() -> None:
    task = {"id": "t", "prompt": "p"}
    fresh = plan_group([], task, 0, 3, needs_reward=True)
    assert fresh.group_id is None and fresh.todo == ((0, 0), (1, 0), (2, 0))
    done = plan_group([past("g", s, 0, "completed") for s in range(3)], task, 0, 3, needs_reward=True)
    assert done.todo == () and done.done_slots == 3
    partial = plan_group([past("g", 0, 0, "completed", version=2), past("g", 1, 0, "failed"),
                          past("g", 1, 1, "aborted"), past("g", 2, 0, "completed", rewarded=False, version=1),
                          past("h", 0, 0, "failed")], task, 0, 3, needs_reward=True)
    assert partial.group_id == "g" and partial.todo == ((1, 2), (2, 1)) and partial.oldest_version == 2
    no_reward = plan_group([past("g", 2, 0, "truncated", rewarded=False)], task, 0, 3, needs_reward=False)
    assert no_reward.todo == ((0, 0), (1, 0))


def test_task_file_reports_every_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 1, "prompt": "ok"}\n{oops\n\n{"id": 1, "prompt": "again"}\n{"files": {"../x": "y"}}\n'
                    '{"prompt": 5, "messages": []}\n[1]\n')
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    text = str(err.value)
    for expected in ("line 2: not valid JSON", "line 4: task id '1' repeats line 1", "line 5: needs `prompt`",
                     "line 5: `files` path '../x'", "line 6: `prompt` must be text", "line 6: `messages` must be",
                     "line 7: a task must be a JSON object"):
        assert expected in text
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "files": {"d/x.txt": "hi"}}\n')
    tasks = load_tasks(path)
    assert [task_id(t) for t in tasks] == [task_id({"prompt": "a"}), task_id(tasks[1])] and task_id(tasks[0]) != \
        task_id(tasks[1])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "p1", "prompt": "x", "answer": "1"}]), tmp_path / "t.parquet")
    assert load_tasks(tmp_path / "t.parquet") == [{"id": "p1", "prompt": "x", "answer": "1"}]
    # a line break only ends a line at "\n": JSON strings may hold U+2028 and U+0085 unescaped (and \r\n ends are fine)
    path.write_text('{"prompt": "a\u2028b\u0085c"}\r\n{"prompt": "d"}\n', encoding="utf-8")
    assert [t["prompt"] for t in load_tasks(path)] == ["a\u2028b\u0085c", "d"]


def test_settings_report_every_problem_at_once(tmp_path: Path) -> None:
    bad = CollectSettings(store="s", run="", tasks=str(tmp_path / "missing.jsonl"), n=0, agent="a:b",
                          agent_cmd="x", reward="c:d", reward_cmd="y", proxy="http://p", top_p=0, retries=-1)
    problems = bad.problems()
    for expected in ("--n must be at least 1", "--retries must be at least 0", "--run must name the run",
                     "--agent and --agent-cmd", "--reward and --reward-cmd", "does not exist", "no policy",
                     "--proxy needs --server", "0 < --top-p"):
        assert any(expected in p for p in problems), (expected, problems)
    with pytest.raises(ValueError, match="cannot collect") as err:
        asyncio.run(collect(bad))
    assert "--agent and --agent-cmd" in str(err.value) and "no policy" in str(err.value)


def test_reward_components_and_response_text() -> None:
    assert components(1) == {"reward": 1.0} and components({"a": 0.5, "b": 1}) == {"a": 0.5, "b": 1.0}
    assert components(0.25, "score") == {"score": 0.25}
    for bad in (None, {}, {"a": float("nan")}, {"a": "1"}, True, {"": 1.0}):
        with pytest.raises(RewardError):
            components(bad)
    assert response_text(json.dumps({"choices": [{"message": {"content": "hi"}}]})) == "hi"
    assert response_text({"content": [{"type": "text", "text": "a"}, {"type": "tool_use"}, {"type": "text",
                                                                                          "text": "b"}]}) == "ab"


def test_follow_waits_for_the_learner_then_cycles_epochs_until_stopped(server: RunningServer, tiny_model: Path,
                                                                        tmp_path: Path) -> None:
    settings = base_settings(tmp_path, server, tiny_model, TASKS[:1], n=2, follow=True, poll_interval_s=0.25)
    store = open_store(settings.store)

    async def main() -> object:
        stop = asyncio.Event()
        collecting = asyncio.create_task(collect(settings, stop=stop))
        await asyncio.sleep(0)
        with store.writer("learner") as w:  # the learner announces itself; only then does collection start
            await asyncio.to_thread(w.append, [Checkpoint(run="exp", policy_version=server.engine.policy_version,
                                                          step=0, meta={"path": str(tiny_model),
                                                                        "groups_per_version": 1})])
        while len({r["group_id"] for r in await asyncio.to_thread(rollout_rows, store, "exp") if r["trainable"]}) < 2:
            assert not collecting.done(), collecting.result()
            await asyncio.sleep(0.25)
        stop.set()
        return await collecting

    summary = asyncio.run(main())
    assert summary.interrupted and summary.groups_complete >= 2
    rows = rollout_rows(store, "exp")
    assert not [r for r in rows if r["status"] == "started"]  # whatever was in flight was closed
    assert all(r["error"] == "interrupted" for r in rows if r["status"] == "aborted")
    epochs = sorted({r["started_meta"]["epoch"] for r in rows})
    assert epochs == list(range(len(epochs))) and len(epochs) >= 2
    first = min(r["started"] for r in rows)
    announced = store.query("SELECT min(time) AS t FROM checkpoints WHERE run = 'exp'").column("t")[0].as_py()
    assert first >= announced


def test_collect_without_a_reward_then_rescore_from_the_stored_turns(server: RunningServer, tiny_model: Path,
                                                                     tmp_path: Path) -> None:
    big = {"id": "big", "prompt": "Summarize", "context": "x" * 9000}  # too large to store with its rollouts
    settings = base_settings(tmp_path, server, tiny_model, [{"id": "small", "prompt": "Hi"}, big], n=2,
                             agent=f"{A}:opaque", reward=None, no_reward=True)
    summary = asyncio.run(collect(settings))
    assert summary.groups_complete == 2 and not summary.scored  # unscored on purpose: a completed rollout fills
    assert "groups collected, unscored (not trainable" in _rendered(summary_table(summary))  # its slot
    store = open_store(settings.store)
    rows = rollout_rows(store, "exp")
    assert all(r["reward"] is None and "result" not in r["final_meta"] for r in rows)
    assert [("task" in r["started_meta"]) for r in rows if r["started_meta"]["task_id"] == "big"] == [False, False]

    first = rescore(store, "exp", f"{A}:last_reply_length")
    assert first.scored == 2 and [why for _, why in first.skipped] == [
        "task 'big' is neither stored with the rollout nor in --tasks"] * 2
    second = rescore(store, "exp", f"{A}:last_reply_length", tasks_file=settings.tasks,
                     where="rollout_id IN (SELECT rollout_id FROM rollouts WHERE reward IS NULL)")
    assert second.scored == 2 and not second.skipped
    replies = {t["rollout_id"]: response_text(t["response"]) for t in store.query(
        "SELECT rollout_id, response FROM turns WHERE run = 'exp'").to_pylist()}
    for row in rollout_rows(store, "exp"):
        bonus = 100.0 if row["started_meta"]["task_id"] == "big" else 0.0
        assert row["reward"] == float(len(replies[row["rollout_id"]])) + bonus


def _rendered(table: object) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_collect_needs_a_reward_choice_and_a_live_server(tiny_model: Path, tmp_path: Path) -> None:
    """Issue 12.17: without --reward it reported "groups completed" for groups the store counts untrainable;
    pointed at a dead --server it opened and failed a rollout for every slot before stopping."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "prompt": "x"}])
    unscored = CollectSettings(store=str(tmp_path / "store"), run="r", tasks=tasks, model=str(tiny_model),
                               agent=f"{A}:chat")
    assert any("no reward: give --reward" in p and "--no-reward" in p for p in unscored.problems())
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    settings = CollectSettings(store=str(tmp_path / "store"), run="r", tasks=tasks, model=str(tiny_model),
                               server=dead, agent=f"{A}:chat", reward=f"{A}:score", display="off",
                               workdir=str(tmp_path / "work"))
    with pytest.raises(PolicyServerUnreachable, match="cannot connect to the policy server at " + dead):
        asyncio.run(collect(settings))
    assert not (tmp_path / "store").exists() and not (tmp_path / "work").exists()  # nothing was opened
