"""An OpenEnv server (openenv-core, in `.venv-envs`) on loopback, played by `trajstore collect` through
`collectors.envs.openenv.OpenEnvText` and the text-environment agent: each rollout its own session, every
step's reward summed into the stored reward, the session's state kept with the result."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from cli.main import main
from collectors.envs.openenv import OpenEnvText
from collectors.envs.text_gym import TextEnvError
from trajstore import open_store

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openenv") / "server.log"


@pytest.fixture(scope="module")
def server(envs_venv_python: Path, server_log: Path) -> Iterator[str]:
    port = free_port()
    with server_log.open("wb") as log:
        proc = subprocess.Popen([str(envs_venv_python), "-m", "uvicorn",
                                 "tests.collectors.envs.openenv_server_for_tests:app", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"], stdout=log, stderr=log,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "the OpenEnv server exited"
            assert time.monotonic() < deadline, "the OpenEnv server did not come up"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_session_resets_steps_and_reports_state(server: str) -> None:
    env = OpenEnvText(server, action_field="message", observation_field="prompt")
    try:
        prompt, info = env.reset(seed=3)
        assert prompt.startswith("Say the word: ") and info["state"]["step_count"] == 0
        word = prompt.removeprefix("Say the word: ")
        _, reward, done, truncated, info = env.step(word[:-1])
        assert 0 < reward < 1 and not done and not truncated and info["state"]["step_count"] == 1
        _, reward, done, _, info = env.step(word)
        assert reward == 1.0 and done and info["state"]["step_count"] == 2
    finally:
        env.close()


def test_bad_addresses_and_fields_are_named(server: str) -> None:
    with pytest.raises(TextEnvError, match="cannot reach the OpenEnv server at ws://127.0.0.1:1/ws"):
        OpenEnvText("http://127.0.0.1:1").reset()
    with pytest.raises(TextEnvError, match="has no field 'nope' .*'prompt'"):
        OpenEnvText(server, observation_field="nope").reset(seed=0)
    with pytest.raises(TextEnvError, match="refused step"):  # the action lacks the field the server requires
        env = OpenEnvText(server, action_field="wrong", observation_field="prompt")
        env.reset(seed=0)
        env.step("x")
    with pytest.raises(TextEnvError, match="http:// or ws://"):
        OpenEnvText("127.0.0.1:8000")


def test_collect_plays_the_server(server: str, tiny_model: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({
        "id": f"spell-{i}", "env": "collectors.envs.openenv:OpenEnvText", "seed": i,
        "env_kwargs": {"url": server, "action_field": "message", "observation_field": "prompt",
                       "reset": {"episode_id": f"ep-{i}"}}}) + "\n" for i in range(2)))
    store = str(tmp_path / "store")
    result = CliRunner().invoke(main, [
        "collect", "--store", store, "--run", "oe", "--tasks", str(tasks), "--n", "2", "--model", str(tiny_model),
        "--agent", "collectors.envs.text_gym:agent", "--reward", "collectors.envs.text_gym:reward",
        "--max-turns", "2", "--max-tokens", "6", "--temperature", "1.0", "--seed", "0", "--threads", "1",
        "--device", "cpu", "--plain", "--workdir", str(tmp_path / "work")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    s = open_store(store)
    rows = s.query("""
        SELECT r.rollout_id, r.status, r.reward, json_extract(f.meta, '$.result') AS result,
               (SELECT count(*) FROM turns t WHERE t.rollout_id = r.rollout_id) AS turns
        FROM rollouts r JOIN events f ON f.rollout_id = r.rollout_id AND f.kind = 'status'
                                    AND f.status = r.status""").to_pylist()
    assert len(rows) == 4 and {r["status"] for r in rows} <= {"completed", "truncated"}
    for row in rows:
        res = json.loads(row["result"])
        # the stored reward is the sum of the server's step rewards; one model call per step
        assert row["reward"] == pytest.approx(sum(res["rewards"]))
        assert row["turns"] == len(res["rewards"]) == res["info"]["state"]["step_count"]
        assert res["info"]["state"]["episode_id"].startswith("ep-")


def test_sessions_end_cleanly_on_the_server(server: str, server_log: Path) -> None:
    """Closing a session waits for the server's close: closing first makes the server fail sending its own."""
    for seed in range(8):
        env = OpenEnvText(server, observation_field="prompt")
        env.reset(seed=seed)
        env.step("apple")
        env.close()
    time.sleep(0.5)
    assert "Exception" not in server_log.read_text(errors="replace")
