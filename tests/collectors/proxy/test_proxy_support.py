"""A truncated call through the capture proxy stores each sampled token's kept set with the turn (streamed or
not), exactly as the embedded server drew it; an untruncated call stores none."""

from __future__ import annotations

from typing import Any

import pytest

from tests.collectors.proxy_harness import MODEL, Harness, openai_client


def _chat(h: Harness, stream: bool, **sampling: Any) -> dict[str, Any]:
    rollout = h.open()
    client = openai_client(rollout)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 10,
                              "seed": 3, "extra_body": {k: v for k, v in sampling.items() if k == "top_k"},
                              **{k: v for k, v in sampling.items() if k != "top_k"}}
    if stream:
        for _ in client.chat.completions.create(stream=True, **kwargs):
            pass
    else:
        client.chat.completions.create(**kwargs)
    h.close(rollout)
    (turn,) = h.turns(rollout["rollout_id"])
    return turn


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_a_top_k_call_stores_every_tokens_kept_set(proxy: Harness, stream: bool) -> None:
    turn = _chat(proxy, stream, top_k=6)
    n = len(turn["output_ids"])
    assert turn["top_k"] == 6 and turn["support_sizes"] == [6] * n and len(turn["support_ids"]) == 6 * n
    sets = [turn["support_ids"][6 * i:6 * i + 6] for i in range(n)]
    assert all(token in kept for token, kept in zip(turn["output_ids"], sets, strict=True))
    _, upstream = proxy.upstream.calls[-1]  # what the server answered is what was stored
    assert (upstream.support_sizes, upstream.support_ids) == (turn["support_sizes"], turn["support_ids"])


def test_an_untruncated_call_stores_no_support(proxy: Harness) -> None:
    turn = _chat(proxy, False, temperature=0.8)
    assert turn["temperature"] == 0.8 and turn["support_sizes"] is None and turn["support_ids"] is None
