"""`trajstore annotate`: a thin click shell over `learner.annotate.annotate`."""

from __future__ import annotations

import click

from cli.options import store_option


@click.command("annotate")
@store_option
@click.option("--run", required=True, help="The run whose samples to score.")
@click.option("--teacher-model", required=True, type=click.Path(exists=True, file_okay=False),
              help="The teacher: a Hugging Face checkpoint directory with the student's tokenizer.")
@click.option("--name", required=True, help="The name the scores are filed under (what `learn --teacher` reads).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Divide the teacher's logits by this before the softmax.")
@click.option("--micro-batch-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Packed tokens per forward pass.")
def annotate(store_loc: str, run: str, teacher_model: str, name: str, device: str, temperature: float,
             micro_batch_tokens: int) -> None:
    """Score the run's stored samples with a teacher model and append its logprobs as events.

    Every output token of every turn gets the teacher's logprob in the context of its sample,
    appended as a `teacher` event per turn (history is not rewritten); the
    `teacher_logprobs` view aligns them with each sample's tokens, and `learn --loss distill
    --teacher NAME` trains the student toward them. Samples already scored under NAME are
    skipped, so a rerun scores only what is new.

    \b
    Example:
      trajstore annotate --store runs/s --run exp1 --teacher-model runs/teacher --name big
      trajstore learn --store runs/s --run exp1 --model runs/student --checkpoints runs/ck \\
          --loss distill --teacher big --steps 20
    """
    from learner.annotate import annotate as run_annotate

    s = run_annotate(store_loc, run, teacher_model, name, device=device, temperature=temperature,
                     micro_batch_tokens=micro_batch_tokens)
    click.echo(f"teacher {s.teacher!r}: scored {s.samples} samples of run {s.run!r} ({s.turns} turns, {s.tokens} "
               f"output tokens); {s.skipped} samples were already scored")
