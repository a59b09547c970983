"""`trajstore demo`: a thin click shell over `cli.demo.run_demo`, plus the printed summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from cli.demo import DemoResult

console = Console()


@click.command("demo")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=Path("trajstore-demo"),
              show_default=True, help="A new directory for the model, checkpoints, store, logs and plot.")
@click.option("--quick", is_flag=True, help="The CI-sized loop: fewer tasks, steps and warm-start steps (~3 min).")
@click.option("--steps", type=click.IntRange(min=1), help="Learner steps (default: the preset's).")
@click.option("--minutes", type=click.FloatRange(min=0.5), help="Time limit for collect + learn (default: the preset's).")
@click.option("--seed", type=int, default=0, show_default=True)
def demo(directory: Path, quick: bool, steps: int | None, minutes: float | None, seed: int) -> None:
    """The closed loop on this machine's CPU: a tiny model gets better at a calculator task.

    Builds a random model, warm-starts it on the tool-call format, then runs `trajstore
    learn` and `trajstore collect --follow` concurrently on one store with a staleness bound
    and hot reload, and reports the reward by policy version.

    \b
    Example:
        trajstore demo --dir /tmp/demo
    """
    from cli.demo import DemoSettings, run_demo  # torch and transformers load only when a demo runs

    settings = DemoSettings.quick(directory, seed) if quick else DemoSettings(directory, seed=seed)
    if steps is not None:
        settings = dataclasses.replace(settings, steps=steps)
    if minutes is not None:
        settings = dataclasses.replace(settings, time_limit_s=minutes * 60)
    result = run_demo(settings, say=console.print)
    show(result)


def show(result: DemoResult) -> None:
    table = Table(title="reward by policy version (rollouts each version sampled)", header_style="bold")
    for name in ("version", "rollouts", "mean reward", "correct", "used calculator", "tokens",
                 "staleness when trained"):
        table.add_column(name, justify="right")
    for row in result.by_version:
        table.add_row(str(row["version"]), str(row["rollouts"]), f"{row['reward']:.3f}",
                      "" if row["correct"] is None else f"{row['correct']:.2f}", f"{row['used_calculator']:.2f}",
                      str(row["tokens"]),
                      "" if row["staleness"] is None else f"{row['staleness']:.2f}")
    console.print(table)
    console.print(f"{result.steps} learner steps, {result.rollouts} rollouts, {result.tokens} tokens in "
                  f"{result.seconds / 60:.1f} min")
    if result.plot:
        console.print(f"plot: {result.plot}")
    store = result.store
    console.print("\nnext:")
    console.print(f"  trajstore query --store {store} \"SELECT version, step, consumed_rollouts FROM checkpoints\"")
    console.print(f"  trajstore query --store {store} \"SELECT min_version, avg(reward), count(*) FROM rollouts "
                  "GROUP BY ALL ORDER BY 1\"")
    console.print(f"  trajstore query --store {store} \"SELECT step, name, value FROM metrics WHERE name IN "
                  "('loss', 'reward_mean', 'staleness_mean') ORDER BY step\"")
    if result.example_rollout:
        console.print(f"  trajstore replay --store {store} {result.example_rollout} --model {result.directory / 'warm'}")
