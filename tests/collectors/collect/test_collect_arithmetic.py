"""The arithmetic environment end to end: `trajstore collect` with the built-in tool agent and the
calculator, on the embedded server, with a tiny model that a short warm start taught the
tool-call format (a random model never calls a tool).

What it shows (issue 4): 16 tasks x `--n 4` land 16 complete groups of 4 rollouts, each with
turns, a reward and a status, queryable with `trajstore query`; and wherever the model called
the calculator, the tool observation's tokens are in the sample with loss_mask 0 while the
sampled tokens around it have loss_mask 1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cli.main import main  # noqa: E402
from collectors.envs import arithmetic  # noqa: E402
from collectors.model.build import init_model  # noqa: E402
from learner.sft import warm_start  # noqa: E402
from tests.collectors.conftest import TINY  # noqa: E402
from trajstore import open_store  # noqa: E402


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY after 120 supervised steps on worked episodes: it writes `<tool_call>` blocks (its digits
    are often wrong, which is what RL is for)."""
    root = tmp_path_factory.mktemp("arith-models")
    init_model(root / "base", TINY, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return warm_start(root / "base", root / "warm", arithmetic.warm_start_conversations(256, seed=0),
                          steps=120, lr=1e-2, batch_size=16, seed=0)
    finally:
        torch.set_num_threads(threads)


def invoke(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def query(store: str, sql: str) -> list[dict]:
    out = invoke("query", "--store", store, "--format", "json", sql)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_sixteen_groups_of_four_with_masked_tool_observations(warm_model: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    tasks = arithmetic.write_tasks(tmp_path / "tasks.jsonl", 16, seed=3)
    threads = torch.get_num_threads()
    try:
        out = invoke("collect", "--store", store, "--run", "arith", "--tasks", str(tasks), "--n", "4",
                     "--model", str(warm_model), "--tools", "collectors.envs.arithmetic:calculator",
                     "--reward", "collectors.envs.arithmetic:reward", "--max-turns", "3", "--max-tokens", "40",
                     "--concurrency", "16", "--seed", "0", "--threads", "1", "--device", "cpu", "--plain",
                     "--workdir", str(tmp_path / "work"))
    finally:
        torch.set_num_threads(threads)
    assert "interrupted" not in out

    groups = query(store, "SELECT group_id, size, planned_size, trainable, complete FROM groups WHERE run = 'arith'")
    assert len(groups) == 16
    assert all(g["complete"] and g["trainable"] == 4 and g["planned_size"] == 4 for g in groups), groups
    rollouts = query(store, "SELECT rollout_id, turns, reward, reward_components, status FROM rollouts "
                            "WHERE run = 'arith' AND trainable")
    assert len(rollouts) == 64
    assert all(r["turns"] >= 1 and r["reward_components"] == 2 and r["status"] in ("completed", "truncated")
               for r in rollouts)

    # the tool observations: every turn after a tool call starts with the <tool_response> block, which is
    # prompt (loss_mask 0); the sampled call before it and the answer after it are trainable
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(warm_model))
    samples = open_store(store).query(
        "SELECT s.tokens, s.loss_mask FROM samples s JOIN rollouts r USING (rollout_id) "
        "WHERE s.run = 'arith' AND r.turns >= 2").to_pylist()
    assert samples, "the warm-started model never called the calculator"
    checked = 0
    for s in samples:
        text_ids, mask = s["tokens"], s["loss_mask"]
        start = text_ids.index(tok.convert_tokens_to_ids("<tool_response>"))
        end = text_ids.index(tok.convert_tokens_to_ids("</tool_response>"))
        assert not any(mask[start:end + 1]), "tool observation tokens must have loss_mask 0"
        assert any(mask[:start]) and any(mask[end + 1:]), "the call and the answer are sampled, hence trainable"
        observation = tok.decode(text_ids[start + 1:end]).strip()
        assert observation  # the calculator's answer (or its error text) is in the sample, masked
        checked += 1
    assert checked >= 32, f"only {checked} of 64 rollouts called the calculator"  # 62 when this was written
