"""Capture proxy overhead: latency and throughput through the proxy versus the policy server directly.

The upstream is a fake vLLM-style policy server with a fixed response time: POST
/v1/completions sleeps, then answers a fixed list of token ids in exactly the response JSON
the embedded server gives (built with `collectors.embedded.protocol`: `token_ids`,
`prompt_token_ids` echoed, `logprobs.token_logprobs`, `policy_version`, the X-Policy-Version
header). It runs at each `--upstream-ms` in turn: 50 ms (a fast server, where this machine's
CPU is the limit) and 1000 ms (about what a real policy takes for a reply of this length).
C sessions run T calls each, one after another:

- direct   POST /v1/completions with the conversation's token ids (precomputed: the rendered
           conversation so far, as the proxy sends it), `return_token_ids`, `logprobs: 0`;
- proxied  one rollout per session (POST /rollouts, before the clock starts), then POST
           /v1/chat/completions with the growing multi-turn `messages`. The proxy renders the
           template, samples upstream with token ids, parses the reply and appends a durable
           `turn` event (fsync) to a real store in a temporary directory on local disk; the
           store is read back afterwards and must hold every turn;
- bare hop the direct calls through `serve_passthrough`, an aiohttp server that forwards the body
           and answers with the upstream's: what one more aiohttp hop costs here, the floor under
           any proxy written this way.

Every path uses the same client: one aiohttp session with an unlimited connection pool in this
process. The upstream, the proxy and the bare hop each run in a process of their own, so none
shares an event loop or the GIL with the load generator. On a 2-core machine the client, the
middle process and the upstream still share two cores: the proxy's CPU time per call is taken
from the client and the upstream too, and is printed beside the latencies (from /proc, so
Linux only). Session starts are spread
over one upstream response time (`--lockstep` starts them together; with a fixed response
time they then stay in step and every call of a round reaches the proxy in one burst).

Added latency = a path's percentile minus direct's; throughput = calls answered per second of wall
time. Rounds take the paths in turn; latencies of all rounds are pooled, the throughput
is the median round.

Time to first token (TTFT), streamed, at 1 and 64 sessions (`--ttft-sessions`): the fake
upstream also streams (`stream: true`: vLLM's CompletionStreamResponse, one event per token,
the first after `--first-token-ms`, then one every `--token-ms`). Direct: the time until the
first event carrying a token id; proxied: POST /v1/chat/completions with `stream: true`, the
time until the first chunk carrying content (the proxy streams from the upstream, so that is
the first sampled token, rendered, parsed and forwarded). Both paths take turns, as above.

    python benchmarks/proxy.py                      # ~4 minutes
    python benchmarks/proxy.py --quick              # ~1 minute
    python benchmarks/proxy.py --only ttft          # the TTFT table only (~30 s)
    python benchmarks/proxy.py --upstream-ms 200 --turns 6 --concurrency 64 256 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import aiohttp  # noqa: E402

MODEL = "bench"
REPLY = "Sure. The answer is forty-two, and here is a short explanation of why that is."
QUESTIONS = ["What is the answer?", "Why is that?", "Can you say more?", "And then?", "Is that all?",
             "Give an example.", "Summarize it.", "Thanks, anything else?"]


# ---------------------------------------------------------------- the fake upstream (its own process)


def upstream_app(model_dir: str, delay_s: float, first_token_s: float = 0.02, token_s: float = 0.005) -> Any:
    """A vLLM-style /v1/completions that sleeps `delay_s` and samples REPLY + <|im_end|> every time; streamed
    (`stream: true`), its first token comes after `first_token_s` and each next one `token_s` later."""
    from aiohttp import web
    from transformers import AutoTokenizer

    from collectors.embedded.engine import Completion
    from collectors.embedded.protocol import CompletionJob, completion_response
    from collectors.policy import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(REPLY, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    logprobs = [-0.5 - 0.01 * i for i in range(len(ids))]
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in ids}

    def answer(prompt: list[int]) -> dict[str, Any]:
        result = Completion(prompt_ids=prompt, output_ids=ids, logprobs=logprobs, top_logprobs=None, text=REPLY,
                            finish_reason="stop", stop_reason=None, policy_version=0)
        job = CompletionJob(prompt=prompt, params=SamplingParams(logprobs=0), return_token_ids=True, model=None)
        return completion_response(job, result, model_name=MODEL, decode_one=texts.__getitem__)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            return await stream(request, body["prompt"])
        await asyncio.sleep(delay_s)
        return web.json_response(answer(body["prompt"]), headers={"X-Policy-Version": "0"})

    async def stream(request: web.Request, prompt: list[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Policy-Version": "0"})
        await resp.prepare(request)
        await asyncio.sleep(first_token_s)
        for i, token in enumerate(ids):
            if i:
                await asyncio.sleep(token_s)
            last = i == len(ids) - 1
            choice: dict[str, Any] = {
                "index": 0, "text": texts[token] if not last else "", "token_ids": [token],
                "logprobs": {"token_logprobs": [logprobs[i]], "tokens": [texts[token]], "text_offset": [0],
                             "top_logprobs": [{texts[token]: logprobs[i]}]},
                "finish_reason": "stop" if last else None, "stop_reason": None}
            if i == 0:
                choice["prompt_token_ids"] = prompt
            event = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [choice], "policy_version": 0}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def serve_upstream(model_dir: str, delay_s: float, first_token_s: float, token_s: float, conn: Connection) -> None:
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(upstream_app(model_dir, delay_s, first_token_s, token_s), access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, backlog=1024).start()
        conn.send(f"http://127.0.0.1:{sock.getsockname()[1]}")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await runner.cleanup()

    asyncio.run(main())


# ---------------------------------------------------------------- the proxy (its own process)


def serve_proxy(model_dir: str, store_dir: str, upstream: str, conn: Connection) -> None:
    from collectors.policy import EmbeddedClient
    from collectors.proxy.app import ProxyConfig, start_proxy
    from trajstore import open_store

    async def main() -> None:
        config = ProxyConfig(model_dir=model_dir, run="bench", model_names=(MODEL,))
        runner, url = await start_proxy(lambda: EmbeddedClient(upstream), open_store(store_dir), config)
        conn.send(url)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await runner.cleanup()  # closes the writer: seals the write-ahead log into the table

    asyncio.run(main())


def serve_passthrough(upstream: str, conn: Connection) -> None:
    """The floor of any proxy here: an aiohttp server that forwards each body upstream, untouched."""
    from aiohttp import web

    async def main() -> None:
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def forward(request: web.Request) -> web.Response:
            async with http.post(upstream + request.path, data=await request.read(),
                                 headers={"Content-Type": "application/json"}) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock, backlog=1024).start()
        conn.send(f"http://127.0.0.1:{sock.getsockname()[1]}")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await runner.cleanup()
        await http.close()

    asyncio.run(main())


def start(target: Any, *args: Any) -> tuple[mp.Process, Connection, str]:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise RuntimeError(f"{target.__name__} did not start within 120 s")
    return proc, parent, parent.recv()


def stop(proc: mp.Process, conn: Connection) -> None:
    conn.send("stop")
    proc.join(60)
    if proc.exitcode != 0:
        raise RuntimeError(f"process {proc.name} exited with {proc.exitcode}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- load generation (this process)


@dataclass
class Round:
    latencies: list[float] = field(default_factory=list)
    calls: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the round

    @property
    def rate(self) -> float:
        return self.calls / self.seconds


def conversation(turns: int) -> list[list[dict[str, str]]]:
    """The messages of each turn: turn t sends t questions and the t - 1 replies before them."""
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    out = []
    for t in range(turns):
        history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        out.append(list(history))
        history.append({"role": "assistant", "content": REPLY})
    return out


def direct_prompts(model_dir: str, turns: list[list[dict[str, str]]]) -> list[list[int]]:
    """The token ids the proxy sends upstream for each turn (the sampled reply re-renders to the same ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for m in turns]


