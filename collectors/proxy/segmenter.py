"""Segmentation of one session's model calls into trainable samples: turns form trees of segments. Pure.

A session holds one token sequence: every prompt the policy saw plus every token it sampled.
A new call continues the session's segment when its prompt starts with exactly what the
segment holds; otherwise it starts a new segment whose prompt is whole (a *fork*).

What "starts with exactly what the segment holds" means here, and why. The agent sends chat
messages, not tokens, and the chat template re-renders the assistant's earlier replies from
their parsed text. Re-tokenizing that text rarely gives back the sampled ids (a BPE model may
sample "he"+"llo" where the tokenizer writes "hello"), so comparing token lists would fork on
nearly every turn although the model's context did not change at all. The check is therefore
done on rendered text, and the tokens are spliced:

- after each call the session keeps `text` = the rendered prompt + the sampled text (decoded
  with special tokens kept: exactly what the model saw and wrote; kept as its parts, never
  joined: the prompt as the pieces its calls added), and `ids` = the prompt ids sent + the
  *sampled* output ids (a `TokenLog`: the next call's ids are a view of it plus the delta, and
  each id's JSON is encoded at most once);
- the next call continues the segment iff its rendered prompt text starts with `text`: the
  template rendered the reply the agent sent back to exactly what the model wrote. Its
  prompt ids are the tokens of the rest of the text (what the template writes after the
  sampled text, such as `\\n` after a sampled `<|im_end|>` or `<|im_end|>\\n` after a reply
  cut by max_tokens, then the new messages), and the policy is sent `ids` + those: the model
  conditions on its own sampled tokens, never on a re-tokenization;
- when the prompt starts with the previous prompt but not with the sampled text, the reply
  came back different from what the model wrote (a stop string cut the text, `<|endoftext|>`
  instead of `<|im_end|>`, tool-call JSON spaced differently from the template, the agent
  re-serialized it): the call forks with reason `template_drift`;
- when the prompt is exactly the previous prompt (the agent sent the same call again: a retry
  after a timeout or a lost answer, or another draw for the same context), the call forks with
  reason `retry`;
- any other mismatch (compaction, edited or dropped messages, changed tools or system
  prompt) forks with reason `history_rewrite`.

Nothing here copies or encodes the session's history per call: the ids to send are a view
(`TokenIds`), and the session's ids grow in place. A prompt rendered as the held prompt and what
is new (`Extended`, from `collectors.proxy.extend`) is checked by its new part alone, and held
as the pieces it is made of: an agent's 80k-token history is never joined into one string or
compared again, call after call (a copy and a compare of 300 kB each that evict what the call
itself works on from the caches). Any other prompt is a whole text, compared piece by piece.

The check is made once, on the prompt the next call renders anyway, so a reply is never
rendered a second time just to predict what the agent will send. Only text the template emits
itself (what follows the sampled text, and the new messages) is ever tokenized; every token the
model sampled stays exactly as sampled, and is the only trainable part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from collectors.policy.token_ids import TokenIds, TokenLog
from collectors.proxy.reconcile import Answered

Encode = Callable[[str], list[int]]

HISTORY_REWRITE = "history_rewrite"
TEMPLATE_DRIFT = "template_drift"
RETRY = "retry"


@dataclass(frozen=True)
class Extended:
    """A prompt made of a held prompt's pieces (`base`, the very tuple a `Held` keeps) and the text after them
    (`new`): what `collectors.proxy.extend` renders for a call that extends its session's last."""

    base: tuple[str, ...]
    new: str

    def __str__(self) -> str:
        return "".join((*self.base, self.new))


Prompt = str | Extended  # a rendered prompt: whole, or extended from the session's held one


def prompt_pieces(prompt: Prompt) -> tuple[str, ...]:
    """The pieces a prompt's text is, in order (a piece a call: none for an empty one)."""
    if isinstance(prompt, Extended):
        return (*prompt.base, prompt.new) if prompt.new else prompt.base
    return (prompt,)


