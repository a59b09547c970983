"""The proxy's hop to the policy server: client thread CPU per call, and the server's reading of it, by prompt length.

    python benchmarks/policy_hop.py [--calls 200] [CONTEXT ...]     (default 8000 32000 80000)

The fake policy server of `benchmarks/agent_upstream.py` answers at once, in its own process, so
the thread CPU measured here (time.thread_time around the calls) is the client's alone: building
and encoding the body, the request, reading and checking the reply. Rows:

- `EmbeddedClient.complete`, the prompt a list: the whole prompt encoded on every call;
- `EmbeddedClient.complete`, the prompt a `TokenIds` view of a session's `TokenLog` plus a
  200-token delta: what the capture proxy sends, only the delta encoded;
  each of these two as a JSON list (`packed_prompts=False`, vLLM's form) and packed
  (`prompt_token_ids_b64`, what the client sends to a server that announces it); the view also as
  a held prefix (`prompt_prefix`: the log's ids named by count and crc32, only the delta sent);
- a ready-encoded body POSTed with aiohttp's client, and with `Connections` (what `Http` uses for
  plain http): the cost of the request itself, without encoding or parsing.

A second table is the embedded server's side, in this process: CPU per call to decode the body
(`collectors.serving.decode_json`, what `read_json` runs) and validate it (`parse_completion_request`,
`check_prompt`), the prompt as a JSON list, packed, and as a held prefix plus the packed delta
(`with_prefix` joins them: the whole prompt is still made, as the engine takes it).
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


async def one_row(clients: tuple[Any, Any, Any], session: Any, conns: Any, upstream: str, ids: list[int], log: Any,
                  body: bytes, sampling: Any, calls: int) -> list[float]:
    """The seven measures of one prompt length (see the module docstring); `clients`: JSON, packed, prefixed."""
    headers = {"Content-Type": "application/json"}

    async def aiohttp_post() -> None:
        async with session.post(upstream + "/v1/completions", data=body, headers=headers) as resp:
            await resp.read()

    row = []
    for client in clients[:2]:
        row.append(await per_call(lambda c=client: c.complete(ids, sampling), calls))
    for client in clients:
        row.append(await per_call(lambda c=client: c.complete(log.view(ids[-DELTA:]), sampling), calls))
    return row + [await per_call(aiohttp_post, calls),
                  await per_call(lambda: conns.request("POST", "/v1/completions", headers, body), calls)]


def server_side(ids: list[int], calls: int) -> tuple[float, ...]:
    """The embedded server's CPU ms per call to decode and validate a prompt of `ids`: JSON list, packed, and the
    ids but the last `DELTA` held (`PrefixCache`) with the delta packed, joined to the whole prompt."""
    import orjson

    from collectors.embedded.prefix_cache import PrefixCache
    from collectors.embedded.protocol import (
        check_prompt,
        parse_completion_request,
        with_prefix,
    )
    from collectors.policy.token_ids import PackedIds, TokenLog
    from collectors.serving import decode_json

    common = {"max_tokens": 16, "logprobs": 0, "return_token_ids": True, "return_prompt_token_ids": False}
    held, cache = TokenLog(ids[:-DELTA]), PrefixCache()
    cache.put(held.key, held.ids)
    prefix = {"key": held.key, "tokens": len(held), "crc32": held.crc32(len(held))}
    bodies = (orjson.dumps({"prompt": ids, **common}),
              orjson.dumps({"prompt_token_ids_b64": PackedIds(ids).text(), **common}),
              orjson.dumps({"prompt_prefix": prefix, "prompt_token_ids_b64": PackedIds(ids[-DELTA:]).text(),
                            **common}))

    def read(raw: bytes) -> None:
        job = with_prefix(parse_completion_request(decode_json(raw)), cache)
        check_prompt(job.prompt, job.params, vocab_size=1 << 20, max_model_len=1 << 30,  # type: ignore[arg-type]
                     max_id=job.prompt_max_id)

    result = []
    for raw in bodies:
        for _ in range(5):
            read(raw)
        start = time.thread_time()
        for _ in range(calls):
            read(raw)
        result.append(1000 * (time.thread_time() - start) / calls)
    return tuple(result)


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
    names = ("list JSON", "list packed", "view JSON", "view packed", "view prefix", "aiohttp POST",
             "Connections POST")
    print(f"{'context':>8} " + " ".join(f"{name:>{max(len(name), 12)}}" for name in names))
    prompts = []
    async with EmbeddedClient(upstream, packed_prompts=False, prompt_prefix=False) as as_json, \
            EmbeddedClient(upstream, prompt_prefix=False) as packed, \
            EmbeddedClient(upstream, prefix_min_ids=1) as prefixed, aiohttp.ClientSession() as session:
        for context in contexts:
            rng = random.Random(context)
            ids = [rng.randrange(4000) for _ in range(context)]
            prompts.append(ids)
            body = orjson.dumps({"prompt": ids, "max_tokens": 16, "logprobs": 0, "return_token_ids": True,
                                 "return_prompt_token_ids": False})
            row = await one_row((as_json, packed, prefixed), session, conns, upstream, ids, TokenLog(ids[:-DELTA]), body,
                                sampling, calls)
            print(f"{context:>8} " + " ".join(f"{ms:>{max(len(name), 12)}.3f}" for ms, name in zip(row, names)),
                  flush=True)
    conns.close()
    print(f"\nembedded server: decode + validate the request, CPU ms per call (load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'context':>8} {'JSON list':>10} {'packed':>10} {'prefix':>10}")
    for ids in prompts:
        print(f"{len(ids):>8} " + " ".join(f"{ms:>10.3f}" for ms in server_side(ids, calls)), flush=True)


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
