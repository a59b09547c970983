"""`trajstore collect` throughput: rollouts/s, model calls/s and tokens/s against a fixed-latency upstream,
and how busy the collector keeps that upstream.

The upstream is a fake policy server in a process of its own (so its CPU use does not take the
collector's GIL): the subset of vLLM's API the embedded client uses (POST /v1/completions with a
token-id prompt, GET /v1/models, GET /health), answering every completion after a fixed latency
(`--latency-ms`, default 200) with the same short reply, REPLY + <|im_end|>, in exactly the response
JSON of the embedded server (`collectors.embedded.protocol`: `token_ids`, `prompt_token_ids` echoed,
`logprobs.token_logprobs`, `policy_version`, X-Policy-Version). It records each request's start and
end (CLOCK_MONOTONIC, shared by every process of the machine) and hands them over on
GET /bench_stats.

The collector is the library call `collectors.collect.runner.collect`, in this process, exactly as
`trajstore collect --server URL --model DIR` runs it: its own capture proxy (appending every turn,
reward and status to a fresh store on local disk), the scheduler, n = 4 rollouts per task. The
agent (`agent` below) makes 2 chat calls per rollout through the OpenAI SDK; the reward is a
constant. Each concurrency level C gets max(C * --per-slot, --min-rollouts) rollouts.

Measured over the steady window, from the first upstream request's start to the last one's end
(start-up of the proxy and the store is left out):

- rollouts/s, calls/s, tokens/s (output tokens the upstream returned);
- upstream busy: the integral of min(in flight, C) / C over the window, i.e. how much of the
  upstream's C slots the collector kept filled (target: >= 95% at C = 128); "any" is the plain
  fraction of the window with at least one request in flight;
- ideal calls/s: C / latency, what a collector with no overhead would reach;
- where each slot's time goes, per rollout: the upstream's two calls; the rest of the two calls as
  the agent saw them (SDK, proxy render, turn append, waiting for the CPU); building the agent's
  OpenAI client; the time outside the agent (open, task files, reward, close,
  scheduling, slots left empty); how many of the C slots had an agent at work on average; and this
  process's CPU (all threads) over the window, per second and per call, against the budget: one
  core keeps C slots of an L-second upstream full only below L / C seconds of CPU per call.

`--shared-client` runs each level a second time, side by side, with the agent's OpenAI clients on
one httpx transport the benchmark owns instead of `ctx.openai` (which, inside `collect`, already
builds each rollout's client on the run's one shared connection pool): a check that the collector's
own pool costs no more than a hand-made one. `--profile C` runs level C
once more under cProfile (the event loop's thread only) and prints where the collector's CPU goes.

    python benchmarks/collect.py                        # ~2 minutes on 2 shared CPU cores
    python benchmarks/collect.py --concurrency 16,128 --shared-client --profile 128
    python benchmarks/collect.py --latency-ms 1000 --concurrency 16,128,512
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import aiohttp

from collectors.agents.context import AgentContext, RolloutInfo

MODEL = "bench"
REPLY = "Sure. 6 times 7 is 42, so the answer is 42."
CALLS_PER_ROLLOUT = 2
TARGET_C, TARGET_BUSY = 128, 0.95
# (start, end), monotonic, of what the agent did (it runs in this process): each rollout's whole run, the
# construction of its OpenAI client (`ctx.openai`, one per rollout), each chat call
AGENT_TIMES: list[tuple[float, float]] = []
CLIENT_TIMES: list[tuple[float, float]] = []
CALL_TIMES: list[tuple[float, float]] = []
# --shared-client: one httpx client for every rollout's OpenAI client (set per level, in its event loop)
SHARED_HTTP: list[Any] = []


# ---------------------------------------------------------------- the agent and reward (`collect` loads them)


async def agent(task: dict[str, Any], ctx: AgentContext) -> str:
    """Two chat calls on a growing conversation, timed as the agent sees them."""
    started = time.monotonic()
    if SHARED_HTTP:  # what `ctx.openai` would cost if the SDK's transport (and its SSL context) were shared
        import openai

        client = openai.AsyncOpenAI(base_url=ctx.base_urls["openai"], api_key=ctx.api_key, max_retries=0,
                                    http_client=SHARED_HTTP[0])
    else:
        client = ctx.openai
    CLIENT_TIMES.append((started, time.monotonic()))
    messages: list[dict[str, str]] = [{"role": "user", "content": task["prompt"]}]
    text = ""
    for turn in range(CALLS_PER_ROLLOUT):
        if turn:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        t0 = time.monotonic()
        reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=ctx.max_tokens, **ctx.sampling)
        CALL_TIMES.append((t0, time.monotonic()))
        text = reply.choices[0].message.content or ""
    AGENT_TIMES.append((started, time.monotonic()))
    return text


async def reward(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> float:
    """Constant; async, so scoring costs no worker thread."""
    return 1.0


# ---------------------------------------------------------------- the fixed-latency upstream (its own process)


def upstream_app(model_dir: str, latency_s: float) -> Any:
    """/v1/completions answering REPLY + <|im_end|> after `latency_s`; every request's (start, end) recorded."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from collectors.embedded.engine import Completion
    from collectors.embedded.protocol import CompletionJob, completion_response
    from collectors.policy import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(REPLY, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    logprobs = [-0.5 - 0.01 * i for i in range(len(ids))]
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in ids}
    intervals: list[tuple[float, float]] = []

    async def completions(request: web.Request) -> web.Response:
        start = time.monotonic()
        body = await request.json()
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return web.json_response({"error": {"message": "prompt must be token ids", "code": 400}}, status=400)
        await asyncio.sleep(latency_s)
        result = Completion(prompt_ids=prompt, output_ids=ids, logprobs=logprobs, top_logprobs=None, text=REPLY,
                            finish_reason="stop", stop_reason=None, policy_version=0)
        job = CompletionJob(prompt=prompt, params=SamplingParams(logprobs=0), return_token_ids=True, model=None)
        text = json.dumps(completion_response(job, result, model_name=MODEL, decode_one=texts.__getitem__))
        intervals.append((start, time.monotonic()))
        return web.Response(text=text, content_type="application/json", headers={"X-Policy-Version": "0"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "policy_version": 0}]},
                                 headers={"X-Policy-Version": "0"})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": 0}, headers={"X-Policy-Version": "0"})

    async def bench_stats(request: web.Request) -> web.Response:
        """Every request since the last call, then forget them (each level reads its own)."""
        out = {"intervals": list(intervals), "output_tokens": len(ids)}
        intervals.clear()
        return web.json_response(out)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/bench_stats", bench_stats)
    return app


