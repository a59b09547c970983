"""How much a warm-started demo model keeps of the weather where it names the item.

Not a speed benchmark: the measurement behind the demo's warm start (docs/lab-notes.md, "How it was
chosen"). For each model directory given (warm starts written by `trajstore demo`, e.g.
`trajstore-demo/warm`), it renders the packing episode up to "Pack the <weather>" for each of
the four weathers (in three cities) and prints, per layer of the residual stream at that last
position, the weather-specific share of the hidden state: the mean norm of (h_weather - mean
over weathers) over the mean norm of h. Near 0, the model's state is the same whatever the
weather, so reward has nothing to sharpen; the last column is what the LM head reads.

    python benchmarks/warm_start_probe.py uniform=DIR_A demonstrator=DIR_B ...

prints one row per model and, for each one after the first, its last-layer share as a ratio
to the first's (name the baseline first).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from collectors.agents.tools import tool_schema
from collectors.envs import packing

PLACES = (("Oslo", 4), ("Paris", 3), ("Tokyo", 6))


def weather_share(model_dir: Path) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    schema = [tool_schema(packing.forecast)]
    shares = []
    for city, day in PLACES:
        states = []
        for weather in packing.ITEM_FOR:
            messages = [
                {"role": "system", "content": packing.SYSTEM},
                {"role": "user", "content": packing.question(city, day)},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "forecast", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": packing.hourly(weather)},
            ]
            text = tokenizer.apply_chat_template(messages, tools=schema, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text + "Pack the " + weather, add_special_tokens=False)
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            states.append(torch.stack([h[0, -1] for h in out.hidden_states]))  # (layers + 1, hidden)
        h = torch.stack(states)  # (weathers, layers + 1, hidden)
        shares.append((h - h.mean(0)).norm(dim=-1).mean(0) / h.norm(dim=-1).mean(0))
    return torch.stack(shares).mean(0).tolist()


def main(args: list[str]) -> None:
    if not args or any("=" not in a for a in args):
        sys.exit("usage: python benchmarks/warm_start_probe.py NAME=MODEL_DIR [NAME=MODEL_DIR ...] (baseline first)")
    torch.set_num_threads(1)
    rows = []
    for arg in args:
        name, _, directory = arg.partition("=")
        if not (Path(directory) / "config.json").is_file():
            sys.exit(f"{directory} is not a model directory (no config.json); pass a demo's warm/ directory")
        rows.append((name, weather_share(Path(directory))))
    base = rows[0][1][-1]
    print(f"{'model':<24} weather-specific share per layer (embeddings ... last)   last vs {rows[0][0]}")
    for name, share in rows:
        print(f"{name:<24} {'  '.join(f'{x:.3f}' for x in share):<44} {share[-1] / base:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