@dataclass
class Held:
    """What a segment holds after a call (see the module docstring)."""

    prompt: tuple[str, ...]  # the last call's rendered prompt, as the pieces the calls added (`prompt_pieces`)
    sampled_text: str  # the text the model sampled after it (special tokens kept)
    ids: TokenLog  # prompt ids + sampled output ids, in order

    @property
    def prompt_text(self) -> str:
        """The last call's prompt, joined (a copy of the whole: the checks here never make it)."""
        return "".join(self.prompt)

    @property
    def text(self) -> str:
        """The prompt and the sampled text, joined (a copy of the whole: `rest` checks without one)."""
        return "".join((*self.prompt, self.sampled_text))

    def _after_prompt(self, prompt: Prompt) -> tuple[str, int] | None:
        """(`prompt`'s text or its new part, where the held prompt ends in it) when `prompt` starts with the held
        prompt; None otherwise. An `Extended` of the held prompt starts with it by construction: only its new part
        is looked at."""
        if isinstance(prompt, Extended) and prompt.base is self.prompt:
            return prompt.new, 0
        text, at = str(prompt), 0
        for piece in self.prompt:
            if not text.startswith(piece, at):
                return None
            at += len(piece)
        return text, at

    def fork_reason(self, prompt: Prompt) -> str:
        """Why a prompt that does not extend the held text forks (see the module docstring)."""
        after = self._after_prompt(prompt)
        if after is None:
            return HISTORY_REWRITE
        text, at = after
        return RETRY if len(text) == at else TEMPLATE_DRIFT

    def rest(self, prompt: Prompt) -> str | None:
        """What `prompt` adds after the held text, or None when it does not start with it."""
        after = self._after_prompt(prompt)
        if after is None or not after[0].startswith(self.sampled_text, after[1]):
            return None
        text, at = after
        return text[at + len(self.sampled_text):]


@dataclass
class SessionState:
    """One conversation thread of a rollout: its current segment and its fork counts."""

    name: str
    segment_id: str | None = None
    next_turn: int = 0
    held: Held | None = None
    answered: Answered | None = None  # the last call's messages and reply, for `collectors.proxy.reconcile`
    forks: Counter[str] = field(default_factory=Counter)
    segments: int = 0
    turns: int = 0


@dataclass(frozen=True)
class TurnPlan:
    """Where the next call goes: its segment, turn index, prompt delta and the full ids to send."""

    segment_id: str
    turn_index: int
    prompt_ids: list[int]  # the turn event's prompt: whole on a new segment, the delta otherwise
    full_ids: Sequence[int]  # what the policy is sent: on a continued segment a view of the held ids + the delta
    fork: str | None  # why a new segment starts (None: first call of the session, or continued)
    previous_segment: str | None


def plan_turn(state: SessionState, prompt: Prompt, encode: Encode, new_segment_id: Callable[[], str]) -> TurnPlan:
    """Decide the next call's segment without changing `state` (the call may still fail)."""
    held = state.held
    fork: str | None = None
    if held is not None and state.segment_id is not None:
        rest = held.rest(prompt)
        if rest is not None:
            view = held.ids.view(encode(rest))  # the delta is its tail: its JSON is encoded once, for both
            return TurnPlan(state.segment_id, state.next_turn, view.tail, view, None, None)
        fork = held.fork_reason(prompt)
    ids = encode(str(prompt))
    # the segment's log from its first call: a policy server that holds a session's ids under the log's key
    # (`collectors.policy.embedded_client`) learns them from this call, and `record_turn` keeps this very log
    view = TokenLog(ids).view()
    return TurnPlan(new_segment_id(), 0, ids, view, fork, state.segment_id)


def _first_log(full_ids: Sequence[int]) -> TokenLog:
    """A new segment's log: the one its first call was a view of (`plan_turn`), unless grown since, else a copy."""
    if isinstance(full_ids, TokenIds) and not full_ids.tail and len(full_ids.log) == full_ids.logged:
        return full_ids.log
    return TokenLog(full_ids)


def record_turn(state: SessionState, plan: TurnPlan, prompt: Prompt, output_ids: Sequence[int],
                sampled_text: str) -> None:
    """Advance `state` past a stored call whose output ids decode to `sampled_text` (special tokens kept)."""
    if plan.turn_index == 0:
        state.segments += 1
        if plan.fork is not None:
            state.forks[plan.fork] += 1
    state.segment_id = plan.segment_id
    state.next_turn = plan.turn_index + 1
    state.turns += 1
    if plan.turn_index == 0 or state.held is None:
        ids = _first_log(plan.full_ids)
    else:  # the session's ids grow in place: a long episode is not copied or encoded again on every call
        ids = state.held.ids
        full = plan.full_ids  # the delta's JSON and packed bytes, when the policy client was sent them (the tail)
        if isinstance(full, TokenIds) and full.tail is plan.prompt_ids:
            ids.extend(plan.prompt_ids, full.tail_json(made_only=True), full.tail_int32(made_only=True))
        else:
            ids.extend(plan.prompt_ids)
    ids.extend(output_ids)
    state.held = Held(prompt=prompt_pieces(prompt), sampled_text=sampled_text, ids=ids)
