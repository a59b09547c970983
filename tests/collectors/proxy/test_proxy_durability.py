"""A reply means its turn is durable: the proxy killed with SIGKILL loses no acknowledged turn, and a
store that cannot write (a failed fsync, a full disk) answers with an error, never with a reply."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from tests.collectors.proxy.test_proxy_cli import ROOT, free_port, wait_healthy
from tests.collectors.proxy_harness import MODEL, Recording, call, openai_client, running_proxy
from trajstore import open_store, wal

SESSIONS = 24


def proxy_process(server: RunningServer, model: Path, store: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    code = "import sys; from cli.main import main; main(['proxy', *sys.argv[1:]])"
    args = ["--upstream", server.url, "--model", str(model), "--store", str(store), "--port", str(port),
            "--model-name", MODEL, *extra]
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def chat_until(url: str, rollout: dict[str, Any], stop: threading.Event, acked: list[dict[str, Any]],
               lock: threading.Lock) -> None:
    """One session's calls, one after another, until `stop`; every reply received goes to `acked`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Session {rollout['rollout_id']} starts."}]
    while not stop.is_set():
        body = {"model": MODEL, "messages": messages, "max_tokens": 6, "logprobs": True}
        try:
            reply = call(url + "/v1/chat/completions", body, key=rollout["api_key"])
        except OSError:  # the proxy is gone: this call was never answered
            return
        if reply.status != 200:
            return
        with lock:
            acked.append(reply.body)
        messages = [*messages, reply.body["choices"][0]["message"], {"role": "user", "content": "Go on."}]


def check_stored_exactly(store: Path, acked: list[dict[str, Any]]) -> None:
    """Every reply an agent received is a stored turn with the very response, ids and logprobs it was sent."""
    rows = open_store(store).query("SELECT response, output_ids, output_logprobs FROM turns").to_pylist()
    stored = {}
    for row in rows:
        response = json.loads(row["response"]) if isinstance(row["response"], str) else row["response"]
        stored[response["id"]] = (response, row)
    for reply in acked:
        assert reply["id"] in stored, f"acknowledged reply {reply['id']} is not in the store"
        response, row = stored[reply["id"]]
        assert response == reply
        sent = reply["choices"][0]["logprobs"]["content"]
        assert row["output_logprobs"][:len(sent)] == pytest.approx([t["logprob"] for t in sent], abs=1e-6)


def test_sigkill_right_after_replies_loses_no_acknowledged_turn(server: RunningServer, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    port, store = free_port(), tmp_path / "store"
    proc = proxy_process(server, tiny_model, store, port)
    url = f"http://127.0.0.1:{port}"
    acked: list[dict[str, Any]] = []
    lock, stop = threading.Lock(), threading.Event()
    try:
        wait_healthy(url, proc)
        rollouts = [call(url + "/rollouts", {"group_id": "g"}).body for _ in range(SESSIONS)]
        with ThreadPoolExecutor(SESSIONS) as pool:
            for r in rollouts:
                pool.submit(chat_until, url, r, stop, acked, lock)
            deadline = time.monotonic() + 120
            while len(acked) < 3 * SESSIONS and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)  # calls are in flight: some answered just now, some never
            stop.set()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    with lock:
        answered = list(acked)
    assert len(answered) >= 3 * SESSIONS
    check_stored_exactly(store, answered)


def refuse_sync(self: wal.SegmentWriter) -> None:
    """The disk refuses to make the write-ahead segment durable, as a full or failing disk does."""
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_turn_whose_fsync_fails_is_an_error_never_a_reply(server: RunningServer, tiny_model: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with running_proxy(Recording(EmbeddedClient(server.url)), tmp_path / "store", tiny_model) as h:
        rollout = h.open(group_id="g")  # its status event is durable before the disk fails
        monkeypatch.setattr(wal.SegmentWriter, "sync", refuse_sync)
        c = openai_client(rollout)
        with pytest.raises(openai.InternalServerError, match="No space left on device.*nothing was recorded"):
            c.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        stream = c.chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIError, match="nothing was recorded"):
            for chunk in stream:  # the tokens may come, but never a finish: the stream ends in an error
                assert all(choice.finish_reason is None for choice in chunk.choices)
        assert h.proxy.capture.stats.turns == 0
        assert h.proxy.capture.stats.durable_wait.as_json()["count"] == 0
    assert open_store(tmp_path / "store").query("SELECT count(*) AS n FROM turns").to_pylist() == [{"n": 0}]