def serve_upstream(model_dir: str, latency_s: float, conn: Connection) -> None:
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(upstream_app(model_dir, latency_s), access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, backlog=1024).start()
        conn.send(f"http://127.0.0.1:{sock.getsockname()[1]}")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await runner.cleanup()

    asyncio.run(main())


def start_upstream(model_dir: str, latency_s: float) -> tuple[mp.process.BaseProcess, Connection, str]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_upstream, args=(model_dir, latency_s, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError("the fake upstream did not start within 120 s")
    return proc, parent, parent.recv()


async def upstream_stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/bench_stats") as resp:
        return await resp.json()


# ---------------------------------------------------------------- measures (pure)


def busy_fractions(intervals: Sequence[tuple[float, float]], slots: int, start: float, end: float
                   ) -> tuple[float, float]:
    """(integral of min(in flight, slots) / slots, fraction with >= 1 in flight), both over [start, end]."""
    if end <= start:
        return 0.0, 0.0
    edges = sorted([(max(s, start), 1) for s, e in intervals if e > start and s < end]
                   + [(min(e, end), -1) for s, e in intervals if e > start and s < end])
    filled = anyone = 0.0
    in_flight, at = 0, start
    for t, step in edges:
        filled += min(in_flight, slots) * (t - at)
        anyone += (t - at) if in_flight > 0 else 0.0
        in_flight, at = in_flight + step, t
    return filled / (slots * (end - start)), anyone / (end - start)


def cpu_at(trace: Sequence[tuple[float, float]], t: float) -> float:
    """Process CPU time at monotonic time `t`, interpolated between the samples around it."""
    before = max((p for p in trace if p[0] <= t), default=trace[0])
    after = min((p for p in trace if p[0] >= t), default=trace[-1])
    if after[0] <= before[0]:
        return before[1]
    return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])


