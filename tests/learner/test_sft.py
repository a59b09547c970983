"""The supervised warm start: loss on assistant tokens only, a few steps lower it, the output loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collectors.envs import arithmetic  # noqa: E402
from collectors.model import ModelSize, init_model  # noqa: E402
from learner.sft import SETTINGS_FILE, tokenize_conversation, warm_start  # noqa: E402

SMALL = ModelSize(vocab_size=1024, hidden_size=32, layers=1, heads=4, kv_heads=2, intermediate_size=64,
                  max_positions=512)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "base"
    init_model(path, SMALL, seed=0)
    return path


def test_only_assistant_tokens_are_learned(base: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    conversation = arithmetic.warm_start_conversations(1, seed=0)[0]
    example = tokenize_conversation(tok, conversation)
    assert len(example.ids) == len(example.mask)
    learned = tok.decode([i for i, m in zip(example.ids, example.mask) if m])
    # exactly the two assistant turns, each through its end-of-turn token; nothing of the prompt or tool output
    call = conversation["messages"][2]["tool_calls"][0]["function"]
    assert learned == (f'<tool_call>\n{{"name": "calculator", "arguments": {call["arguments"]}}}\n</tool_call>'
                       f'<|im_end|>{conversation["messages"][-1]["content"]}<|im_end|>')
    assert tok.decode(example.ids) == tok.apply_chat_template(conversation["messages"], tools=conversation["tools"],
                                                              tokenize=False)


def test_warm_start_lowers_the_loss_and_saves_a_checkpoint(base: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    out = warm_start(base, tmp_path / "warm", arithmetic.warm_start_conversations(32, seed=0), steps=30, lr=1e-2,
                     batch_size=8, seed=0)
    losses = json.loads((out / SETTINGS_FILE).read_text())["loss"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    AutoModelForCausalLM.from_pretrained(str(out))
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    with pytest.raises(FileExistsError):
        warm_start(base, out, arithmetic.warm_start_conversations(2), steps=1, lr=1e-3, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="steps"):
        warm_start(base, tmp_path / "bad", arithmetic.warm_start_conversations(2), steps=0, lr=1e-3, batch_size=1,
                   seed=0)
