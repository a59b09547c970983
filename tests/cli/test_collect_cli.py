"""`trajstore collect` and `trajstore reward` from the command line: in-process with click's CliRunner, and
as a real process interrupted with SIGINT mid-run, then resumed to completion."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.embedded.app import RunningServer, serve_in_thread  # noqa: E402
from collectors.model.build import init_model  # noqa: E402
from collectors.policy import EmbeddedClient  # noqa: E402
from collectors.proxy.app import ProxyConfig, serve_proxy_in_thread  # noqa: E402
from tests.collectors.agents_for_tests import rollout_rows, usable_by_task, write_tasks  # noqa: E402
from tests.collectors.conftest import TINY  # noqa: E402
from trajstore import open_store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAJSTORE = shutil.which("trajstore") or str(Path(sys.executable).parent / "trajstore")
A = "tests.collectors.agents_for_tests"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-models") / "tiny"
    init_model(path, TINY, seed=0)
    return path


@pytest.fixture(scope="module")
def policy(model_dir: Path) -> Iterator[RunningServer]:
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(model_dir, threads=1, max_batch=16, device="cpu") as running:
            yield running
    finally:
        torch.set_num_threads(threads)


def invoke(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_collect_then_query_and_rescore(model_dir: Path, tmp_path: Path) -> None:
    """No --server: the embedded server runs in the collecting process."""
    store = str(tmp_path / "store")
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "q1", "prompt": "Hi"}, {"id": "q2", "prompt": "Yo"}])
    threads = torch.get_num_threads()
    try:
        out = invoke("collect", "--store", store, "--run", "cli", "--tasks", tasks, "--n", "3", "--threads", "1",
                     "--device", "cpu", "--model", str(model_dir), "--agent", f"{A}:chat", "--reward", f"{A}:score",
                     "--max-tokens", "8", "--seed", "4", "--plain", "--workdir", str(tmp_path / "work"))
    finally:
        torch.set_num_threads(threads)
    assert "groups completed" in out and "interrupted" not in out
    rows = json.loads(invoke("query", "--store", store, "--format", "json",
                             "SELECT count(*) AS n, count(*) FILTER (WHERE trainable) AS usable, "
                             "count(DISTINCT group_id) AS groups, min(turns) AS turns FROM rollouts WHERE run = 'cli'"))
    assert rows == {"n": 6, "usable": 6, "groups": 2, "turns": 1}

    out = invoke("reward", "--store", store, "--run", "cli", "--reward", f"{A}:rescore", "--name", "v2")
    assert "scored 6 rollouts of run cli (mean reward 2.0000); skipped 0" in out
    # a second component was appended; the first stays, so each reward grew by exactly 2
    after = {r["rollout_id"]: r for r in rollout_rows(open_store(store), "cli")}
    assert all(r["reward_components"] == 3 for r in after.values())
    out = invoke("reward", "--store", store, "--run", "cli", "--reward", f"{A}:rescore", "--name", "v2",
                 "--where", "rollout_id = 'nope'")
    assert "scored 0 rollouts" in out


def test_collect_lists_every_problem_before_starting(tmp_path: Path) -> None:
    tasks = tmp_path / "bad.jsonl"
    tasks.write_text('{"prompt": "ok"}\n{"oops"\n{"id": "x"}\n')
    out = invoke("collect", "--store", str(tmp_path / "s"), "--run", "r", "--tasks", str(tasks), "--n", "0",
                 "--agent", "nomodule", "--agent-cmd", "true", "--reward", "json:nothing_here", "--poll-interval", "0",
                 code=1)
    for expected in ("--n must be at least 1", "--agent and --agent-cmd", "no policy: pass --model",
                     "--poll-interval must be positive",
                     "must be written module:name", "module json has no 'nothing_here'", "line 2: not valid JSON",
                     "line 3: needs `prompt`"):
        assert expected in out, out
    assert not (tmp_path / "s").exists()  # nothing was started


def wait_for(condition: object, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sigint_aborts_in_flight_rollouts_and_a_rerun_completes_each_group_once(
        policy: RunningServer, model_dir: Path, tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store = open_store(store_dir)
    tasks = [{"id": "t0", "prompt": "a"}, {"id": "t1", "prompt": "b"},
             {"id": "t2", "prompt": "c", "block": True}, {"id": "t3", "prompt": "d", "block": True}]
    gate = tmp_path / "gate"  # blocked agents wait for this file after their model call
    env = {**os.environ, "TRAJSTORE_TEST_GATE": str(gate), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    config = ProxyConfig(model_dir=str(model_dir), run="sig", writer="proxy-sig", model_names=("*",))
    with serve_proxy_in_thread(lambda: EmbeddedClient(policy.url), store, config) as proxy:
        command = [TRAJSTORE, "collect", "--store", str(store_dir), "--run", "sig", "--n", "2",
                   "--tasks", write_tasks(tmp_path / "tasks.jsonl", tasks), "--server", policy.url,
                   "--proxy", proxy.url, "--agent", f"{A}:blocking", "--reward", f"{A}:score", "--max-tokens", "8",
                   "--seed", "2", "--plain", "--workdir", str(tmp_path / "work")]
        first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        try:
            def ready() -> bool:  # t0, t1 done; the four rollouts of t2, t3 made their call and wait
                if first.poll() is not None:
                    raise AssertionError(f"collect exited early ({first.returncode}): {first.stdout.read()}")
                rows = rollout_rows(store, "sig")
                done = [r for r in rows if r["trainable"]]
                waiting = [r for r in rows if r["status"] == "started" and r["turns"] == 1]
                return len(done) == 4 and len(waiting) == 4

            wait_for(ready, "two groups done and two blocked")
            first.send_signal(signal.SIGINT)
            output, _ = first.communicate(timeout=120)
        finally:
            if first.poll() is None:
                first.kill()
        assert first.returncode == 130, output
        assert "interrupted" in output and "rollouts aborted" in output
        rows = rollout_rows(store, "sig")
        assert len(rows) == 8 and not [r for r in rows if r["status"] == "started"]
        blocked = [r for r in rows if r["started_meta"]["task_id"] in ("t2", "t3")]
        assert all(r["status"] == "aborted" and r["error"] == "interrupted" and r["turns"] == 1 for r in blocked)

        gate.touch()
        second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "groups already complete (skipped)" in second.stdout

    rows = rollout_rows(store, "sig")
    usable = usable_by_task(rows)
    assert sorted(usable) == [("t0", 0), ("t1", 0), ("t2", 0), ("t3", 0)]
    for groups in usable.values():  # one group per task, complete with one usable rollout per slot
        assert list(groups.values()) == [[0, 1]]
    counts = {tid: sum(r["started_meta"]["task_id"] == tid for r in rows) for tid in ("t0", "t1", "t2", "t3")}
    assert counts == {"t0": 2, "t1": 2, "t2": 4, "t3": 4}  # finished groups were not redone
    resumed = [r for r in rows if r["started_meta"]["task_id"] in ("t2", "t3") and r["trainable"]]
    assert all(r["started_meta"]["attempt"] == 1 for r in resumed)
