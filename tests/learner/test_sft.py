"""The supervised warm start: which tokens it learns, that its shared-prefix forward is exact, that it
learns, and that what it writes is a checkpoint transformers (and so the embedded server) loads."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from collectors.model.build import init_model  # noqa: E402
from learner import sft  # noqa: E402
from tests.collectors.conftest import TINY  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def conversation(a: int, b: int) -> dict[str, Any]:
    """A worked tool episode in the messages the tool agent sends (see collectors.envs.arithmetic)."""
    arguments = json.dumps({"a": a, "b": b})
    return {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": f"Add {a} and {b}."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": str(a + b)},
        {"role": "assistant", "content": f"It is {a + b}."},
    ]}


def conversations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [conversation(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sft") / "base"
    init_model(path, TINY, seed=0)
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny))


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_loss_covers_exactly_what_the_model_writes(tokenizer: Any) -> None:
    conv = conversation(37, 48)
    example = sft.tokenize_conversation(tokenizer, conv)
    text = tokenizer.apply_chat_template(conv["messages"], tools=TOOLS, tokenize=False)
    assert len(example.ids) == len(example.mask)
    assert tokenizer.decode(example.ids, skip_special_tokens=False) == text
    assert example.ids == tokenizer.encode(text, add_special_tokens=False)  # span by span = all at once here
    learned = [t for t, m in zip(example.ids, example.mask, strict=True) if m]
    assert tokenizer.decode(learned, skip_special_tokens=False) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 37, "b": 48}}\n</tool_call><|im_end|>'
        "It is 85.<|im_end|>")
    # the first turn's prompt, as the proxy renders and tokenizes it, is untrained and right before the call
    prompt = tokenizer.apply_chat_template(conv["messages"][:2], tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert example.ids[:len(prompt_ids)] == prompt_ids
    assert not any(example.mask[:len(prompt_ids)]) and example.mask[len(prompt_ids)]
    # the tool's answer sits between the two turns and is not learned
    observation = tokenizer.encode("\n<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n", add_special_tokens=False)
    start = next(i for i in range(len(example.ids)) if example.ids[i:i + len(observation)] == observation)
    assert not any(example.mask[start:start + len(observation)])


def test_a_conversation_without_an_assistant_turn_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="no assistant message"):
        sft.tokenize_conversation(tokenizer, {"messages": [{"role": "user", "content": "hi"}]})


def test_the_shared_prefix_forward_equals_the_plain_one(tiny: Path, tokenizer: Any) -> None:
    examples = [sft.tokenize_conversation(tokenizer, c) for c in conversations(3)]
    ids, attention, labels = sft._batch(examples, tokenizer.pad_token_id)
    assert sft.shared_prefix(ids, attention) > 100  # the system prompt and the tool list
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    model.train()
    results = []
    for forward in (sft.hidden_states, lambda m, i, a: m.base_model(input_ids=i, attention_mask=a).last_hidden_state):
        model.zero_grad()
        hidden = forward(model, ids, attention)
        keep = labels[:, 1:] != -100
        logits = model.get_output_embeddings()(hidden[:, :-1][keep])
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][keep])
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (fast, fast_grads), (plain, plain_grads) = results
    assert fast == pytest.approx(plain, rel=1e-5)
    for g1, g2 in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_a_few_steps_learn_and_the_output_loads(tiny: Path, tokenizer: Any, tmp_path: Path) -> None:
    data = conversations(32)
    out = sft.warm_start(tiny, tmp_path / "warm", data, steps=30, lr=1e-2, batch_size=8, seed=0)
    assert out == tmp_path / "warm"
    probe = [sft.tokenize_conversation(tokenizer, c) for c in conversations(8, seed=1)]  # unseen sums
    batch = sft._batch(probe, tokenizer.pad_token_id)
    losses = {}
    for name, path in (("before", tiny), ("after", out)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            losses[name] = sft.token_loss(model, *batch).item()
    assert losses["after"] < 0.5 * losses["before"], losses
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert loaded.chat_template == tokenizer.chat_template and loaded.encode("x = 12") == tokenizer.encode("x = 12")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_text() == (tiny / name).read_text(), name
    record = json.loads((out / sft.SETTINGS_FILE).read_text())
    assert record["steps"] == 30 and record["conversations"] == 32 and len(record["loss"]) == 30
    assert record["base_model"] == str(tiny.resolve())


def test_the_same_seed_trains_the_same_weights(tiny: Path, tmp_path: Path) -> None:
    data = conversations(8)
    a, b = (sft.warm_start(tiny, tmp_path / name, data, steps=3, lr=1e-3, batch_size=4, seed=5) for name in "ab")
    ma, mb = (AutoModelForCausalLM.from_pretrained(str(p)) for p in (a, b))
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_bad_settings_are_all_reported_before_any_work(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        sft.warm_start(tiny, tmp_path / "out", [], steps=0, lr=0.0, batch_size=0, seed=0)
    for part in ("steps must be >= 1", "lr must be > 0", "batch_size must be >= 1", "no conversations"):
        assert part in str(err.value)
    assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        sft.warm_start(tiny, tmp_path / "full", conversations(1), steps=1, lr=1e-3, batch_size=1, seed=0)
