"""Segmentation of a session's calls, as pure functions over text and token ids (no model, no server).

Tokens here are characters (`encode` = code points) and "sampled" ids are made-up numbers
above 1000, so a test can tell spliced sampled ids from re-tokenized text.
"""

from __future__ import annotations

import functools
import itertools

import orjson

from collectors.policy import token_ids
from collectors.proxy.segmenter import (
    HISTORY_REWRITE,
    RETRY,
    TEMPLATE_DRIFT,
    Extended,
    SessionState,
    TurnPlan,
    plan_turn,
    record_turn,
)

END = "<|im_end|>"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def ids_factory():
    counter = itertools.count()
    return lambda: f"seg-{next(counter)}"


def call(state: SessionState, prompt: str, sampled: str, new_id, out_ids=None) -> TurnPlan:
    """One call: plan, 'sample' `sampled` (ids 1000+), record."""
    plan = plan_turn(state, prompt, encode, new_id)
    output = out_ids if out_ids is not None else [1000 + i for i in range(len(sampled))]
    record_turn(state, plan, prompt, output, sampled)
    return plan


def test_first_call_is_a_whole_prompt_and_not_a_fork() -> None:
    state, new_id = SessionState("main"), ids_factory()
    plan = call(state, "U:hi\nA:", "yo" + END, new_id)
    assert plan.segment_id == "seg-0" and plan.turn_index == 0 and plan.fork is None
    assert plan.prompt_ids == plan.full_ids == encode("U:hi\nA:")
    assert state.segments == 1 and not state.forks


def test_a_prompt_extending_the_held_text_continues_with_the_sampled_ids_spliced() -> None:
    state, new_id = SessionState("main"), ids_factory()
    first = call(state, "U:hi\nA:", "yo" + END, new_id, out_ids=[1001, 1002, 1003])
    second = plan_turn(state, "U:hi\nA:yo" + END + "\nU:more\nA:", encode, new_id)
    assert second.segment_id == first.segment_id and second.turn_index == 1 and second.fork is None
    # the delta: the template's newline after the sampled end-of-turn, then the new message
    assert second.prompt_ids == encode("\n") + encode("U:more\nA:")
    # the policy sees its own sampled ids, not a re-tokenization of "yo<|im_end|>"
    assert second.full_ids == encode("U:hi\nA:") + [1001, 1002, 1003] + second.prompt_ids


def test_a_reply_cut_by_max_tokens_is_closed_by_prompt_tokens() -> None:
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "partial", new_id)
    plan = plan_turn(state, "P" + "partial" + END + "\nU", encode, new_id)
    assert plan.fork is None and plan.prompt_ids == encode(END + "\n") + encode("U")


def test_a_rewritten_history_forks_into_a_whole_new_segment() -> None:
    state, new_id = SessionState("main"), ids_factory()
    first = call(state, "S U1 A:", "a1" + END, new_id)
    call(state, "S U1 A:a1" + END + "\nU2 A:", "a2" + END, new_id)
    compacted = call(state, "S summary A:", "a3" + END, new_id)
    assert compacted.fork == HISTORY_REWRITE and compacted.previous_segment == first.segment_id
    assert compacted.turn_index == 0 and compacted.prompt_ids == encode("S summary A:")
    assert state.segments == 2 and state.forks == {HISTORY_REWRITE: 1} and state.turns == 3
    after = plan_turn(state, "S summary A:a3" + END + "\nU A:", encode, new_id)
    assert after.segment_id == compacted.segment_id and after.turn_index == 1


def test_a_reply_the_template_cannot_reproduce_forks_the_next_call_as_drift() -> None:
    state, new_id = SessionState("main"), ids_factory()
    # sampled '{"a":1}' but the template writes '{"a": 1}' back
    call(state, "P", '{"a":1}' + END, new_id)
    plan = plan_turn(state, "P" + '{"a": 1}' + END + "\nU", encode, new_id)
    assert plan.fork == TEMPLATE_DRIFT and plan.prompt_ids == plan.full_ids
    # a history that does not even extend the text is a rewrite, whatever the drift
    assert plan_turn(state, "Q", encode, new_id).fork == HISTORY_REWRITE


def test_a_stop_string_cut_reply_sent_back_shorter_forks_as_drift() -> None:
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "hello STOP", new_id)  # the server stopped on "STOP"; the agent saw "hello "
    plan = plan_turn(state, "P" + "hello " + END + "\nU", encode, new_id)
    assert plan.fork == TEMPLATE_DRIFT and plan.previous_segment is not None


def test_the_same_prompt_sent_again_forks_as_a_retry() -> None:
    """An agent that resends its last call (a retry after a lost answer, another draw) neither continues the
    segment nor drifted: the reason says so."""
    state, new_id = SessionState("main"), ids_factory()
    first = call(state, "S U1 A:", "a1" + END, new_id)
    again = call(state, "S U1 A:", "b1" + END, new_id)
    assert again.fork == RETRY and again.previous_segment == first.segment_id and again.turn_index == 0
    assert again.prompt_ids == encode("S U1 A:") and state.forks == {RETRY: 1}
    # the prompt and one more character is not a retry
    assert plan_turn(state, "S U1 A:x", encode, new_id).fork == TEMPLATE_DRIFT


def test_planning_does_not_change_the_session() -> None:
    """A call whose upstream fails leaves the session exactly as it was."""
    state, new_id = SessionState("main"), ids_factory()
    call(state, "P", "a" + END, new_id)
    before = (state.segment_id, state.next_turn, state.held, dict(state.forks), state.segments)
    plan_turn(state, "totally different", encode, new_id)
    plan_turn(state, "Pa" + END + "\nU", encode, new_id)
    assert (state.segment_id, state.next_turn, state.held, dict(state.forks), state.segments) == before


