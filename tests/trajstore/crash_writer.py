"""Child process of the crash and concurrency tests: a real writer (or compactor) to kill.

    python crash_writer.py append STORE NAME ACKS '{"resend_from": 0, "seal_bytes": 4000, ...}'
    python crash_writer.py compact STORE ACKS '{"target_bytes": 40000}'

`append` opens writer NAME and appends one rollout per call (batch `b`: its turns, a reward
and a status, all with client-chosen event_ids from `make_batch`), from `resend_from` on,
until killed or until batch `stop`. A client restarted after a crash re-sends what it is
not sure of: the test passes a `resend_from` a few batches before the first one never
acknowledged. Options: seal_bytes, seal_interval, seal_every (explicit `seal()` after every
n-th batch, announced by a `sealing` line so the parent can aim a kill into it), go (a path
to wait for after opening, so that many writers start appending at once).

Each call's AppendResult is written to ACKS as one JSON line only *after* `append`
returned, so ACKS lists exactly what the store acknowledged. `os.write` hands the line to
the kernel, which keeps it when this process is killed with SIGKILL (the tests kill
processes, not the machine, so no fsync is needed).

`compact` runs `store.compact` in a loop and acknowledges each pass the same way.

The parent rebuilds the very same events with `make_batch` to check what the store returns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def batch_size(b: int) -> int:
    """Events in batch `b`: 1 to 5 turns, a reward and a status."""
    return turns_in(b) + 2


def turns_in(b: int) -> int:
    return 1 + (b * 7) % 5


def make_batch(name: str, b: int) -> list[dict[str, Any]]:
    """Batch `b` of writer `name`: one whole rollout, deterministic so the parent can rebuild it."""
    rollout = f"{name}-r{b}"
    group = f"{name}-g{b // 4}"
    events: list[dict[str, Any]] = []
    for j in range(turns_in(b)):
        n_prompt = 1 + (b * 13 + j * 5) % 40
        n_out = 1 + (b + j) % 20
        events.append({
            "kind": "turn", "event_id": f"{name}-b{b}-t{j}", "run": "crash",
            "group_id": group, "rollout_id": rollout, "segment_id": f"{rollout}-s0",
            "turn_index": j, "policy_version": b % 3,
            "prompt_ids": [(b * 31 + j * 17 + k) % 50_000 for k in range(n_prompt)],
            "output_ids": [(b * 11 + j * 3 + k) % 50_000 for k in range(n_out)],
            "output_logprobs": [-0.01 * (k + 1) for k in range(n_out)],
        })
    events.append({"kind": "reward", "event_id": f"{name}-b{b}-reward", "run": "crash",
                   "group_id": group, "rollout_id": rollout, "reward": float(b % 7)})
    events.append({"kind": "status", "event_id": f"{name}-b{b}-status", "run": "crash",
                   "group_id": group, "rollout_id": rollout, "status": "completed", "group_size": 4})
    return events


def fingerprint(event: dict[str, Any]) -> tuple[Any, ...]:
    """What the parent compares per event (the same columns `FINGERPRINT_SQL` selects)."""
    prompt, out = event.get("prompt_ids"), event.get("output_ids")
    return (
        event["kind"], event["rollout_id"], event.get("turn_index"),
        None if prompt is None else len(prompt), None if prompt is None else sum(prompt),
        None if out is None else len(out), None if out is None else sum(out),
        event.get("reward"), event.get("status"),
    )


FINGERPRINT_SQL = """
    SELECT event_id, kind, rollout_id, turn_index,
           len(prompt_ids) AS n_prompt, list_sum(prompt_ids)::BIGINT AS sum_prompt,
           len(output_ids) AS n_out, list_sum(output_ids)::BIGINT AS sum_out,
           reward, status, writer, writer_seq
    FROM events
"""


class Acks:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def run_append(store_uri: str, name: str, acks: Acks, cfg: dict[str, Any]) -> None:
    import trajstore

    store = trajstore.open_store(store_uri)
    writer = store.writer(name, seal_bytes=cfg.get("seal_bytes", 64 << 20),
                          seal_interval=cfg.get("seal_interval", 60.0))
    acks.write(ready=True, pid=os.getpid(), epoch=writer.epoch)
    if cfg.get("go"):  # wait for the parent's start signal, so that all writers append at once
        while not os.path.exists(cfg["go"]):
            time.sleep(0.005)
    stop = cfg.get("stop")  # None: append until killed
    seal_every = cfg.get("seal_every", 0)
    b = cfg.get("resend_from", 0)
    while stop is None or b < stop:
        result = writer.append(make_batch(name, b))
        acks.write(b=b, appended=result.appended, duplicates=result.duplicates,
                   first=result.first_seq, last=result.last_seq)
        if seal_every and (b + 1) % seal_every == 0:
            acks.write(sealing=b)  # lets the parent aim a kill into the seal
            acks.write(sealed=writer.seal(), after=b)
        b += 1
    writer.close()
    acks.write(closed=True)


def run_compact(store_uri: str, acks: Acks, cfg: dict[str, Any]) -> None:
    import trajstore

    store = trajstore.open_store(store_uri)
    acks.write(ready=True, pid=os.getpid())
    while True:
        result = store.compact(target_bytes=cfg.get("target_bytes", 20_000))
        acks.write(compacted=result.rewritten, files_before=result.files_before,
                   files_after=result.files_after, version=result.version,
                   orphans=result.orphans_sealed)


def main(argv: list[str]) -> None:
    mode = argv[1]
    if mode == "append":
        run_append(argv[2], argv[3], Acks(argv[4]), json.loads(argv[5]))
    elif mode == "compact":
        run_compact(argv[2], Acks(argv[3]), json.loads(argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; use append or compact")


if __name__ == "__main__":
    main(sys.argv)
