"""`trajstore demo`: a thin click shell over `cli.demo.run_demo`, plus the printed summary."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import click
from rich.columns import Columns
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cli.output import CommandConsole
from cli.replay_cmd import render_answers
from learner.settings import LossName

if TYPE_CHECKING:
    from cli.demo import DemoResult

console = CommandConsole()


@click.command("demo")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=Path("trajstore-demo"),
              show_default=True, help="A new directory for the model, checkpoints, store, logs and plot.")
@click.option("--quick", is_flag=True, help="The CI-sized loop: the same task, 40 learner steps instead of 90.")
@click.option("--steps", type=click.IntRange(min=1), help="Learner steps (default: the preset's).")
@click.option("--minutes", type=click.FloatRange(min=0.5),
              help="Safety net for collect + learn (default: 60); the demo's budget is its learner steps. When "
                   "it fires, the demo says so and exits with status 1.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine", type=click.Choice(["embedded", "vllm"]), default="embedded", show_default=True,
              help="Who serves the model to the collector: the embedded server, or vLLM from .venv-vllm "
                   "(collect --vllm); the preset is the same.")
@click.option("--loss", type=click.Choice(get_args(LossName)), default="ppo", show_default=True,
              help="The learner's loss (learn --loss; distill needs a teacher, which the loop does not have).")
def demo(directory: Path, quick: bool, steps: int | None, minutes: float | None, seed: int, engine: str,
         loss: str) -> None:
    """The closed loop on this machine's CPU: a tiny model learns by RL to pack for the forecast.

    Builds a random model, warm-starts it on the format (call the forecast tool, name an item:
    the right one in 30% of the worked episodes), then runs `trajstore learn` and `trajstore collect --follow`
    concurrently on one store with a staleness bound and hot reload, and reports how often
    each policy version packed the right item (`correct`), with a replay of one failure of
    version 0 beside one success late in the run.

    \b
    Example:
        trajstore demo --dir /tmp/demo
    """
    from cli.demo import DemoSettings, run_demo  # torch and transformers load only when a demo runs

    settings = DemoSettings.quick(directory, seed) if quick else DemoSettings(directory, seed=seed)
    settings = dataclasses.replace(settings, engine=engine, loss=loss)
    if steps is not None:
        settings = dataclasses.replace(settings, steps=steps)
    if minutes is not None:
        settings = dataclasses.replace(settings, time_limit_s=minutes * 60)
    result = run_demo(settings, say=console.print)
    show(result)
    if result.cut_short:
        raise click.ClickException(f"the demo was cut short: {result.cut_short}")


def show(result: DemoResult) -> None:
    from cli.demo import last_quarter

    rows = result.by_version
    table = Table(title="correct by policy version: packed the right item for the forecast (rollouts each "
                        "version sampled)", header_style="bold")
    for name in ("version", "correct", "95% interval", "rollouts", "called forecast", "tokens",
                 "staleness when trained"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(str(row["version"]), f"{row['correct']:.2f}", f"{row['low']:.2f}-{row['high']:.2f}",
                      str(row["rollouts"]), f"{row['called_tool']:.2f}", str(row["tokens"]),
                      "" if row["staleness"] is None else f"{row['staleness']:.2f}")
    console.print(table)
    if rows:
        late = last_quarter(rows)
        first = rows[0]
        console.print(f"[bold]correct: version 0 {first['correct']:.2f} ({first['low']:.2f}-{first['high']:.2f}, "
                      f"{first['rollouts']} rollouts) -> last quarter, versions {late['versions'][0]}-"
                      f"{late['versions'][-1]}: {late['correct']:.2f} ({late['low']:.2f}-{late['high']:.2f}, "
                      f"{late['rollouts']} rollouts)[/bold]; without reading the forecast the best is 0.25")
    console.print(f"{result.steps} of {result.planned_steps} learner steps, {result.rollouts} rollouts, "
                  f"{result.tokens} tokens in {result.seconds / 60:.1f} min")
    if result.cut_short:
        console.print(f"[bold red]CUT SHORT:[/bold red] {result.cut_short}")
    if result.plot:
        console.print(f"plot: {result.plot}")
    store = result.store
    if result.failure and result.success:
        show_pair(result)
    console.print("\nnext:")
    console.print(f"  trajstore query --store {store} \"SELECT version, step, consumed_rollouts FROM checkpoints\"")
    console.print(f"  trajstore query --store {store} \"SELECT min_version, avg(reward), count(*) FROM rollouts "
                  "GROUP BY ALL ORDER BY 1\"")
    console.print(f"  trajstore query --store {store} \"SELECT step, name, value FROM metrics WHERE name IN "
                  "('loss', 'reward_mean', 'staleness_mean') ORDER BY step\"")
    for rollout in (result.failure, result.success):
        if rollout:
            console.print(f"  trajstore replay --store {store} {rollout} --model {result.directory / 'warm'} --brief")


def show_pair(result: DemoResult) -> None:
    """One failure of version 0 beside one success of the last quarter, as `trajstore replay --brief` shows them."""
    import trajstore
    from collectors.replay import load_episode, tokenizer_decode

    store = trajstore.open_store(result.store, create=False)
    decode = tokenizer_decode(str(result.directory / "warm"))
    width = max(44, (console.width - 2) // 2)  # two panels side by side, each with a border and padding of 4
    panels = []
    for rollout, title in ((result.failure, "version 0: a failure"), (result.success, "late in the run: a success")):
        out = Console(width=width - 4, record=True, file=io.StringIO(), force_terminal=console.is_terminal)
        render_answers(load_episode(store, rollout, decode=decode), out)
        panels.append(Panel(Text.from_ansi(out.export_text(styles=True)), title=title, width=width))
    console.print(Columns(panels))
