"""The proxy's hop to the policy server: client thread CPU per call, by prompt length.

    python benchmarks/policy_hop.py [--calls 200] [CONTEXT ...]     (default 8000 32000 80000)

The fake policy server of `benchmarks/agent_upstream.py` answers at once, in its own process, so
the thread CPU measured here (time.thread_time around the calls) is the client's alone: building
and encoding the body, the request, reading and checking the reply. Rows:

- `EmbeddedClient.complete`, the prompt a list: the whole prompt encoded on every call;
- `EmbeddedClient.complete`, the prompt a `TokenIds` view of a session's `TokenLog` plus a
  200-token delta: what the capture proxy sends, only the delta encoded;
- a ready-encoded body POSTed with aiohttp's client, and with `Connections` (what `Http` uses for
  plain http): the cost of the request itself, without encoding or parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agent_upstream import start_upstream  # the fake policy server, its own process

DELTA = 200  # the ids new in a call (the rest is the session's log)


async def per_call(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    """Thread CPU ms per call, after a warm-up."""
    for _ in range(20):
        await call()
    start = time.thread_time()
    for _ in range(calls):
        await call()
    return 1000 * (time.thread_time() - start) / calls


async def one_row(client: Any, session: Any, conns: Any, upstream: str, ids: list[int], log: Any, body: bytes,
                  sampling: Any, calls: int) -> tuple[float, float, float, float]:
    """The four measures of one prompt length (see the module docstring)."""
    headers = {"Content-Type": "application/json"}

    async def aiohttp_post() -> None:
        async with session.post(upstream + "/v1/completions", data=body, headers=headers) as resp:
            await resp.read()

    return (await per_call(lambda: client.complete(ids, sampling), calls),
            await per_call(lambda: client.complete(log.view(ids[-DELTA:]), sampling), calls),
            await per_call(aiohttp_post, calls),
            await per_call(lambda: conns.request("POST", "/v1/completions", headers, body), calls))


async def bench(upstream: str, contexts: list[int], calls: int) -> None:
    import aiohttp
    import orjson

    from collectors.policy import EmbeddedClient, SamplingParams
    from collectors.policy.connections import Connections
    from collectors.policy.token_ids import TokenLog

    sampling = SamplingParams(max_tokens=16, seed=1)
    url = urlsplit(upstream)
    conns = Connections(url.hostname or "127.0.0.1", url.port or 80, url.netloc)
    print(f"client thread CPU per call, ms (load average {os.getloadavg()[0]:.1f}; the machine may be shared)")
    print(f"{'context':>8} {'complete(list)':>15} {'complete(view)':>15} {'aiohttp POST':>13} {'Connections POST':>17}")
    async with EmbeddedClient(upstream) as client, aiohttp.ClientSession() as session:
        for context in contexts:
            rng = random.Random(context)
            ids = [rng.randrange(4000) for _ in range(context)]
            body = orjson.dumps({"prompt": ids, "max_tokens": 16, "logprobs": 0, "return_token_ids": True,
                                 "return_prompt_token_ids": False})
            row = await one_row(client, session, conns, upstream, ids, TokenLog(ids[:-DELTA]), body, sampling,
                                calls)
            print(f"{context:>8} " + " ".join(f"{ms:>{w}.3f}" for ms, w in zip(row, (15, 15, 13, 17))), flush=True)
    conns.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("contexts", type=int, nargs="*", default=[8000, 32000, 80000])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per row (default 200)")
    args = ap.parse_args()
    from collectors.model.build import ModelSize, init_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        init_model(model, ModelSize(), seed=0)
        proc, conn, upstream = start_upstream(model)
        try:
            asyncio.run(bench(upstream, args.contexts, args.calls))
        finally:
            conn.send("stop")
            proc.join(30)


if __name__ == "__main__":
    main()
