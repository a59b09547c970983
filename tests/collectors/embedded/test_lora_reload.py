"""The embedded server hot-reloads LoRA adapter checkpoints (the learner's format) merged into their base."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from collectors.embedded.app import RunningServer, serve_in_thread
from collectors.embedded.engine import load_model
from collectors.errors import WeightLoadError
from collectors.policy import EmbeddedClient
from learner.lora import apply_lora, load_adapter_for_training, save_adapter
from tests.collectors import http

PROMPT = [50, 51, 52, 53]
BODY: dict[str, Any] = dict(prompt=PROMPT, seed=7, temperature=1.0, max_tokens=16, logprobs=0,
                            return_token_ids=True, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A non-trivial adapter: peft starts B at zero (= the base policy), so B gets seeded random values."""
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), rank=4, alpha=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    return save_adapter(model, tmp_path_factory.mktemp("ckpts") / "v000001", tiny_model)


@pytest.fixture
def fresh_server(tiny_model: Path) -> Iterator[RunningServer]:
    """A server per test: these tests move its version, which must not leak into the next test."""
    threads = torch.get_num_threads()
    try:
        with serve_in_thread(tiny_model, threads=1, device="cpu") as running:
            yield running
    finally:
        torch.set_num_threads(threads)


def sample(server: RunningServer) -> dict[str, Any]:
    reply = http.post(server.url + "/v1/completions", BODY)
    assert reply.status == 200, reply.body
    assert reply.headers["X-Policy-Version"] == str(reply.json()["policy_version"])
    return reply.json()


def peft_logprobs(tiny_model: Path, adapter: Path, output: list[int]) -> torch.Tensor:
    """Temperature-1 logprobs of `output` after PROMPT under the unmerged PeftModel (the learner's view)."""
    model = load_adapter_for_training(tiny_model, adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def test_merged_adapter_computes_what_the_peft_model_computes(tiny_model: Path, adapter: Path) -> None:
    ids = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(3))  # (B, T)
    merged = load_model(adapter, torch.device("cpu"))
    assert type(merged).__name__ == "Qwen2ForCausalLM"  # plain model: the adapter costs nothing at serving time
    unmerged = load_adapter_for_training(tiny_model, adapter).eval()
    base = load_model(tiny_model, torch.device("cpu"))
    with torch.no_grad():
        got, want, before = (m(input_ids=ids).logits for m in (merged, unmerged, base))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(got, before, atol=1e-3), "the adapter should change the model"


def test_engine_loads_an_adapter_as_the_next_version(fresh_server: RunningServer, tiny_model: Path,
                                                     adapter: Path) -> None:
    v0 = sample(fresh_server)
    assert v0["policy_version"] == 0

    fresh_server.engine.load_weights(adapter, 1)
    v1 = sample(fresh_server)
    assert v1["policy_version"] == 1
    tokens = v1["choices"][0]["token_ids"]
    assert tokens != v0["choices"][0]["token_ids"], "same seed, new weights: the sample should differ"
    ref = peft_logprobs(tiny_model, adapter, tokens)
    got = torch.tensor(v1["choices"][0]["logprobs"]["token_logprobs"])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert sample(fresh_server)["choices"][0]["token_ids"] == tokens  # deterministic under the seed

    fresh_server.engine.load_weights(tiny_model, 2)  # back to a full checkpoint: the base policy again
    assert sample(fresh_server)["choices"][0]["token_ids"] == v0["choices"][0]["token_ids"]


def test_embedded_client_reloads_an_adapter_over_http(fresh_server: RunningServer, adapter: Path) -> None:
    v0 = sample(fresh_server)

    async def reload() -> int | None:
        async with EmbeddedClient(fresh_server.url) as client:
            await client.load_weights(str(adapter), 1)
            return client.policy_version

    assert asyncio.run(reload()) == 1
    models = http.get(fresh_server.url + "/v1/models").json()["data"][0]
    assert models["policy_version"] == 1 and models["root"] == str(adapter)
    v1 = sample(fresh_server)
    assert v1["policy_version"] == 1
    assert v1["choices"][0]["token_ids"] != v0["choices"][0]["token_ids"]


def with_base(adapter: Path, target: Path, base: str | None) -> Path:
    shutil.copytree(adapter, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def test_a_bad_adapter_is_refused_and_the_old_weights_keep_serving(fresh_server: RunningServer, adapter: Path,
                                                                   tmp_path: Path) -> None:
    v0 = sample(fresh_server)
    missing = with_base(adapter, tmp_path / "missing-base", str(tmp_path / "gone"))
    with pytest.raises(WeightLoadError) as err:
        fresh_server.engine.load_weights(missing, 1)
    message = str(err.value)
    assert str(tmp_path / "gone") in message and "base_model_name_or_path" in message
    assert "not a local model directory" in message

    hub_name = with_base(adapter, tmp_path / "hub-base", "Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(WeightLoadError, match="Hub names are not downloaded"):
        fresh_server.engine.load_weights(hub_name, 1)
    no_base = with_base(adapter, tmp_path / "no-base", None)
    with pytest.raises(WeightLoadError, match="names no base model"):
        fresh_server.engine.load_weights(no_base, 1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightLoadError, match="no config.json .* and no adapter_config.json"):
        fresh_server.engine.load_weights(empty, 1)

    async def reload_over_http() -> None:
        async with EmbeddedClient(fresh_server.url) as client:
            await client.load_weights(str(missing), 1)

    with pytest.raises(WeightLoadError, match="base_model_name_or_path"):
        asyncio.run(reload_over_http())

    assert fresh_server.engine.policy_version == 0 and fresh_server.engine.stats.reloads == 0
    after = sample(fresh_server)
    assert after["policy_version"] == 0
    assert after["choices"][0]["token_ids"] == v0["choices"][0]["token_ids"]
