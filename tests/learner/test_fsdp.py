"""`torchrun --nproc-per-node 2 ... trajstore learn`: FSDP2 on CPU with gloo, against one process on the same data.

Real processes: torchrun starts two ranks of the `trajstore` console script; one `trajstore
learn` process trains the same store copy. Tolerance: the two runs sum the same gradients in a
different order (per rank, then across ranks), so float32 rounding differs; after 3 AdamW steps
at lr 1e-3 the largest weight difference measured was 1.8e-7 (`SAME_WEIGHTS` allows 1e-4, while
one step moves weights by ~1e-3). The crash test SIGKILLs rank 1 while the learner waits for
data, then runs the same command again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trajstore
from learner import checkpoints
from tests.learner.synth import make_model, write_groups

pytestmark = pytest.mark.slow  # several torchrun and learner processes: about a minute on 2 cores

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TRAJSTORE = shutil.which("trajstore") or str(BIN / "trajstore")
TORCHRUN = shutil.which("torchrun") or str(BIN / "torchrun")
SAME_WEIGHTS = 1e-4
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / "tiny")


def learn_args(store: Path, model: Path, ckpts: Path, *extra: str) -> list[str]:
    # 96-token micro-batches: a step of 2 groups packs into an odd number of them, so the ranks' shares differ
    return ["learn", "--store", str(store), "--model", str(model), "--checkpoints", str(ckpts), "--groups-per-step",
            "2", "--micro-batch-tokens", "96", "--lr", "1e-3", "--max-staleness", "100", "--device", "cpu",
            "--wait-timeout", "1", "--poll-interval", "0.1", *extra]


def torchrun(*args: str) -> list[str]:
    # `--` ends torchrun's own options: without it torchrun takes `--run` for its `--run-path`
    return [TORCHRUN, "--standalone", "--nproc-per-node", "2", TRAJSTORE, "--", *args]


def final_weights(ckpts: Path) -> dict[str, torch.Tensor]:
    newest = checkpoints.latest(ckpts)
    assert newest is not None
    return load_file(str(newest.path / "model.safetensors"))


def metric_rows(store: Path) -> list[dict[str, float]]:
    """The metrics of each step, in step order."""
    rows = trajstore.open_store(store).query("SELECT step, name, value FROM metrics ORDER BY step").to_pylist()
    steps: dict[int, dict[str, float]] = {}
    for r in rows:
        steps.setdefault(r["step"], {})[r["name"]] = r["value"]
    return [steps[k] for k in sorted(steps)]


def checkpoint_events(store: Path) -> list[tuple[int, list[str]]]:
    rows = trajstore.open_store(store).query(
        "SELECT version, consumed FROM checkpoints ORDER BY version").to_pylist()
    return [(r["version"], r["consumed"]) for r in rows]


def test_two_ranks_train_the_same_weights_as_one_process_with_half_the_state_each(model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    write_groups(tmp_path / "one" / "store", model_dir, groups=6, group_size=4)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    runs = {}
    for name, command in (("one", [TRAJSTORE]), ("two", torchrun())):
        d = tmp_path / name
        runs[name] = subprocess.run([*command, *learn_args(d / "store", model_dir, d / "ckpts", "--steps", "3")],
                                    cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600, check=False)
        assert runs[name].returncode == 0, runs[name].stdout + runs[name].stderr

    one, two = final_weights(tmp_path / "one" / "ckpts"), final_weights(tmp_path / "two" / "ckpts")
    initial = load_file(str(model_dir / "model.safetensors"))
    assert sorted(one) == sorted(two)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    moved = min((one[k] - initial[k]).abs().max().item() for k in initial)
    assert worst < SAME_WEIGHTS < moved, (worst, moved)

    # one checkpoint event per version, the same rollouts consumed, written once (by rank 0)
    events = {name: checkpoint_events(tmp_path / name / "store") for name in runs}
    assert [v for v, _ in events["two"]] == [0, 1, 2, 3] and events["two"] == events["one"]
    m1, m2 = metric_rows(tmp_path / "one" / "store"), metric_rows(tmp_path / "two" / "store")
    assert [m["ranks"] for m in m2] == [2.0] * 3 and [m["ranks"] for m in m1] == [1.0] * 3
    assert any(int(m["micro_batches"]) % 2 for m in m2), "no step gave the ranks unequal shares"
    for a, b in zip(m1, m2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["micro_batches"] == b["micro_batches"]
    # sharding shows: each rank holds about half the parameters, gradients and AdamW state
    ratio = m2[-1]["state_mb_per_rank"] / m1[-1]["state_mb_per_rank"]
    assert 0.45 < ratio < 0.6, ratio


def rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of the worker torchrun started for `rank` (its environment says RANK=...)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), -1)
        if ppid == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_a_killed_rank_leaves_store_and_checkpoints_consistent_and_the_run_resumes(model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    store, ckpts = tmp_path / "store", tmp_path / "ckpts"
    write_groups(store, model_dir, groups=4, group_size=4)  # two steps' worth; then the learner waits
    first = subprocess.Popen(torchrun(*learn_args(store, model_dir, ckpts, "--follow")), cwd=REPO, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while checkpoints.latest(ckpts) is None or checkpoints.latest(ckpts).version < 2:  # type: ignore[union-attr]
            assert first.poll() is None, first.stdout.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no version 2 within 300 s"
            time.sleep(0.2)
        victim = rank_pid(first.pid, 1)
        assert victim is not None, "rank 1 not found"
        os.kill(victim, signal.SIGKILL)
        output, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, output

    # consistent: whole versions only, each announced once
    assert [i.version for i in checkpoints.published(ckpts)] == [1, 2]
    assert [v for v, _ in checkpoint_events(store)] == [0, 1, 2]

    write_groups(store, model_dir, groups=4, group_size=4, first_group=4)
    again = subprocess.run(torchrun(*learn_args(store, model_dir, ckpts, "--steps", "4")), cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    events = checkpoint_events(store)
    assert [v for v, _ in events] == [0, 1, 2, 3, 4]
    consumed = [rid for _, rids in events for rid in rids]
    assert len(consumed) == len(set(consumed)) == 32, "every rollout trained into exactly one version"