async def run_round(url: str, sessions: int, *, proxied: bool, turns: list[list[dict[str, str]]],
                    prompts: list[list[int]], keys: list[str], max_tokens: int, spread_s: float = 0.0) -> Round:
    """`sessions` concurrent sessions of len(turns) calls each, their starts spread evenly over `spread_s`;
    returns every call's latency."""
    result = Round()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def call(route: str, body: dict[str, Any], headers: dict[str, str] | None) -> None:
            t0 = time.perf_counter()
            async with http.post(url + route, json=body, headers=headers) as resp:
                reply = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{route} answered {resp.status}: {reply[:300]!r}")
            result.latencies.append(time.perf_counter() - t0)
            json.loads(reply)  # as an SDK would

        async def session(s: int) -> None:
            await asyncio.sleep(spread_s * s / sessions)
            for t in range(len(turns)):
                if proxied:
                    await call("/v1/chat/completions", {"model": MODEL, "messages": turns[t], "max_tokens": max_tokens},
                               {"Authorization": f"Bearer {keys[s]}"})
                else:
                    await call("/v1/completions", {"model": MODEL, "prompt": prompts[t], "max_tokens": max_tokens,
                                                   "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop": [],
                                                   "logprobs": 0, "return_token_ids": True}, None)

        t0 = time.perf_counter()
        await asyncio.gather(*(session(s) for s in range(sessions)))
        result.seconds = time.perf_counter() - t0
    result.calls = len(result.latencies)
    return result


