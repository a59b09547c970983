"""`trajstore sft`: the supervised warm start (`learner.sft.warm_start`) over a JSON-lines file of conversations."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import click

from learner.settings import WarmStartSettings

DEFAULTS = {f.name: f.default for f in fields(WarmStartSettings)}
PROGRESS_EVERY = 10  # steps between loss lines


@click.command("sft")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The model to start from: a Hugging Face checkpoint directory (trajstore init-model makes one).")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help='Worked conversations, JSON lines: {"messages": [...], "tools": [...] or null} per line.')
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Where the trained checkpoint is written (a new or empty directory).")
@click.option("--steps", type=click.IntRange(min=1), default=DEFAULTS["steps"], show_default=True,
              help="Optimizer steps (batches drawn in a seeded shuffled order, epoch after epoch).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=DEFAULTS["lr"], show_default=True,
              help="Peak AdamW learning rate (warm-up, then cosine decay to a tenth); pretrained models want ~1e-5.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULTS["batch_size"], show_default=True,
              help="Conversations per step.")
@click.option("--seed", type=int, default=DEFAULTS["seed"], show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="torch CPU threads (1 is fastest for tiny models).")
def sft(model_dir: str, data: str, out_dir: str, steps: int, lr: float, batch_size: int, seed: int,
        threads: int | None) -> None:
    """Supervised warm start: train a model on worked conversations before RL (loss on assistant tokens only).

    A model that never writes a well-formed tool call gets no reward to learn from; a short
    supervised pass on complete conversations (in the messages an agent sends, tool calls
    and tool results included) teaches it the format. The output is a full checkpoint that
    `collect --model` and `learn --model` start from.

    \b
    Example:
      trajstore init-model my/base
      python -m examples.fruit_env my/          # my/tasks.jsonl and my/sft.jsonl
      trajstore sft --model my/base --data my/sft.jsonl --out my/warm --steps 150 --threads 1
    """
    import torch

    from learner.sft import load_conversations, warm_start

    if threads is not None:
        torch.set_num_threads(threads)  # on a busy machine a second thread of a tiny model mostly spin-waits

    conversations = load_conversations(data)
    out = Path(out_dir)
    click.echo(f"sft: {steps} steps of {batch_size} on {len(conversations)} conversations from {data}")

    def progress(step: int, loss: float) -> None:
        if step % PROGRESS_EVERY == 0 or step == steps - 1:
            click.echo(f"  step {step + 1:>5}/{steps}  loss {loss:.4f}")

    warm_start(model_dir, out, conversations, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
               on_step=progress)
    click.echo(f"wrote {out} (settings and loss curve in {out / 'trajstore_warm_start.json'})")
