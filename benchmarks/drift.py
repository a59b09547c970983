"""Template drift per model family: how often a multi-turn episode stays one token sequence, and how often a reply
re-tokenizes to the ids that were sampled.

For each family (hermes, llama3, harmony) a tiny model is built on the spot (`init_model(family=...)`) and a
capture proxy runs in front of a policy; real SDK clients (openai's Chat Completions and anthropic's
Messages, alternating by episode) drive a multi-turn tool loop through it: every tool call is answered
with a tool result, every plain answer with a new user question, for `--turns` model calls. Two policies:

- random: the random model itself on the embedded server (`trajstore serve` in a thread), sampling at
  temperature 1: arbitrary token sequences, the worst case a template meets;
- formatted: a policy that always writes its family's documented format (a call with compact JSON
  arguments, or a final answer, each with reasoning where the family has it, ended by the family's own
  stop token), so what drifts is the template and parser, not the model. Its ids and logprobs are
  scripted, not sampled; the proxy, templates, tokenizers, SDKs and store are the real ones.

Per family and policy it prints the share of episodes stored as one segment (no fork), the share of
replies whose decoded text re-tokenizes to the sampled ids (`meta.output_retokenizes`), and the forks by
reason, read back from the store.

    python benchmarks/drift.py                      # about a minute on 2 shared CPU cores
    python benchmarks/drift.py --episodes 20 --turns 6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import anthropic  # noqa: E402
import openai  # noqa: E402

from collectors.model.build import ModelSize, init_model  # noqa: E402
from collectors.model.families import FAMILIES  # noqa: E402
from collectors.policy import Chunk, Sample, SamplingParams  # noqa: E402

MODEL = "tiny"
SIZE = ModelSize(vocab_size=2048, hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128,
                 max_positions=4096)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                                  "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the weather.", "input_schema": SCHEMA}]
CITIES = ["Paris", "Oslo", "Lima", "Tokyo"]


def formatted_reply(family: str, rng: random.Random) -> tuple[str, str]:
    """(text, stop token) of one reply that follows `family`'s documented format."""
    city, think = rng.choice(CITIES), rng.choice(["I need the weather.", "Check the forecast first."])
    args = json.dumps({"city": city}, separators=(",", ":"))  # compact: an SDK sends it back re-serialized
    call = rng.random() < 0.6
    if family == "hermes":
        body = (f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' if call
                else f"It is sunny in {city}.")
        return f"<think>\n{think}\n</think>\n\n{body}", "<|im_end|>"
    if family == "llama3":
        if call:  # both forms the model card documents: after <|python_tag|> (ends <|eom_id|>) or bare JSON
            tagged = rng.random() < 0.5
            text = f'{{"name": "get_weather", "parameters": {args}}}'
            return ("<|python_tag|>" + text, "<|eom_id|>") if tagged else (text, "<|eot_id|>")
        return f"It is sunny in {city}.", "<|eot_id|>"
    analysis = f"<|channel|>analysis<|message|>{think}<|end|><|start|>assistant"
    if call:
        return analysis + f" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{args}", "<|call|>"
    return analysis + f"<|channel|>final<|message|>It is sunny in {city}.", "<|return|>"


class Formatted:
    """A PolicyClient whose replies always follow the family's format (see the module docstring)."""

    base_url = "formatted://"

    def __init__(self, tokenizer: Any, family: str, seed: int) -> None:
        self.tokenizer, self.family, self.rng = tokenizer, family, random.Random(seed)

    async def complete(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                       session_id: str | None = None) -> Sample:
        text, stop = formatted_reply(self.family, self.rng)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.convert_tokens_to_ids(stop)]
        ids = ids[:sampling.max_tokens]
        return Sample(prompt_ids=list(prompt_ids), output_ids=ids, output_logprobs=[0.0] * len(ids),
                      text=text, finish_reason="stop" if len(ids) > 1 else "length", policy_version=0)

    async def stream(self, prompt_ids: Sequence[int], sampling: SamplingParams, *,
                     session_id: str | None = None) -> AsyncIterator[Chunk]:
        sample = await self.complete(prompt_ids, sampling)
        for i, token in enumerate(sample.output_ids):
            last = i == len(sample.output_ids) - 1
            yield Chunk([token], [0.0], self.tokenizer.decode([token]), 0,
                        finish_reason=sample.finish_reason if last else None)

    async def models(self) -> list[str]:
        return ["formatted"]

    async def load_weights(self, path: str, version: int) -> None:
        pass

    async def aclose(self) -> None:
        pass