async def open_rollouts(proxy: str, n: int, group: str) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async def one() -> str:
            async with http.post(proxy + "/rollouts", json={"group_id": group}) as resp:
                return (await resp.json())["api_key"]
        return list(await asyncio.gather(*(one() for _ in range(n))))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


PATHS = ("direct", "bare hop", "proxied")  # the bare hop: serve_passthrough, the cost of any extra aiohttp server


@dataclass
class Row:
    """One (upstream time, sessions) cell: the rounds of each path."""

    upstream_ms: float
    sessions: int
    rounds: dict[str, list[Round]] = field(default_factory=lambda: {p: [] for p in PATHS})


def measure(model_dir: str, store_dir: str, upstream_ms: float, args: argparse.Namespace,
            turns: list[list[dict[str, str]]], prompts: list[list[int]]) -> tuple[list[Row], int, int]:
    """Every concurrency level against one upstream; returns the rows, turns answered and turns stored."""
    from trajstore import open_store

    up_proc, up_conn, upstream = start(serve_upstream, model_dir, upstream_ms / 1000, 0.02, 0.005)
    hop_proc, hop_conn, hop = start(serve_passthrough, upstream)
    px_proc, px_conn, proxy = start(serve_proxy, model_dir, store_dir, upstream)
    paths = {"direct": (upstream, None), "bare hop": (hop, hop_proc.pid), "proxied": (proxy, px_proc.pid)}
    rows, answered = [], 0
    spread_s = 0.0 if args.lockstep else upstream_ms / 1000
    for c in args.concurrency:
        warm = asyncio.run(open_rollouts(proxy, c, f"warm-{c}"))
        for url, _ in paths.values():  # connections, first renders
            asyncio.run(run_round(url, c, proxied=url == proxy, turns=turns[:1], prompts=prompts, keys=warm,
                                  max_tokens=args.max_tokens))
        answered += c
        row = Row(upstream_ms, c)
        for r in range(args.repeats):  # round robin, so a busy moment of the machine hits every path alike
            keys = asyncio.run(open_rollouts(proxy, c, f"c{c}-r{r}"))
            for name, (url, middle) in paths.items():
                pids = {"client": os.getpid(), "upstream": up_proc.pid, **({"middle": middle} if middle else {})}
                before = {n: cpu_seconds(pid) for n, pid in pids.items()}
                rnd = asyncio.run(run_round(url, c, proxied=url == proxy, turns=turns, prompts=prompts, keys=keys,
                                            max_tokens=args.max_tokens, spread_s=spread_s))
                rnd.cpu = {n: cpu_seconds(pid) - before[n] for n, pid in pids.items()}
                row.rounds[name].append(rnd)
            answered += row.rounds["proxied"][-1].calls
        rows.append(row)
    stop(px_proc, px_conn)  # closes the writer, which seals its log into the table
    stop(hop_proc, hop_conn)
    stop(up_proc, up_conn)
    stored = open_store(store_dir).query("SELECT count(*) AS n FROM events WHERE kind = 'turn'").to_pylist()[0]["n"]
    return rows, answered, stored


