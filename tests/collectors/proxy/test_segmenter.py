"""Segmentation of a session's calls, as pure functions over text and token ids (no model, no server).

Tokens here are characters (`encode` = code points) and "sampled" ids are made-up numbers
above 1000, so a test can tell spliced sampled ids from re-tokenized text.
"""

from __future__ import annotations

import itertools

from collectors.proxy.segmenter import (
    HISTORY_REWRITE,
    TEMPLATE_DRIFT,
    SessionState,
    TurnPlan,
    closing_ids,
    plan_turn,
    record_turn,
)

END = "<|im_end|>"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def ids_factory():
    counter = itertools.count()
    return lambda: f"seg-{next(counter)}"


def call(state: SessionState, prompt: str, sampled: str, reply: str | None, new_id, out_ids=None) -> TurnPlan:
    """One call: plan, 'sample' (ids 1000+), record. `reply` is the template's re-rendering."""
    plan = plan_turn(state, prompt, encode, new_id)
    output = out_ids if out_ids is not None else [1000 + i for i in range(len(sampled))]
    record_turn(state, plan, prompt, output, reply, closing_ids(sampled, reply, encode))
    return plan


def test_first_call_is_a_whole_prompt_and_not_a_fork() -> None:
    state, new_id = SessionState("main"), ids_factory()
    plan = call(state, "U:hi\nA:", "yo" + END, "yo" + END + "\n", new_id)
    assert plan.segment_id == "seg-0" and plan.turn_index == 0 and plan.fork is None
    assert plan.prompt_ids == plan.full_ids == encode("U:hi\nA:")
    assert state.segments == 1 and not state.forks


def test_a_prompt_extending_the_held_text_continues_with_the_sampled_ids_spliced() -> None:
    state, new_id = SessionState("main"), ids_factory()
    first = call(state, "U:hi\nA:", "yo" + END, "yo" + END + "\n", new_id, out_ids=[1001, 1002, 1003])
    second = plan_turn(state, "U:hi\nA:yo" + END + "\nU:more\nA:", encode, new_id)
    assert second.segment_id == first.segment_id and second.turn_index == 1 and second.fork is None
    # the delta: the template's newline after the sampled end-of-turn, then the new message
    assert second.prompt_ids == encode("\n") + encode("U:more\nA:")
    # the policy sees its own sampled ids, not a re-tokenization of "yo<|im_end|>"
    assert second.full_ids == encode("U:hi\nA:") + [1001, 1002, 1003] + second.prompt_ids


def test_a_reply_cut_by_max_tokens_is_closed_by_prompt_tokens() -> None:
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "partial", "partial" + END + "\n", new_id)
    plan = plan_turn(state, "P" + "partial" + END + "\nU", encode, new_id)
    assert plan.fork is None and plan.prompt_ids == encode(END + "\n") + encode("U")


def test_a_rewritten_history_forks_into_a_whole_new_segment() -> None:
    state, new_id = SessionState("main"), ids_factory()
    first = call(state, "S U1 A:", "a1" + END, "a1" + END + "\n", new_id)
    call(state, "S U1 A:a1" + END + "\nU2 A:", "a2" + END, "a2" + END + "\n", new_id)
    compacted = call(state, "S summary A:", "a3" + END, "a3" + END + "\n", new_id)
    assert compacted.fork == HISTORY_REWRITE and compacted.previous_segment == first.segment_id
    assert compacted.turn_index == 0 and compacted.prompt_ids == encode("S summary A:")
    assert state.segments == 2 and state.forks == {HISTORY_REWRITE: 1} and state.turns == 3
    after = plan_turn(state, "S summary A:a3" + END + "\nU A:", encode, new_id)
    assert after.segment_id == compacted.segment_id and after.turn_index == 1


def test_a_reply_the_template_cannot_reproduce_forks_the_next_call_as_drift() -> None:
    state, new_id = SessionState("main"), ids_factory()
    # sampled '{"a":1}' but the template writes '{"a": 1}' back
    call(state, "P", '{"a":1}' + END, '{"a": 1}' + END + "\n", new_id)
    assert state.held is not None and state.held.drift
    plan = plan_turn(state, "P" + '{"a": 1}' + END + "\nU", encode, new_id)
    assert plan.fork == TEMPLATE_DRIFT and plan.prompt_ids == plan.full_ids
    # a history that does not even extend the text is a rewrite, whatever the drift
    assert plan_turn(state, "Q", encode, new_id).fork == HISTORY_REWRITE


def test_a_reply_that_cannot_be_rendered_counts_as_drift() -> None:
    assert closing_ids("x", None, encode) is None
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "x", None, new_id)
    assert plan_turn(state, "P", encode, new_id).fork == TEMPLATE_DRIFT


def test_planning_does_not_change_the_session() -> None:
    """A call whose upstream fails leaves the session exactly as it was."""
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "a" + END, "a" + END + "\n", new_id)
    before = (state.segment_id, state.next_turn, state.held, dict(state.forks), state.segments)
    plan_turn(state, "totally different", encode, new_id)
    plan_turn(state, "Pa" + END + "\nU", encode, new_id)
    assert (state.segment_id, state.next_turn, state.held, dict(state.forks), state.segments) == before


def test_sessions_are_independent() -> None:
    main, sub, new_id = SessionState("main"), SessionState("sub"), ids_factory()
    a = call(main, "P", "a" + END, "a" + END + "\n", new_id)
    b = call(sub, "P", "a" + END, "a" + END + "\n", new_id)
    assert a.segment_id != b.segment_id and a.fork is None and b.fork is None
