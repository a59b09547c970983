"""A policy-server outage during `trajstore collect`: how many rollouts fail, how many groups stay incomplete.

A real `trajstore serve` (a tiny model made by `trajstore init-model`) runs as its own process; a
real `trajstore collect --server URL` collects from it (n = 4 rollouts per task, each rollout a
few model calls with a pause between them, a constant reward). After `--warmup` seconds the
server is killed with SIGKILL, stays down `--down` seconds, and is restarted on the same port.
When collect ends (or `--limit` passes) the store is read:

- failed: rollout attempts that ended `failed` (each one an attempt burnt by the outage);
- incomplete: groups with fewer than n usable rollouts;
- how long collect ran, and its exit status.

    python benchmarks/outage.py                      # about 2 minutes on 2 shared CPU cores
    python benchmarks/outage.py --down 20 --tasks 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
N = 4


async def agent(task: dict[str, Any], ctx: Any) -> str:
    """A few model calls with a pause between them: a rollout lasts a second or two, so an outage meets many."""
    import asyncio

    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    text = ""
    for _ in range(3):
        reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages, max_tokens=ctx.max_tokens,
                                                         **ctx.sampling)
        text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        await asyncio.sleep(0.3)
    return text


def reward(task: dict[str, Any], result: Any, rollout: Any) -> float:
    return 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def serve(model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--device", "cpu"], cwd=REPO, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not healthy(f"http://127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start; see {log}")
        time.sleep(0.2)
    return proc


def measure(store: Path, run: str) -> dict[str, int]:
    from trajstore import open_store

    if not store.is_dir():
        return {"usable": 0}
    rows = open_store(store).query("""
        SELECT count(*) FILTER (WHERE status = 'failed') AS failed,
               count(*) FILTER (WHERE status = 'aborted') AS aborted,
               count(*) FILTER (WHERE trainable) AS usable,
               count(DISTINCT group_id) AS groups,
               count(DISTINCT group_id) FILTER (WHERE group_id IN (
                   SELECT group_id FROM rollouts WHERE run = $run GROUP BY group_id
                   HAVING count(*) FILTER (WHERE trainable) < $n)) AS incomplete
        FROM rollouts WHERE run = $run""", {"run": run, "n": N}).to_pylist()[0]
    return {k: int(v or 0) for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=40, help="tasks (groups of 4)")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of collection before the kill")
    parser.add_argument("--down", type=float, default=20.0, help="seconds the server stays down")
    parser.add_argument("--limit", type=float, default=240.0, help="most seconds collect may run")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="trajstore-outage-"))
    model, store, log = root / "model", root / "store", root / "serve.log"
    subprocess.run([sys.executable, "-m", "cli.main", "init-model", str(model), "--vocab-size", "2048",
                    "--heads", "4", "--kv-heads", "2", "--intermediate-size", "128", "--max-positions", "2048"],
                   cwd=REPO, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n" for i in range(args.tasks)))
    port = free_port()
    server = serve(model, port, log)
    collect = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "collect", "--store", str(store), "--run", "outage", "--tasks", str(tasks),
         "--server", f"http://127.0.0.1:{port}", "--model", str(model), "--n", str(N), "--max-tokens", "16",
         "--concurrency", str(args.concurrency), "--agent", "benchmarks.outage:agent",
         "--reward", "benchmarks.outage:reward", "--rollout-timeout", "120", "--plain", "--workdir", str(root / "work")],
        cwd=REPO, stdout=(root / "collect.log").open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    started = time.monotonic()
    try:
        while measure(store, "outage")["usable"] < 2 * N:  # collecting, not still starting up
            if collect.poll() is not None or time.monotonic() - started > args.limit:
                raise SystemExit(f"collect did not get going; see {root / 'collect.log'}")
            time.sleep(0.5)
        started = time.monotonic()
        time.sleep(args.warmup)
        server.send_signal(signal.SIGKILL)
        server.wait()
        print(f"server killed at {time.monotonic() - started:.1f} s; down for {args.down:g} s", flush=True)
        time.sleep(args.down)
        server = serve(model, port, log)
        print(f"server back at {time.monotonic() - started:.1f} s", flush=True)
        try:
            code: int | str = collect.wait(timeout=max(args.limit - (time.monotonic() - started), 1))
        except subprocess.TimeoutExpired:
            collect.send_signal(signal.SIGINT)
            collect.wait(timeout=120)
            code = f"stopped at the {args.limit:g} s limit"
    finally:
        for proc in (collect, server):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    elapsed = time.monotonic() - started
    counts = measure(store, "outage")
    print(f"collect ran {elapsed:.0f} s after its first rollouts (exit {code}); {args.tasks} groups of {N}, outage {args.down:g} s")
    print(f"failed rollouts {counts['failed']}, aborted {counts['aborted']}, usable {counts['usable']}; "
          f"groups incomplete {counts['incomplete']} of {counts['groups']}")
    print(f"logs: {root}")


if __name__ == "__main__":
    main()
