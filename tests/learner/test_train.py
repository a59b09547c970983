"""The training loop end to end on a tiny model and a synthetic store: what it trains, logs and publishes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

import trajstore  # noqa: E402
from learner import checkpoints  # noqa: E402
from learner.settings import AggregationName, LearnSettings, LossName, SettingsError  # noqa: E402
from learner.train import AGGREGATIONS, LOSSES, learn  # noqa: E402
from tests.learner.synth import make_model, write_groups  # noqa: E402

GROUPS = 10  # complete groups of 4 rollouts in the synthetic store


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def template(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GROUPS complete groups, all sampled at version 0; each test trains on a copy."""
    path = tmp_path_factory.mktemp("template") / "store"
    write_groups(path, model_dir, groups=GROUPS, group_size=4)
    return path


def fresh_store(template: Path, where: Path) -> Path:
    shutil.copytree(template, where / "store")
    return where / "store"


def settings(store_dir: Path, model_dir: Path, **over: Any) -> LearnSettings:
    base = LearnSettings(store=str(store_dir), run="default", model=str(model_dir),
                         checkpoints=str(store_dir.parent / "ckpts"),
                         groups_per_step=2, steps=1, lr=1e-3, max_staleness=100, micro_batch_tokens=96,
                         wait_timeout=0.2, poll_interval=0.05, device="cpu")
    return replace(base, **over)


def checkpoint_rows(store_dir: Path) -> list[dict[str, Any]]:
    return trajstore.open_store(store_dir).query(
        "SELECT version, step, consumed FROM checkpoints WHERE run = 'default' ORDER BY version").to_pylist()


