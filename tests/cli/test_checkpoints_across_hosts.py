"""Checkpoints across hosts: a learner on an S3 store (moto) publishes each version beside the table, and a
collector process with its own disk (its own model copy, spool and checkpoint cache; the learner's
directory gone) loads the version through the store. A damaged or unfinished upload is never loaded; a
learner killed mid-upload uploads the version again before announcing it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.collect.reload import local_checkpoint, read_head  # noqa: E402
from tests.collectors.agents_for_tests import write_tasks  # noqa: E402
from tests.conftest import S3Server  # noqa: E402
from tests.learner.synth import make_model, write_groups  # noqa: E402
from trajstore import ArtifactError, artifacts, open_store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAJSTORE = shutil.which("trajstore") or str(Path(sys.executable).parent / "trajstore")
A = "tests.collectors.agents_for_tests"


def learn(store: str, model: Path, ckpts: Path, steps: int, *extra: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, [
        "learn", "--store", store, "--run", "default", "--model", str(model), "--checkpoints", str(ckpts),
        "--groups-per-step", "2", "--steps", str(steps), "--max-staleness", "100", "--micro-batch-tokens", "96",
        "--lr", "1e-3", "--wait-timeout", "5", "--poll-interval", "0.05", "--device", "cpu", *extra],
        catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_a_collector_on_another_host_loads_the_version_through_the_store(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner_host, collector_host = tmp_path / "learner-host", tmp_path / "collector-host"
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(learner_host / "spool"))
    model = make_model(learner_host / "tiny")
    shutil.copytree(model, collector_host / "tiny")  # each host has its own copy of the initial model
    store = s3_server.new_uri()
    write_groups(store, model, groups=2, group_size=4)
    learn(store, model, learner_host / "ckpts", 1)

    head = read_head(open_store(store), "default")
    assert head is not None
    v1 = f"{store}/checkpoints/default/v000001"
    assert (head.version, head.path, head.uri) == (1, str(learner_host / "ckpts" / "v000001"), v1)
    # on the learner's host the announced directory is its own: nothing is downloaded
    assert local_checkpoint(head.load_request(), tmp_path / "unused-cache") == head.path
    assert not (tmp_path / "unused-cache").exists()

    shutil.move(learner_host, tmp_path / "gone")  # from here on no process can see the learner's disk
    cache = collector_host / "cache"
    weights = (tmp_path / "gone" / "ckpts" / "v000001" / "model.safetensors").read_bytes()
    s3_server.put(f"{v1}/model.safetensors", weights[:-7])  # damaged in storage: refused, never loaded
    with pytest.raises(ArtifactError, match="is damaged: model.safetensors"):
        local_checkpoint(head.load_request(), cache)
    s3_server.put(f"{v1}/model.safetensors", weights)

    tasks = write_tasks(collector_host / "tasks.jsonl", [{"id": "q1", "prompt": "Hi"}])
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAJSTORE_SPOOL": str(collector_host / "spool"),
           "HOME": str(collector_host / "home")}
    done = subprocess.run(
        [TRAJSTORE, "collect", "--store", store, "--run", "default", "--tasks", tasks, "--n", "2",
         "--model", str(collector_host / "tiny"), "--agent", f"{A}:chat", "--reward", f"{A}:score",
         "--max-tokens", "4", "--threads", "1", "--device", "cpu", "--plain",
         "--workdir", str(collector_host / "work"), "--checkpoint-cache", str(cache)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    versions = open_store(store, spool=tmp_path / "reader-spool").query(
        "SELECT DISTINCT policy_version FROM turns WHERE group_id NOT LIKE 'default-g%'").column(0).to_pylist()
    assert versions == [1], "the collector sampled with version 1, loaded from the store"
    (copy,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert artifacts.holds(copy, head.digest or "")
    assert (copy / "model.safetensors").read_bytes() == weights


def test_a_learner_killed_mid_upload_uploads_again_before_announcing(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    model = make_model(tmp_path / "tiny")
    store = s3_server.new_uri()
    write_groups(store, model, groups=2, group_size=4)
    bucket_dir = f"s3://{s3_server.bucket}/shared-ckpts-{tmp_path.name}"
    learn(store, model, tmp_path / "ckpts", 1, "--checkpoint-uri", bucket_dir)
    # killed after v2 was renamed into place, with only config.json uploaded and no event appended
    v2 = tmp_path / "ckpts" / "v000002"
    shutil.copytree(tmp_path / "ckpts" / "v000001", v2)
    info = json.loads((v2 / "trajstore_checkpoint.json").read_text())
    (v2 / "trajstore_checkpoint.json").write_text(json.dumps({**info, "version": 2, "step": 2, "consumed": []}))
    s3_server.put(f"{bucket_dir}/v000002/config.json", (v2 / "config.json").read_bytes())
    stale = read_head(open_store(store), "default")
    assert stale is not None and stale.version == 1 and stale.uri == f"{bucket_dir}/v000001"

    learn(store, model, tmp_path / "ckpts", 2, "--checkpoint-uri", bucket_dir)  # resumes at step 2: trains none
    head = read_head(open_store(store), "default")
    assert head is not None and (head.version, head.uri) == (2, f"{bucket_dir}/v000002")
    copy = artifacts.fetch(head.uri or "", tmp_path / "cache", expect=head.digest)
    assert (copy / "model.safetensors").read_bytes() == (v2 / "model.safetensors").read_bytes()
    assert not (copy / "learner_state.pt").exists(), "the optimizer state stays on the learner's disk"


def test_a_learner_resumes_on_another_host_from_what_it_published(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host A learns 2 steps and is lost with its disk; host B (its own spool, model copy and checkpoint
    directory) goes on from version 2 with A's optimizer state, and no rollout is trained twice."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(host_a / "spool"))
    model = make_model(host_a / "tiny")
    shutil.copytree(model, host_b / "tiny")
    store = s3_server.new_uri()
    write_groups(store, model, groups=8, group_size=4)
    learn(store, model, host_a / "ckpts", 2)
    state_a = (host_a / "ckpts" / "v000002" / "learner_state.pt").read_bytes()
    shutil.move(host_a, tmp_path / "gone")  # preempted: no process can see A's disk any more

    monkeypatch.setenv("TRAJSTORE_SPOOL", str(host_b / "spool"))
    learn(store, host_b / "tiny", host_b / "ckpts", 4)
    assert (host_b / "ckpts" / "v000002" / "learner_state.pt").read_bytes() == state_a  # fetched, verified
    reader = open_store(store, spool=tmp_path / "reader-spool")
    rows = reader.query("SELECT version, step, consumed, path FROM checkpoints ORDER BY version").to_pylist()
    assert [(r["version"], r["step"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    assert [Path(r["path"]).parent.parent.name for r in rows[1:]] == ["host-a", "host-a", "host-b", "host-b"]
    consumed = [rid for r in rows for rid in r["consumed"]]
    assert len(consumed) == len(set(consumed)) == 4 * 2 * 4  # every step's groups once, none trained twice
    optimizer = torch.load(host_b / "ckpts" / "v000004" / "learner_state.pt", weights_only=True)["optimizer"]
    assert {float(p["step"]) for p in optimizer["state"].values()} == {4.0}  # Adam's moments went on from A's
    writers = reader.query("SELECT DISTINCT writer FROM events WHERE kind = 'checkpoint'").column(0).to_pylist()
    assert len(writers) == 2 and all(w.startswith("learner-default-") for w in writers)  # one name per host


@pytest.mark.parametrize(("value", "message"), [
    ("http://host/x", "use a directory path or an s3://bucket/prefix URI"),
    ("s3://", "names no bucket"),
    ("CKPTS", "is the --checkpoints directory itself"),
])
def test_a_bad_checkpoint_uri_is_refused_before_any_work(tmp_path: Path, value: str, message: str) -> None:
    model = make_model(tmp_path / "tiny")
    ckpts = tmp_path / "ckpts"
    out = learn(str(tmp_path / "store"), model, ckpts, 1, "--checkpoint-uri",
                str(ckpts) if value == "CKPTS" else value, code=1)
    (line,) = [line for line in out.splitlines() if "checkpoint_uri" in line]
    assert message in line, out
    assert not (tmp_path / "store").exists()


def test_a_checkpoint_uri_that_cannot_take_uploads_is_refused_before_training(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    model = make_model(tmp_path / "tiny")
    out = learn(s3_server.new_uri(), model, tmp_path / "ckpts", 1, "--create-store",
                "--checkpoint-uri", "s3://no-such-bucket/ckpts", code=1)
    assert "bucket 'no-such-bucket' does not exist" in out.splitlines()[-1], out
    assert not (tmp_path / "ckpts").exists()


def test_a_checkpoint_cache_that_is_a_file_is_refused(tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "q1", "prompt": "Hi"}])
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(main, [
        "collect", "--store", str(tmp_path / "s"), "--run", "r", "--tasks", tasks, "--server", "http://127.0.0.1:9",
        "--no-reward", "--checkpoint-cache", str(tmp_path / "file")], catch_exceptions=False)
    assert result.exit_code == 2  # click's usage error
    (line,) = [line for line in result.output.splitlines() if "--checkpoint-cache" in line]
    assert "is a file" in line, result.output
    assert not (tmp_path / "s").exists()
