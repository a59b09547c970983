"""`VLLMClient` against real vLLM (the CPU build): what it returns is checked against transformers on the same weights.

The session's vLLM (tests/collectors/conftest.py) serves `vllm_model`; these tests reload it,
so each loads a version above the one it finds (`served_label`). The ground truth for "which
weights sampled this" is a recomputation: the logprobs transformers gives the sampled ids
under a checkpoint, with the request's temperature and top-k applied (vLLM's
`--logprobs-mode processed_logprobs`). On the tiny float32 models here vLLM and transformers
agree to 1e-6 (measured: the largest difference per token over the 134 samples of one run of
this module was 9.5e-7); `MATCH` allows 1e-4. The two test checkpoints give a sequence's
tokens logprobs that differ by 0.09 to 0.35 per token on average (measured on 64 random
sequences: smallest 0.091), far above `DIFFER` (5e-3), so a sample matches exactly one of them.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from collectors.errors import WeightLoadError
from collectors.policy import PolicyServerRejected, PolicyServerUnreachable, Sample, SamplingParams, VLLMClient
from collectors.policy.vllm_server import VLLMServer, start_vllm
from tests.collectors.recompute import (
    DIFFER,
    MATCH,
    cached_model,
    fresh_model,
    max_diff,
    recompute,
    recompute_spans,
)

pytestmark = pytest.mark.vllm

PROMPT = [50, 51, 52, 53, 54, 55]


def finished_requests(url: str) -> int:
    """Requests vLLM finished, whatever the reason (its Prometheus counter)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


