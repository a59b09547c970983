"""The engine drives transformers' cache through the supported `cache=` argument, with the same tokens.

transformers renamed `past_key_values` to `cache` and warns on every forward pass that still
uses the old name (it is removed in 5.40); a batch that prefills, merges and retires rows
must sample without one such warning, and its logprobs must equal a forward pass without a
cache at all.
"""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest

from collectors.embedded.engine import Completion, Engine
from collectors.policy import Sample, SamplingParams
from tests.collectors.recompute import MATCH, cached_model, recompute


def test_a_batch_samples_without_deprecated_cache_arguments_and_matches_a_cacheless_forward(tiny_model: Path) -> None:
    engine = Engine(tiny_model, device="cpu", max_batch=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    lengths = [3, 12, 7]  # rows retire at different steps, so the batch is cut while others decode

    async def run() -> list[Completion]:
        return await asyncio.gather(*(engine.agenerate(p, SamplingParams(max_tokens=n, seed=i, ignore_eos=True))
                                      for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            done = asyncio.run(run())
    finally:
        engine.close()
    deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert deprecated == []
    model = cached_model(str(tiny_model))
    for prompt, completion in zip(prompts, done, strict=True):
        assert len(completion.output_ids) == lengths[prompts.index(prompt)]
        sample = Sample(prompt, completion.output_ids, completion.logprobs, completion.text, completion.finish_reason,
                        completion.policy_version)
        assert completion.logprobs == pytest.approx(recompute(model, sample), abs=MATCH)