def report(rows: list[Row]) -> None:
    print(f"\n  {'upstream':>8} {'sessions':>8} {'path':<9} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>8} "
          f"{'added p50':>10} {'added p99':>10} {'throughput':>10}   CPU us/call: client / middle / upstream")
    verdicts = []
    for row in rows:
        base: tuple[float, float, float] = (0.0, 0.0, 1.0)
        for name, rounds in row.rounds.items():
            lat = [x for r in rounds for x in r.latencies]
            calls = sum(r.calls for r in rounds)
            # /proc counts CPU in 10 ms ticks: per-call figures need a few hundred calls to mean anything
            cpu = {n: f"{1e6 * sum(r.cpu[n] for r in rounds) / calls:,.0f}" if calls >= 200 else "~"
                   for n in rounds[0].cpu}
            p50, p99, rate = 1000 * pct(lat, 0.5), 1000 * pct(lat, 0.99), statistics.median(r.rate for r in rounds)
            line = f"  {row.upstream_ms:>6g}ms {row.sessions:>8} {name:<9} {calls:>6} {p50:>8.2f} {p99:>8.2f} {rate:>8,.0f}"
            if name == "direct":
                base = (p50, p99, rate)
                line += f" {'':>10} {'':>10} {'':>10}"
            else:
                line += f" {p50 - base[0]:>+7.2f} ms {p99 - base[1]:>+7.2f} ms {rate / base[2]:>10.1%}"
            print(f"{line}   {cpu['client']:>6} / {cpu.get('middle', '-'):>6} / {cpu['upstream']:>5}")
            if name == "proxied":
                added, share = p50 - base[0], rate / base[2]
                offered = row.sessions / (row.upstream_ms / 1000)
                verdicts.append(f"{row.upstream_ms:g} ms upstream, {row.sessions} sessions (offered {offered:,.0f} "
                                f"calls/s, direct served {base[2]:,.0f}): added p50 {added:+.2f} ms "
                                f"({'met' if added <= 1 else 'MISSED'}), throughput {share:.1%} "
                                f"({'met' if share >= 0.95 else 'MISSED'})")
    print("\ntargets (capture proxy against direct): added p50 <= 1 ms, throughput >= 95% of direct")
    for v in verdicts:
        print("  " + v)


# ---------------------------------------------------------------- time to first token, streamed