def run(scenario: Callable[[], object]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def test_processed_logprobs_match_a_transformers_recomputation(vllm_server: VLLMServer, vllm_model: Path,
                                                                served_label: Callable[[], int]) -> None:
    version = served_label() + 1

    async def scenario() -> None:
        async with VLLMClient(vllm_server.url) as client:
            await client.load_weights(str(vllm_model), version)
            for temperature, top_k in ((1.0, 0), (0.7, 0), (1.3, 20)):
                samples = await asyncio.gather(*(client.complete(PROMPT, SamplingParams(
                    max_tokens=24, temperature=temperature, top_k=top_k, seed=seed)) for seed in range(4)))
                for s in samples:
                    assert s.policy_version == version and len(s.output_ids) == len(s.output_logprobs) > 0
                    expected = recompute(cached_model(str(vllm_model)), s, temperature, top_k)
                    assert max_diff(s.output_logprobs, expected) < MATCH, (temperature, top_k)
    run(scenario)


def test_seeds_stop_strings_and_finish_reasons(vllm_server: VLLMServer) -> None:
    async def scenario() -> None:
        async with VLLMClient(vllm_server.url) as client:
            a, b = [await client.complete(PROMPT, SamplingParams(max_tokens=30, seed=3)) for _ in range(2)]
            assert a.output_ids == b.output_ids and a.finish_reason == "length" and a.stop_reason is None
            stop = a.text[len(a.text) // 2:len(a.text) // 2 + 2]
            cut = await client.complete(PROMPT, SamplingParams(max_tokens=30, seed=3, stop=(stop,)))
            assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
            assert cut.text == a.text[:a.text.index(stop)] and cut.output_ids == a.output_ids[:len(cut.output_ids)]
            first_id = await client.complete(PROMPT, SamplingParams(max_tokens=30, seed=3,
                                                                    stop_token_ids=(a.output_ids[4],)))
            assert first_id.finish_reason == "stop" and first_id.output_ids == a.output_ids[:5]
    run(scenario)


def test_a_reload_under_load_stamps_every_token_with_the_weights_that_drew_it(
        vllm_server: VLLMServer, vllm_model: Path, vllm_model_v2: Path, served_label: Callable[[], int]) -> None:
    """Completions stream in while the weights change four times in keep mode: none is aborted or sent again,
    calls in flight go on with the new weights, and every token's logprob is recomputed under the version
    stamped on it (over the cache vLLM kept: `recompute_spans`); the other checkpoint's would not match."""
    base = served_label()
    weights = {base + 1 + i: (vllm_model_v2 if i % 2 else vllm_model) for i in range(5)}

    async def scenario() -> tuple[list[Sample], int]:
        async with VLLMClient(vllm_server.url) as owner:
            await owner.load_weights(str(weights[base + 1]), base + 1)
            requests = finished_requests(vllm_server.url)
            stop = asyncio.Event()

            # each worker its own length, 64 to 504 tokens: the longest calls outlast the 0.5 s between reloads
            # (so some are in flight at each), the shortest often fit between two. Six calls of 96 tokens each ran
            # in step (started together after a resume, ended together about 0.17 s later here), and all four
            # reloads could land between two such batches, with no call in flight (seen once)
            async def sampler(worker: int) -> list[Sample]:
                out, i = [], 0
                while not stop.is_set():
                    out.append(await owner.complete(PROMPT, SamplingParams(max_tokens=64 + 88 * worker,
                                                                                 ignore_eos=True,
                                                                                 seed=worker * 1000 + i)))
                    i += 1
                return out

            workers = [asyncio.create_task(sampler(w)) for w in range(6)]
            for version in range(base + 2, base + 6):
                await asyncio.sleep(0.5)
                await owner.load_weights(str(weights[version]), version)
            await asyncio.sleep(0.5)
            stop.set()
            return ([s for batch in await asyncio.gather(*workers) for s in batch],
                    finished_requests(vllm_server.url) - requests)

    samples, upstream = asyncio.run(scenario())
    assert upstream == len(samples), "one vLLM request per call: none sent again"
    assert all(s.finish_reason == "length" for s in samples), "none aborted"
    stamped = {v for s in samples for v in (s.version_values or [s.policy_version])}
    assert stamped >= set(weights) - {base + 1}, "tokens sampled under every reloaded version"
    spanning = [s for s in samples if s.version_values is not None]
    assert spanning, "some calls were in flight at a reload and went on with the new weights"
    models = {v: cached_model(str(path)) for v, path in weights.items()}
    other = {v: cached_model(str(vllm_model_v2 if path == vllm_model else vllm_model)) for v, path in weights.items()}
    worst = 0.0
    for s in samples:
        diff = max_diff(s.output_logprobs, recompute_spans(models, s))
        worst = max(worst, diff)
        assert diff < MATCH, f"the versions stamped on this sample ({s.version_values or s.policy_version}) did not draw it"
        if s.version_values is None:
            mine, theirs = recompute_spans(models, s), recompute_spans(other, s)
            assert sum(abs(x - y) for x, y in zip(mine, theirs)) / len(mine) > DIFFER
    print(f"{len(samples)} samples, {len(spanning)} spanning a reload; largest |vLLM - recompute| {worst:.2e}")


def test_learner_lora_adapters_load_at_runtime_and_sample_as_peft_does(
        vllm_server: VLLMServer, vllm_model: Path, tmp_path: Path) -> None:
    """An adapter checkpoint as the learner publishes it (with non-zero B, so it changes the policy)."""
    from learner.checkpoints import publish
    from learner.lora import apply_lora

    torch.manual_seed(0)
    peft_model = apply_lora(fresh_model(vllm_model), rank=8, alpha=16)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad])
    adapter = publish(tmp_path / "ckpt", 1, 1, peft_model, vllm_model, optimizer, info={"run": "lora"}, adapter=True)
    merged = peft_model.merge_and_unload().eval()

    async def scenario() -> None:
        prefix = f"lora{tmp_path.name[-6:]}"  # adapters outlive the test on the shared server: a name of its own
        async with VLLMClient(vllm_server.url, model=vllm_server.model, reload="lora", lora_prefix=prefix) as a, \
                VLLMClient(vllm_server.url, model=vllm_server.model, reload="lora", lora_prefix=prefix) as b:
            base = await a.complete(PROMPT, SamplingParams(max_tokens=12, seed=1))
            await a.load_weights(str(adapter), 1)
            await b.load_weights(str(adapter), 1)  # already loaded by `a`: taken as is
            for client in (a, b):
                s = await client.complete(PROMPT, SamplingParams(max_tokens=12, seed=1))
                assert s.policy_version == 1 and base.policy_version == 0
                assert max_diff(s.output_logprobs, recompute(merged, s)) < MATCH
            assert f"{prefix}-v1" in await a.models()
            with pytest.raises(WeightLoadError, match="No adapter found"):
                await a.load_weights(str(tmp_path / "missing"), 2)
            assert (await a.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == 1
    run(scenario)


def test_refused_requests_and_checkpoints_leave_the_server_serving(vllm_server: VLLMServer, tiny_model: Path,
                                                                  served_label: Callable[[], int]) -> None:
    version = served_label() + 1

    async def scenario() -> None:
        async with VLLMClient(vllm_server.url) as client:
            # vLLM's engine dies on a failed reload_weights, so these never reach it
            for path, reason in (("/no-such-checkpoint", "not a checkpoint directory"),
                                 (str(tiny_model), "tie_word_embeddings")):
                with pytest.raises(WeightLoadError, match=reason):
                    await client.load_weights(path, version)
            with pytest.raises(PolicyServerRejected, match="out of vocabulary"):
                await client.complete([1, 10**6], SamplingParams(max_tokens=2))
            assert (await client.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == version - 1
    run(scenario)


@pytest.mark.slow  # a second vLLM: 30-75 s to start on 2 cores
def test_a_vllm_without_dev_routes_then_gone(vllm_model: Path, vllm_model_v2: Path, tmp_path: Path,
                                            vllm_server: VLLMServer) -> None:
    """A second vLLM, started without VLLM_SERVER_DEV_MODE or runtime LoRA, then stopped."""
    server = start_vllm(vllm_model, dev_mode=False, log_path=tmp_path / "vllm.log")

    async def scenario() -> None:
        async with VLLMClient(server.url, policy_version=3) as weights, \
                VLLMClient(server.url, reload="follow") as follower, \
                VLLMClient(server.url, reload="lora") as lora:
            assert (await weights.complete(PROMPT, SamplingParams(max_tokens=2))).policy_version == 3
            with pytest.raises(WeightLoadError, match="VLLM_SERVER_DEV_MODE=1"):
                await weights.load_weights(str(vllm_model_v2), 4)
            with pytest.raises(WeightLoadError, match="no GET /weight_info"):
                await follower.load_weights(str(vllm_model_v2), 1)
            with pytest.raises(WeightLoadError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
                await lora.load_weights(str(tmp_path), 1)
            server.stop()
            with pytest.raises(PolicyServerUnreachable, match="check that vLLM is running there"):
                await lora.complete(PROMPT, SamplingParams(max_tokens=2))

    try:
        run(scenario)
    finally:
        server.stop()


def test_the_launcher_refuses_a_model_vllm_cannot_serve(tiny_model: Path, vllm_server: VLLMServer) -> None:
    from collectors.policy.vllm_server import VLLMUnavailable

    config = json.loads((tiny_model / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 16
    with pytest.raises(VLLMUnavailable, match="head size 16"):
        start_vllm(tiny_model)
