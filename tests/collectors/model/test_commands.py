"""`trajstore init-model` and `trajstore serve` as click commands and as a real server process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from click.testing import CliRunner

from cli.main import main


def test_init_model_command_builds_a_model_and_reports_bad_sizes(tmp_path: Path) -> None:
    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["init-model", str(out), "--vocab-size", "400", "--hidden-size", "32", "--layers", "1",
                                             "--heads", "2", "--kv-heads", "1", "--intermediate-size", "48",
                                             "--max-positions", "128"])
    assert result.exit_code == 0, result.output
    assert "400 tokens" in result.output and (out / "model.safetensors").exists()
    bad = CliRunner().invoke(main, ["init-model", str(tmp_path / "x"), "--hidden-size", "30", "--heads", "4"])
    assert bad.exit_code != 0 and "divisible" in bad.output


def test_serve_command_runs_a_server_process(tiny_model: Path) -> None:
    code = "import sys; from cli.main import main; main(['serve', *sys.argv[1:]])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--model", str(tiny_model), "--port", "0", "--threads", "1",
         "--policy-version", "4", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT [...]"
        assert "policy version 4" in line, line + proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" on ")[1].split()[0]
        request = urllib.request.Request(url + "/v1/completions", method="POST", data=json.dumps(
            {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "return_token_ids": True,
             "ignore_eos": True}).encode())  # an unseeded sample may end on EOS at once
        with urllib.request.urlopen(request, timeout=60) as r:
            body = json.loads(r.read())
            assert r.headers["X-Policy-Version"] == "4"
        assert body["policy_version"] == 4 and len(body["choices"][0]["token_ids"]) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
