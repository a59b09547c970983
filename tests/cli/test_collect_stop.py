"""Ctrl-C under load: `trajstore collect` as a real process, its own embedded server busy with many model
calls and agent commands (each with a child process), is interrupted mid-run. It must stop promptly,
kill every agent and child, and leave every rollout it opened closed (aborted), with the store sound."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.cli.test_collect_cli import REPO, TRAJSTORE, model_dir, wait_for  # noqa: F401 - model_dir: a fixture
from tests.collectors.agents_for_tests import rollout_rows, write_tasks
from tests.collectors.collect.test_collect_faults import gone
from trajstore import open_store

SCRIPT = REPO / "tests" / "collectors" / "scripts" / "busy_agent.py"
CONCURRENCY = 24
STOP_BOUND_S = 20.0  # a hang guard, not a speed test: a stuck stop took minutes


def test_sigint_under_load_stops_promptly_and_closes_every_rollout(model_dir: Path, tmp_path: Path) -> None:
    store_dir, work = tmp_path / "store", tmp_path / "work"
    tasks = [{"id": f"t{i}", "prompt": "go"} for i in range(CONCURRENCY)]
    command = [TRAJSTORE, "collect", "--store", str(store_dir), "--run", "stop", "--n", "2",
               "--tasks", write_tasks(tmp_path / "tasks.jsonl", tasks), "--model", str(model_dir),
               "--device", "cpu", "--threads", "1", "--concurrency", str(CONCURRENCY), "--max-tokens", "1900",
               "--agent-cmd", f"python {SCRIPT}", "--reward-cmd", "true", "--plain", "--workdir", str(work)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def busy() -> bool:  # every slot runs an agent (each asks for up to 1900 tokens: calls of many seconds)
            assert proc.poll() is None, proc.communicate()[0]
            return work.is_dir() and len(list(work.glob("*/pids"))) >= CONCURRENCY

        wait_for(busy, "every slot busy with an agent")
        time.sleep(3)  # their model calls are under way
        pids = [int(p) for f in work.glob("*/pids") for p in f.read_text().split()]
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"collect did not stop within {STOP_BOUND_S:g} s of SIGINT: "
                                 f"{proc.communicate()[0][-3000:]}") from None
        stopped_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, output
    print(f"collect stopped {stopped_s:.1f} s after SIGINT")
    assert all(gone(pid) for pid in pids), "an agent or its child outlived the collector"

    rows = rollout_rows(open_store(store_dir), "stop")
    assert len(rows) >= CONCURRENCY
    assert not [r for r in rows if r["status"] == "started"], "a rollout was left open"
    assert all(r["status"] == "aborted" and r["error"] == "interrupted" for r in rows)
    verify = subprocess.run([TRAJSTORE, "verify", "--store", str(store_dir)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
