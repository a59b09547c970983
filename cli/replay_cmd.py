"""`trajstore replay`: one stored rollout shown the way the model saw it (rich), or as JSON.

A thin click shell over `collectors.replay.load_episode`; the rendering is here. Prompt and
tool-observation tokens are dim, sampled trainable tokens bold green, sampled tokens masked
out of the loss yellow.
"""

from __future__ import annotations

import json
from statistics import fmean
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from cli.options import store_option
from cli.output import CommandConsole

if TYPE_CHECKING:
    from collectors.replay import Decode, Episode, ReplayTurn, Span

STYLES = {"prompt": "dim", "sampled": "bold green", "sampled_masked": "yellow"}
LABELS = {"prompt": "prompt / tool observation", "sampled": "sampled (trainable)",
          "sampled_masked": "sampled, masked out of the loss"}


def _span_text(span: Span) -> str:
    return span.text if span.text is not None else "[" + " ".join(map(str, span.ids)) + "] "


def _turn_header(turn: ReplayTurn) -> Text:
    trained = sum(turn.output_mask)
    mean = f" · mean logprob {fmean(turn.output_logprobs):.3f}" if turn.output_logprobs else ""
    return Text(f"turn {turn.turn_index} · policy v{turn.policy_version} · finish {turn.finish_reason or '?'} · "
                f"{len(turn.prompt_ids)} prompt + {len(turn.output_ids)} sampled tokens ({trained} trainable){mean}",
                style="bold")


def _token_table(turn: ReplayTurn, decode: Decode | None) -> Table:
    table = Table(show_edge=False, header_style="bold", pad_edge=False)
    for name in ("#", "kind", "id", "text", "logprob"):
        table.add_column(name, justify="right" if name in ("#", "id", "logprob") else "left")
    from collectors.replay import token_rows

    for i, row in enumerate(token_rows(turn, decode)):
        logprob = "" if row["logprob"] is None else f"{row['logprob']:.4f}"
        text = "" if row["text"] is None else repr(row["text"])
        table.add_row(str(i), row["kind"], str(row["id"]), Text(text), logprob, style=STYLES[row["kind"]])
    return table


def render(episode: Episode, console: Console, *, decode: Decode | None = None, tokens: bool = False) -> None:
    """Print an episode: summary, then per segment and turn its tokens, tool traffic and versions."""
    rewards = ", ".join(f"{k}={v:g}" for k, v in episode.rewards.items())
    reward = f"{episode.reward:g} ({rewards})" if episode.reward is not None else "none"
    n_turns = sum(len(s.turns) for s in episode.segments)
    console.print(Text(f"rollout {episode.rollout_id}", style="bold"), Text(f"run {episode.run} · group "
                                                                           f"{episode.group_id}"))
    console.print(Text(f"status {episode.status or 'none'}" + (f" ({episode.error})" if episode.error else "")
                       + f" · reward {reward} · policy versions {', '.join(map(str, episode.policy_versions))} · "
                       f"{len(episode.segments)} segment(s), {n_turns} turn(s)"))
    legend = Text("legend: ")
    for kind, label in LABELS.items():
        legend.append(label, style=STYLES[kind]).append("  ")
    console.print(legend if episode.decoded else legend.append("(token ids: pass --model DIR to decode)"))
    for n, segment in enumerate(episode.segments, 1):
        extra = f" · segment reward {segment.reward:g}" if segment.reward is not None else ""
        console.rule(Text(f"segment {n}/{len(episode.segments)} {segment.segment_id} · session "
                          f"{segment.session_id or '-'}{extra}"))
        for turn in segment.turns:
            console.print(_turn_header(turn))
            for result in turn.tool_results:
                console.print(Text(f"← tool result{f' ({result.name})' if result.name else ''}: {result.content}",
                                   style="magenta"))
            body = Text()
            for span in turn.spans:
                body.append(_span_text(span), style=STYLES[span.kind])
            console.print(body)
            for call in turn.tool_calls:
                console.print(Text(f"→ tool call {call.name} {call.arguments}", style="cyan"))
            if tokens:
                console.print(_token_table(turn, decode))


def _last_user_message(turn: ReplayTurn) -> str | None:
    """The last user message of a decoded ChatML prompt (the templates of init-model and Qwen), if any."""
    text = "".join(span.text or "" for span in turn.spans if span.kind == "prompt")
    start = text.rfind("<|im_start|>user\n")
    if start < 0:
        return None
    body = text[start + len("<|im_start|>user\n"):]
    return body.split("<|im_end|>", 1)[0].strip() or None


def render_answers(episode: Episode, console: Console) -> None:
    """The brief form: the question, then per turn what the tool returned, what the model wrote and
    the tools it called; no prompt tokens (`render` shows those)."""
    rewards = ", ".join(f"{k}={v:g}" for k, v in episode.rewards.items()) or "none"
    console.print(Text(f"rollout {episode.rollout_id} · policy v{', v'.join(map(str, episode.policy_versions))} · "
                       f"reward {rewards}", style="bold"))
    turns = [turn for segment in episode.segments for turn in segment.turns]
    question = _last_user_message(turns[0]) if turns and episode.decoded else None
    if question:
        console.print(Text(f"user: {question}"))
    for turn in turns:
        for result in turn.tool_results:
            console.print(Text(f"← tool result{f' ({result.name})' if result.name else ''}: {result.content}",
                               style="magenta"))
        wrote = "".join(_span_text(span) for span in turn.spans if span.kind != "prompt").strip()
        console.print(Text(f"model (v{turn.policy_version}): ", style="bold").append(wrote, style="green"))
        for call in turn.tool_calls:
            console.print(Text(f"→ tool call {call.name} {call.arguments}", style="cyan"))


@click.command("replay")
@store_option
@click.argument("rollout_id")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
              help="Decode tokens with this checkpoint's tokenizer; without it, token ids are shown.")
@click.option("--tokens", is_flag=True, help="Add every token: id, text, kind and logprob.")
@click.option("--json", "as_json", is_flag=True, help="Print the episode as one JSON object.")
@click.option("--brief", is_flag=True, help="Only the question, the tool traffic and what the model wrote.")
def replay(store_loc: str, rollout_id: str, model_dir: str | None, tokens: bool, as_json: bool, brief: bool) -> None:
    """Show a past episode the way the model saw it.

    Per segment and turn: prompt and tool-observation tokens (dim) and sampled tokens (bold
    green; yellow where masked out of the loss), tool calls and results, policy versions,
    rewards and status. Find rollout ids with `trajstore query`.

    \b
    Example:
      trajstore query --store runs/s "SELECT rollout_id, reward FROM rollouts LIMIT 5"
      trajstore replay --store runs/s ROLLOUT_ID --model tiny-model --tokens
    """
    import trajstore
    from collectors.replay import load_episode, token_rows, tokenizer_decode

    store = trajstore.open_store(store_loc, create=False)
    decode = tokenizer_decode(model_dir) if model_dir else None
    episode = load_episode(store, rollout_id, decode=decode)
    if as_json:
        payload = episode.as_json()
        if tokens:
            for seg, segment in zip(payload["segments"], episode.segments, strict=True):
                for out, turn in zip(seg["turns"], segment.turns, strict=True):
                    out["tokens"] = token_rows(turn, decode)
        click.echo(json.dumps(payload, default=str))
        return
    if brief:
        render_answers(episode, CommandConsole())
        return
    render(episode, CommandConsole(), decode=decode, tokens=tokens)


if __name__ == "__main__":
    replay()
