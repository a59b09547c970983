"""Rollout routing replay on a tiny MoE: routes the embedded engine recorded, stored per turn, replayed by the learner.

The store is written as the capture proxy writes it (`trajstore.routes.turn_rows` on each call's
routes, multi-turn and fanned-out segments included) from completions the embedded engine sampled
(float32, CPU). The learner then recomputes every sampled token's logprob from a shard:

- under the sampling weights with routes replayed, it matches the behaviour logprob to 1e-6;
- after a weight update that touched only the routers (the learner's routing now differs from the
  sampler's, as R3's motivation has it), the recomputation without replay differs by far more,
  and with replay it matches to 1e-6 again. The routers pick one expert of four and renormalize
  (top-1), so the gate weight is exactly 1 and the router's weights only decide *which* expert:
  with the same experts replayed, nothing else differs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

import trajstore  # noqa: E402
from collectors.embedded.engine import Completion, Engine  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from collectors.policy import SamplingParams  # noqa: E402
from learner.batching import pack  # noqa: E402
from learner.errors import LearnerError  # noqa: E402
from learner.losses import token_logprobs  # noqa: E402
from learner.routing import moe_routers, replayed  # noqa: E402
from learner.settings import LearnSettings  # noqa: E402
from learner.train import forward_logits, learn  # noqa: E402
from trajstore import Reward, Status, Turn, routes  # noqa: E402

PARITY = 1e-6  # max |behaviour - recomputed| logprob, float32 on CPU
MOE = ModelSize(vocab_size=512, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=64,
                max_positions=512, experts=4, experts_per_token=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("models") / "moe"
    init_model(path, MOE, seed=0)
    return path


@pytest.fixture(scope="module")
def rerouted_dir(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights but new router weights: a weight update that changes which expert each token takes."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    torch.manual_seed(7)
    for router in moe_routers(model):
        router.weight.data = torch.randn_like(router.weight) * 0.5
    path = tmp_path_factory.mktemp("models") / "moe-rerouted"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (path / name).write_bytes((moe_dir / name).read_bytes())
    return path


def sample_all(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[Completion]:
    """Sample every prompt in one batch (left-padded prefill, shared decode steps)."""
    done = threading.Semaphore(0)
    out: dict[int, Completion] = {}

    def finish(i: int, result: Completion | BaseException) -> None:
        assert isinstance(result, Completion), result
        out[i] = result
        done.release()

    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True),
                      lambda r, i=i: finish(i, r))
    for _ in prompts:
        assert done.acquire(timeout=120)
    return [out[i] for i in range(len(prompts))]


def turn(c: Completion, rollout: str, segment: str, index: int, stored_prompt: list[int]) -> Turn:
    """A turn as the capture proxy stores it: the prompt delta, the output, and the call's routes."""
    rows = routes.turn_rows(c.routed_experts, len(c.prompt_ids), len(c.output_ids), len(stored_prompt))
    return Turn(run="moe", group_id="g0", rollout_id=rollout, segment_id=segment, turn_index=index, policy_version=0,
                prompt_ids=stored_prompt, output_ids=c.output_ids, output_logprobs=c.logprobs,
                **routes.turn_columns(rows))


