"""The capture proxy's scan of a request body's conversation list, against one regular expression per string.

`collectors.proxy.body_splice` finds where each element of a body's `messages` list ends, so that the next body
of the session is decoded by what is new in it. It scans a session's body whole once (when the next repeats it)
and the new bytes of every call after. Timed here (process CPU, median of `--repeats`), the whole list of:

- `1b first, <context>`: a session's first body in table 1b of `benchmarks/proxy_agents.py` (a long task
  history in one message, then the tools);
- `call 39, <context>`: table 1's 39th call (about 80 messages: tool calls and their results);
- `7 MB body`: the body `proxy_agents.py` sends beside the sessions (`--hog-mb`);
- `1 MB image`: one user message with an image as a base64 data URL (a string without escapes) and a question;
- `short strings with escapes`: 2,000 messages of 60 short strings each, a third with an escaped quote and a
  third with an escaped backslash (the scan's worst case: many strings that a regular expression takes whole).

Each way: the baseline, one regular expression that matches every JSON string whole (what the proxy ran before:
it steps through every escape); the proxy's scan (`body_splice._elements`). Both must find the same ends.

    python benchmarks/body_scan.py                    # ~10 s
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from piece_cache import cpu_ms, tiny_renderer
from agent_workload import build_workload, hog_body

BASELINE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[][{}]')  # a JSON string (any escapes) or a bracket


def baseline_elements(raw: bytes, pos: int) -> tuple[list[int], int] | None:
    """The element ends and the closing bracket of the list at `pos`, one regular expression match per token."""
    ends: list[int] = []
    depth = 0
    for m in BASELINE.finditer(raw, pos):
        c = raw[m.start()]
        if c == 0x22:
            if not depth:
                ends.append(m.end())
        elif c == 0x7B or c == 0x5B:
            depth += 1
        elif depth:
            depth -= 1
            if not depth:
                ends.append(m.end())
        else:
            return ends, m.start()
    return None


def image_body() -> bytes:
    image = base64.b64encode(random.Random(0).randbytes(750_000)).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
               {"type": "text", "text": "What does this screenshot show?"}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def escapes_body() -> bytes:
    parts = ["ab", 'say "x"', "c:\\tmp"] * 20
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": parts} for _ in range(2000)]}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 80000])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    from collectors.proxy.body_splice import _elements

    bodies: list[tuple[str, bytes]] = []
    with tiny_renderer() as (tok, _):
        for context in args.contexts:
            bodies.append((f"1b first, {context // 1000}k", build_workload(tok, context, 40, 256, step_tokens=150)
                           .body(0, 1)))
            bodies.append((f"call 39, {context // 1000}k", build_workload(tok, context, 40, 256).body(38, 1)))
    bodies += [("7 MB body", hog_body(7.0, 256)), ("1 MB image", image_body()),
               ("short strings with escapes", escapes_body())]

    print(f"load average {os.getloadavg()[0]:.1f} (2 shared cores); ms of CPU to scan a body's list, median of "
          f"{args.repeats}")
    print(f"  {'body':<28} {'bytes':>10} {'elements':>9} {'baseline':>9} {'proxy':>9} {'ratio':>7}")
    for name, raw in bodies:
        start = raw.index(b"[", raw.index(b'"messages"')) + 1
        found = _elements(raw, start)
        if found is None or found != baseline_elements(raw, start):
            raise SystemExit(f"{name}: the scan found other element ends than the baseline")
        base = cpu_ms(lambda: baseline_elements(raw, start), args.repeats)  # noqa: B023 - called at once
        mine = cpu_ms(lambda: _elements(raw, start), args.repeats)  # noqa: B023 - called at once
        print(f"  {name:<28} {len(raw):>10,} {len(found[0]):>9,} {base:>9.3f} {mine:>9.3f} "
              f"{base / max(mine, 1e-6):>6.1f}x")


if __name__ == "__main__":
    main()
