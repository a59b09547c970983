"""`trajstore view`: the read-only web viewer, a thin shell over `collectors.viewer.run`."""

from __future__ import annotations

import click

from cli.options import store_option


@click.command("view")
@store_option
@click.option("--port", type=int, default=8200, show_default=True, help="TCP port (0 picks a free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default: anyone who can reach it reads the whole store.")
@click.option("--model", "model", type=click.Path(exists=True, file_okay=False),
              help="Decode tokens with this checkpoint's tokenizer (default: the newest checkpoint the store "
                   "announces, if it is on this disk; otherwise token ids are shown).")
def view(store_loc: str, port: int, host: str, model: str | None) -> None:
    """Browse runs, rollouts, groups and episodes in a web page, down to each token.

    Read-only and live: pages read the latest table version plus this machine's unsealed rows
    (add ?v=N to pin a version). Runs: reward by policy version and the learner's curves;
    rollouts: a filterable table; an episode: what the model saw, with a token view of ids,
    behaviour logprobs and masks.

    \b
    Example:
      trajstore view --store runs/s --model tiny-model     # then open http://127.0.0.1:8200/
    """
    from collectors.viewer import ViewerSettings, run

    run(ViewerSettings(store=store_loc, host=host, port=port, model=model))
