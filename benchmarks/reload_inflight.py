"""Hot reloads landing during long generations: how many calls are aborted, sent again or held back by them.

C callers keep long completions in flight (token-id prompts, `ignore_eos`, M tokens each) against
one policy server while the collector's client reloads the weights R times, alternating two
checkpoints built on the spot with `init_model` (no downloads). Counted per run:

- calls            completions the callers asked for;
- upstream         requests the server received (the embedded server's `requests` counter, or vLLM's
                   /metrics `vllm:request_success_total` + aborted): `upstream - calls` calls were sent
                   again because a reload overlapped them;
- failed           calls that raised or came back aborted;
- spanning         calls whose tokens came from two or more versions (weights updated in flight);
- reload wait      mean seconds a `load_weights` call took (a drain waits for the calls in flight).

Run it on this tree, and on an older one to compare (the script only uses the client API both share):

    python benchmarks/reload_inflight.py                     # embedded server, ~1 minute on 2 cores
    python benchmarks/reload_inflight.py --engine vllm       # real vLLM (CPU build), ~2 minutes
    git archive main | tar -x -C /tmp/before && PYTHONPATH=/tmp/before python benchmarks/reload_inflight.py
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from collectors.model.build import ModelSize, init_model
from collectors.policy import EmbeddedClient, SamplingParams, VLLMClient

PROMPT = [50, 51, 52, 53, 54, 55]


def build_models(root: Path) -> tuple[Path, Path]:
    size = ModelSize()  # the default: vLLM's CPU backend serves and reloads it
    paths = root / "v1", root / "v2"
    for seed, path in enumerate(paths):
        init_model(path, size, seed=seed)  # the second: other weights, same tokenizer and shapes
    return paths


async def drive(client: EmbeddedClient | VLLMClient, paths: tuple[Path, Path], callers: int, tokens: int,
                reloads: int, first_version: int) -> dict[str, float]:
    stop, outcomes, waits = asyncio.Event(), [], []

    async def caller(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                s = await client.complete(PROMPT, SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                                 seed=worker * 10_000 + i))
                outcomes.append("aborted" if s.finish_reason == "abort" else
                                "spanning" if getattr(s, "version_values", None) else "ok")
            except Exception:  # noqa: BLE001 - counted, not raised: the benchmark measures failures
                outcomes.append("failed")
            i += 1

    tasks = [asyncio.create_task(caller(w)) for w in range(callers)]
    await asyncio.sleep(1.0)
    for r in range(reloads):
        started = time.monotonic()
        await client.load_weights(str(paths[(r + 1) % 2]), first_version + r)
        waits.append(time.monotonic() - started)
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks)
    return {"calls": len(outcomes), "failed": outcomes.count("failed") + outcomes.count("aborted"),
            "spanning": outcomes.count("spanning"), "reload_wait_s": statistics.mean(waits),
            "resampled_by_client": getattr(client, "resampled", 0)}  # older clients counted their resamples


def vllm_requests(url: str) -> int:
    """Requests vLLM finished (any reason), from its Prometheus metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(v) for v in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reloads", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp))
        if args.engine == "embedded":
            from collectors.embedded.app import serve_in_thread

            with serve_in_thread(paths[0], threads=1, device="cpu", max_batch=16) as server:
                async def run() -> dict[str, float]:
                    async with EmbeddedClient(server.url) as client:
                        return await drive(client, paths, args.callers, args.tokens, args.reloads, 1)
                result = asyncio.run(run())
                upstream = server.engine.stats.requests
        else:
            from collectors.policy.vllm_server import start_vllm

            with start_vllm(paths[0]) as server:
                async def run() -> dict[str, float]:
                    async with VLLMClient(server.url) as client:
                        return await drive(client, paths, args.callers, args.tokens, args.reloads, 1)
                result = asyncio.run(run())
                upstream = vllm_requests(server.url)
    resent = max(upstream - result["calls"], result["resampled_by_client"])
    print(f"engine {args.engine}: {args.callers} callers x {args.tokens} tokens, {args.reloads} reloads")
    print(f"calls {result['calls']}, upstream requests {upstream}, sent again {resent:.0f} "
          f"({resent / args.reloads:.1f} per reload), failed or aborted {result['failed']}, "
          f"spanning two or more versions {result['spanning']}, mean reload call {result['reload_wait_s']:.2f} s")


if __name__ == "__main__":
    main()
