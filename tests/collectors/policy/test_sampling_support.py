"""Each sampled token's kept set on the wire: the embedded server's `support_sizes` / `support_ids`, vLLM's
`sampling_mask`, both read into `Sample.support_sizes` / `support_ids` (the turn columns of those names)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient, PolicyServerBadResponse, SamplingParams, StreamedSample
from collectors.policy.http import parse_completion
from trajstore.events import SUPPORT_IDS_CAP

PROMPT = [50, 51, 52, 53]


def _complete_and_stream(server: RunningServer, params: SamplingParams) -> tuple[Any, Any]:
    async def scenario() -> tuple[Any, Any]:
        async with EmbeddedClient(server.url) as client:
            whole = await client.complete(PROMPT, params)
            joined = StreamedSample(PROMPT)
            async for chunk in client.stream(PROMPT, params):
                joined.add(chunk)
            return whole, joined.sample()
    return asyncio.run(scenario())


def test_the_embedded_server_returns_each_tokens_kept_set_complete_and_streamed(server: RunningServer) -> None:
    whole, streamed = _complete_and_stream(server, SamplingParams(max_tokens=12, top_k=8, seed=4))
    assert whole.support_sizes == [8] * len(whole.output_ids)  # random logits: no ties at the 8th
    sets = [whole.support_ids[8 * i:8 * i + 8] for i in range(len(whole.output_ids))]
    assert all(token in kept and kept == sorted(kept) for token, kept in zip(whole.output_ids, sets, strict=True))
    assert (streamed.output_ids, streamed.support_sizes, streamed.support_ids) == (
        whole.output_ids, whole.support_sizes, whole.support_ids)


def test_an_untruncated_draw_records_no_support(server: RunningServer) -> None:
    whole, streamed = _complete_and_stream(server, SamplingParams(max_tokens=6, seed=4))
    assert whole.support_sizes is whole.support_ids is streamed.support_sizes is None


def test_a_kept_set_above_the_cap_travels_as_its_size_alone(server: RunningServer) -> None:
    whole, _ = _complete_and_stream(server, SamplingParams(max_tokens=6, top_p=0.95, seed=4))
    assert min(whole.support_sizes) > SUPPORT_IDS_CAP and whole.support_ids == []


def _choice(**extra: Any) -> dict[str, Any]:
    return {"choices": [{"text": "ab", "finish_reason": "length", "token_ids": [7, 9],
                         "logprobs": {"token_logprobs": [-0.5, -0.25]}, **extra}]}


def test_vllms_sampling_mask_is_read_into_the_same_columns() -> None:
    wide = list(range(SUPPORT_IDS_CAP + 88))
    sample = parse_completion(_choice(sampling_mask=[[9, 7, 3], wide]), PROMPT, policy_version=0, url="u")
    assert sample.support_sizes == [3, SUPPORT_IDS_CAP + 88] and sample.support_ids == [3, 7, 9]


@pytest.mark.parametrize(("extra", "message"), [
    ({"sampling_mask": [[7]]}, "kept sets for 1 tokens but 2 sampled tokens"),
    ({"sampling_mask": [[7], "x"]}, "not a list of lists of token ids"),
    ({"support_sizes": [1, 1], "support_ids": [7]}, "1 `support_ids` for kept sets whose sizes"),
    ({"support_sizes": [1, -1], "support_ids": [7]}, "not both lists of non-negative integers"),
])
def test_a_malformed_support_is_a_bad_response(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyServerBadResponse, match=message):
        parse_completion(_choice(**extra), PROMPT, policy_version=0, url="u")
