"""What the piece cache saves on a session's first call: CPU to tokenize a whole rendered history.

The history is the last call of `benchmarks/proxy_agents.py`'s workload at each `--contexts` size (a system
prompt, tool schemas, a task and tool-using turns up to that many tokens), rendered by the proxy's
`ChatRenderer` with the tiny model's tokenizer and chat template. Timed (process CPU, median of `--repeats`):

- whole: the Rust backend's `encode_batch_fast` of the whole text (the proxy without the cache);
- cold: through an empty `PieceCache` (every piece tokenized, a piece repeated in the text only once);
- fan-out: the same prompt again (another session of the same `rollout_id` group): every piece a hit;
- shared head: another session's first call with the same system prompt and tools but its own task and
  history (from another seed), after the first one's.

Every way is checked to give the whole-text ids.

    python benchmarks/piece_cache.py                     # 8k and 80k; ~20 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `trajstore proxy` runs

from agent_workload import build_workload


def cpu_ms(work: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        work()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


@contextmanager
def tiny_renderer() -> Iterator[tuple[Any, Any]]:
    """The tiny model's tokenizer and the proxy's `ChatRenderer` of it, built in a temporary directory."""
    from transformers import AutoTokenizer

    from collectors.model.build import ModelSize, init_model
    from collectors.proxy.render import ChatRenderer

    with tempfile.TemporaryDirectory(prefix="tiny-renderer-") as tmp:
        init_model(str(Path(tmp) / "model"), ModelSize(), seed=0)
        tok = AutoTokenizer.from_pretrained(Path(tmp) / "model")
        renderer = ChatRenderer(tok)
        try:
            yield tok, renderer
        finally:
            renderer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 80000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from collectors.proxy.piece_cache import PieceCache

    with tiny_renderer() as (tok, renderer):
        backend = tok.backend_tokenizer
        print(f"load average {os.getloadavg()[0]:.1f} (2 shared cores); ms of process CPU, median of {args.repeats}")
        print(f"{'context':>8} {'tokens':>8} {'chars':>9} {'head chars':>10} {'whole':>7} {'cold':>7} "
              f"{'fan-out':>8} {'shared head':>11} {'(whole)':>8}")
        for context in args.contexts:
            first = json.loads(build_workload(tok, context, 40, 256, seed=0).bodies[-1])
            second = json.loads(build_workload(tok, context, 40, 256, seed=1).bodies[-1])
            text = renderer.render(first["messages"], first["tools"], generation_prompt=True)
            other = renderer.render(first["messages"][:1] + second["messages"][1:], first["tools"],
                                    generation_prompt=True)
            head = renderer.render(first["messages"][:1], first["tools"], generation_prompt=False)
            ids = {t: backend.encode(t, add_special_tokens=False).ids for t in (text, other)}

            whole = cpu_ms(partial(backend.encode_batch_fast, [text], add_special_tokens=False), args.repeats)
            whole_other = cpu_ms(partial(backend.encode_batch_fast, [other], add_special_tokens=False), args.repeats)
            cold = cpu_ms(lambda t=text: PieceCache(backend).encode(t), args.repeats)
            warm = PieceCache(backend)
            assert warm.encode(text) == ids[text]
            fan_out = cpu_ms(partial(warm.encode, text), args.repeats)
            shared = []
            for _ in range(args.repeats):
                cache = PieceCache(backend)
                cache.encode(text)
                start = time.process_time()
                assert cache.encode(other) == ids[other]
                shared.append((time.process_time() - start) * 1e3)
            print(f"{context:>8,} {len(ids[text]):>8,} {len(text):>9,} {len(head):>10,} {whole:>7.2f} {cold:>7.2f} "
                  f"{fan_out:>8.2f} {statistics.median(shared):>11.2f} {whole_other:>8.2f}")


if __name__ == "__main__":
    main()
