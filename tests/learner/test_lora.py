"""LoRA in the learner: only the adapter trains, and an adapter checkpoint round-trips for resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collectors.model.build import ModelSize, init_model  # noqa: E402
from learner.lora import DEFAULT_TARGET_MODULES, TOKENIZER_FILES, apply_lora, load_adapter_for_training, save_adapter  # noqa: E402

SIZE = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                 max_positions=2048, tie_embeddings=True)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("models") / "base"
    init_model(path, SIZE, seed=0)
    return path


def load(base_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SIZE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))  # (B, T)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def lora_params(model: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_only_the_adapter_trains_and_a_fresh_adapter_is_the_base_policy(base_dir: Path) -> None:
    torch.manual_seed(0)
    base_params = {n: p.detach().clone() for n, p in load(base_dir).named_parameters()}
    ids = batch()
    with torch.no_grad():
        base_logits = load(base_dir)(input_ids=ids).logits
    model = apply_lora(load(base_dir))
    assert isinstance(model, PeftModel)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert not any("lora_" in n for n in frozen)
    assert len(trainable) == SIZE.layers * len(DEFAULT_TARGET_MODULES) * 2  # A and B of every targeted linear
    with torch.no_grad():  # B starts at zero: version 0's behaviour logprobs stay exact
        assert torch.equal(model(input_ids=ids).logits, base_logits)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    before = lora_params(model)
    for step in (1, 2):
        loss = lm_loss(model, ids)
        assert loss.item() > 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        after = lora_params(model)
        changed = {n for n in after if not torch.equal(after[n], before[n])}
        if step == 1:  # with B = 0 the gradient reaches B only; A follows once B is nonzero
            assert changed == {n for n in after if "lora_B" in n}
        else:
            assert changed == set(after), f"LoRA parameters that never changed: {sorted(set(after) - changed)}"
    # no base weight moved: peft keeps each adapted layer's own weights under `base_layer`
    after_base = {n.replace(".base_layer", ""): p for n, p in model.get_base_model().named_parameters()
                  if "lora_" not in n}
    assert after_base.keys() == base_params.keys()
    moved = [n for n, p in after_base.items() if not torch.equal(p, base_params[n])]
    assert not moved, f"base parameters changed: {moved}"


def test_bad_lora_settings_are_reported_together(base_dir: Path) -> None:
    with pytest.raises(ValueError) as err:
        apply_lora(load(base_dir), rank=0, alpha=0, dropout=1.0, target_modules=["q_proj", "qkv_proj"])
    message = str(err.value)
    for part in ("rank must be an integer >= 1", "alpha must be > 0", "dropout must be in [0, 1)",
                 "['qkv_proj'] are not linear layers", "q_proj"):
        assert part in message, (part, message)


def test_save_adapter_writes_a_self_describing_dir_that_resumes_exactly(base_dir: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    model = apply_lora(load(base_dir), rank=4, alpha=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        lm_loss(model, batch(1)).backward()
        optimizer.step()

    monkeypatch.chdir(base_dir.parent)  # a relative base path is recorded absolute
    out = save_adapter(model, tmp_path / "v000001", Path(base_dir.name))
    files = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "config.json" not in files and "README.md" not in files
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            assert (out / name).read_bytes() == (base_dir / name).read_bytes(), name
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= files
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert sorted(config["target_modules"]) == sorted(DEFAULT_TARGET_MODULES)

    resumed = load_adapter_for_training(base_dir, out)
    assert {n for n, p in resumed.named_parameters() if p.requires_grad} == set(lora_params(resumed))
    trained, loaded = lora_params(model), lora_params(resumed)
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[n], loaded[n]) for n in trained)
    model.eval()
    resumed.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch(2)).logits, resumed(input_ids=batch(2)).logits)

    resumed_optimizer = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
    lm_loss(resumed, batch(3)).backward()
    resumed_optimizer.step()
    assert any(not torch.equal(p, loaded[n]) for n, p in lora_params(resumed).items())


def test_resume_needs_an_adapter_and_a_base(base_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter checkpoint"):
        load_adapter_for_training(base_dir, base_dir)
    adapter = save_adapter(apply_lora(load(base_dir)), tmp_path / "a", base_dir)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_adapter_for_training(tmp_path / "missing-base", adapter)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        save_adapter(apply_lora(load(base_dir)), tmp_path / "b", tmp_path / "missing-base")
