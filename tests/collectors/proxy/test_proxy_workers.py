"""`trajstore proxy --workers 2` as a real process tree: rollouts pinned to a worker, calls on the shared
address forwarded to the owner, stats merged, and a worker killed with SIGKILL losing nothing it answered."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from collectors.embedded.app import RunningServer
from collectors.proxy.workers import key_owner
from tests.collectors.proxy.test_proxy_cli import free_port, wait_healthy
from tests.collectors.proxy.test_proxy_durability import proxy_process
from tests.collectors.proxy_harness import MODEL, call, openai_client
from trajstore import open_store


def chat(url: str, key: str, text: str, **extra: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 5, **extra}
    return call(url + "/v1/chat/completions", body, key=key)


def health(url: str) -> dict[str, Any]:
    return call(url + "/health").body


def wait_until(check: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("timed out")


@pytest.fixture
def two_workers(server: RunningServer, tiny_model: Path, tmp_path: Path) -> Any:
    port, store = free_port(), tmp_path / "store"
    proc = proxy_process(server, tiny_model, store, port, "--workers", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, store, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=90)[0]
        assert proc.returncode == 0, output


def test_rollouts_spread_over_workers_and_any_address_serves_them(two_workers: Any) -> None:
    url, store, _ = two_workers
    workers = health(url)["workers"]
    assert [w["status"] for w in workers] == ["ok", "ok"] and len({w["pid"] for w in workers}) == 2
    rollouts = [call(url + "/rollouts", {"group_id": "g"}).body for _ in range(4)]
    owners = [key_owner(r["api_key"])[0] for r in rollouts]
    assert sorted(owners) == [0, 0, 1, 1]  # opened on the least loaded worker
    for r, owner in zip(rollouts, owners, strict=True):
        assert r["base_urls"]["openai"].startswith(f"http://127.0.0.1:{workers[owner]['port']}/r/")
        openai_client(r).chat.completions.create(model=MODEL, max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
    for r in rollouts:  # the shared address with only the key: forwarded to the owner, streamed too
        assert chat(url, r["api_key"], "again").status == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key=r["api_key"], max_retries=0)
        chunks = list(c.chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                                messages=[{"role": "user", "content": "streamed"}]))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert call(f"{url}/rollouts/{r['rollout_id']}", key=r["api_key"]).body["turns"] == 3
    stats = call(url + "/stats").body
    assert stats["turns"] == 12 and stats["durable_wait"]["count"] == 12
    assert [w["turns"] for w in stats["workers"]] == [6, 6]
    assert stats["rollouts"]["open"] == 4
    assert open_store(store).query("SELECT count(*) AS n FROM turns").to_pylist() == [{"n": 12}]
    sealed = call(url + "/seal", {})  # every worker seals its own log
    assert sealed.status == 200 and sealed.body == {"sealed": 16}, sealed.body  # 4 starts and 12 turns
    table = open_store(store).snapshot(live=False)
    assert table.query("SELECT count(*) AS n FROM turns").to_pylist() == [{"n": 12}]


def test_a_killed_worker_loses_no_answered_turn_and_its_rollouts_are_refused(two_workers: Any) -> None:
    url, store, _ = two_workers
    rollouts = [call(url + "/rollouts", {"group_id": "g"}).body for _ in range(4)]
    answered = []
    for r in rollouts:
        for i in range(2):
            reply = chat(r["base_urls"]["openai"].removesuffix("/v1"), r["api_key"], f"turn {i}")
            assert reply.status == 200
            answered.append(reply.body["id"])
    victim = next(w for w in health(url)["workers"] if w["index"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)

    stored = {json.loads(row["response"])["id"] for row in open_store(store).query(
        "SELECT response FROM turns").to_pylist()}
    assert set(answered) <= stored  # the dead worker's too: durable before they were answered

    lost = [r for r in rollouts if key_owner(r["api_key"])[0] == 1]
    kept = [r for r in rollouts if key_owner(r["api_key"])[0] == 0]
    for r in lost:  # on its own (restarted) port and on the shared address alike
        for base in (r["base_urls"]["openai"].removesuffix("/v1"), url):
            refused = chat(base, r["api_key"], "still there?")
            assert refused.status == 401, refused.body
            assert "open the rollout again with POST /rollouts" in refused.body["error"]["message"]
    for r in kept:
        assert chat(url, r["api_key"], "go on").status == 200
    restarted = wait_until(lambda: [w for w in health(url)["workers"] if w["index"] == 1 and w.get("generation")])
    assert restarted[0]["pid"] != victim["pid"] and restarted[0]["status"] == "ok"
    fresh = call(url + "/rollouts", {"group_id": "g2"}).body  # the proxy takes new rollouts on both workers
    assert chat(url, fresh["api_key"], "new").status == 200


def test_workers_that_cannot_start_stop_the_proxy_with_the_reason(server: RunningServer, tiny_model: Path,
                                                                   tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    proc = proxy_process(server, tiny_model, tmp_path / "a-file" / "store", free_port(), "--workers", "2")
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, output
    assert "exited before it served" in output and "Traceback" not in output
    assert "a-file" in output  # the store path that could not be opened