def mean_length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals) / len(intervals) if intervals else 0.0


@dataclass(frozen=True)
class Level:
    """One concurrency level's measurements."""

    concurrency: int
    client: str  # how the agent got its OpenAI client: "ctx.openai" or "shared" (--shared-client)
    rollouts: int
    calls: int
    output_tokens: int
    window_s: float  # first upstream request's start to the last one's end
    total_s: float  # the whole collect() call, start-up included
    busy: float
    any_busy: float
    upstream_call_s: float  # mean upstream interval
    agent_call_s: float  # mean chat call as the agent saw it
    client_s: float  # mean construction of a rollout's OpenAI client
    agent_s: float  # mean agent run per rollout
    agents_running: float  # mean number of agents running over the window (of C slots)
    cpu_s: float  # this process's CPU time (all threads) over the window

    @property
    def slot_s_per_rollout(self) -> float:
        """Seconds of one concurrency slot each rollout took: C * window / rollouts."""
        return self.concurrency * self.window_s / self.rollouts

    def row(self, latency_s: float) -> dict[str, Any]:
        ideal = self.concurrency / latency_s
        return {"concurrency": self.concurrency, "client": self.client, "rollouts": self.rollouts, "calls": self.calls,
                "rollouts_per_s": self.rollouts / self.window_s, "calls_per_s": self.calls / self.window_s,
                "tokens_per_s": self.output_tokens / self.window_s, "busy": self.busy, "any_busy": self.any_busy,
                "ideal_calls_per_s": ideal, "window_s": self.window_s, "total_s": self.total_s,
                "cpu_ms_per_call": 1000 * self.cpu_s / self.calls, "agents_running": self.agents_running}


# ---------------------------------------------------------------- one level


def write_tasks(path: Path, level: int, count: int) -> str:
    with path.open("w") as f:
        for i in range(count):
            f.write(json.dumps({"id": f"c{level}-{i}", "prompt": f"Question {i}: what is {i % 97} times 7?"}) + "\n")
    return str(path)


