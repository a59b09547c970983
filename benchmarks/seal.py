"""Sealing a writer's segment into Parquet: from the batches the writer kept, against reading the segment again.

A writer seals the batches it wrote from memory (`trajstore.writer`: it keeps each segment's batches until the
segment is sealed); a segment left by an earlier process, or one whose seal failed, is read from disk and its
checksums verified first (`trajstore.wal.read_segment`), as every seal did before. Both write the same Parquet
file and commit it. Here the same turns, shaped like the capture proxy's (one append per call: a request delta
of a few kB, the new prompt ids, 256 output ids with their logprobs), are appended to two stores, and each
store's segment is sealed one way; CPU time of the sealing thread, rounds alternated, median shown.

    python benchmarks/seal.py                  # 1,344 appends of ~31 kB, 3 rounds (~1 minute)
    python benchmarks/seal.py --appends 256 --rounds 1
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import trajstore
from trajstore.writer import seal_segments

VOCAB = 151_936


def make_turns(n: int, request_bytes: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(4096)]
    turns = []
    for i in range(n):
        text = " ".join(rng.choice(words, request_bytes // 6))[:request_bytes]
        turns.append({
            "kind": "turn", "event_id": trajstore.new_id("e-"), "run": "bench", "group_id": f"g-{i // 256}",
            "rollout_id": f"r-{i // 32}", "segment_id": f"s-{i // 32}", "turn_index": i % 32, "policy_version": 0,
            "prompt_ids": rng.integers(0, VOCAB, 400, dtype=np.int32).tolist(),
            "output_ids": rng.integers(0, VOCAB, 256, dtype=np.int32).tolist(),
            "output_logprobs": (-rng.exponential(0.7, 256)).astype(np.float32).tolist(),
            "finish_reason": "stop", "request": f'{{"messages": [{{"role": "tool", "content": "{text}"}}]}}',
        })
    return turns


def seal_once(root: Path, turns: list[dict[str, Any]], from_memory: bool) -> tuple[float, int]:
    """(thread CPU seconds of the seal, bytes of the segment) for one store holding `turns`."""
    store = trajstore.open_store(root)
    writer = store.writer("w", seal_bytes=1 << 40, seal_interval=1e6)
    for turn in turns:
        writer.append([turn])
    with writer._io:  # noqa: SLF001 - the segment is closed as a seal would, and sealed here, timed alone
        writer._rotate()  # noqa: SLF001
        segments, writer._closed_segments = writer._closed_segments, []  # noqa: SLF001
    size = sum(p.stat().st_size for p in segments)
    kept = writer._kept if from_memory else None  # noqa: SLF001
    start = time.thread_time()
    result = seal_segments(writer.table, writer.name, segments, expected=writer._sealed_seq, kept=kept)  # noqa: SLF001
    cpu = time.thread_time() - start
    writer._sealed_seq = result.sealed_seq  # noqa: SLF001
    writer._kept.clear()  # noqa: SLF001
    writer.close()
    if result.events != len(turns) or store.query("SELECT count(*) AS n FROM events").to_pylist() != [{"n": len(turns)}]:
        raise SystemExit(f"the seal committed {result.events} of {len(turns)} events")
    return cpu, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--appends", type=int, default=1344, help="turns appended, one per append (default 1344)")
    ap.add_argument("--request-bytes", type=int, default=26_000, help="each turn's request text (default 26000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each sealing both ways (default 3)")
    args = ap.parse_args()
    if args.appends < 1 or args.rounds < 1 or args.request_bytes < 0:
        ap.error("--appends and --rounds need at least 1, --request-bytes at least 0")
    turns = make_turns(args.appends, args.request_bytes)
    times: dict[bool, list[float]] = {True: [], False: []}
    size = 0
    with tempfile.TemporaryDirectory() as tmp:
        seal_once(Path(tmp) / "warm", turns[:16], True)  # the process's first seal pays one-off costs: not counted
        for r in range(args.rounds):
            for from_memory in ((True, False) if r % 2 == 0 else (False, True)):
                root = Path(tmp) / f"s{r}-{int(from_memory)}"
                cpu, size = seal_once(root, turns, from_memory)
                times[from_memory].append(cpu)
                shutil.rmtree(root)
    memory, disk = statistics.median(times[True]), statistics.median(times[False])
    print(f"one segment of {args.appends:,} appends, {size / 1e6:.1f} MB; seal CPU (thread), median of {args.rounds}")
    print(f"  read from disk and verified   {disk:7.3f} s   (rounds: {', '.join(f'{t:.3f}' for t in times[False])})")
    print(f"  the writer's kept batches     {memory:7.3f} s   (rounds: {', '.join(f'{t:.3f}' for t in times[True])})")
    print(f"  ratio                         {disk / memory:7.2f}x")


if __name__ == "__main__":
    main()
