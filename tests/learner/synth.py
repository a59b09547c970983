"""A synthetic run for the learner's tests: groups of rollouts written straight into a store.

Every rollout shares its group's prompt, samples random token ids, and records as behaviour
logprobs what the given model assigns to them (plus a little noise, as an inference engine
would differ from the trainer), so importance ratios start near 1 as in a real run. Shapes:
the first rollout of every group is two turns with a tool response between them, the second
fans out into two segments (a sub-agent), the rest are one turn; rewards differ within each
group, so every advantage is nonzero. Times and ids are fixed by the arguments: the same call
writes the same store.

Also runnable, for the crash test's subprocesses: `python -m tests.learner.synth STORE MODEL
GROUPS GROUP_SIZE`.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

import trajstore  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from trajstore import Reward, Status, Turn  # noqa: E402

# tests.collectors.conftest.TINY, restated: importing that conftest loads the server and both SDKs
TINY = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                 max_positions=2048, tie_embeddings=True)
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_model(path: Path, seed: int = 0) -> Path:
    if not (path / "config.json").is_file():
        init_model(path, TINY, seed=seed)
    return path


def _behaviour(model: torch.nn.Module, tokens: list[int], rng: np.random.Generator) -> np.ndarray:
    """logprob of each token given the ones before it (index 0 unused), with engine-like noise."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1).numpy()
    lp = np.minimum(lp + rng.normal(0.0, 0.02, size=lp.shape), 0.0)
    return np.concatenate([[0.0], lp]).astype(np.float32)


def write_groups(store_path: Path, model_dir: Path, *, groups: int, group_size: int = 4, run: str = "default",
                 seed: int = 0, first_group: int = 0, policy_version: int = 0, writer: str = "synth",
                 prompt_len: int = 12, output_len: int = 6) -> list[str]:
    """Append `groups` complete groups (ids g{first_group:04d}...) and return their rollout ids."""
    rng = np.random.default_rng(seed + 1000 * first_group)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    store = trajstore.open_store(store_path)
    rollouts: list[str] = []
    events: list[object] = []
    for g in range(first_group, first_group + groups):
        group_id = f"{run}-g{g:04d}"
        t0 = EPOCH + timedelta(seconds=10 * g)
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        for k in range(group_size):
            rollout_id = f"{group_id}-r{k}"
            rollouts.append(rollout_id)
            # (segment prompt, turns): rollout 0 calls a tool once, rollout 1 starts a sub-agent
            segments = [(prompt, 2 if k == 0 else 1)]
            if k == 1:
                segments.append((rng.integers(0, vocab, prompt_len // 2).tolist(), 1))
            for s, (seg_prompt, turns) in enumerate(segments):
                segment_id = f"{rollout_id}-s{s}"
                tokens: list[int] = []
                for turn in range(turns):
                    delta = list(seg_prompt) if turn == 0 else rng.integers(0, vocab, 4).tolist()  # tool response
                    output = rng.integers(0, vocab, output_len + int(rng.integers(0, 4))).tolist()
                    tokens += delta + output
                    behaviour = _behaviour(model, tokens, rng)[-len(output):]
                    events.append(Turn(
                        run=run, group_id=group_id, rollout_id=rollout_id, segment_id=segment_id,
                        session_id="main" if s == 0 else "sub", turn_index=turn, policy_version=policy_version,
                        prompt_ids=delta, output_ids=output, output_logprobs=behaviour.tolist(),
                        finish_reason="stop", time=t0 + timedelta(milliseconds=100 * k + 10 * s + turn),
                        event_id=f"{segment_id}-t{turn}"))
            reward = float(k) / group_size + float(rng.uniform(0.0, 0.1))  # distinct within the group
            events.append(Reward(run=run, group_id=group_id, rollout_id=rollout_id, reward=reward,
                                 time=t0 + timedelta(seconds=1, milliseconds=k), event_id=f"{rollout_id}-reward"))
            events.append(Status(run=run, group_id=group_id, rollout_id=rollout_id, status="completed",
                                 group_size=group_size, time=t0 + timedelta(seconds=2, milliseconds=k),
                                 event_id=f"{rollout_id}-status"))
    with store.writer(writer) as w:
        w.append(events)  # type: ignore[arg-type]
    return rollouts


if __name__ == "__main__":
    store_arg, model_arg, groups_arg, size_arg = sys.argv[1:5]
    write_groups(Path(store_arg), make_model(Path(model_arg)), groups=int(groups_arg), group_size=int(size_arg))