async def run_level(c: int, rollouts: int, *, upstream: str, model_dir: str, tmp: Path, tag: str = "",
                    shared_client: bool = False, profile: cProfile.Profile | None = None) -> Level:
    from collectors.collect.runner import collect
    from collectors.collect.settings import CollectSettings

    n = 4
    groups = -(-rollouts // n)
    name = f"c{c}{tag}"
    tasks = write_tasks(tmp / f"tasks-{name}.jsonl", c, groups)
    settings = CollectSettings(
        store=str(tmp / f"store-{name}"), run=f"bench-{name}", tasks=tasks, n=n, server=upstream, model=model_dir,
        concurrency=c, max_tokens=64, seed=0, rollout_timeout=120, retries=0, agent=f"{__name__}:agent",
        reward=f"{__name__}:reward", workdir=str(tmp / f"work-{name}"), display="off")
    await upstream_stats(upstream)  # forget the requests of anything before
    for times in (AGENT_TIMES, CLIENT_TIMES, CALL_TIMES):
        times.clear()
    if shared_client:
        import openai

        SHARED_HTTP.append(openai.DefaultAsyncHttpxClient(limits=openai.DEFAULT_CONNECTION_LIMITS))
    cpu_trace: list[tuple[float, float]] = []  # (monotonic, process CPU): the window's CPU is read off it

    async def trace_cpu() -> None:
        while True:
            cpu_trace.append((time.monotonic(), time.process_time()))
            await asyncio.sleep(0.05)

    t0 = time.monotonic()
    tracer = asyncio.create_task(trace_cpu())
    if profile is not None:
        profile.enable()
    try:
        summary = await collect(settings)
    finally:
        if profile is not None:
            profile.disable()
        tracer.cancel()
        cpu_trace.append((time.monotonic(), time.process_time()))
        for http in SHARED_HTTP:
            await http.aclose()
        SHARED_HTTP.clear()
    total = time.monotonic() - t0
    stats = await upstream_stats(upstream)
    intervals = [tuple(x) for x in stats["intervals"]]
    done = summary.rollouts.get("completed", 0)
    if done != groups * n or len(intervals) != CALLS_PER_ROLLOUT * done:
        raise SystemExit(f"concurrency {c}: {summary.rollouts} rollouts and {len(intervals)} upstream calls, expected "
                         f"{groups * n} completed and {CALLS_PER_ROLLOUT * groups * n} calls")
    start, end = min(s for s, _ in intervals), max(e for _, e in intervals)
    busy, anyone = busy_fractions(intervals, c, start, end)
    running = sum(max(0.0, min(e, end) - max(s, start)) for s, e in AGENT_TIMES) / (end - start)
    cpu = cpu_at(cpu_trace, end) - cpu_at(cpu_trace, start)
    return Level(c, "shared" if shared_client else "ctx.openai", done, len(intervals),
                 len(intervals) * stats["output_tokens"], end - start, total, busy, anyone, mean_length(intervals),
                 mean_length(CALL_TIMES), mean_length(CLIENT_TIMES), mean_length(AGENT_TIMES), running, cpu)


# ---------------------------------------------------------------- report


def report(levels: list[Level], latency_s: float) -> None:
    print(f"\n  {'concurrency':>11} {'client':<10} {'rollouts':>8} {'rollouts/s':>10} {'calls/s':>8} {'tokens/s':>9} "
          f"{'upstream busy':>13} {'any':>6} {'ideal calls/s':>13} {'target':>18}")
    for lv in levels:
        r = lv.row(latency_s)
        target = (f">= {TARGET_BUSY:.0%} busy: " + ("met" if lv.busy >= TARGET_BUSY else "MISSED")
                  if lv.concurrency == TARGET_C else "-")
        print(f"  {lv.concurrency:>11} {lv.client:<10} {lv.rollouts:>8} {r['rollouts_per_s']:>10.1f} "
              f"{r['calls_per_s']:>8.1f} {r['tokens_per_s']:>9,.0f} {lv.busy:>13.1%} {lv.any_busy:>6.1%} "
              f"{r['ideal_calls_per_s']:>13,.0f} {target:>18}")
    print("\n  where a slot's time goes, ms per rollout (slot = C * window / rollouts), and the collector's CPU:")
    print(f"  {'concurrency':>11} {'client':<10} {'slot':>8} {'upstream':>9} {'call overhead':>13} {'SDK client':>10} "
          f"{'outside agent':>13} {'agents running':>14} {'CPU cores':>9} {'CPU ms/call':>11}")
    for lv in levels:
        upstream = CALLS_PER_ROLLOUT * lv.upstream_call_s
        overhead = CALLS_PER_ROLLOUT * (lv.agent_call_s - lv.upstream_call_s)
        outside = lv.slot_s_per_rollout - lv.agent_s
        print(f"  {lv.concurrency:>11} {lv.client:<10} {1000 * lv.slot_s_per_rollout:>8.1f} {1000 * upstream:>9.1f} "
              f"{1000 * overhead:>13.1f} {1000 * lv.client_s:>10.1f} {1000 * outside:>13.1f} "
              f"{lv.agents_running:>10.1f}/{lv.concurrency:<3} {lv.cpu_s / lv.window_s:>9.2f} "
              f"{1000 * lv.cpu_s / lv.calls:>11.1f}")
    print("  upstream: its two calls as it timed them; call overhead: the agent's two chat calls minus that (SDK, "
          "proxy render, turn append, waiting for the CPU); SDK client: building the rollout's AsyncOpenAI "
          "(`ctx.openai`, or one on the shared transport); outside agent: slot minus the agent's run (open, task "
          "files, reward, facts lookup, close, scheduling, and slots left empty); agents running: mean agents at "
          "work over the window, of C slots; CPU: this process (all threads) over the window")
    budget = 1000 * latency_s / TARGET_C  # ms of one core per call at which one process can keep C slots full
    print(f"\n  budget: keeping {TARGET_C} slots of a {1000 * latency_s:g} ms upstream full takes "
          f"{TARGET_C / latency_s:,.0f} calls/s, i.e. at most {budget:.1f} ms of CPU per call if the collector had "
          "one core to itself (it shares this machine's cores with the upstream); measured: "
          + ", ".join(f"C={lv.concurrency} {lv.client} {1000 * lv.cpu_s / lv.calls:.1f} ms" for lv in levels))


def print_profile(profile: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).strip_dirs().sort_stats(key).print_stats(top)
        text = out.getvalue()
        print(f"\n  cProfile, top {top} by {key}:")
        print(text[text.find("   ncalls"):].rstrip())


# ---------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,128", help="comma-separated concurrency levels (default 1,16,128)")
    ap.add_argument("--latency-ms", type=float, default=200.0, help="the upstream's fixed response time (default 200)")
    ap.add_argument("--per-slot", type=int, default=4, help="rollouts per concurrency slot (default 4)")
    ap.add_argument("--min-rollouts", type=int, default=32, help="rollouts at least, per level (default 32)")
    ap.add_argument("--shared-client", action="store_true",
                    help="run every level a second time with the agent's OpenAI clients on one shared HTTP transport "
                         "instead of `ctx.openai` (which builds a client, and a TLS context, per rollout)")
    ap.add_argument("--profile", type=int, default=None, metavar="C",
                    help="afterwards, run level C again under cProfile and print where this process's CPU goes")
    ap.add_argument("--profile-top", type=int, default=30, help="functions shown per profile listing (default 30)")
    args = ap.parse_args(argv)
    levels_c = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels_c or min(levels_c) < 1 or args.per_slot < 1 or args.min_rollouts < 1 or args.latency_ms <= 0:
        ap.error("--concurrency needs levels >= 1, --per-slot and --min-rollouts >= 1, --latency-ms > 0")
    latency_s = args.latency_ms / 1000

    from collectors.model.build import ModelSize, init_model

    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="collect-bench-") as name:
        tmp = Path(name)
        model_dir = str(tmp / "model")  # only its tokenizer and chat template are used (the proxy renders with them)
        init_model(model_dir, ModelSize(vocab_size=2048, intermediate_size=128, max_positions=2048), seed=0)
        proc, conn, upstream = start_upstream(model_dir, latency_s)
        try:
            print(f"upstream: fake vLLM /v1/completions in its own process, fixed latency {args.latency_ms:g} ms, "
                  f"every reply {REPLY!r} + <|im_end|>")
            print(f"collector: collectors.collect.runner.collect in this process (its capture proxy appending to a fresh "
                  f"store under {tmp} per level), n 4, {CALLS_PER_ROLLOUT} chat calls per rollout (OpenAI SDK), "
                  f"constant reward, max({args.per_slot} x C, {args.min_rollouts}) rollouts per level")
            print(f"machine: {os.cpu_count()} CPU cores shared by the collector and the upstream (and whatever else "
                  f"runs), load average {os.getloadavg()[0]:.1f} at start")
            for c in levels_c:
                rollouts = max(c * args.per_slot, args.min_rollouts)
                for shared in (False, True) if args.shared_client else (False,):
                    levels.append(asyncio.run(run_level(c, rollouts, upstream=upstream, model_dir=model_dir, tmp=tmp,
                                                        tag="-shared" if shared else "", shared_client=shared)))
            report(levels, latency_s)
            if args.profile is not None:
                profile = cProfile.Profile()
                c = args.profile
                lv = asyncio.run(run_level(c, max(c * args.per_slot, args.min_rollouts), upstream=upstream,
                                           model_dir=model_dir, tmp=tmp, tag="-profiled",
                                           shared_client=args.shared_client, profile=profile))
                print(f"\n  profiled run at concurrency {c} (cProfile slows it): upstream busy {lv.busy:.1%}, "
                      f"{lv.calls / lv.window_s:.1f} calls/s")
                print_profile(profile, args.profile_top)
        finally:
            conn.send("stop")
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    print(f"\ntarget: the collector keeps the upstream at least {TARGET_BUSY:.0%} busy at concurrency {TARGET_C}")
    return [lv.row(latency_s) for lv in levels]


if __name__ == "__main__":
    main()
