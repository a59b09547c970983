"""`AgentContext`'s SDK clients through the real capture proxy: on one shared connection pool (as
`trajstore collect` runs them) or each on its own (an agent driven by hand)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from collectors.agents.context import AgentContext, RolloutInfo, shared_http_client
from tests.collectors.proxy_harness import MODEL, Harness


def context(h: Harness, tmp_path: Path, http: Any = None) -> tuple[AgentContext, dict[str, Any]]:
    rollout = h.open(group_size=1)
    info = RolloutInfo(run="test", group_id=rollout["group_id"], rollout_id=rollout["rollout_id"], slot=0, attempt=0,
                       workdir=tmp_path, policy_version=0)
    return AgentContext(info, rollout["base_urls"], rollout["api_key"], MODEL, max_turns=2, max_tokens=4,
                        http_client=http), rollout


async def ask(ctx: AgentContext, seed: int) -> None:
    await ctx.openai.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=ctx.max_tokens, seed=seed)


def test_rollouts_share_one_pool_that_outlives_them(proxy: Harness, tmp_path: Path) -> None:
    """Both SDKs of several rollouts (and a sub-agent's session) on one pool: each call lands in its own
    rollout and session, and closing a context leaves the pool open for the next rollouts."""
    first, first_rollout = context(proxy, tmp_path)
    second, second_rollout = context(proxy, tmp_path)

    async def main() -> tuple[bool, str]:
        http = shared_http_client(4)
        for ctx in (first, second):
            ctx.http_client = http
        try:
            await asyncio.gather(ask(first, 1), ask(first.session("helper"), 2), ask(second, 3),
                                 second.anthropic.messages.create(model=MODEL, max_tokens=4,
                                                                  messages=[{"role": "user", "content": "Yo"}]))
            await first.aclose()
            await second.aclose()
            third, _ = context(proxy, tmp_path, http)  # the pool serves rollouts after the first ones closed
            await ask(third, 4)
            stream = await third.openai.chat.completions.create(  # streams come through the pool's transport too
                model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=4, seed=6, stream=True)
            assert [chunk async for chunk in stream][-1].choices[0].finish_reason in ("stop", "length")
            async with third.anthropic.messages.stream(model=MODEL, max_tokens=4,
                                                       messages=[{"role": "user", "content": "On"}]) as events:
                assert (await events.get_final_message()).stop_reason in ("end_turn", "max_tokens")
            await third.aclose()
            still_open = not http.is_closed
        finally:
            await http.aclose()
        late, _ = context(proxy, tmp_path, http)  # its clients really go through the pool: closed, it refuses
        try:
            await ask(late, 5)
        except RuntimeError as exc:
            return still_open, str(exc)
        return still_open, "the call went through a closed pool"

    still_open, refused = asyncio.run(main())
    assert still_open and "closed" in refused
    sessions = {r: sorted(t["session_id"] for t in proxy.turns(r))
                for r in (first_rollout["rollout_id"], second_rollout["rollout_id"])}
    assert sessions == {first_rollout["rollout_id"]: ["helper", "main"], second_rollout["rollout_id"]: ["main", "main"]}


def test_without_a_shared_pool_a_context_closes_its_own_clients(proxy: Harness, tmp_path: Path) -> None:
    ctx, rollout = context(proxy, tmp_path)

    async def main() -> tuple[bool, bool]:
        await ask(ctx, 5)
        openai_client, anthropic_client = ctx.openai, ctx.anthropic
        await ctx.aclose()
        return openai_client.is_closed(), anthropic_client.is_closed()

    assert asyncio.run(main()) == (True, True)
    assert [t["session_id"] for t in proxy.turns(rollout["rollout_id"])] == ["main"]