async def ttft_round(url: str, sessions: int, *, proxied: bool, turns: list[list[dict[str, str]]],
                     prompts: list[list[int]], keys: list[str], max_tokens: int, spread_s: float) -> list[float]:
    """Every streamed call's time to its first token (direct) or first content chunk (proxied)."""
    out: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def call(route: str, body: dict[str, Any], headers: dict[str, str] | None) -> None:
            t0, first = time.perf_counter(), None
            async with http.post(url + route, json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{route} answered {resp.status}: {(await resp.read())[:300]!r}")
                async for raw in resp.content:
                    line = raw.strip()
                    if first is not None or not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    choice = (event.get("choices") or [{}])[0]
                    if (choice.get("delta") or {}).get("content") if proxied else choice.get("token_ids"):
                        first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError(f"{route} streamed no token")
            out.append(first)

        async def session(s: int) -> None:
            await asyncio.sleep(spread_s * s / sessions)
            for t in range(len(turns)):
                if proxied:
                    await call("/v1/chat/completions", {"model": MODEL, "messages": turns[t], "max_tokens": max_tokens,
                                                        "stream": True}, {"Authorization": f"Bearer {keys[s]}"})
                else:
                    await call("/v1/completions", {"model": MODEL, "prompt": prompts[t], "max_tokens": max_tokens,
                                                   "stream": True, "logprobs": 0, "return_token_ids": True}, None)

        await asyncio.gather(*(session(s) for s in range(sessions)))
    return out


def measure_ttft(model_dir: str, store_dir: str, args: argparse.Namespace, turns: list[list[dict[str, str]]],
                 prompts: list[list[int]]) -> None:
    first_s, token_s = args.first_token_ms / 1000, args.token_ms / 1000
    up_proc, up_conn, upstream = start(serve_upstream, model_dir, 0.0, first_s, token_s)
    px_proc, px_conn, proxy = start(serve_proxy, model_dir, store_dir, upstream)
    reply_s = first_s + token_s * 20
    print(f"\ntime to first token, streamed: upstream's first token after {args.first_token_ms:g} ms, then one every "
          f"{args.token_ms:g} ms; {args.turns} calls per session, starts spread over {reply_s * 1000:.0f} ms; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'sessions':>8} {'path':<8} {'calls':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'added p50':>10} "
          f"{'proxy CPU us/call':>12}")
    verdicts = []
    for c in args.ttft_sessions:
        warm = asyncio.run(open_rollouts(proxy, c, f"ttft-warm-{c}"))
        asyncio.run(ttft_round(proxy, c, proxied=True, turns=turns[:1], prompts=prompts, keys=warm,
                               max_tokens=args.max_tokens, spread_s=0))
        got: dict[str, list[float]] = {"direct": [], "proxied": []}
        proxy_cpu = 0.0
        for r in range(args.repeats):
            keys = asyncio.run(open_rollouts(proxy, c, f"ttft-{c}-{r}"))
            for name, url in (("direct", upstream), ("proxied", proxy)):
                before = cpu_seconds(px_proc.pid)
                got[name] += asyncio.run(ttft_round(url, c, proxied=name == "proxied", turns=turns, prompts=prompts,
                                                    keys=keys, max_tokens=args.max_tokens, spread_s=reply_s))
                proxy_cpu += (cpu_seconds(px_proc.pid) - before) * (name == "proxied")
        base = 1000 * pct(got["direct"], 0.5)
        for name, lat in got.items():
            p50 = 1000 * pct(lat, 0.5)
            added = f"{p50 - base:>+7.2f} ms" if name == "proxied" else ""
            # /proc counts CPU in 10 ms ticks: per-call figures need a few hundred calls to mean anything
            cpu = f"{1e6 * proxy_cpu / len(lat):,.0f}" if name == "proxied" and len(lat) >= 200 else "~"
            print(f"  {c:>8} {name:<8} {len(lat):>6} {p50:>8.2f} {1000 * pct(lat, 0.9):>8.2f} "
                  f"{1000 * pct(lat, 0.99):>8.2f} {added:>10} {cpu:>12}")
        added_p50 = 1000 * pct(got["proxied"], 0.5) - base
        verdicts.append(f"{c} session(s): TTFT added p50 {added_p50:+.2f} ms"
                        + (f" ({'met' if added_p50 <= 5 else 'MISSED'} the 5 ms target)" if c == 1 else ""))
    stop(px_proc, px_conn)
    stop(up_proc, up_conn)
    print("target (streamed, 1 session): time to first token within 5 ms of direct")
    for v in verdicts:
        print("  " + v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256],
                    help="concurrent sessions (default 1 64 256; 1 shows the cost of one call through an idle proxy)")
    ap.add_argument("--upstream-ms", type=float, nargs="+", default=[50.0, 1000.0],
                    help="the upstream's fixed response times, one run each (default 50 1000)")
    ap.add_argument("--turns", type=int, default=6, help="calls per session, a growing conversation (default 6)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every call (default 64)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per row, the paths taking turns (default 2)")
    ap.add_argument("--lockstep", action="store_true",
                    help="start all sessions at the same moment (the worst case: with a fixed upstream time they stay "
                         "in step, so every call of a round reaches the proxy in one burst); by default their starts "
                         "are spread over one upstream response time, as agents whose calls take different times are")
    ap.add_argument("--quick", action="store_true", help="short run: 3 turns, 1 round")
    ap.add_argument("--ttft-sessions", type=int, nargs="+", default=[1, 64],
                    help="concurrent sessions of the time-to-first-token table (default 1 64)")
    ap.add_argument("--first-token-ms", type=float, default=20.0, help="the streamed upstream's first token (20)")
    ap.add_argument("--token-ms", type=float, default=5.0, help="the streamed upstream's time per token (5)")
    ap.add_argument("--only", choices=["latency", "ttft"], help="run one of the two measurements")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.repeats = 3, 1

    from collectors.model.build import ModelSize, init_model

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        model_dir = str(Path(tmp) / "model")
        init_model(model_dir, ModelSize(), seed=0)
        turns = conversation(args.turns)
        prompts = direct_prompts(model_dir, turns)
        if args.only == "ttft":
            args.upstream_ms = []
        print(f"upstream: fake vLLM /v1/completions (the embedded server's response JSON), fixed response time "
              f"{' and '.join(f'{ms:g} ms' for ms in args.upstream_ms)}; every reply {REPLY!r} + <|im_end|>")
        starts = "all at once (--lockstep)" if args.lockstep else "starts spread over one upstream response time"
        print(f"sessions: {args.turns} calls each, a growing conversation (prompts {len(prompts[0])}-{len(prompts[-1])} "
              f"tokens), max_tokens {args.max_tokens}, {starts}; {args.repeats} round(s) per row, the paths taking turns")
        print("processes: load generator (aiohttp, this process) | middle: the capture proxy (own process and event "
              f"loop, appending to a store under {tmp}) or the bare hop (own process) | upstream (own process)")
        print(f"machine: {os.cpu_count()} CPU cores shared by the client, the middle and the upstream, load average "
              f"{os.getloadavg()[0]:.1f} at start")
        for ms in args.upstream_ms:
            store_dir = str(Path(tmp) / f"store-{ms:g}ms")
            got, answered, stored = measure(model_dir, store_dir, ms, args, turns, prompts)
            print(f"store ({ms:g} ms run): {stored} turn events read back after the proxy closed, "
                  f"{answered} calls answered")
            if stored != answered:
                raise SystemExit(f"the store holds {stored} turns but {answered} calls were answered")
            rows += got
        if rows:
            report(rows)
        if args.only != "latency":
            measure_ttft(model_dir, str(Path(tmp) / "store-ttft"), args, turns, prompts)


if __name__ == "__main__":
    main()
