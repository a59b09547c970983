"""Real vLLM (the CPU build) serving `trajstore init-model --moe`: what it can and cannot give the store.

It serves the tiny Qwen3-MoE and its processed logprobs match transformers on the same weights,
so MoE policies collect through `VLLMClient` like dense ones. It returns no `routed_experts`: in
vLLM 0.32 they come from the AuxOutput connector, which needs Model Runner V2, which needs Triton
with a CPU backend that the CPU build lacks (`vllm/config/vllm.py`; see docs for the messages).
So such samples carry no routes and the learner routes them itself; the embedded server carries
routing replay (tests/learner/test_routing.py). If a later CPU build returns routes, the second
test fails and says so: then the client already stores them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectors.model.build import ModelSize, init_model
from collectors.policy import SamplingParams, VLLMClient
from collectors.policy.vllm_server import VLLMServer, start_vllm
from tests.collectors.conftest import vllm_or_skip
from tests.collectors.recompute import MATCH, cached_model, max_diff, recompute

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, Path]]:
    vllm_or_skip()
    model = tmp_path_factory.mktemp("models") / "moe"
    init_model(model, ModelSize(vocab_size=2048, intermediate_size=128, max_positions=2048, experts=4), seed=0)
    server = start_vllm(model, max_model_len=512, log_path=tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        yield server, model
    finally:
        server.stop()


def test_vllm_serves_the_moe_model_with_transformers_logprobs_and_no_routes(moe_vllm: tuple[VLLMServer, Path]) -> None:
    server, model = moe_vllm

    async def scenario() -> None:
        async with VLLMClient(server.url) as client:
            samples = await asyncio.gather(*(client.complete([50, 51, 52, 53, 54], SamplingParams(
                max_tokens=16, seed=seed)) for seed in range(3)))
            for s in samples:
                assert max_diff(s.output_logprobs, recompute(cached_model(str(model)), s)) <= MATCH
                assert s.routed_experts is None, "this vLLM returned routes: the CPU build now supports them"

    asyncio.run(scenario())
