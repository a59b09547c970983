"""Drift on the vLLM-rendered capture path, per model family: how many multi-turn episodes stay in one segment.

For each family (init-model's `hermes`, and `llama3` with vLLM's `llama3_json` parser), a tiny
model is built on the spot exactly as `init-model --family F` writes it (every stop token the
family has), vLLM 0.32's CPU build serves it with the family's tool-call parser and
`--enable-scale-out`, and a capture proxy with `render="vllm"` stands in front. E episodes per
family run a real SDK tool loop, alternating the openai SDK (Chat Completions) and the
anthropic SDK (Messages): two calls of a tool, then an answer, each turn sampled at
temperature 1 with its own seed. A random model writes no tool call by itself, so each call
asks vLLM for one with `structured_outputs` (a regular expression of the family's call
format), as any vLLM client can; the stop token that ends each reply is the model's own draw
among the family's stop tokens (`--template-stop-only`: the one its template writes after a reply).

Reported per family, from the store: the share of episodes whose turns are all in one segment,
the share of replies whose text re-tokenizes to the sampled ids (`meta.output_retokenizes`),
and the forks by reason.

    python benchmarks/vllm_drift.py                 # 10 episodes per family, ~6 minutes on 2 loaded cores
    python benchmarks/vllm_drift.py --episodes 4 --family hermes
    python benchmarks/vllm_drift.py --template-stop-only     # each model's only stop token is its template's
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from collectors.model.build import init_model
from collectors.policy.vllm_server import start_vllm
from tests.collectors.proxy.vllm_render_cases import (
    A_TOOLS,
    ANSWER,
    HERMES,
    LLAMA3,
    SIZE,
    TOOLS,
    Family,
    RecordingVLLM,
    one_stop,
)
from tests.collectors.proxy_harness import (
    MODEL,
    Harness,
    anthropic_client,
    openai_client,
    running_proxy,
)


def openai_episode(h: Harness, family: Family, seed: int) -> str:
    rollout = h.open()
    c = openai_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one to one, twice."}]
    for turn in range(2):
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48, seed=seed + turn,
                                      extra_body=family.structured(family.call))
        message = r.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "2"} for call in calls]
    c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24, seed=seed + 2,
                              extra_body=family.structured(ANSWER))
    return str(rollout["rollout_id"])


def anthropic_episode(h: Harness, family: Family, seed: int) -> str:
    rollout = h.open()
    c = anthropic_client(rollout)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one to one, twice."}]
    for turn in range(2):
        r = c.messages.create(model=MODEL, max_tokens=48, tools=A_TOOLS, messages=messages,
                              extra_body={**family.structured(family.call), "seed": seed + turn})
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": "2"} for b in r.content
                   if b.type == "tool_use"]
        messages.append({"role": "user", "content": results or "go on"})
    c.messages.create(model=MODEL, max_tokens=24, tools=A_TOOLS, messages=messages,
                      extra_body={**family.structured(ANSWER), "seed": seed + 2})
    return str(rollout["rollout_id"])


def measure(family: Family, episodes: int, work: Path, template_stop_only: bool) -> dict[str, Any]:
    model = work / family.name
    init_model(model, SIZE, seed=0, family=family.name)
    if template_stop_only:
        one_stop(model, family.end)
    server = start_vllm(model, served_name=MODEL, render=True, tool_call_parser=family.parser,
                        log_path=work / f"vllm-{family.name}.log")
    try:
        with running_proxy(RecordingVLLM(server.url), work / f"store-{family.name}", model, render="vllm") as h:
            ids = [(openai_episode if i % 2 == 0 else anthropic_episode)(h, family, 1000 * i) for i in range(episodes)]
            turns = [h.turns(rollout_id) for rollout_id in ids]
    finally:
        server.stop()
    metas = [json.loads(t["meta"]) for episode in turns for t in episode]
    return {"family": family.name, "parser": family.parser, "episodes": episodes,
            "one_segment": sum(len({t["segment_id"] for t in episode}) == 1 for episode in turns),
            "replies": len(metas), "retokenize": sum(m["output_retokenizes"] for m in metas),
            "forks": dict(Counter(m["fork"] for m in metas if m["fork"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--family", choices=["hermes", "llama3"], action="append")
    parser.add_argument("--template-stop-only", action="store_true",
                        help="the model's only stop token is the one its template writes after a reply")
    args = parser.parse_args()
    families = [f for f in (HERMES, LLAMA3) if f.name in (args.family or ["hermes", "llama3"])]
    print("| family (vLLM parser) | episodes in one segment | replies re-tokenizing to the sampled ids | forks |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            r = measure(family, args.episodes, Path(tmp), args.template_stop_only)
            print(f"| {r['family']} ({r['parser']}) | {r['one_segment']}/{r['episodes']} "
                  f"({r['one_segment'] / r['episodes']:.0%}) | {r['retokenize']}/{r['replies']} "
                  f"({r['retokenize'] / r['replies']:.0%}) | {r['forks'] or 'none'} |", flush=True)


if __name__ == "__main__":
    main()
