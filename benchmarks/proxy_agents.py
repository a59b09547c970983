"""Capture proxy at agent scale: long tool-using sessions resent whole on every call, many at once.

The workload is shaped like coding agents' traces: a session is 20-40 calls (`--turns`); each
call resends the whole conversation so far: a system prompt and a dozen tool schemas, the task,
then every earlier reply (a short text and one tool call) with its tool result. The history
grows evenly to its context size (`--contexts`, default 8k / 32k / 80k tokens of this model's
tokenizer) at the 40th call. Every request body is built and serialized once before the clock
starts and sent as bytes, so the load generator's own CPU stays small. Each session's task and tool
results carry its own tag (numbered as the call is sent), so sessions share only the system prompt and
the tools, as distinct agents do; `--shared-sessions` sends all the very same bodies, as one fan-out
group's sessions (one task, several samples) do. With `--step-tokens`, a session's long starting history
is its own (in its task), not the system prompt.

Three processes: the load generator (this one, aiohttp), `trajstore proxy` (the real command,
its own process, `--workers N` passed through), and a fake policy server that answers at once
or after a fixed delay (`--upstream-ms`):

- POST /v1/completions   what the proxy calls: vLLM's completions from token ids, the request read
                         by the embedded server's own parser (so every option it takes is honoured)
                         and answered in its JSON, streamed too; the reply is always the same text
                         and tool call, the one the next request's history holds;
- POST /v1/chat/completions  what the direct rounds call with the very same bodies (the agent
                         talking to an OpenAI-compatible server with no proxy): the body is decoded,
                         as any server would, and the same reply is answered.

Proxy and direct rounds alternate in one run. Printed side by side:

1. proxy CPU per turn (the proxy's processes' own CPU time from /proc over the turns answered) per
   context size, upstream answering at once, `--cpu-sessions` sessions; again (1b) with every call adding
   the same `--step-tokens` (150) to a session starting from a long history (the cost against the history
   alone); each row also gives the first call's CPU per session (it renders the whole history once) and the
   CPU per turn over the calls after each session's first, the kernel's part and the fake upstream's CPU (it
   shares the two cores); each part includes sealing its own turns into the table (`POST /seal` before each
   reading: see `run_round`); `--cpu-repeats` (3) rounds per context, taken in turns so a slow moment falls on
   every context alike;
2. throughput through the proxy as % of direct, and the added p50 / p99 latency, at each of
   `--sessions` (default 32 / 96 / 192) with the upstream taking `--upstream-ms` (1000), at
   `--throughput-context` (32k);
3. per turn, the wait for the durable commit (median / p99, from the proxy's GET /stats
   `durable_wait` histogram, read before and after each round);
4. other sessions' time to first token (streamed) while one session sends a `--hog-mb` (7) MB
   body, against the same sessions' baseline without it.

Each round ends by closing its rollouts with a reward, as RL episodes end (they stayed open before the eighth
round). Every turn the proxy answered must be in its store afterwards (read back once it has stopped, or it fails).

    python benchmarks/proxy_agents.py                     # all four tables (~10 minutes on 2 cores)
    python benchmarks/proxy_agents.py --quick             # a bounded smoke run (~2 minutes)
    python benchmarks/proxy_agents.py --only cpu --contexts 8000 80000
    python benchmarks/proxy_agents.py --workers 2         # `trajstore proxy --workers 2`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_upstream import MODEL, start_upstream  # the fake policy server, its own process
from agent_workload import Workload, build_workload, hog_body, tool_schemas  # the sessions' bodies

# ---------------------------------------------------------------- the proxy: the real `trajstore proxy` command


TRAJSTORE = [sys.executable, "-c", "from cli.main import main; main()"]  # the `trajstore` command, this Python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proxy_has_workers() -> bool:
    return "--workers" in subprocess.run([*TRAJSTORE, "proxy", "--help"], capture_output=True, text=True, timeout=120,
                                         check=False, cwd=tempfile.gettempdir()).stdout


def start_proxy(model_dir: str, store: str, upstream: str, workers: int | None, log: Path) -> tuple[subprocess.Popen,
                                                                                                     str]:
    port = free_port()
    cmd = [*TRAJSTORE, "proxy", "--upstream", upstream, "--model", model_dir, "--store", store, "--port", str(port), "--model-name", MODEL, "--max-model-len", str(1 << 22)]
    cmd += ["--workers", str(workers)] if workers else []
    # cwd: `python -c` imports from its working directory first; PYTHONPATH alone says which tree is measured
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trajstore proxy exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("trajstore proxy did not listen within 180 s")


def stop_proxy(proc: subprocess.Popen) -> None:
    """SIGINT, as Ctrl-C: the proxy closes its writer, which seals its log into the table."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("trajstore proxy did not stop within 120 s of SIGINT") from None