def test_sessions_are_independent() -> None:
    main, sub, new_id = SessionState("main"), SessionState("sub"), ids_factory()
    a = call(main, "P", "a" + END, new_id)
    b = call(sub, "P", "a" + END, new_id)
    assert a.segment_id != b.segment_id and a.fork is None and b.fork is None


def test_a_long_chain_sends_every_prompt_delta_and_sampled_id_in_order() -> None:
    state, new_id = SessionState("main"), ids_factory()
    prompt, expected = "U0\nA:", encode("U0\nA:")
    for k in range(5):
        out = [2000 + 10 * k + i for i in range(3)]
        plan = call(state, prompt, f"r{k}" + END, new_id, out_ids=out)
        assert plan.full_ids == expected and plan.fork is None and plan.turn_index == k
        expected = expected + out
        delta = f"\nU{k + 1}\nA:"
        prompt = prompt + f"r{k}" + END + delta
        expected = expected + encode(delta)


def test_a_prompt_extended_from_the_held_pieces_plans_as_its_joined_text_without_joining_it() -> None:
    """A prompt given as the held prompt's pieces and what follows them (`Extended`, as `collectors.proxy.extend`
    renders it) plans exactly as its joined text, continuations and forks alike; the session holds the pieces."""
    new_id = ids_factory()
    whole, pieces = SessionState("main"), SessionState("main")
    for state in (whole, pieces):
        call(state, "U0\nA:", '{"a":1}' + END, new_id)
    steps = [  # (what follows the held prompt, the reply sampled next, the fork expected)
        (lambda held: held.sampled_text + "\nU1\nA:", "b" + END, None),
        (lambda held: '{"a": 1}' + END + "\nU2\nA:", "c" + END, None),  # respaced: not what was sampled
        (lambda held: "", "d" + END, RETRY),  # the last prompt again
        (lambda held: held.sampled_text + "\nU3\nA:", "e" + END, None)]
    forks = [None, TEMPLATE_DRIFT, RETRY, None]
    replies = ['{"a":1}' + END] + [reply for _, reply, _ in steps]
    for k, (after, reply, _) in enumerate(steps):
        text = whole.held.prompt_text + after(whole.held)
        extended = Extended(pieces.held.prompt, after(pieces.held))
        assert str(extended) == text
        a, b = plan_turn(whole, text, encode, new_id), plan_turn(pieces, extended, encode, new_id)
        assert a.fork == b.fork == forks[k] and a.turn_index == b.turn_index
        assert list(a.prompt_ids) == list(b.prompt_ids) and list(a.full_ids) == list(b.full_ids)
        record_turn(whole, a, text, [3000 + k], replies[k + 1])
        record_turn(pieces, b, extended, [3000 + k], replies[k + 1])
        assert pieces.held.prompt_text == whole.held.prompt_text and len(whole.held.prompt) == 1
    assert whole.forks == pieces.forks == {TEMPLATE_DRIFT: 1, RETRY: 1}
    assert len(pieces.held.prompt) == 4  # a piece a call, forks included; none for the retry's empty one
    # an `Extended` of other pieces than the held ones is checked as its text
    stranger = Extended((pieces.held.prompt_text,), pieces.held.sampled_text + "\nU4\nA:")
    assert plan_turn(pieces, stranger, encode, new_id).fork is None


def counted(encoded: list[int], dumps, ids) -> bytes:
    encoded.append(len(ids))
    return dumps(ids)


def test_a_stored_call_grows_the_session_by_the_json_its_prompt_was_sent_with(monkeypatch) -> None:
    """The prompt ids are encoded to JSON once per call (for a policy server sent JSON); recording the call takes
    that JSON (a huge call's ids are millions) and encodes nothing; the next call's JSON encodes only the ids
    added since, the sampled ones."""
    state, new_id = SessionState("main"), ids_factory()
    for prompt, sampled in (("U:hi\nA:", "yo" + END), ("U:hi\nA:yo" + END + "\nU:more\nA:", "ok" + END),
                            ("U:other\nA:", "no" + END)):  # a first call, a continued one, a fork
        plan = plan_turn(state, prompt, encode, new_id)
        sent = plan.full_ids.json()  # what the policy client sends
        encoded: list[int] = []
        monkeypatch.setattr(token_ids.orjson, "dumps", functools.partial(counted, encoded, token_ids.orjson.dumps))
        output = [1000 + i for i in range(len(sampled))]
        record_turn(state, plan, prompt, output, sampled)
        assert encoded == [], encoded
        grown = state.held.ids.view().json()
        monkeypatch.undo()
        assert encoded == [len(output)], encoded
        assert grown == sent[:-1] + b"," + orjson.dumps(output)[1:]


def test_a_new_segment_starts_a_new_log_and_a_view_of_the_last_one_stays_exact() -> None:
    state, new_id = SessionState("main"), ids_factory()
    call(state, "U:a long first prompt\\nA:", "yo" + END, new_id)
    first = state.held.ids
    kept = first.view()  # e.g. a prompt still being sent
    call(state, "U:another one\\nA:", "ok" + END, new_id)  # a fork: a new log
    assert state.held.ids is not first and state.segments == 2
    assert kept == encode("U:a long first prompt\\nA:") + [1000 + i for i in range(len("yo" + END))]
    assert state.held.ids.ids.tolist() == encode("U:another one\\nA:") + [1000 + i for i in range(len("ok" + END))]