@pytest.fixture(scope="module")
def store_dir(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One group of three rollouts: one turn; two turns with a tool reply between them; a main agent and a
    sub-agent (two segments). Every call sampled by the engine in batches with other calls."""
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(0, MOE.vocab_size - 16, n).tolist()  # noqa: E731
    engine = Engine(moe_dir, device="cpu", max_batch=4)
    try:
        p0, p1, p2 = prompt(9), prompt(6), prompt(11)
        first = sample_all(engine, [p0, p1, p2], max_tokens=12)
        tool = prompt(4)
        second = sample_all(engine, [p1 + first[1].output_ids + tool, prompt(3)], max_tokens=10)[0]
        sub_prompt = prompt(7)
        sub = sample_all(engine, [sub_prompt], max_tokens=9)[0]
    finally:
        engine.close()
    events: list[object] = [
        turn(first[0], "r0", "r0-s0", 0, p0),
        turn(first[1], "r1", "r1-s0", 0, p1), turn(second, "r1", "r1-s0", 1, tool),
        turn(first[2], "r2", "r2-s0", 0, p2), turn(sub, "r2", "r2-s1", 0, sub_prompt),
    ]
    for k, rollout in enumerate(("r0", "r1", "r2")):
        events += [Reward(run="moe", group_id="g0", rollout_id=rollout, reward=float(k)),
                   Status(run="moe", group_id="g0", rollout_id=rollout, status="completed", group_size=3)]
    path = tmp_path_factory.mktemp("stores") / "store"
    with trajstore.open_store(path, create=True).writer("w") as w:
        w.append(events)  # type: ignore[arg-type]
    return path


def recomputed(model_dir: Path, store_dir: Path, replay: bool) -> tuple[np.ndarray, np.ndarray]:
    """(behaviour, recomputed) logprobs of every sampled token of the store's one group, from a packed shard."""
    store = trajstore.open_store(store_dir)
    shard = store.shard(policy_version=0, max_staleness=0, run="moe")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    behaviour, mine = [], []
    with torch.no_grad():
        for mb in pack(shard.samples, 4096):
            mb = mb if replay else dataclasses.replace(mb, routes=None)
            keep = mb.mask.nonzero().squeeze(1)
            mine.append(token_logprobs(forward_logits(model, mb, 1.0), mb.targets[keep]).numpy())
            behaviour.append(mb.behaviour_logprobs[keep].numpy())
    return np.concatenate(behaviour), np.concatenate(mine)


def test_sample_routes_line_up_with_tokens_across_turns_and_segments(store_dir: Path) -> None:
    rows = trajstore.open_store(store_dir).query(
        "SELECT segment_id, tokens, routed_experts, routed_experts_shape FROM samples ORDER BY segment_id").to_pylist()
    assert [r["segment_id"] for r in rows] == ["r0-s0", "r1-s0", "r2-s0", "r2-s1"]
    for r in rows:
        n = len(r["tokens"])
        assert r["routed_experts_shape"] == [n, MOE.layers, 1]
        table = np.array(r["routed_experts"]).reshape(n, MOE.layers, 1)
        assert (table[0] == routes.ABSENT).all()  # nothing predicted a segment's first token
        assert ((table[1:] >= 0) & (table[1:] < MOE.experts)).all()  # every other position's route is known


def test_replayed_routes_match_the_sampler_to_1e6(moe_dir: Path, store_dir: Path) -> None:
    behaviour, mine = recomputed(moe_dir, store_dir, replay=True)
    assert len(behaviour) == 12 * 3 + 10 + 9
    assert np.abs(behaviour - mine).max() <= PARITY


def test_after_a_router_update_only_replay_recovers_the_sampled_logprobs(rerouted_dir: Path, store_dir: Path) -> None:
    behaviour, own = recomputed(rerouted_dir, store_dir, replay=False)
    _, replay = recomputed(rerouted_dir, store_dir, replay=True)
    assert np.abs(behaviour - own).max() > 1e-2  # the learner's own routing computes another network
    assert np.abs(behaviour - replay).max() <= PARITY


def test_the_moe_model_trains_under_learn_with_routes_replayed(rerouted_dir: Path, store_dir: Path,
                                                               tmp_path: Path) -> None:
    """`learn` on the rerouted model: replayed, the importance weights are 1 (the sampled network is the one
    trained); with --no-replay-routes they are not. Both steps train and publish."""
    seen = {}
    for replay in (True, False):
        work = tmp_path / str(replay)
        work.mkdir()
        import shutil

        shutil.copytree(store_dir, work / "store")
        summary = learn(LearnSettings(store=str(work / "store"), run="moe", model=str(rerouted_dir),
                                      checkpoints=str(work / "ckpts"), groups_per_step=1, steps=1, lr=1e-3,
                                      max_staleness=0, wait_timeout=0.2, poll_interval=0.05, device="cpu",
                                      replay_routes=replay))
        assert summary.steps_trained == 1 and summary.published == (1,)
        seen[replay] = summary.last_metrics
    assert seen[True]["routes_replayed"] == 1.0 and seen[False]["routes_replayed"] == 0.0
    assert abs(seen[True]["is_weight_mean"] - 1.0) <= 1e-5 and seen[True]["mismatch_kl_k3"] <= 1e-10
    assert abs(seen[False]["is_weight_mean"] - 1.0) > 1e-3 and seen[False]["mismatch_kl_k3"] > 1e-4


def test_routes_of_another_model_are_refused_with_a_clear_error(moe_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with pytest.raises(LearnerError, match="3 layers x top-1.*2 MoE layers.*--model"):
        with replayed(model, torch.zeros((4, 3, 1), dtype=torch.int16)):
            pass


def test_packing_shifts_routes_like_logprobs_and_fills_samples_without_routes() -> None:
    """Input position i takes the route stored with token i + 1; a sample without routes (a store written before
    them, a dense turn) gets -1 rows: the learner's own routing there."""
    import pyarrow as pa

    samples = pa.table({
        "tokens": [[1, 2, 3, 4], [5, 6, 7]], "loss_mask": [[False, False, True, True], [False, True, True]],
        "logprobs": [[0.0, 0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], "advantage": [1.0, -1.0],
        "rollout_segments": [1, 1],
        "routed_experts": pa.array([[-1, 10, 11, 12], None], pa.list_(pa.int16())),
        "routed_experts_shape": pa.array([[4, 1, 1], None], pa.list_(pa.int32())),
    })
    (mb,) = pack(samples, 64)
    by_sample = {int(i): mb.routes[mb.seq == i, 0, 0].tolist() for i in mb.seq.unique()}
    assert by_sample[mb.rows.index(0)] == [10, 11, 12] and by_sample[mb.rows.index(1)] == [-1, -1]
