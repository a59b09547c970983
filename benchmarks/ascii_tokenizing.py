"""What the ASCII tokenizing path costs against the Rust tokenizer it replaces, on the texts the proxy tokenizes.

The proxy tokenizes, per call, what the call adds to its session: the template's text after the sampled
reply and the new messages (tool results, mostly). Timed here with the tiny model's tokenizer (Qwen2's
layout) and chat template, thread CPU per text, for each way:

- tokenizer: the Rust backend's `encode_batch_fast` (what the proxy called before);
- re path: `collectors.proxy.ascii_bpe.AsciiBPE` cutting pre-tokens with Python's `re` (what it called for ASCII
  text before the C scan, and still does without a C compiler or for other split regexes);
- C scan: the same path with the cut and the lookups in C (`collectors/proxy/_ascii_words.c`), what it calls now.

Texts:

- `new per call, <context>`: what each call of `benchmarks/proxy_agents.py`'s workload adds at that context
  (8 sessions, calls 5-40: the last reply and the new tool result, rendered), in the order sent;
- `repository code and docs`: this repository's Python files and docs (their ASCII characters), in 8 kB
  slices, once with an empty word cache (every distinct pre-token new) and once again (warm);
- `whole first prompt, 80k`: the workload's last call rendered whole (a fork or a first call).

Every text's ids are checked to be the tokenizer's.

    python benchmarks/ascii_tokenizing.py                  # ~30 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `trajstore proxy` runs

from piece_cache import tiny_renderer
from agent_workload import build_workload

ROOT = Path(__file__).resolve().parent.parent


def per_text_ms(encode: Callable[[str], list[int]], texts: list[str], repeats: int) -> float:
    """Thread CPU per text, median of `repeats` passes over `texts`."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for text in texts:
            encode(text)
        times.append((time.thread_time() - start) * 1e3 / len(texts))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 32000, 80000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from collectors.proxy.ascii_bpe import AsciiBPE

    with tiny_renderer() as (tok, renderer):
        backend = tok.backend_tokenizer

        def tokenizer(text: str) -> list[int]:
            return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

        def fresh(scan: bool = True) -> AsciiBPE:
            made, why = AsciiBPE.of(backend)
            if made is None:
                raise SystemExit(f"no ASCII path for this tokenizer: {why}")
            if scan and made.as_json()["scan"] != "C":
                raise SystemExit("the C scan is not built (collectors/proxy/_ascii_words.c): reinstall with a C compiler")
            if not scan:
                made._digits = None  # noqa: SLF001 - the path as it runs without the compiled module
            return made

        sets: list[tuple[str, list[str], bool]] = []  # (name, texts, from an empty word cache each pass)
        for context in args.contexts:
            load = build_workload(tok, context, 40, 256)
            texts = [renderer.render(json.loads(load.body(t, s))["messages"][-2:], None, generation_prompt=True)
                     for s in range(8) for t in range(5, 40)]
            sets.append((f"new per call, {context // 1000}k", texts, False))
        source = "".join(p.read_text() for d in ("collectors", "trajstore", "learner", "cli", "docs")
                         for p in sorted((ROOT / d).rglob("*.py" if d != "docs" else "*.md")))
        source = "".join(c for c in source if c.isascii())
        slices = [source[i:i + 8192] for i in range(0, len(source), 8192)]
        sets.append(("repository code and docs, cold", slices, True))
        sets.append(("repository code and docs, warm", slices, False))
        last = json.loads(build_workload(tok, args.contexts[-1], 40, 256).bodies[-1])
        sets.append((f"whole first prompt, {args.contexts[-1] // 1000}k",
                     [renderer.render(last["messages"], last["tools"], generation_prompt=True)], False))

        print(f"load average {os.getloadavg()[0]:.1f} (2 shared cores); ms of thread CPU per text, median of "
              f"{args.repeats} passes")
        print(f"  {'texts':<36} {'n':>5} {'chars':>8} {'ids':>7} {'tokenizer':>10} {'re path':>8} {'C scan':>8} "
              f"{'vs tokenizer':>12} {'vs re':>6}")
        for name, texts, cold in sets:
            ways = {}
            for scan in (False, True):
                fast = fresh(scan)
                for text in texts:
                    if fast.encode(text) != tokenizer(text):
                        raise SystemExit(f"{name}: the ASCII path gave other ids than the tokenizer")
                if cold:
                    ways[scan] = statistics.median(per_text_ms(fresh(scan).encode, texts, 1) for _ in range(args.repeats))
                else:
                    ways[scan] = per_text_ms(fast.encode, texts, args.repeats)
            base = per_text_ms(tokenizer, texts, args.repeats)
            chars = statistics.mean(map(len, texts))
            ids = statistics.mean(len(tokenizer(t)) for t in texts[:50])
            print(f"  {name:<36} {len(texts):>5} {chars:>8,.0f} {ids:>7,.0f} {base:>10.3f} {ways[False]:>8.3f} "
                  f"{ways[True]:>8.3f} {base / ways[True]:>11.1f}x {ways[False] / ways[True]:>5.1f}x")


if __name__ == "__main__":
    main()
