"""`trajstore proxy` and `trajstore serve` as real processes, driven by an SDK, stopped with SIGINT or SIGTERM.

A stopped proxy seals what it appended: a reader of the Delta table alone (Spark, Polars, here
delta-rs) sees every event at once, without a `trajstore compact` (issue 12.13: `kill PID` used
to leave them in the write-ahead log)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

from cli.main import main
from collectors.embedded.app import RunningServer
from tests.collectors.proxy_harness import call, openai_client
from trajstore import open_store, owner

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if call(url + "/health").status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the proxy at {url} did not come up within {timeout} s")


@pytest.mark.parametrize(("stop_with", "whole"), [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_the_command_serves_stores_and_seals_when_stopped(server: RunningServer, tiny_model: Path, tmp_path: Path,
                                                           stop_with: signal.Signals, whole: bool) -> None:
    port, store = free_port(), tmp_path / "store"
    code = "import sys; from cli.main import main; main(['proxy', *sys.argv[1:]])"
    args = ["--upstream", server.url, "--model", str(tiny_model), "--store", str(store), "--port", str(port),
            "--run", "cli-run", "--model-name", "tiny", *(["--whole-requests"] if whole else [])]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        rollout = call(url + "/rollouts", {"group_id": "g"}).body
        c = openai_client(rollout)
        messages = [{"role": "user", "content": "hi"}]
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4).choices[0].message
        messages += [{"role": "assistant", "content": reply.content or ""}, {"role": "user", "content": "more"}]
        c.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert call(f"{url}/rollouts/{rollout['rollout_id']}/close", {"status": "completed", "reward": 0.5},
                    key=rollout["api_key"]).status == 200
    finally:
        proc.send_signal(stop_with)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert f"capture proxy on http://127.0.0.1:{port}" in output
    rows = open_store(store).query("SELECT run, turns, reward, status FROM rollouts").to_pylist()
    assert rows == [{"run": "cli-run", "turns": 2, "reward": 0.5, "status": "completed"}]
    sealed = DeltaTable(str(store / "events")).to_pyarrow_table(columns=["kind", "writer", "request_base"])
    assert sorted(sealed.column("kind").to_pylist()) == ["reward", "status", "status", "turn", "turn"]  # all sealed
    # the second call extends the first: a delta, unless --whole-requests
    assert sum(base is not None for base in sealed.column("request_base").to_pylist()) == (0 if whole else 1)
    # the default writer name is unique across machines (host, pid and this disk's spool id), not `proxy-PORT`
    spool = owner.spool_id(open_store(store).location.wal_root)
    (writer,) = set(sealed.column("writer").to_pylist())
    assert re.fullmatch(rf"proxy-[\w.-]+-{proc.pid}-{spool:x}", writer), writer


def test_a_proxy_killed_with_unsealed_turns_has_them_sealed_by_the_next_proxy_on_its_machine(
        server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    """Default writer names never repeat (each carries the pid), so no later proxy reopens a killed one's
    write-ahead log: `trajstore proxy` seals what stopped writers of its machine left when it starts."""
    store = tmp_path / "store"
    code = "import sys; from cli.main import main; main(['proxy', *sys.argv[1:]])"

    def start() -> tuple[subprocess.Popen, str]:
        port = free_port()
        args = ["--upstream", server.url, "--model", str(tiny_model), "--store", str(store), "--port", str(port),
                "--model-name", "tiny", "--seal-interval", "3600"]
        proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        return proc, url

    first, url = start()
    try:
        rollout = call(url + "/rollouts", {"group_id": "g"}).body
        openai_client(rollout).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4)
    finally:
        first.kill()  # SIGKILL: its acknowledged turn is in its write-ahead log only
        first.communicate(timeout=60)
    assert not (store / "events" / "_delta_log").exists() or "turn" not in DeltaTable(
        str(store / "events")).to_pyarrow_table(columns=["kind"]).column("kind").to_pylist()
    second, _ = start()
    second.send_signal(signal.SIGTERM)
    output = second.communicate(timeout=60)[0]
    assert second.returncode == 0 and "sealed what stopped writers" in output, output
    sealed = DeltaTable(str(store / "events")).to_pyarrow_table(columns=["kind", "writer"]).to_pylist()
    assert {"kind": "turn", "writer": f"proxy-{socket.gethostname()}-{first.pid}-"
            f"{owner.spool_id(open_store(store).location.wal_root):x}"} in sealed, sealed


def test_serve_stops_cleanly_on_sigterm(tiny_model: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(tiny_model), "--port", str(port),
                             "--threads", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "stopping" in output, output
    assert "Traceback" not in output


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["proxy", "--upstream", "http://127.0.0.1:9", "--model", str(tmp_path),
                                        "--store", str(tmp_path / "store")])
    assert result.exit_code == 1 and "not a Hugging Face checkpoint" in result.output


def test_the_startup_hint_opens_a_rollout_when_pasted(server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    """The banner's `curl` line, run as printed, opens a rollout (it lacked the JSON header: a 415)."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    port = free_port()
    code = "import sys; from cli.main import main; main(['proxy', *sys.argv[1:]])"
    args = ["--upstream", server.url, "--model", str(tiny_model), "--store", str(tmp_path / "store"),
            "--port", str(port), "--run", "hint"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        banner = ""
        while "open a rollout:" not in banner:
            banner = proc.stdout.readline()
            assert banner or proc.poll() is None, "the proxy exited before printing its banner"
        command = shlex.split(banner.split("open a rollout:", 1)[1])
        assert command[0] == "curl"
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert "api_key" in json.loads(done.stdout), done.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_the_help_examples_send_json_to_the_rollout_routes() -> None:
    text = CliRunner().invoke(main, ["proxy", "--help"], terminal_width=200).output
    commands = re.sub(r"\\\n\s*", " ", text)  # one line per command
    posts = [line for line in commands.splitlines() if "curl" in line and "/rollouts" in line]
    assert len(posts) == 2
    assert all("-H 'Content-Type: application/json'" in line for line in posts), posts
