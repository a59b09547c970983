"""On-policy distillation: the loss against the exact reverse-KL gradient, and a student trained by
`learn --loss distill` on its own samples, scored by `annotate`, moving toward a teacher.

The end-to-end test builds two tiny models on the spot: the student (the learner tests' tiny
model) and a teacher of the same shape and tokenizer whose final norm is scaled up, so its
next-token distributions are sharp where the student's are nearly uniform and the reverse KL
between them is large. The student samples its own continuations (on-policy), the teacher
scores them, and the student trains on them; the exact reverse KL on held-out prompts falls.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

import trajstore  # noqa: E402
from collectors.model.build import init_model  # noqa: E402
from learner.annotate import annotate  # noqa: E402
from learner.distill import distill_loss  # noqa: E402
from learner.losses import token_logprobs  # noqa: E402
from learner.train import learn  # noqa: E402
from tests.learner.synth import EPOCH, TINY, make_model  # noqa: E402
from tests.learner.test_train import settings  # noqa: E402

F64 = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- the loss


def test_distill_loss_by_hand() -> None:
    behaviour = t(-1.0, -2.0, -1.0)
    lp = (behaviour + t(0.0, 0.0, 1.0)).requires_grad_()  # lp = [-1, -2, 0]: w = [1, 1, 2 (capped from e)]
    teacher = t(-0.5, -3.0, -1.0)
    loss, rkl = distill_loss(lp, behaviour, teacher, t(0.0, 0.0, 0.0), cap=2.0)
    # reverse KL per token, lp - teacher = [-0.5, 1, 1]; loss = w * rkl * lp = [0.5, -2, 0]
    assert torch.allclose(rkl, t(-0.5, 1.0, 1.0)) and torch.allclose(loss, t(0.5, -2.0, 0.0))
    loss.sum().backward()
    # d/d lp = w * rkl: [-0.5, 1, 2]
    assert lp.grad is not None and torch.allclose(lp.grad, t(-0.5, 1.0, 2.0))
    # with a task reward: the advantage adds reward_coef * A to -(lp - teacher)
    lp.grad = None
    loss, _ = distill_loss(lp, behaviour, teacher, t(1.0, 1.0, 1.0), reward_coef=0.5, cap=2.0)
    loss.sum().backward()
    assert torch.allclose(lp.grad, t(-1.0, 0.5, 1.0))  # w * (rkl - 0.5)


def test_distill_gradient_is_the_exact_reverse_kl_gradient_on_own_samples() -> None:
    # sum over the vocabulary of pi(y) * grad loss(y) = grad KL(pi || T), exactly (on-policy: w = 1)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 7, generator=g, dtype=F64).requires_grad_()
    teacher = torch.log_softmax(torch.randn(7, generator=g, dtype=F64) * 2, 0)
    pi = torch.softmax(logits[0], 0).detach()
    expected = torch.zeros_like(logits)
    for y in range(7):
        lp = token_logprobs(logits, torch.tensor([y]))
        loss, _ = distill_loss(lp, lp.detach(), teacher[y:y + 1], t(0.0))
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        expected += pi[y] * grad
    logp = torch.log_softmax(logits[0], 0)
    (exact,) = torch.autograd.grad((logp.exp() * (logp - teacher)).sum(), logits)
    assert torch.allclose(expected, exact, atol=1e-12)


# ---------------------------------------------------------------- the loop


def scaled_model(path: Path, scale: float) -> Path:
    """The learner tests' tiny model (same shape, tokenizer and seed) with its logits scaled `scale`x
    through the final norm. A freshly initialized model is nearly uniform over its 2048 tokens, where
    the reverse KL is flat and on-policy samples carry almost no signal; scaled, it holds the same
    preferences firmly, as a trained model does."""
    init_model(path, TINY, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: torch.Tensor, new: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, new) tokens sampled from the model after each prompt, and their logprobs."""
    g = torch.Generator().manual_seed(seed)
    ids, lps = prompts, []
    for _ in range(new):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g)
        lps.append(logp.gather(1, nxt))
        ids = torch.cat([ids, nxt], 1)
    return ids[:, prompts.shape[1]:], torch.cat(lps, 1)


@torch.no_grad()
def reverse_kl(student: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor, prompt_len: int) -> float:
    """Exact KL(student || teacher) over the vocabulary, averaged over the output positions of `ids`."""
    s = torch.log_softmax(student(input_ids=ids).logits[:, prompt_len - 1:-1].double(), -1)
    te = torch.log_softmax(teacher(input_ids=ids).logits[:, prompt_len - 1:-1].double(), -1)
    return float((s.exp() * (s - te)).sum(-1).mean())


def write_samples(store_dir: Path, prompts: torch.Tensor, outputs: torch.Tensor, logprobs: torch.Tensor,
                  group_size: int) -> None:
    """The student's samples as turns, one group per prompt, every reward 0 (pure distillation)."""
    events: list[object] = []
    for i in range(prompts.shape[0]):
        group, rollout = f"g{i // group_size:03d}", f"r{i:03d}"
        time = EPOCH + timedelta(seconds=i)
        events += [
            trajstore.Turn(group_id=group, rollout_id=rollout, segment_id=f"{rollout}-s0", turn_index=0,
                           policy_version=0, prompt_ids=prompts[i].tolist(), output_ids=outputs[i].tolist(),
                           output_logprobs=logprobs[i].tolist(), time=time),
            trajstore.Reward(group_id=group, rollout_id=rollout, reward=0.0, time=time),
            trajstore.Status(group_id=group, rollout_id=rollout, status="completed", group_size=group_size, time=time),
        ]
    with trajstore.open_store(store_dir).writer("student") as w:
        w.append(events)  # type: ignore[arg-type]


