"""Load through the proxy: 64 concurrent sessions in 64 rollouts, and a checkpoint reload under load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import openai

from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from tests.collectors.proxy_harness import MODEL, Harness, assert_exact


async def one_call(rollout: dict[str, Any], i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """Half the agents speak OpenAI, half Anthropic; returns (rollout_id the proxy reported, text)."""
    if i % 2:
        c = anthropic.AsyncAnthropic(base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"],
                                     max_retries=0)
        m = await c.messages.create(model=MODEL, max_tokens=max_tokens, extra_body={"seed": i},
                                    messages=[{"role": "user", "content": f"Agent {i} here."}])
        await c.close()
        return m.content[0].text, m.model_extra["trajstore"]
    o = openai.AsyncOpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)
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


def test_a_reload_under_load_stamps_every_turn_with_the_version_that_sampled_it(
        proxy: Harness, server: RunningServer, tiny_model_v2: Path) -> None:
    rollouts = [proxy.open(group_id="reload") for _ in range(24)]

    async def run() -> None:
        first = [asyncio.create_task(one_call(r, i, 24)) for i, r in enumerate(rollouts[:16])]
        for _ in range(500):  # reload only once the server is decoding some of them
            if server.engine.running:
                break
            await asyncio.sleep(0.01)
        async with EmbeddedClient(server.url) as admin:
            await admin.load_weights(str(tiny_model_v2), 1)
        later = [asyncio.create_task(one_call(r, i, 8)) for i, r in enumerate(rollouts[16:], start=16)]
        await asyncio.gather(*first, *later)

    asyncio.run(run())
    versions, stored = {}, by_rollout(proxy, "reload")
    for rollout in rollouts:
        # assert_exact: the stored version == the one in the server's own response for those tokens
        (turn,) = assert_exact(proxy, rollout["rollout_id"], stored[rollout["rollout_id"]])
        versions[rollout["rollout_id"]] = turn["policy_version"]
    assert {versions[r["rollout_id"]] for r in rollouts[16:]} == {1}
    assert 0 in {versions[r["rollout_id"]] for r in rollouts[:16]}  # in flight at the reload: finished on v0
    assert set(versions.values()) <= {0, 1} and server.engine.policy_version == 1
