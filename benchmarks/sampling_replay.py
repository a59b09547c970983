"""Sampling-support replay, end to end: the importance ratio of one learner step with replay on and off.

For each setting, the commands a user runs: `trajstore init-model` (a random policy, the default
shape), `trajstore collect` from it with the embedded server at the setting's top-p / top-k, then
one `trajstore learn` step on the store and one with `--no-support-replay` on a copy of it. Same
weights in the collector and the learner, float32 on CPU: the only gap between behaviour and
recomputed logprobs is the support each token was drawn from, so with replay the step's
`is_weight_mean` must be 1 (the issue's bound: within 0.005, and `mismatch_kl_k3` <= 1e-4) and
without it the ratio is the kept mass of the truncated distribution, well below 1.

Also the storage the kept sets cost: bytes per sampled token of `support_sizes` + `support_ids`
(4 bytes per int32 value; Parquet compresses them further), for every setting.

    python benchmarks/sampling_replay.py [--tasks 2] [--n 4] [--max-tokens 32] [--settings "top_p 0.7" ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trajstore
from collectors.envs import packing

SETTINGS: dict[str, list[str]] = {
    "top_p 0.7": ["--top-p", "0.7"],
    "top_k 8": ["--top-k", "8"],
    "top_p 0.9": ["--top-p", "0.9"],
    "top_k 64": ["--top-k", "64"],
}
TRAINED = ("top_p 0.7", "top_k 8")  # the issue's two: a learner step with replay on and off
RUN = "replay"


def trajstore_cli(*args: object, log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("a") as out:
        subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], check=True, stdout=out,
                       stderr=subprocess.STDOUT, env=env, timeout=900)


def step_metrics(store: Path) -> dict[str, float]:
    rows = trajstore.open_store(store).query(
        "SELECT name, value FROM metrics WHERE run = $run AND step = 1", {"run": RUN}).to_pylist()
    return {r["name"]: r["value"] for r in rows}


def support_bytes(store: Path) -> tuple[float, int]:
    """(bytes of support_sizes + support_ids per sampled token, sampled tokens)."""
    row = trajstore.open_store(store).query(
        """SELECT sum(output_tokens) AS tokens, sum(coalesce(len(support_sizes), 0) + coalesce(len(support_ids), 0))
                  AS values FROM turns WHERE run = $run""", {"run": RUN}).to_pylist()[0]
    return 4.0 * float(row["values"]) / float(row["tokens"]), int(row["tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2, help="tasks (groups) per setting; one learner step takes all")
    parser.add_argument("--n", type=int, default=4, help="rollouts per task")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the rows here, as JSON")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="sampling-replay-"))
    log = root / "commands.log"
    root.mkdir(parents=True, exist_ok=True)
    model = root / "base"
    if not (model / "config.json").is_file():
        trajstore_cli("init-model", model, log=log)
    tasks = packing.write_tasks(root / "tasks.jsonl", args.tasks, seed=1)
    rows = []
    for name in args.settings:
        d = root / name.replace(" ", "_")
        store = d / "store"
        if not store.exists():
            trajstore_cli("collect", "--store", store, "--run", RUN, "--tasks", tasks, "--n", args.n, "--model", model,
                          "--tools", "collectors.envs.packing:forecast", "--reward", "collectors.envs.packing:reward",
                          "--max-turns", 1, "--max-tokens", args.max_tokens, "--seed", 0, "--plain",
                          *SETTINGS[name], log=log)
        per_token, tokens = support_bytes(store)
        row = {"setting": name, "tokens": tokens, "bytes/token": per_token}
        if name in TRAINED:
            if not (d / "store-no-replay").exists():  # the collected store, before either learner wrote to it
                shutil.copytree(store, d / "store-no-replay")
            for replay in (True, False):
                where = store if replay else d / "store-no-replay"
                ckpt = d / ("ckpt" if replay else "ckpt-no-replay")
                if not step_metrics(where):
                    trajstore_cli("learn", "--store", where, "--run", RUN, "--model", model, "--checkpoints", ckpt,
                                  "--steps", 1, "--groups-per-step", args.tasks, "--device", "cpu", "--wait-timeout", 60,
                                  *([] if replay else ["--no-support-replay"]), log=log)
                m = step_metrics(where)
                key = "on" if replay else "off"
                row[f"is_w {key}"], row[f"k3 {key}"] = m["is_weight_mean"], m["mismatch_kl_k3"]
                row[f"replayed {key}"] = m.get("replayed_tokens", 0.0)
        rows.append(row)
    print(f"sampling-support replay, {args.tasks} tasks x {args.n} rollouts, <= {args.max_tokens} tokens each, "
          f"random init-model policy, float32 CPU (work: {root})")
    print(f"{'setting':<10} {'tokens':>6} {'B/token':>8} {'is_w on':>9} {'k3 on':>9} {'is_w off':>9} {'k3 off':>9}")
    for r in rows:
        trained = (f"{r['is_w on']:9.5f} {r['k3 on']:9.2e} {r['is_w off']:9.5f} {r['k3 off']:9.2e}"
                   if "is_w on" in r else f"{'-':>9} {'-':>9} {'-':>9} {'-':>9}")
        print(f"{r['setting']:<10} {r['tokens']:>6} {r['bytes/token']:8.1f} {trained}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
