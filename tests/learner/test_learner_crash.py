"""A learner process killed with SIGKILL at random points and restarted: every rollout is trained
into exactly one published version, versions have no gaps, and the end result is the run that
was never interrupted (resume restores weights, optimizer state, RNG and the data order).

Each attempt is a process forked from a forkserver that preloaded tests/learner/crash_learner.py,
which calls `learner.train.learn` as `trajstore learn` does (the command itself is covered in
test_train.py)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import trajstore  # noqa: E402
from learner.settings import LearnSettings  # noqa: E402
from learner.train import learn  # noqa: E402
from tests.learner import crash_learner  # noqa: E402
from tests.ledger import assert_ledger_balances  # noqa: E402
from tests.learner.synth import make_model, write_groups  # noqa: E402

GROUPS, GROUP_SIZE, PER_STEP, STEPS, PUBLISH_EVERY = 24, 3, 2, 12, 2
KILL_AFTER = (1, 2, 3)  # attempt k is killed once it has logged this many steps: mid-step, mid-publish, ...


def settings(store: Path, model: Path, ckpts: Path) -> LearnSettings:
    return LearnSettings(store=str(store), run="default", model=str(model), checkpoints=str(ckpts),
                         groups_per_step=PER_STEP,
                         steps=STEPS, publish_every=PUBLISH_EVERY, max_staleness=100, lr=1e-3, micro_batch_tokens=96,
                         device="cpu", poll_interval=0.05, wait_timeout=30)


def metric_events(store: trajstore.Store) -> int:
    return store.query("SELECT count(*) AS n FROM events WHERE kind = 'metric'").column("n")[0].as_py()


def wait_for(condition: Callable[..., bool], proc: BaseProcess, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout  # only a guard against hanging; no assertion depends on timing
    while not condition() and proc.is_alive():
        assert time.monotonic() < deadline, f"the learner made no progress in {timeout} s"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_and_restart_trains_each_rollout_exactly_once(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = make_model(tmp_path / "tiny")
    store_dir, ckpts = tmp_path / "store", tmp_path / "ckpts"
    rollouts = write_groups(store_dir, model, groups=GROUPS, group_size=GROUP_SIZE)
    clean_store, clean_ckpts = tmp_path / "clean-store", tmp_path / "clean-ckpts"
    shutil.copytree(store_dir, clean_store)  # for the uninterrupted run at the end
    store = trajstore.open_store(store_dir)
    # every attempt is forked from a server that has imported the learner once (see crash_learner)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.learner.crash_learner"])
    config = asdict(settings(store_dir, model, ckpts))

    def attempt(i: int) -> BaseProcess:
        proc = ctx.Process(target=crash_learner.run, args=(config, str(tmp_path / f"attempt-{i}.log")))
        proc.start()
        return proc

    killed_mid_run = 0
    for i, after in enumerate(KILL_AFTER):
        start = metric_events(store)
        proc = attempt(i)
        wait_for(lambda target=start + after: metric_events(store) >= target, proc)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            killed_mid_run += 1
        proc.join(timeout=60)
        assert proc.exitcode is not None
    assert killed_mid_run == len(KILL_AFTER), "each kill should land while its learner runs"
    final = attempt(len(KILL_AFTER))
    final.join(timeout=300)
    assert final.exitcode == 0, (tmp_path / f"attempt-{len(KILL_AFTER)}.log").read_text()[-3000:]

    rows = store.query("SELECT version, step, consumed FROM checkpoints WHERE run = 'default' "
                       "ORDER BY version").to_pylist()
    versions = [r["version"] for r in rows]
    assert versions == list(range(STEPS // PUBLISH_EVERY + 1)), versions  # 0..n, each once, no gaps
    assert [r["step"] for r in rows] == [v * PUBLISH_EVERY for v in versions]
    consumed = [rid for r in rows for rid in r["consumed"]]
    assert len(consumed) == len(set(consumed)), "a rollout was trained into two versions"
    assert sorted(consumed) == sorted(rollouts)  # and every rollout into one
    ledger = assert_ledger_balances(store)  # after the kills: every generated token trained or masked, none lost
    assert all(r["waiting"] == r["stale"] == r["incomplete"] == r["failed"] == 0 for r in ledger), ledger
    assert sum(r["trained"] for r in ledger) > 0, ledger
    for v in versions[1:]:
        assert (ckpts / f"v{v:06d}" / "model.safetensors").is_file()
    assert not list(ckpts.glob(".partial-*"))

    # the interrupted run ends exactly where an uninterrupted one does
    learn(settings(clean_store, model, clean_ckpts))
    from transformers import AutoModelForCausalLM

    last = f"v{STEPS // PUBLISH_EVERY:06d}"
    crashed = AutoModelForCausalLM.from_pretrained(ckpts / last).state_dict()
    clean = AutoModelForCausalLM.from_pretrained(clean_ckpts / last).state_dict()
    for name, p in clean.items():
        assert torch.allclose(p, crashed[name], atol=1e-6), name