def weights(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_one_step_changes_every_trainable_parameter(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    summary = learn(settings(store_dir, model_dir))
    assert summary.published == (1,) and summary.step == 1
    before, after = weights(model_dir), weights(tmp_path / "ckpts" / "v000001")
    unchanged = [name for name, p in before.items() if torch.equal(p, after[name])]
    assert not unchanged


# Golden values: 4 steps of the default loss (PPO, token mean, GRPO) on the synthetic store
# (seed 0), lr 1e-3, 2 groups per step, publishing every 2 steps. When a deliberate change
# moves them, run `GOLDEN_PRINT=1 pytest -s -k golden tests/learner/test_train.py` and paste
# the printed list here.
GOLDEN_LOSSES = [0.21216325, 0.33329032, 0.24536724, 0.29413044]


def test_golden_loss_curve(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    seen: list[tuple[int, int, float]] = []
    summary = learn(settings(store_dir, model_dir, steps=4, publish_every=2),
                    show=lambda step, version, m: seen.append((step, version, m["loss"])))
    losses = [loss for _, _, loss in seen]
    if os.environ.get("GOLDEN_PRINT"):
        print("GOLDEN_LOSSES =", [round(x, 8) for x in losses])
    assert [(step, version) for step, version, _ in seen] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4, abs=1e-6)
    assert summary.published == (1, 2) and summary.version == 2 and summary.stopped == "steps"
    store = trajstore.open_store(store_dir)
    stored = store.query("SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step").to_pylist()
    assert [r["value"] for r in stored] == pytest.approx(losses)  # one Metric event per step
    names = set(store.query("SELECT DISTINCT name FROM metrics").column("name").to_pylist())
    assert {"loss", "clip_fraction", "is_weight_mean", "is_weight_min", "is_weight_max", "mismatch_kl_k3",
            "entropy", "grad_norm", "reward_mean", "advantage_mean", "advantage_std", "staleness_mean",
            "staleness_max", "tokens", "tokens_per_s", "step_time"} <= names


@pytest.mark.parametrize("aggregation", get_args(AggregationName))
def test_micro_batch_budget_does_not_change_the_step(template: Path, model_dir: Path, tmp_path: Path,
                                                     aggregation: str) -> None:
    """Normalizers are global: one big forward pass or many small ones give the same loss and weights."""
    results = []
    for budget in (4096, 24):
        store_dir = fresh_store(template, tmp_path / f"b{budget}")
        summary = learn(settings(store_dir, model_dir, aggregation=aggregation, micro_batch_tokens=budget))
        results.append((summary, weights(store_dir.parent / "ckpts" / "v000001")))
    (big, big_w), (small, small_w) = results
    assert small.last_metrics["micro_batches"] > big.last_metrics["micro_batches"] == 1
    for metric in ("loss", "grad_norm", "clip_fraction", "entropy"):
        assert small.last_metrics[metric] == pytest.approx(big.last_metrics[metric], rel=1e-5), metric
    for name, p in big_w.items():  # Adam's first step is ~lr * sign(grad): summation order moves a few ~1e-6
        assert torch.allclose(p, small_w[name], atol=1e-5), name


def test_tis_loss_with_kl_to_the_initial_model(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    seen: list[dict[str, float]] = []
    learn(settings(store_dir, model_dir, steps=2, loss="tis", kl_coef=0.5, aggregation="seq_mean_token_sum"),
          show=lambda step, version, m: seen.append(dict(m)))
    assert seen[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # step 1: the policy is the reference
    assert seen[1]["kl_ref"] > 0  # step 2: one update away from it
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in seen)


def test_each_rollout_is_consumed_by_exactly_one_version(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    summary = learn(settings(store_dir, model_dir, steps=3, publish_every=2))
    assert summary.published == (1, 2)  # steps 1-2, then the last step on its own
    rows = checkpoint_rows(store_dir)
    assert [(r["version"], r["step"]) for r in rows] == [(0, 0), (1, 2), (2, 3)]
    paced = trajstore.open_store(store_dir).query("SELECT groups_per_version FROM checkpoints ORDER BY version")
    assert paced.column(0).to_pylist() == [4, 4, 4]  # what collectors pace admission by
    consumed = [rid for r in rows for rid in r["consumed"]]
    assert len(consumed) == len(set(consumed)) == 3 * 2 * 4
    store = trajstore.open_store(store_dir)
    per_step = store.query("SELECT step, rollout_id FROM step_rollouts ORDER BY step").to_pylist()
    assert sorted(r["rollout_id"] for r in per_step) == sorted(consumed)
    oldest = store.query("SELECT rollout_id FROM rollouts ORDER BY started, rollout_id LIMIT 24")
    assert sorted(consumed) == sorted(oldest.column("rollout_id").to_pylist())  # oldest groups first


def test_resume_announces_a_version_whose_event_was_lost(template: Path, model_dir: Path, tmp_path: Path) -> None:
    """A crash between the rename of v2 and the append of its event: the restart appends it."""
    store_dir = fresh_store(template, tmp_path)
    first = learn(settings(store_dir, model_dir, steps=1))
    ckpts = tmp_path / "ckpts"
    v1 = checkpoints.read_info(ckpts / "v000001")
    store = trajstore.open_store(store_dir)
    untouched = store.query("SELECT rollout_id FROM rollouts WHERE rollout_id NOT IN "
                            "(SELECT rollout_id FROM consumed) ORDER BY started, rollout_id LIMIT 8")
    lost = untouched.column("rollout_id").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(v1.path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoints.publish(ckpts, 2, 2, model, model_dir, optimizer, adapter=False,
                        info={"run": "default", "parent": 1, "consumed": lost, "metrics": {"loss": 1.0}})
    assert [r["version"] for r in checkpoint_rows(store_dir)] == [0, 1]

    second = learn(settings(store_dir, model_dir, steps=3))
    assert first.published == (1,) and second.resumed_from == 2 and second.published == (3,)
    rows = checkpoint_rows(store_dir)
    assert [(r["version"], r["step"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert rows[2]["consumed"] == lost
    consumed = [rid for r in rows for rid in r["consumed"]]
    assert len(consumed) == len(set(consumed)) == 8 * 3  # step 3 skipped what v2 had consumed


def test_staleness_bound_and_no_data_stop(template: Path, model_dir: Path, tmp_path: Path) -> None:
    """Data sampled at version 0 is too stale for version 1 when max_staleness is 0: the learner waits, then stops."""
    store_dir = fresh_store(template, tmp_path)
    summary = learn(settings(store_dir, model_dir, steps=5, max_staleness=0))
    assert summary.steps_trained == 1 and summary.published == (1,) and summary.stopped == "no_data"
    empty = trajstore.open_store(tmp_path / "empty")
    summary = learn(settings(tmp_path / "empty", model_dir, checkpoints=str(tmp_path / "ck2"), steps=2))
    assert summary.steps_trained == 0 and summary.published == () and summary.version == 0
    zero = empty.query("SELECT version, groups_per_version FROM checkpoints").to_pylist()
    assert zero == [{"version": 0, "groups_per_version": 2}]


def test_a_foreign_checkpoint_history_is_refused(template: Path, model_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints published nowhere but the learner's own directory: another directory cannot resume the run,
    and is told so at once (before any model loads) with the directory that can."""
    store_dir = fresh_store(template, tmp_path)
    learn(settings(store_dir, model_dir, steps=1))

    def no_model(*args: object) -> None:
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("learner.train.load_policy", no_model)
    with pytest.raises(checkpoints.CheckpointError, match="up to version 1") as refused:
        learn(settings(store_dir, model_dir, steps=2, checkpoints=str(tmp_path / "other")))
    assert f"Resume there with --checkpoints {(tmp_path / 'ckpts' / 'v000001').resolve()}" in str(refused.value)


def test_lora_publishes_adapters_and_resumes_from_them(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    learn(settings(store_dir, model_dir, steps=1, lora=True, lora_rank=4, lr=1e-2))
    v1 = tmp_path / "ckpts" / "v000001"
    adapter = json.loads((v1 / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(model_dir.resolve()) and not (v1 / "config.json").exists()
    assert checkpoints.read_info(v1).adapter
    second = learn(settings(store_dir, model_dir, steps=2, lora=True, lora_rank=4, lr=1e-2))
    assert second.resumed_from == 1 and second.published == (2,)
    with pytest.raises(checkpoints.CheckpointError, match="LoRA"):
        learn(settings(store_dir, model_dir, steps=3))


def test_the_learn_command(template: Path, model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    store_dir = fresh_store(template, tmp_path)
    common = ["learn", "--store", str(store_dir), "--run", "default", "--model", str(model_dir),
              "--checkpoints", str(tmp_path / "ck"),
              "--groups-per-step", "2", "--max-staleness", "100", "--device", "cpu", "--wait-timeout", "1"]
    result = CliRunner().invoke(main, [*common, "--steps", "1", "--lr", "1e-3"])
    assert result.exit_code == 0, result.output
    assert "step 1 v0 | loss" in result.output and "versions published: 1;" in result.output
    bad = CliRunner().invoke(main, [*common, "--lr", "0", "--clip-low", "2"])
    assert bad.exit_code == 1
    assert "lr must be > 0" in bad.output and "clip_low" in bad.output and "give steps" in bad.output


def test_warmup_raises_the_lr_linearly_then_holds_it(template: Path, model_dir: Path, tmp_path: Path) -> None:
    store_dir = fresh_store(template, tmp_path)
    learn(settings(store_dir, model_dir, steps=4, warmup_steps=3))
    lrs = trajstore.open_store(store_dir).query(
        "SELECT value FROM metrics WHERE name = 'lr' ORDER BY step").column("value").to_pylist()
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    assert "warmup_steps must be >= 0" in " ".join(settings(store_dir, model_dir, warmup_steps=-1).problems())


def test_settings_report_every_problem_at_once(tmp_path: Path) -> None:
    bad = LearnSettings(store=str(tmp_path / "s"), run="default", model=str(tmp_path / "missing"),
                        checkpoints=str(tmp_path),
                        groups_per_step=0, lr=0.0, clip_low=1.5, loss="dpo", steps=None)  # type: ignore[arg-type]
    with pytest.raises(SettingsError) as info:
        learn(bad)
    text = str(info.value)
    for words in ("is not a directory", "groups_per_step must be >= 1", "lr must be > 0", "clip_low",
                  "loss 'dpo'", "give steps"):
        assert words in text
    assert len(info.value.problems) == 6


def test_each_choice_maps_to_one_function() -> None:
    assert set(LOSSES) == set(get_args(LossName))
    assert set(AGGREGATIONS) == set(get_args(AggregationName))


def test_learn_needs_an_explicit_run_and_an_existing_store(template: Path, model_dir: Path, tmp_path: Path) -> None:
    """Issue 12.16: a mistyped --store used to create an empty store and wait for 10 minutes, and a
    forgotten --run trained the run "default": nothing, with exit status 0."""
    from click.testing import CliRunner

    from cli.main import main

    common = ["learn", "--model", str(model_dir), "--checkpoints", str(tmp_path / "ck"), "--device", "cpu",
              "--steps", "1", "--wait-timeout", "0.5", "--poll-interval", "0.05"]
    missing = CliRunner().invoke(main, [*common, "--store", str(tmp_path / "typo"), "--run", "default"])
    assert missing.exit_code == 1 and "no trajstore store at" in missing.output, missing.output
    assert not (tmp_path / "typo").exists()
    no_run = CliRunner().invoke(main, [*common, "--store", str(template)])
    assert no_run.exit_code == 2 and "Missing option '--run'" in no_run.output
    store_dir = fresh_store(template, tmp_path)
    wrong = CliRunner().invoke(main, [*common, "--store", str(store_dir), "--run", "exp1"])
    assert wrong.exit_code == 1, wrong.output
    assert "waiting for 8 complete, unconsumed groups of run 'exp1'" in wrong.output
    assert "the store has no rollouts of run 'exp1' (its runs: 'default'); is --run right?" in wrong.output
    assert "trained nothing in 0.5 s" in wrong.output
    created = CliRunner().invoke(main, [*common, "--store", str(tmp_path / "new"), "--run", "x", "--create-store"])
    assert created.exit_code == 1 and "trained nothing" in created.output and (tmp_path / "new" / "events").is_dir()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_settings_error(template: Path, model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="sees no GPU on this machine; use --device cpu"):
        learn(settings(fresh_store(template, tmp_path), model_dir, device="cuda"))


def test_token_ids_beyond_the_models_vocabulary_are_named(model_dir: Path, tmp_path: Path) -> None:
    """Issue 12.15: a run collected with a bigger tokenizer failed deep inside the embedding with an
    IndexError; the learner names the rollout and the id instead."""
    from learner.errors import LearnerError

    store = trajstore.open_store(tmp_path / "store")
    with store.writer("w") as w:
        for i, ids in enumerate(([5, 6], [7, 9000])):
            rid = f"big-{i}"
            w.append([trajstore.Turn(run="default", group_id="g", rollout_id=rid, segment_id=rid, turn_index=0,
                                     policy_version=0, prompt_ids=[1, 2], output_ids=ids, output_logprobs=[-1.0, -1.0]),
                      trajstore.Reward(run="default", group_id="g", rollout_id=rid, reward=float(i)),
                      trajstore.Status(run="default", group_id="g", rollout_id=rid, status="completed",
                                       group_size=2)])
    with pytest.raises(LearnerError, match="rollout big-1 .* holds token id 9000, but the model has 2048 tokens"):
        learn(settings(tmp_path / "store", model_dir, groups_per_step=1))


def test_sigterm_stops_learn_cleanly_and_seals_and_its_output_is_its_own(template: Path, model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """Issue 12.13 and 12.18: `kill PID` ends `trajstore learn` as Ctrl-C does (its checkpoint event is
    sealed: a reader of the Delta table alone sees it), and the output holds the learner's own lines,
    no library progress bars or warnings."""
    import signal
    import subprocess
    import sys

    from deltalake import DeltaTable

    from tests.conftest import REPO

    store_dir = fresh_store(template, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "learn", "--store", str(store_dir), "--run", "default",
                             "--model", str(model_dir), "--checkpoints", str(tmp_path / "ck"), "--groups-per-step",
                             "2", "--max-staleness", "100", "--device", "cpu", "--follow", "--lr", "1e-3",
                             "--poll-interval", "0.1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline()  # type: ignore[union-attr]
        assert first.startswith("step 1 v0 | loss"), first + proc.stderr.read()  # type: ignore[union-attr]
        while "waiting for 2 complete" not in proc.stdout.readline():  # type: ignore[union-attr]
            assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert err.strip() == "stopped by SIGTERM", err
    sealed = DeltaTable(str(store_dir / "events")).to_pyarrow_table(columns=["kind", "run"]).to_pylist()
    assert sum(r["kind"] == "checkpoint" for r in sealed) == 1 + GROUPS // 2  # version 0, then one per step
    assert sum(r["kind"] == "metric" for r in sealed) == GROUPS // 2


LOSS_METRICS = {"clip_fraction_low", "clip_fraction_high", "masked_tokens", "rejected_samples", "rejected_tokens",
                "seq_ratio_mean", "seq_ratio_min", "seq_ratio_max"}


@pytest.mark.parametrize("over", [
    {"loss": "ppo", "dual_clip": 3.0},
    {"loss": "gspo", "aggregation": "seq_mean_token_mean"},
    {"loss": "cispo"},
    {"loss": "tis", "mask_ratio": (0.5, 5.0), "reject": "k3", "reject_high": 0.05},
    {"loss": "ppo", "reject": "geo", "reject_low": 0.5, "reject_high": 2.0, "kl_coef": 0.1, "kl_estimator": "k2"},
    {"loss": "gspo", "kl_coef": 0.1, "kl_estimator": "k1"},
], ids=["ppo-dual-clip", "gspo", "cispo", "tis-icepop-k3-reject", "ppo-geo-reject-k2", "gspo-k1"])
def test_each_loss_trains_without_diverging_and_logs_its_metrics(template: Path, model_dir: Path, tmp_path: Path,
                                                                 over: dict[str, Any]) -> None:
    store_dir = fresh_store(template, tmp_path)
    seen: list[dict[str, float]] = []
    learn(settings(store_dir, model_dir, steps=3, **over), show=lambda step, version, m: seen.append(dict(m)))
    assert len(seen) == 3
    for m in seen:
        assert all(math.isfinite(v) for v in m.values()), m
        assert 0.9 < m["seq_ratio_min"] <= m["seq_ratio_mean"] <= m["seq_ratio_max"] < 1.1  # one small step apart
    names = set(trajstore.open_store(store_dir).query("SELECT DISTINCT name FROM metrics").column("name").to_pylist())
    assert LOSS_METRICS <= names
    if over.get("kl_coef"):
        assert "kl_ref" in names


def test_rejected_samples_are_counted_and_never_trained_on(template: Path, model_dir: Path, tmp_path: Path) -> None:
    # the synthetic behaviour logprobs carry engine-like noise (0.02 per token, a mean k3 of ~2e-4): a k3
    # bound of 1e-8 rejects every sample, so the step trains on nothing and moves no weight
    store_dir = fresh_store(template, tmp_path)
    summary = learn(settings(store_dir, model_dir, reject="k3", reject_high=1e-8))
    m = summary.last_metrics
    assert m["rejected_samples"] == m["samples"] and m["rejected_tokens"] == m["trainable_tokens"]
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
    before, after = weights(model_dir), weights(tmp_path / "ckpts" / "v000001")
    assert all(torch.equal(p, after[name]) for name, p in before.items())


def test_the_learn_command_takes_the_loss_flags(template: Path, model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    store_dir = fresh_store(template, tmp_path)
    common = ["learn", "--store", str(store_dir), "--run", "default", "--model", str(model_dir),
              "--checkpoints", str(tmp_path / "ck"), "--groups-per-step", "2", "--max-staleness", "100",
              "--device", "cpu", "--wait-timeout", "1", "--steps", "1"]
    result = CliRunner().invoke(main, [*common, "--loss", "ppo", "--dual-clip", "3", "--mask-ratio", "0.5,5",
                                       "--reject", "geo:0.5,2", "--kl-coef", "0.1", "--kl-estimator", "k2"])
    assert result.exit_code == 0, result.output
    for flags, says in ((["--mask-ratio", "0.5"], "is not LOW,HIGH"), (["--reject", "geo:2"], "is not none, geo:"),
                        (["--reject", "k3:0"], "reject k3 needs a bound > 0"),
                        (["--loss", "distill"], "loss distill needs teacher"),
                        (["--dual-clip", "0.5"], "dual_clip must be > 1")):
        bad = CliRunner().invoke(main, [*common, *flags])
        assert bad.exit_code != 0 and says in bad.output, (flags, bad.output)
        assert "Traceback" not in bad.output
def test_groups_without_reward_spread_are_counted_and_named(template: Path, model_dir: Path, tmp_path: Path) -> None:
    """Every rollout of the two oldest groups rescored to 0: the step trains on nothing and says so."""
    store_dir = fresh_store(template, tmp_path)
    store = trajstore.open_store(store_dir)
    oldest = store.query("SELECT group_id, rollout_id FROM rollouts WHERE group_id IN "
                         "(SELECT group_id FROM groups ORDER BY started LIMIT 3) ORDER BY started").to_pylist()
    later = datetime(2027, 1, 1, tzinfo=timezone.utc)
    with store.writer("rescore") as w:  # a newer value of the same reward component replaces the old one
        w.append([trajstore.Reward(run="default", group_id=r["group_id"], rollout_id=r["rollout_id"], reward=0.0,
                                   time=later, event_id=f"{r['rollout_id']}-rescored") for r in oldest])
    said: list[str] = []
    learn(settings(store_dir, model_dir, steps=2), say=said.append)
    step1, step2 = ([r for r in store.query("SELECT step, name, value FROM metrics WHERE name = "
                                            "'groups_no_spread' ORDER BY step").to_pylist()])
    assert (step1["value"], step2["value"]) == (2.0, 1.0)  # groups 1-2, then group 3 beside a scored one
    assert [line.split(":")[0] for line in said] == ["step 1 trained on nothing", "step 2"]
    assert "2 of its 2 groups had no reward spread" in said[0] and "the gradient is 0" in said[0]
    assert "1 of its 2 groups had no reward spread" in said[1]


def test_rejected_samples_are_listed_and_counted_apart_in_the_ledger(template: Path, model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A sample `--reject` leaves out of the loss is consumed (not offered again) but its trainable tokens
    are the ledger's `rejected`, not `trained`; the step's metric event names it (the `rejected` view)."""
    from tests.ledger import assert_ledger_balances

    store_dir = fresh_store(template, tmp_path)
    # the synthetic behaviour logprobs carry engine-like noise, so every sample's mean k3 exceeds 1e-12
    learn(settings(store_dir, model_dir, steps=1, reject="k3", reject_high=1e-12))
    store = trajstore.open_store(store_dir)
    consumed = store.query("SELECT rollout_id FROM step_rollouts").column(0).to_pylist()
    rejected = store.query("SELECT step, rollout_id, segment_id FROM rejected ORDER BY rollout_id").to_pylist()
    samples = store.query("SELECT rollout_id, segment_id FROM samples WHERE list_contains($ids, rollout_id) "
                          "AND trainable_tokens > 0 ORDER BY rollout_id", {"ids": consumed}).to_pylist()
    assert [(r["rollout_id"], r["segment_id"]) for r in rejected] == [(r["rollout_id"], r["segment_id"])
                                                                       for r in samples]
    assert {r["step"] for r in rejected} == {1}
    (row,) = assert_ledger_balances(store)
    assert row["trained"] == 0 and row["rejected"] > 0
    metric = store.query("SELECT value FROM metrics WHERE name = 'rejected_tokens'").column(0).to_pylist()
    assert metric == [row["rejected"]]


def test_a_step_without_rejections_trains_every_consumed_token(template: Path, model_dir: Path,
                                                               tmp_path: Path) -> None:
    from tests.ledger import assert_ledger_balances

    store_dir = fresh_store(template, tmp_path)
    learn(settings(store_dir, model_dir, steps=1))
    store = trajstore.open_store(store_dir)
    assert store.query("SELECT count(*) FROM rejected").column(0).to_pylist() == [0]
    (row,) = assert_ledger_balances(store)
    assert row["rejected"] == 0 and row["trained"] > 0


def test_a_waiting_learner_polls_the_follower_and_plans_a_shard_once_enough_groups_are_ready(
        template: Path, model_dir: Path, tmp_path: Path) -> None:
    """While too few groups are ready, each poll is a count on the follower's incremental snapshot (no
    sealed file read twice) and no shard is planned after the first; once enough are, the shard comes."""
    from learner.train import wait_for_shard

    store_dir = fresh_store(template, tmp_path)
    store = trajstore.open_store(store_dir)
    plans: list[int] = []
    plan = store.shard
    store.shard = lambda **kw: plans.append(1) or plan(**kw)  # type: ignore[method-assign]
    with contextlib.closing(store.follower()) as follower:
        sealed = len(store.pin().table.files)
        assert sealed > 0
        too_many = settings(store_dir, model_dir, groups_per_step=GROUPS + 1, wait_timeout=0.6, poll_interval=0.02)
        assert wait_for_shard(store, too_many, 0, [], follower=follower) is None
        assert plans == [1]  # the first poll plans; the others only count ready groups
        assert follower.files_read == sealed  # every sealed file read once however many polls
        enough = replace(too_many, groups_per_step=GROUPS - 1)
        held = store.query("SELECT rollout_id FROM rollouts WHERE group_id = (SELECT min(group_id) FROM groups)")
        shard = wait_for_shard(store, enough, 0, held.column(0).to_pylist(), follower=follower)
        assert shard is not None and len(shard.group_ids) == GROUPS - 1
        assert follower.files_read == sealed