def post(url: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    with urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode(), headers)) as reply:
        return json.load(reply)


def openai_episode(rollout: dict[str, Any], turns: int, max_tokens: int, stream: bool) -> None:
    c = openai.OpenAI(base_url=rollout["base_urls"]["openai"], api_key=rollout["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    for _ in range(turns):
        if stream:
            with c.chat.completions.stream(model=MODEL, messages=messages, tools=OPENAI_TOOLS,
                                           max_tokens=max_tokens) as s:
                try:
                    message = s.get_final_completion().choices[0].message
                except openai.LengthFinishReasonError as cut:  # the helper refuses a reply cut by max_tokens
                    message = cut.completion.choices[0].message
        else:
            message = c.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS,
                                                max_tokens=max_tokens).choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed", "refusal"}))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "And tomorrow?"})


def anthropic_episode(rollout: dict[str, Any], turns: int, max_tokens: int, stream: bool) -> None:
    c = anthropic.Anthropic(base_url=rollout["base_urls"]["anthropic"], api_key=rollout["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    for _ in range(turns):
        if stream:
            with c.messages.stream(model=MODEL, max_tokens=max_tokens, tools=ANTHROPIC_TOOLS, messages=messages) as s:
                reply = s.get_final_message()
        else:
            reply = c.messages.create(model=MODEL, max_tokens=max_tokens, tools=ANTHROPIC_TOOLS, messages=messages)
        blocks = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": '{"weather": "sunny"}'} for u in uses]
            or "And tomorrow?"})


def measure(family: str, policy: str, episodes: int, turns: int, max_tokens: int, seed: int,
            work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from collectors.embedded.app import serve_in_thread
    from collectors.policy import EmbeddedClient
    from collectors.proxy.app import ProxyConfig, serve_proxy_in_thread
    from trajstore import open_store

    model = work / family
    if not model.exists():
        init_model(model, SIZE, seed=seed, family=family)
    store = open_store(work / f"store-{family}-{policy}")
    with ExitStack() as stack:
        if policy == "random":
            server = stack.enter_context(serve_in_thread(model, threads=1, max_batch=4, device="cpu"))
            client: Any = EmbeddedClient(server.url)
        else:
            client = Formatted(AutoTokenizer.from_pretrained(model), family, seed)
        proxy = stack.enter_context(serve_proxy_in_thread(lambda: client, store, ProxyConfig(
            model_dir=str(model), run="drift", model_names=(MODEL,))))
        for i in range(episodes):
            rollout = post(proxy.url + "/rollouts", {"group_id": f"e{i}"})
            episode = openai_episode if i % 2 == 0 else anthropic_episode
            episode(rollout, turns, max_tokens, stream=i % 4 >= 2)
            post(f"{proxy.url}/rollouts/{rollout['rollout_id']}/close", {"status": "completed", "reward": 0.0},
                 key=rollout["api_key"])
        rows = store.query("SELECT rollout_id, segment_id, meta FROM turns WHERE run = 'drift'").to_pylist()
    segments: dict[str, set[str]] = {}
    forks: Counter[str] = Counter()
    retokenize = 0
    for row in rows:
        meta = json.loads(row["meta"])
        segments.setdefault(row["rollout_id"], set()).add(row["segment_id"])
        retokenize += bool(meta["output_retokenizes"])
        forks[meta["fork"]] += meta["fork"] is not None
    return {"family": family, "policy": policy, "episodes": len(segments), "turns": len(rows),
            "one_segment": sum(len(s) == 1 for s in segments.values()) / max(len(segments), 1),
            "retokenizes": retokenize / max(len(rows), 1), "forks": {k: v for k, v in forks.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="hermes,llama3,harmony")
    parser.add_argument("--policies", default="formatted,random")
    parser.add_argument("--episodes", type=int, default=8, help="per family and policy (openai and anthropic alternate)")
    parser.add_argument("--turns", type=int, default=4, help="model calls per episode")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="drift-") as tmp:
        for family in families:
            for policy in args.policies.split(","):
                results.append(measure(family, policy, args.episodes, args.turns, args.max_tokens, args.seed,
                                       Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
    print("\n| family | policy | episodes | replies | episodes in one segment | replies re-tokenizing | forks |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        forks = ", ".join(f"{k} {v}" for k, v in sorted(r["forks"].items())) or "none"
        print(f"| {r['family']} | {r['policy']} | {r['episodes']} | {r['turns']} | {r['one_segment']:.0%} | "
              f"{r['retokenizes']:.0%} | {forks} |")


if __name__ == "__main__":
    main()