def test_learn_distill_moves_the_student_toward_the_teacher(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    student_dir = scaled_model(tmp_path / "student", 10.0)
    teacher_dir = scaled_model(tmp_path / "teacher", 20.0)  # the student's preferences, twice as sharp
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt_len, new, groups, group_size, steps = 6, 8, 16, 4, 4
    train_prompts = torch.randint(0, TINY.vocab_size, (groups, prompt_len), generator=g).repeat_interleave(group_size, 0)
    held_out = torch.randint(0, TINY.vocab_size, (8, prompt_len), generator=g)

    outputs, logprobs = sample(student, train_prompts, new, seed=1)
    store_dir = tmp_path / "store"
    write_samples(store_dir, train_prompts, outputs, logprobs, group_size)
    scored = annotate(str(store_dir), "default", str(teacher_dir), "sharp", device="cpu")
    assert scored.samples == groups * group_size and scored.tokens == groups * group_size * new

    # the view lines the teacher's scores up with the sample's tokens: the teacher's own logprobs
    row = trajstore.open_store(store_dir).query(
        "SELECT s.tokens, t.teacher_logprobs FROM samples s JOIN teacher_logprobs t USING (rollout_id, segment_id) "
        "WHERE rollout_id = 'r000'").to_pylist()[0]
    ids = torch.tensor([row["tokens"]])
    with torch.no_grad():
        direct = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    assert row["teacher_logprobs"][:prompt_len] == [0.0] * prompt_len
    assert torch.allclose(torch.tensor(row["teacher_logprobs"][prompt_len:]), direct[prompt_len - 1:], atol=1e-5)

    held_ids = torch.cat([held_out, sample(student, held_out, new, seed=2)[0]], 1)
    before = reverse_kl(student, teacher, held_ids, prompt_len)
    s = replace(settings(store_dir, student_dir), loss="distill", teacher="sharp", steps=steps, lr=1e-3,
                groups_per_step=groups // steps, micro_batch_tokens=256)
    summary = learn(s)
    assert summary.steps_trained == steps
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpts" / f"v{steps:06d}", dtype=torch.float32).eval()
    after = reverse_kl(trained, teacher, held_ids, prompt_len)
    print(f"held-out reverse KL(student || teacher): {before:.4f} -> {after:.4f}")
    assert after < 0.8 * before
    metrics = trajstore.open_store(store_dir).query(
        "SELECT step, value FROM metrics WHERE name = 'distill_kl' ORDER BY step").column("value").to_pylist()
    assert len(metrics) == steps and metrics[-1] < metrics[0]  # the k1 estimate on the training samples falls too


def small_student_store(tmp_path: Path) -> Path:
    """tmp_path/store: 4 samples (2 groups of 2) of 3 tokens the tiny student sampled; returns the student."""
    torch.set_num_threads(1)
    student_dir = make_model(tmp_path / "student")
    prompts = torch.randint(0, TINY.vocab_size, (4, 5), generator=torch.Generator().manual_seed(0))
    outputs, logprobs = sample(AutoModelForCausalLM.from_pretrained(student_dir).eval(), prompts, 3, seed=0)
    write_samples(tmp_path / "store", prompts, outputs, logprobs, 2)
    return student_dir


def test_learn_distill_refuses_samples_without_teacher_logprobs(tmp_path: Path) -> None:
    student_dir = small_student_store(tmp_path)
    s = replace(settings(tmp_path / "store", student_dir), loss="distill", teacher="nobody")
    with pytest.raises(Exception, match="trajstore annotate"):
        learn(s)


def test_the_annotate_command_scores_what_is_new_once(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    student_dir = small_student_store(tmp_path)
    args = ["annotate", "--store", str(tmp_path / "store"), "--run", "default", "--teacher-model", str(student_dir),
            "--name", "self", "--device", "cpu"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "scored 4 samples" in first.output and "(4 turns, 12 output tokens)" in first.output
    again = CliRunner().invoke(main, args)
    assert "scored 0 samples" in again.output and "4 samples were already scored" in again.output
    store = trajstore.open_store(tmp_path / "store")
    assert store.query("SELECT count(*) AS n FROM events WHERE kind = 'teacher'").column("n")[0].as_py() == 4
    # the student scoring itself: its logprobs are the behaviour logprobs the samples were recorded with
    rows = store.query("SELECT s.logprobs, t.teacher_logprobs FROM samples s "
                       "JOIN teacher_logprobs t USING (rollout_id, segment_id)").to_pylist()
    for row in rows:
        assert torch.allclose(torch.tensor(row["teacher_logprobs"]), torch.tensor(row["logprobs"]), atol=1e-4)
    missing = CliRunner().invoke(main, [*args[:2], str(tmp_path / "nowhere"), *args[3:]])
    assert missing.exit_code == 1 and "no trajstore store" in missing.output and "Traceback" not in missing.output
