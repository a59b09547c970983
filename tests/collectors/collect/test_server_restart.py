"""A policy server that restarts (SIGKILL, then started again on its start-up weights) while a collector
runs: the collector notices from what the server reports that it serves an older version than the one
it loaded, and loads the learner's newest again, with no new publish."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

from collectors.collect.runner import collect
from collectors.collect.settings import CollectSettings
from tests.collectors.agents_for_tests import write_tasks
from trajstore import Checkpoint, open_store

REPO = Path(__file__).resolve().parents[3]
A = "tests.collectors.agents_for_tests"
RUN = "restart"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as reply:
            return json.load(reply)
    except OSError:
        return None


def serve(model: Path, port: int) -> subprocess.Popen[str]:
    """`trajstore serve` on `port` (version 0: its start-up weights), once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--device", "cpu"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while health(f"http://127.0.0.1:{port}") is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    return proc


async def until(condition: object, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)

def collect_through_a_restart(settings: CollectSettings, model: Path, port: int, *, down_s: float,
                              before: Callable[[], Awaitable[None]], after: Callable[[], Awaitable[None]]) -> object:
    """Collect against a real `trajstore serve` on `port`: once `before` is done, kill it with SIGKILL, keep
    it down `down_s` seconds, start it again on the same port, wait for `after`, stop collecting. Returns
    collect's summary; the server is gone at the end whatever happened."""
    server = serve(model, port)
    try:
        async def main() -> object:
            nonlocal server
            stop = asyncio.Event()
            collecting = asyncio.create_task(collect(settings, stop=stop))
            try:
                await before()
                server.send_signal(signal.SIGKILL)
                server.wait()
                await asyncio.sleep(down_s)
                server = await asyncio.to_thread(serve, model, port)
                await after()
            finally:
                stop.set()
            return await collecting

        return asyncio.run(main())
    finally:
        server.kill()
        server.communicate()


def test_a_restarted_server_gets_the_newest_version_again_without_a_publish(tiny_model: Path, tiny_model_v2: Path,
                                                                             tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = open_store(tmp_path / "store")
    with store.writer("learner") as writer:  # the learner published version 1, newer than the server's 0
        writer.append([Checkpoint(run=RUN, policy_version=1, step=1, event_id=f"checkpoint:{RUN}:1",
                                  meta={"path": str(tiny_model_v2), "groups_per_version": 1})])
    tasks = [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(2)]
    settings = CollectSettings(store=str(tmp_path / "store"), run=RUN, server=url, model=str(tiny_model),
                               tasks=write_tasks(tmp_path / "tasks.jsonl", tasks), n=2, max_tokens=4, seed=1,
                               agent=f"{A}:chat", reward=f"{A}:score", forever=True, display="off",
                               concurrency=2, rollout_timeout=60, poll_interval_s=0.2, workdir=str(tmp_path / "work"))

    def serving(version: int) -> bool:
        return (health(url) or {}).get("policy_version") == version

    async def restarted() -> None:  # back on version 0, same port
        assert serving(0)
        await until(lambda: serving(1), "the collector loading version 1 into the restarted server")

    summary = collect_through_a_restart(settings, tiny_model, port, down_s=0.0,
                                        before=lambda: until(lambda: serving(1), "the collector loading version 1"),
                                        after=restarted)
    assert summary.reloads >= 2 and summary.served_version == 1  # type: ignore[attr-defined]


def test_an_outage_makes_model_calls_wait_not_rollouts_fail(tiny_model: Path, tmp_path: Path,
                                                            caplog: object) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tasks = [{"id": f"t{i}", "prompt": f"task {i}", "turns": 2} for i in range(4)]
    settings = CollectSettings(store=str(tmp_path / "store"), run="outage", server=url, model=str(tiny_model),
                               tasks=write_tasks(tmp_path / "tasks.jsonl", tasks), n=2, max_tokens=4, seed=1,
                               agent=f"{A}:chat", reward=f"{A}:score", forever=True, display="off", retries=1,
                               concurrency=4, rollout_timeout=120, workdir=str(tmp_path / "work"))
    store = open_store(tmp_path / "store")

    def usable() -> int:
        if not (tmp_path / "store").is_dir():
            return 0
        return int(store.query("SELECT count(*) AS n FROM rollouts WHERE run = 'outage' AND trainable"
                               ).to_pylist()[0]["n"])

    async def restarted() -> None:
        before = await asyncio.to_thread(usable)
        await until(lambda: usable() >= before + 8, "rollouts after the restart")

    # down 3 s: the agents' model calls meet a refused connection
    summary = collect_through_a_restart(settings, tiny_model, port, down_s=3.0,
                                        before=lambda: until(lambda: usable() >= 4, "the first rollouts"),
                                        after=restarted)
    statuses = store.query("SELECT status, error FROM rollouts WHERE run = 'outage' AND status = 'failed'").to_pylist()
    assert not statuses, statuses  # the outage failed no rollout
    assert summary.rollouts.get("failed", 0) == 0  # type: ignore[attr-defined]
    assert "model calls wait up to" in caplog.text  # type: ignore[attr-defined]
