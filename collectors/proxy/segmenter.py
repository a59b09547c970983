"""Segmentation of one session's model calls into trainable samples (DESIGN.md, "Turns form trees"). Pure.

A session holds one token sequence: every prompt the policy saw plus every token it sampled.
A new call continues the session's segment when its prompt starts with exactly what the
segment holds; otherwise it starts a new segment whose prompt is whole (a *fork*).

What "starts with exactly what the segment holds" means here, and why. The agent sends chat
messages, not tokens, and the chat template re-renders the assistant's earlier replies from
their parsed text. Re-tokenizing that text rarely gives back the sampled ids (a BPE model may
sample "he"+"llo" where the tokenizer writes "hello"), so comparing token lists would fork on
nearly every turn although the model's context did not change at all. The check is therefore
done on rendered text, and the tokens are spliced:

- after each call the session keeps `text` = the rendered prompt + the reply as the template
  renders it back, through the assistant's end-of-turn (`...<|im_end|>\\n`), and `ids` = the
  prompt ids sent + the *sampled* output ids, plus `closing` = the ids of whatever the
  template adds after the sampled text (`\\n` after a sampled `<|im_end|>`, `<|im_end|>\\n`
  after a reply cut by max_tokens);
- the next call continues the segment iff its rendered prompt text starts with `text`; its
  prompt ids are `closing` + the tokens of the rest of the text, and the policy is sent
  `ids` + those: the model conditions on its own sampled tokens, never on a re-tokenization;
- the reply can only be spliced when the sampled text (special tokens kept) is a prefix of
  its re-rendering. When it is not (a stop string cut the text, `<|endoftext|>` instead of
  `<|im_end|>`, tool-call JSON spaced differently from the template), the history the agent
  sends back is not what the model saw: the next call forks with reason `template_drift`;
- any other mismatch (compaction, edited or dropped messages, changed tools or system
  prompt) forks with reason `history_rewrite`.

Only text the template emits itself (`closing` and the new messages) is ever tokenized; every
token the model sampled stays exactly as sampled, and is the only trainable part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Encode = Callable[[str], list[int]]

HISTORY_REWRITE = "history_rewrite"
TEMPLATE_DRIFT = "template_drift"


@dataclass
class Held:
    """What a segment holds after a call (see the module docstring)."""

    text: str  # rendered conversation through the last reply's end-of-turn
    ids: list[int]  # prompt ids + sampled output ids, in order
    closing: list[int]  # template tokens after the last sampled token, not yet in any turn
    drift: bool  # the last reply does not re-render to its sampled text


@dataclass
class SessionState:
    """One conversation thread of a rollout: its current segment and its fork counts."""

    name: str
    segment_id: str | None = None
    next_turn: int = 0
    held: Held | None = None
    forks: Counter[str] = field(default_factory=Counter)
    segments: int = 0
    turns: int = 0


@dataclass(frozen=True)
class TurnPlan:
    """Where the next call goes: its segment, turn index, prompt delta and the full ids to send."""

    segment_id: str
    turn_index: int
    prompt_ids: list[int]  # the turn event's prompt: whole on a new segment, the delta otherwise
    full_ids: list[int]  # what the policy is sent
    fork: str | None  # why a new segment starts (None: first call of the session, or continued)
    previous_segment: str | None


def plan_turn(state: SessionState, prompt_text: str, encode: Encode, new_segment_id: Callable[[], str]) -> TurnPlan:
    """Decide the next call's segment without changing `state` (the call may still fail)."""
    held = state.held
    if held is not None and state.segment_id is not None and prompt_text.startswith(held.text):
        if not held.drift:
            delta = held.closing + encode(prompt_text[len(held.text):])
            return TurnPlan(state.segment_id, state.next_turn, delta, held.ids + delta, None, None)
        fork: str | None = TEMPLATE_DRIFT
    else:
        fork = HISTORY_REWRITE if held is not None else None
    ids = encode(prompt_text)
    return TurnPlan(new_segment_id(), 0, ids, ids, fork, state.segment_id)


def closing_ids(sampled_text: str, reply_text: str | None, encode: Encode) -> list[int] | None:
    """Tokens the template writes after the sampled text, or None when the reply re-renders differently."""
    if reply_text is None or not reply_text.startswith(sampled_text):
        return None
    rest = reply_text[len(sampled_text):]
    return encode(rest) if rest else []


def record_turn(state: SessionState, plan: TurnPlan, prompt_text: str, output_ids: Sequence[int],
                reply_text: str | None, closing: list[int] | None) -> None:
    """Advance `state` past a stored call.

    `reply_text` is the template's rendering of the reply as the agent was answered (None: it
    cannot be rendered); `closing` is `closing_ids(...)` for it (None: the reply drifted).
    """
    if plan.turn_index == 0:
        state.segments += 1
        if plan.fork is not None:
            state.forks[plan.fork] += 1
    state.segment_id = plan.segment_id
    state.next_turn = plan.turn_index + 1
    state.turns += 1
    state.held = Held(text=prompt_text + (reply_text or ""), ids=plan.full_ids + list(output_ids),
                      closing=closing or [], drift=closing is None)