def tree_cpu_seconds(pid: int | None) -> tuple[float, float]:
    """(user + system CPU, system CPU) of a process and its live descendants (Linux /proc); zeros without one."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    user, system, todo = 0, 0, [pid] if pid else []
    while todo:
        p = todo.pop()
        if p in stats:
            user, system = user + int(stats[p][11]), system + int(stats[p][12])
        todo += children.get(p, [])
    return (user + system) / os.sysconf("SC_CLK_TCK"), system / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- load generation (this process)


@dataclass
class Round:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    seconds: float = 0.0
    proxy_cpu: float = 0.0
    steady_cpu: float = 0.0  # with `steady`: the proxy's CPU over the calls after every session's first
    steady_kernel: float = 0.0  # the part of it spent in the kernel (system time: sockets, writes, fsync)
    steady_turns: int = 0
    steady_upstream: float = 0.0  # the fake upstream's CPU over the same calls (it shares the proxy's cores)
    first_cpu: float = 0.0  # with `steady`: the proxy's CPU over the sessions' first calls, sealing their turns too
    waits: list[int] = field(default_factory=list)  # the durable-wait histogram's counts during the round

    @property
    def turns(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.turns / self.seconds


def session_turns(s: int, lo: int, hi: int) -> int:
    return lo + (s * 7919) % (hi - lo + 1)


async def open_rollouts(http: aiohttp.ClientSession, proxy: str, n: int) -> list[tuple[str, str, str]]:
    async def one() -> tuple[str, str, str]:  # (key, its calls' base URL as an orchestrator hands it over, rollout id)
        async with http.post(proxy + "/rollouts", json={"group_id": "bench"}) as resp:
            body = await resp.json()
            if os.environ.get("PROXY_AGENTS_SHARED_PORT") == "1":  # every call to --port (forwarded between workers)
                return body["api_key"], proxy, body["rollout_id"]
            return body["api_key"], body["base_urls"]["openai"].removesuffix("/v1"), body["rollout_id"]
    return list(await asyncio.gather(*(one() for _ in range(n))))


async def close_rollouts(http: aiohttp.ClientSession, proxy: str, keys: Sequence[str], ids: Sequence[str]) -> None:
    async def one(key: str, rollout_id: str) -> None:
        async with http.post(f"{proxy}/rollouts/{rollout_id}/close", json={"status": "completed", "reward": 1.0},
                             headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"closing rollout {rollout_id} answered {resp.status}: {await resp.text()}")
    await asyncio.gather(*(one(k, r) for k, r in zip(keys, ids, strict=True)))


async def seal(http: aiohttp.ClientSession, proxy: str) -> bool:
    """`POST /seal`: the proxy seals what it appended so far into the table; False for a proxy without the route."""
    async with http.post(proxy + "/seal", json={}) as resp:
        if resp.status == 404:
            return False
        if resp.status != 200:
            raise RuntimeError(f"POST /seal answered {resp.status}: {await resp.text()}")
        return True


async def stats_waits(http: aiohttp.ClientSession, proxy: str) -> list[int]:
    async with http.get(proxy + "/stats") as resp:
        return (await resp.json()).get("durable_wait", {}).get("counts", [])


async def run_round(url: str, load: Workload, sessions: int, turns: tuple[int, int], *, proxy: str, proxied: bool,
                    stream: bool = False, spread_s: float = 0.0, hog: bytes | None = None,
                    pid: int | None = None, steady: bool = False, upstream_pid: int | None = None) -> Round:
    """`sessions` sessions, each its calls one after another; `hog`: one more session sending that body
    over and over until the others are done (its own calls are not counted); `steady`: every session waits
    after its first call until all have made theirs, and the proxy's CPU is also read there, so that the
    calls that extend a session are measured apart from the first, which renders the whole history. Each part
    pays for sealing its own turns into the table: the proxy is asked to seal (`POST /seal`) before the CPU is
    read at the barrier and at the end, so a seal of the first calls' long prompts never lands among the later
    calls, nor one of an earlier round's turns in this round (the proxy seals every 64 MB on its own, which
    otherwise falls on whichever round fills the segment)."""
    rnd = Round()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        keys, bases, rollout_ids = zip(*await open_rollouts(http, proxy, sessions + (hog is not None)))
        urls = [base if proxied else url for base in bases]
        before = await stats_waits(http, proxy)
        route = "/v1/chat/completions"
        done = asyncio.Event()

        async def call(body: bytes, key: str | None, record: bool, to: str) -> None:
            t0 = time.perf_counter()
            first = None
            async with http.post(to + route, data=body,
                                 headers={**headers, **({"Authorization": f"Bearer {key}"} if key else {})}) as resp:
                if stream and resp.status == 200:
                    async for raw in resp.content:
                        if first is None and raw.startswith(b"data: {") and b'"content":"' in raw.replace(b" ", b""):
                            first = time.perf_counter() - t0
                reply = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{route} answered {resp.status}: {reply[:300]!r}")
            if record:
                rnd.latencies.append(time.perf_counter() - t0)
                if first is not None:
                    rnd.ttfts.append(first)

        firsts, resumed = asyncio.Barrier(sessions), asyncio.Event()
        steady_from: list[tuple[float, float, int, float]] = []  # (CPU, system, turns, upstream CPU) after 1st calls
        sealing = steady and await seal(http, proxy)  # what earlier rounds left unsealed is sealed before cpu0

        async def session(s: int) -> None:
            await asyncio.sleep(spread_s * s / sessions)
            for t in range(session_turns(s, *turns)):
                await call(load.body(t, s, stream=stream), keys[s] if proxied else None, True, urls[s])
                if steady and t == 0:
                    if await firsts.wait() == 0:
                        if sealing:  # the first calls' turns are sealed as theirs, before the later calls start
                            await seal(http, proxy)
                        steady_from.append((*tree_cpu_seconds(pid), rnd.turns, tree_cpu_seconds(upstream_pid)[0]))
                        resumed.set()
                    await resumed.wait()

        async def hogging() -> None:
            while not done.is_set():
                await call(hog, keys[-1], False, urls[-1])

        cpu0 = tree_cpu_seconds(pid)
        t0 = time.perf_counter()
        hogger = asyncio.create_task(hogging()) if hog is not None else None
        await asyncio.gather(*(session(s) for s in range(sessions)))
        rnd.seconds = time.perf_counter() - t0
        if sealing:  # the later calls' turns sealed within their part
            await seal(http, proxy)
        cpu1 = tree_cpu_seconds(pid)
        rnd.proxy_cpu = cpu1[0] - cpu0[0]
        if steady_from:
            rnd.first_cpu = steady_from[0][0] - cpu0[0]
            rnd.steady_cpu, rnd.steady_kernel = cpu1[0] - steady_from[0][0], cpu1[1] - steady_from[0][1]
            rnd.steady_turns = rnd.turns - steady_from[0][2]
            rnd.steady_upstream = tree_cpu_seconds(upstream_pid)[0] - steady_from[0][3]
        done.set()
        if hogger is not None:
            await hogger
        after = await stats_waits(http, proxy)
        rnd.waits = [a - b for a, b in zip(after, before)] if before else after
        await close_rollouts(http, proxy, keys, rollout_ids)  # figures read: ends the episodes, frees their state
    return rnd


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def wait_pct(counts: list[int], q: float) -> str:
    if not counts:  # a proxy without the durable_wait histogram in /stats
        return "-"
    from collectors.proxy.waits import percentile_ms
    got = percentile_ms(counts, q)
    return f"{got:.2f}" if got is not None else "-"


async def proxy_stats(proxy: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(proxy + "/stats") as resp:
        return await resp.json()


async def set_delay(upstream: str, **delays: float) -> None:
    async with aiohttp.ClientSession() as http, http.post(upstream + "/bench/delay", json=delays) as resp:
        resp.raise_for_status()


# ---------------------------------------------------------------- the four tables


def table_cpu(args: argparse.Namespace, loads: dict[int, Workload], upstream: str, proxy: str, pid: int,
              upstream_pid: int, title: str = "1. proxy CPU per turn") -> int:
    """The CPU rows, `--cpu-repeats` rounds per context taken in turns (8k, 32k, 80k, 8k, ...), so that a slow
    moment of the machine falls on every context alike; each row gives the median round and the range."""
    asyncio.run(set_delay(upstream, s=0.0))
    repeats = args.cpu_repeats
    print(f"\n{title}: {args.cpu_sessions} sessions of {args.turns[0]}-{args.turns[1]} calls, upstream "
          f"answering at once, {repeats} round{'s' * (repeats > 1)} per context taken in turns"
          f"{', median round (range)' if repeats > 1 else ''}; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'context':>8} {'last prompt':>11} {'added/call':>10} {'turns':>6} {'proxy CPU ms/turn':>20} "
          f"{'1st call ms':>11} {'after the 1st':>20} {'(kernel)':>8} {'upstream':>8} {'turns/s':>8} "
          f"{'durable wait p50 / p99 ms':>26}")
    rounds: dict[int, list[Round]] = {context: [] for context in loads}
    for _ in range(repeats):
        for context, load in loads.items():
            rounds[context].append(asyncio.run(run_round(proxy, load, args.cpu_sessions, tuple(args.turns), proxy=proxy,
                                                         proxied=True, pid=pid, steady=True, upstream_pid=upstream_pid)))
    answered, overall, steady = 0, {}, {}
    for context, got in rounds.items():
        turns = sum(r.turns for r in got)
        answered += turns
        overall[context] = [1000 * r.proxy_cpu / r.turns for r in got]
        steady[context] = [1000 * r.steady_cpu / max(1, r.steady_turns) for r in got]
        waits = [sum(c) for c in zip(*(r.waits for r in got))]
        first = statistics.median(1000 * r.first_cpu / args.cpu_sessions for r in got)  # ms a session's first call
        print(f"  {context:>8,} {loads[context].last_prompt_tokens:>11,} {loads[context].added_tokens:>10,.0f} {turns:>6} "
              f"{spread(overall[context]):>20} {first:>11.1f} "
              f"{spread(steady[context]):>20} "
              f"{statistics.median(1000 * r.steady_kernel / max(1, r.steady_turns) for r in got):>8.2f} "
              f"{statistics.median(1000 * r.steady_upstream / max(1, r.steady_turns) for r in got):>8.2f} "
              f"{statistics.median(r.rate for r in got):>8.1f} {wait_pct(waits, 0.5):>12} / {wait_pct(waits, 0.99):<10}")
    if len(loads) > 1:
        for label, per in (("per turn", overall), ("after the 1st", steady)):
            medians = [statistics.median(v) for v in per.values()]
            lo, hi = min(medians), max(medians)
            print(f"  target: <= 3 ms per turn, flat within 25%; {label} (medians): max {hi:.2f} ms "
                  f"({'met' if hi <= 3 else 'MISSED'}), spread {hi / lo - 1:+.0%} ({'met' if hi <= 1.25 * lo else 'MISSED'})")
    return answered


def spread(values: list[float]) -> str:
    """The median of `values`, and their range when there are several."""
    return (f"{values[0]:.2f}" if len(values) == 1
            else f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")


def table_throughput(args: argparse.Namespace, load: Workload, upstream: str, proxy: str, pid: int) -> int:
    asyncio.run(set_delay(upstream, s=args.upstream_ms / 1000))
    spread = args.upstream_ms / 1000
    print(f"\n2./3. throughput and durable commit: {load.context:,}-token contexts, upstream {args.upstream_ms:g} ms, "
          f"session starts spread over one upstream time; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'sessions':>8} {'path':<7} {'turns':>6} {'p50 ms':>8} {'p99 ms':>8} {'turns/s':>8} {'vs direct':>9} "
          f"{'added p50':>10} {'added p99':>10} {'CPU ms/turn':>11} {'durable wait p50 / p99 ms':>26}")
    answered = 0
    for c in args.sessions:
        got: dict[str, list[Round]] = {"direct": [], "proxy": []}
        for _ in range(args.repeats):  # the paths take turns, so a busy moment of the machine hits both alike
            got["direct"].append(asyncio.run(run_round(upstream, load, c, tuple(args.turns), proxy=proxy,
                                                       proxied=False, spread_s=spread)))
            got["proxy"].append(asyncio.run(run_round(proxy, load, c, tuple(args.turns), proxy=proxy, proxied=True,
                                                      spread_s=spread, pid=pid)))
        answered += sum(r.turns for r in got["proxy"])
        base = None
        for name, rounds in got.items():
            lat = [x for r in rounds for x in r.latencies]
            p50, p99, rate = 1000 * pct(lat, 0.5), 1000 * pct(lat, 0.99), statistics.median(r.rate for r in rounds)
            line = f"  {c:>8} {name:<7} {len(lat):>6} {p50:>8.1f} {p99:>8.1f} {rate:>8.1f}"
            if base is None:
                base = (p50, p99, rate)
                print(line)
                continue
            turns = sum(r.turns for r in rounds)
            waits = [sum(x) for x in zip(*(r.waits for r in rounds))]
            print(f"{line} {rate / base[2]:>9.1%} {p50 - base[0]:>+8.1f}ms {p99 - base[1]:>+8.1f}ms "
                  f"{1000 * sum(r.proxy_cpu for r in rounds) / turns:>11.2f} "
                  f"{wait_pct(waits, 0.5):>12} / {wait_pct(waits, 0.99):<10}")
    print("  targets: >= 97% of direct at 96 sessions, >= 90% at 192 (1 s upstream); durable wait p50 <= 1 ms and "
          "p99 <= 20 ms at 32 sessions")
    return answered


def table_hog(args: argparse.Namespace, load: Workload, upstream: str, proxy: str, pid: int) -> int:
    asyncio.run(set_delay(upstream, s=0.0, first_token_s=0.02, token_s=0.002))
    hog = hog_body(args.hog_mb, 8)
    print(f"\n4. time to first token (streamed) of {args.hog_sessions} sessions ({load.context:,}-token contexts, "
          f"first upstream token after 20 ms), without and with one more session sending a {len(hog) / 1e6:.1f} MB "
          f"body over and over; load average {os.getloadavg()[0]:.1f}")
    print(f"  {'round':<12} {'turns':>6} {'TTFT p50 ms':>12} {'p99 ms':>8} {'added p99':>10}")
    answered, base = 0, None
    spread = 0.05
    for name, body in (("baseline", None), (f"{args.hog_mb:g} MB body", hog)) * args.repeats:
        rnd = asyncio.run(run_round(proxy, load, args.hog_sessions, tuple(args.turns), proxy=proxy, proxied=True,
                                    stream=True, spread_s=spread, hog=body, pid=pid))
        answered += rnd.turns
        p50, p99 = 1000 * pct(rnd.ttfts, 0.5), 1000 * pct(rnd.ttfts, 0.99)
        added = "" if body is None or base is None else f"{p99 - base:>+8.1f}ms"
        base = p99 if body is None else base
        print(f"  {name:<12} {rnd.turns:>6} {p50:>12.1f} {p99:>8.1f} {added:>10}")
    print("  target: other sessions' p99 time to first token at most 50 ms above their baseline")
    return answered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8000, 32000, 80000],
                    help="context sizes in tokens reached at the 40th call (default 8000 32000 80000)")
    ap.add_argument("--turns", type=int, nargs=2, default=[20, 40], metavar=("MIN", "MAX"),
                    help="calls per session, spread evenly over MIN..MAX (default 20 40)")
    ap.add_argument("--cpu-sessions", type=int, default=32, help="sessions of the CPU-per-turn table (default 32)")
    ap.add_argument("--shared-sessions", action="store_true",
                    help="every session sends the very same bodies, as one fan-out group's do (default: each "
                         "session's task and tool results are its own; the system prompt and tools are shared)")
    ap.add_argument("--step-tokens", type=int, default=150,
                    help="table 1b: the CPU per turn again with every call adding about this many tokens, the rest "
                         "of each context in the history a session starts with (default 150; 0: no table 1b)")
    ap.add_argument("--sessions", type=int, nargs="+", default=[32, 96, 192],
                    help="concurrent sessions of the throughput table (default 32 96 192)")
    ap.add_argument("--throughput-context", type=int, default=32000, help="context of the throughput table (32000)")
    ap.add_argument("--upstream-ms", type=float, default=1000.0,
                    help="the upstream's fixed response time in the throughput table (default 1000)")
    ap.add_argument("--hog-mb", type=float, default=7.0, help="the huge body's size in MB (default 7)")
    ap.add_argument("--hog-sessions", type=int, default=32, help="sessions measured beside the huge body (32)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every call (default 256)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per row of tables 2-4 (default 1)")
    ap.add_argument("--cpu-repeats", type=int, default=3,
                    help="rounds per context of tables 1 and 1b, taken in turns (default 3; the median is shown)")
    ap.add_argument("--workers", type=int, help="passed to `trajstore proxy --workers N` when it has that option")
    ap.add_argument("--only", choices=["cpu", "throughput", "hog"], nargs="+", help="run only these tables")
    ap.add_argument("--quick", action="store_true",
                    help="bounded smoke run: 4-8 calls per session, contexts 8000 32000, 16 / 48 sessions, "
                         "300 ms upstream, a 2 MB body")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.contexts, args.sessions, args.upstream_ms = [4, 8], [8000, 32000], [16, 48], 300.0
        args.cpu_sessions, args.hog_sessions, args.hog_mb, args.cpu_repeats = 16, 8, 2.0, 1
    if args.cpu_repeats < 1:
        ap.error("--cpu-repeats needs at least 1 round")
    if args.turns[0] < 1 or args.turns[1] < args.turns[0]:
        ap.error("--turns MIN MAX needs 1 <= MIN <= MAX")
    only = set(args.only or ["cpu", "throughput", "hog"])
    if args.workers and not proxy_has_workers():
        print(f"note: this `trajstore proxy` has no --workers option yet; --workers {args.workers} is ignored and "
              "one proxy process serves")
        args.workers = None

    from transformers import AutoTokenizer

    from collectors.model.build import ModelSize, init_model
    from trajstore import open_store

    with tempfile.TemporaryDirectory(prefix="proxy-agents-") as tmp:
        model_dir = str(Path(tmp) / "model")
        init_model(model_dir, ModelSize(), seed=0)
        tok = AutoTokenizer.from_pretrained(model_dir)
        contexts = sorted(set(args.contexts) | ({args.throughput_context} if "throughput" in only else set())
                          | ({min(args.contexts)} if "hog" in only else set()))
        if args.quick:
            args.throughput_context = 8000
        max_turns = 40 if not args.quick else args.turns[1]
        loads = {c: build_workload(tok, c, max_turns, args.max_tokens, shared=args.shared_sessions) for c in contexts}
        if args.step_tokens and args.step_tokens * max_turns >= min(args.contexts):
            ap.error(f"--step-tokens {args.step_tokens} over {max_turns} calls is more than the smallest context")
        stepped = {c: build_workload(tok, c, max_turns, args.max_tokens, step_tokens=args.step_tokens,
                                         shared=args.shared_sessions)
                   for c in sorted(args.contexts)} if args.step_tokens and "cpu" in only else {}
        print(f"workload: sessions of {args.turns[0]}-{args.turns[1]} calls, each resending the whole history (a "
              f"system prompt, {len(tool_schemas())} tool schemas, one tool call and its result per earlier call); "
              "bodies prebuilt; every reply is one text and tool call; "
              + ("every session sends the same bodies (--shared-sessions)" if args.shared_sessions else
                 "each session's task and tool results its own, the system prompt and tools shared"))
        print(f"machine: {os.cpu_count()} CPU cores shared by the load generator, the proxy and the fake upstream; "
              f"load average {os.getloadavg()[0]:.1f} at start")
        up_proc, up_conn, upstream = start_upstream(model_dir)
        store = str(Path(tmp) / "store")
        proxy_proc, proxy = start_proxy(model_dir, store, upstream, args.workers, Path(tmp) / "proxy.log")
        print(f"proxy: `trajstore proxy{f' --workers {args.workers}' if args.workers else ''}` (pid {proxy_proc.pid})")
        answered = 0
        try:  # the tables; then what the proxy counted: every turn should continue its segment (no forks)
            if "cpu" in only:
                answered += table_cpu(args, {c: loads[c] for c in sorted(args.contexts)}, upstream, proxy,
                                      proxy_proc.pid, up_proc.pid)
                if stepped:
                    answered += table_cpu(args, stepped, upstream, proxy, proxy_proc.pid, up_proc.pid, title=(
                        f"1b. the same, every call adding about {args.step_tokens:,} tokens to a long starting history"))
            if "throughput" in only:
                answered += table_throughput(args, loads[args.throughput_context], upstream, proxy, proxy_proc.pid)
            if "hog" in only:
                answered += table_hog(args, loads[min(args.contexts)], upstream, proxy, proxy_proc.pid)
            counted = asyncio.run(proxy_stats(proxy))
            print(f"\nproxy /stats: turns {counted['turns']}, histories {counted['history']}, forks {counted['forks']}, "
                  f"calls sent as a held prefix {counted.get('prompt_prefix', 'n/a')}")
        finally:
            stop_proxy(proxy_proc)
            up_conn.send("stop")
            up_proc.join(30)
        stored = open_store(store).query("SELECT count(*) AS n FROM events WHERE kind = 'turn'").to_pylist()[0]["n"]
        print(f"\nstore: {stored} turn events read back after the proxy stopped; {answered} counted calls answered "
              "(plus the huge-body calls)")
        if stored < answered:
            raise SystemExit(f"the store holds {stored} turns but {answered} calls were answered")


if __name__ == "__main__":
    main()
