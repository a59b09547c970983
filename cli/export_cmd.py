"""`trajstore export`: a thin shell over `trajstore.export.export`."""

from __future__ import annotations

import click
from cli.options import store_option

FORMAT_CHOICES = ("hf", "sft", "tokens", "ng-trajectory")  # trajstore.export.FORMATS, without importing pyarrow


@click.command("export")
@store_option
@click.option("--format", "fmt", type=click.Choice(FORMAT_CHOICES), required=True,
              help="hf: a Hugging Face dataset directory (Parquet + card), one row per sample; sft: chat-format "
                   "JSON lines (TRL's SFT trainer); tokens: a Parquet table, one row per token; ng-trajectory: "
                   "NeMo Gym's rollout JSON lines.")
@click.option("--run", required=True, help="The run to export (`trajstore stats` lists them).")
@click.option("--version", "version", type=click.IntRange(min=0),
              help="Export this table version (time travel; default: the latest, plus this machine's live rows).")
@click.option("--where", help="SQL condition over the exported rows, e.g. \"reward >= 1 AND status = 'completed'\".")
@click.argument("out", type=click.Path(dir_okay=True, file_okay=True))
def export(store_loc: str, fmt: str, run: str, version: int | None, where: str | None, out: str) -> None:
    """Export a run's samples to OUT, streaming (the run is never loaded whole).

    \b
    Examples:
      trajstore export --store runs/s --format hf --run r1 ds/
      trajstore export --store runs/s --format sft --run r1 --where "reward >= 1" sft.jsonl
      trajstore export --store runs/s --format tokens --run r1 tokens.parquet
      trajstore export --store runs/s --format ng-trajectory --run r1 rollouts.jsonl
    """
    import trajstore
    from trajstore.export import export as run_export

    store = trajstore.open_store(store_loc, create=False)
    result = run_export(store, fmt, run=run, out=out, version=version, where=where)  # type: ignore[arg-type]
    what = "token rows" if fmt == "tokens" else "samples"
    skipped = f" ({result.skipped} samples without chat JSON skipped)" if result.skipped else ""
    click.echo(f"{result.rows} {what} of run {run!r} written to {result.out} as {fmt}{skipped}; "
                  f"table version {result.table_version}")
