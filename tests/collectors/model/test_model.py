"""init-model: an HF checkpoint that transformers loads offline, deterministic in its seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from collectors.model.build import ModelSize, init_model


def test_checkpoint_loads_offline_like_vllm_would(tiny_model: Path, tiny_size: ModelSize) -> None:
    assert {p.name for p in tiny_model.iterdir()} >= {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == tiny_size.layers
    assert model.config.vocab_size == len(tokenizer) == tiny_size.vocab_size  # every sampleable id decodes
    ids = tokenizer("Hello, world!", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], tiny_size.vocab_size) and torch.isfinite(logits).all()


def test_generation_config_stops_on_chat_end_and_sets_no_sampling_defaults(tiny_model: Path) -> None:
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert gen["eos_token_id"] == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert not {"temperature", "top_p", "top_k", "do_sample", "repetition_penalty"} & gen.keys()


def test_files_carry_keys_older_loaders_read(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    tok_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert "<tool_call>" in tok_config["chat_template"]


def test_same_seed_same_files_other_seed_other_weights(tmp_path: Path, tiny_model: Path) -> None:
    small = ModelSize(vocab_size=512, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                      max_positions=256)
    a, b, c = (init_model(tmp_path / name, small, seed=seed) for name, seed in (("a", 7), ("b", 7), ("c", 8)))
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes()
        assert (a.path / name).read_bytes() != (c.path / name).read_bytes()
    assert a.vocab_size == 512


def test_invalid_sizes_are_all_reported() -> None:
    problems = ModelSize(hidden_size=60, heads=8, kv_heads=3).problems()
    assert any("divisible by heads 8" in p for p in problems)
    assert any("divisible by kv_heads 3" in p for p in problems)
    with pytest.raises(ValueError, match="at least"):
        init_model("/nonexistent/never-written", ModelSize(vocab_size=100))


def test_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        init_model(tmp_path)
