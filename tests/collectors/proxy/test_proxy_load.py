"""Load through the proxy: 64 concurrent sessions in 64 rollouts, and a checkpoint reload under load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import openai

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient, Sample
from tests.collectors.proxy_harness import MODEL, Harness, assert_exact
from tests.collectors.recompute import MATCH, cached_model, max_diff, recompute_spans


async def one_call(rollout: dict[str, Any], i: int, max_tokens: int, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """Half the agents speak OpenAI (streaming when `stream`), half Anthropic; returns (text, the proxy's info)."""
    if i % 2:
        c = anthropic.AsyncAnthropic(base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"],
                                     max_retries=0)
        m = await c.messages.create(model=MODEL, max_tokens=max_tokens, extra_body={"seed": i},
                                    messages=[{"role": "user", "content": f"Agent {i} here."}])
        await c.close()
        return m.content[0].text, m.model_extra["trajstore"]
    o = openai.AsyncOpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)
    if stream:
        pieces, info = [], {}
        async for event in await o.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, seed=i, stream=True,
                messages=[{"role": "user", "content": f"Agent {i} here."}]):
            pieces += [c.delta.content or "" for c in event.choices]
            info = (event.model_extra or {}).get("trajstore", info)
        await o.close()
        return "".join(pieces), info
    r = await o.chat.completions.create(model=MODEL, max_tokens=max_tokens, seed=i,
                                        messages=[{"role": "user", "content": f"Agent {i} here."}])
    await o.close()
    return r.choices[0].message.content or "", r.model_extra["trajstore"]


def by_rollout(h: Harness, group_id: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for t in h.store.query("SELECT * FROM turns WHERE group_id = ? ORDER BY time", [group_id]).to_pylist():
        out.setdefault(t["rollout_id"], []).append(t)
    return out


def test_64_concurrent_sessions_each_land_in_their_own_rollout(proxy: Harness) -> None:
    rollouts = [proxy.open(group_id="load", group_size=64) for _ in range(64)]

    async def all_calls() -> list[tuple[str, dict[str, Any]]]:
        return await asyncio.gather(*(one_call(r, i, 6) for i, r in enumerate(rollouts)))

    results = asyncio.run(all_calls())
    stored = by_rollout(proxy, "load")
    assert len(stored) == 64
    for rollout, (text, info) in zip(rollouts, results, strict=True):
        assert info["rollout_id"] == rollout["rollout_id"]
        (turn,) = assert_exact(proxy, rollout["rollout_id"], stored[rollout["rollout_id"]])
        response = json.loads(turn["response"])
        openai_api = "choices" in response
        answered = response["choices"][0]["message"]["content"] if openai_api else response["content"][0]["text"]
        assert answered == text and turn["turn_index"] == 0


def test_a_reload_under_load_stamps_every_token_with_the_version_that_sampled_it(
        proxy: Harness, server: RunningServer, tiny_model: Path, tiny_model_v2: Path) -> None:
    """A reload lands while calls generate: none is aborted or sampled again, the calls in flight go on with
    the new weights, and each stored token's version and logprob are those of the weights that sampled it."""
    rollouts = [proxy.open(group_id="reload") for _ in range(24)]

    async def run() -> None:
        first = [asyncio.create_task(one_call(r, i, 48, stream=i % 4 == 0)) for i, r in enumerate(rollouts[:16])]
        for _ in range(500):  # reload only once the server is decoding some of them
            if server.engine.running and server.engine.stats.decode_steps > 4:
                break
            await asyncio.sleep(0.01)
        async with EmbeddedClient(server.url) as admin:
            await admin.load_weights(str(tiny_model_v2), 1)
        later = [asyncio.create_task(one_call(r, i, 8)) for i, r in enumerate(rollouts[16:], start=16)]
        await asyncio.gather(*first, *later)

    requests = server.engine.stats.requests
    asyncio.run(run())
    assert server.engine.stats.requests - requests == 24, "one upstream call per agent call: nothing resampled"
    versions, stored = {}, by_rollout(proxy, "reload")
    models = {0: cached_model(str(tiny_model)), 1: cached_model(str(tiny_model_v2))}
    for rollout in rollouts:
        # assert_exact: the stored versions == those in the server's own response for those tokens
        (turn,) = assert_exact(proxy, rollout["rollout_id"], stored[rollout["rollout_id"]])
        assert turn["finish_reason"] != "abort"
        versions[rollout["rollout_id"]] = turn["output_versions"]
        sample = Sample(prompt_ids=turn["prompt_ids"], output_ids=turn["output_ids"],
                        output_logprobs=turn["output_logprobs"], text="", finish_reason="stop",
                        policy_version=turn["policy_version"], version_starts=turn["output_version_starts"],
                        version_values=turn["output_version_values"])
        assert max_diff(turn["output_logprobs"], recompute_spans(models, sample)) < MATCH
    assert all(set(versions[r["rollout_id"]]) == {1} for r in rollouts[16:])
    spanning = [v for v in versions.values() if len(set(v)) == 2]
    assert spanning and all(v == sorted(v) for v in spanning), "calls in flight at the reload went on with v1"
    assert server.engine.policy_version == 1
    shares = proxy.store.stats().runs
    assert any((row["multi_version_samples"] or 0) > 0 for row in shares)
