"""Storage cost of MoE routes per token, beside the token id's: raw (Arrow) and sealed (compressed Parquet).

Samples `--calls` completions of `--tokens` tokens from a `trajstore init-model --moe` model (the
default: 2 layers, 4 experts, top-2) with the embedded engine, stores them as the capture proxy
does (one turn per call: prompt, output, logprobs and `routed_experts`), seals them, and reads the
sealed file's column sizes. A token id costs 4 bytes raw (int32); a token's routes cost
2 x layers x top_k bytes raw (int16). Sealed, both are compressed; the figure printed per column
is its compressed bytes over the tokens it covers (prompt + output).

    python benchmarks/routes.py                       # ~1 min on a busy 2-core machine
    python benchmarks/routes.py --experts 8 --experts-per-token 2 --layers 4
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

import trajstore
from collectors.embedded.engine import Completion, Engine
from collectors.model.build import ModelSize, init_model
from collectors.policy import SamplingParams
from trajstore import Turn, routes


def sample(engine: Engine, prompts: list[list[int]], tokens: int) -> list[Completion]:
    done, out = threading.Semaphore(0), {}

    def finish(i: int, result: Completion | BaseException) -> None:
        out[i] = result
        done.release()

    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_tokens=tokens, seed=i, ignore_eos=True), lambda r, i=i: finish(i, r))
    for _ in prompts:
        done.acquire()
    return [out[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="sampled tokens per call")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per call")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--experts-per-token", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = ModelSize(layers=args.layers, experts=args.experts, experts_per_token=args.experts_per_token)
        init_model(Path(tmp) / "moe", size, seed=0)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, size.vocab_size - 16, args.prompt).tolist() for _ in range(args.calls)]
        engine = Engine(Path(tmp) / "moe", device="cpu", max_batch=16, threads=1)
        try:
            done = sample(engine, prompts, args.tokens)
        finally:
            engine.close()
        store = trajstore.open_store(Path(tmp) / "store", create=True)
        with store.writer("bench") as w:
            w.append([Turn(group_id="g", rollout_id=f"r{i}", segment_id=f"r{i}-s0", turn_index=0, policy_version=0,
                           prompt_ids=c.prompt_ids, output_ids=c.output_ids, output_logprobs=c.logprobs,
                           **routes.turn_columns(routes.turn_rows(c.routed_experts, len(c.prompt_ids),
                                                                  len(c.output_ids), len(c.prompt_ids))))
                      for i, c in enumerate(done)])
            w.seal()
        sizes: dict[str, int] = {}
        for file in (Path(tmp) / "store").rglob("*.parquet"):
            meta = pq.ParquetFile(file).metadata
            for g in range(meta.num_row_groups):
                for c in range(meta.num_columns):
                    col = meta.row_group(g).column(c)
                    name = col.path_in_schema.split(".")[0]
                    sizes[name] = sizes.get(name, 0) + col.total_compressed_size
    tokens = args.calls * (args.prompt + args.tokens)
    out_tokens = args.calls * args.tokens
    raw = 2 * args.layers * args.experts_per_token
    print(f"{args.calls} calls x ({args.prompt} prompt + {args.tokens} sampled) tokens, {args.layers} layers, "
          f"{args.experts} experts, top-{args.experts_per_token}")
    print(f"{'column':<22}{'raw B/token':>12}{'sealed B/token':>16}")
    print(f"{'prompt+output ids':<22}{4:>12}{(sizes['prompt_ids'] + sizes['output_ids']) / tokens:>16.2f}")
    print(f"{'output_logprobs':<22}{4:>12}{sizes['output_logprobs'] / out_tokens:>16.2f}  (per sampled token)")
    print(f"{'routed_experts':<22}{raw:>12}{sizes['routed_experts'] / tokens:>16.2f}")


if __name__ == "__main__":
    main()
