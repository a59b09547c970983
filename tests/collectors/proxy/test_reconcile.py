"""History reconciliation as pure functions: the agent's copy of a reply, same meaning or a real rewrite."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.proxy.reconcile import (
    EXACT,
    FIRST,
    RESERIALIZED,
    REWRITTEN,
    Answered,
    _same,
    _same_history,
    reconcile,
    reply_message,
)

USER = {"role": "user", "content": "2+2?"}
RAW = '<think>\nadd\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
REPLY = reply_message("", "add", [("add", '{"a": 2, "b": 2}')])
SAMPLED = {"role": "assistant", "content": RAW}
ANSWERED = Answered(messages=[USER], prompt_messages=[USER], reply=REPLY, sampled=SAMPLED, continue_final=False)
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "4"}


def sent(content: Any = None, reasoning: str | None = None, args: Any = '{"a": 2, "b": 2}',
         name: str = "add") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content,
                               "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


SAME = [
    ("as answered", sent(reasoning="add"), EXACT),
    ("compact JSON (pydantic-ai)", sent(args='{"a":2,"b":2}'), RESERIALIZED),
    ("arguments as an object (Anthropic)", sent(reasoning="add", args={"b": 2, "a": 2}), EXACT),
    ("reasoning dropped", sent(), RESERIALIZED),
    ("think block left in the content", sent(content="<think>\nadd\n</think>\n\n", reasoning=None), RESERIALIZED),
    ("whitespace", sent(content="  ", reasoning=" add\n"), RESERIALIZED),
]


@pytest.mark.parametrize(("reply", "how"), [c[1:] for c in SAME], ids=[c[0] for c in SAME])
def test_a_reply_with_the_same_meaning_is_rendered_as_sampled(reply: dict[str, Any], how: str) -> None:
    messages, got = reconcile([USER, reply, RESULT], ANSWERED)
    assert got == how and messages == [USER, SAMPLED, RESULT]


REWRITES = [
    ("other arguments", [USER, sent(args='{"a": 3, "b": 2}'), RESULT]),
    ("other tool", [USER, sent(name="sub"), RESULT]),
    ("other reasoning", [USER, sent(reasoning="subtract"), RESULT]),
    ("a call dropped", [USER, {"role": "assistant", "content": "4"}, RESULT]),
    ("edited question", [{"role": "user", "content": "3+3?"}, sent(), RESULT]),
    ("compacted", [{"role": "user", "content": "summary"}, RESULT]),
    ("history shorter than before", [USER]),
]


@pytest.mark.parametrize("messages", [c[1] for c in REWRITES], ids=[c[0] for c in REWRITES])
def test_a_real_rewrite_is_left_alone(messages: list[dict[str, Any]]) -> None:
    assert reconcile(messages, ANSWERED) == (messages, REWRITTEN)


def test_the_first_call_and_earlier_turns_as_they_were_rendered() -> None:
    assert reconcile([USER], None) == ([USER], FIRST)
    # a third call: the first reply is rendered as it was (sampled), the second reconciled now
    second = Answered(messages=[USER, sent(args='{"a":2,"b":2}'), RESULT], prompt_messages=[USER, SAMPLED, RESULT],
                      reply=reply_message("It is 4.", None, []), sampled={"role": "assistant", "content": "It is 4."},
                      continue_final=False)
    follow = {"role": "user", "content": "thanks"}
    messages, how = reconcile([USER, sent(args='{"a":2,"b":2}'), RESULT, {"role": "assistant", "content": "It is 4."},
                               follow], second)
    assert how == EXACT and messages == [USER, SAMPLED, RESULT, {"role": "assistant", "content": "It is 4."}, follow]


def test_a_continued_prefill_comes_back_merged() -> None:
    prefill = {"role": "assistant", "content": '{"answer":'}
    answered = Answered(messages=[USER, prefill], prompt_messages=[USER, prefill],
                        reply=reply_message('{"answer": 4}', None, []),
                        sampled={"role": "assistant", "content": '{"answer": 4}'}, continue_final=True)
    messages, how = reconcile([USER, {"role": "assistant", "content": '{"answer": 4}'}, USER], answered)
    assert how == EXACT and messages == [USER, {"role": "assistant", "content": '{"answer": 4}'}, USER]


def test_an_earlier_reply_sent_back_unchanged_is_the_same_whatever_it_holds() -> None:
    """A reply with its <think> block left in the content, sent back in the history exactly as in the last call,
    is that call's message (it was taken for a rewrite: its reasoning split off compared unequal to itself)."""
    inline = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nLet me add."}
    before = [USER, inline, RESULT]
    answered = Answered(messages=before, prompt_messages=before, reply=REPLY, sampled=SAMPLED, continue_final=False)
    messages, how = reconcile([*before, sent(reasoning="add"), RESULT], answered)
    assert how == EXACT and messages == [*before, SAMPLED, RESULT]


MESSAGES = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": st.sampled_from(["a", "a ", "b"])}),
    st.builds(sent, content=st.sampled_from([None, "", "<think>\nr\n</think>\n\nx", " x"]),
              reasoning=st.sampled_from([None, "r", " r"]),
              args=st.sampled_from(['{"a": 2}', '{"a":2}', {"a": 2}, "{"]), name=st.sampled_from(["add", "sub"])))


@settings(max_examples=300, deadline=None)
@given(before=st.lists(MESSAGES, max_size=4), after=st.lists(MESSAGES, max_size=4), copy=st.booleans())
def test_one_comparison_of_the_history_says_what_each_message_does(before: list[dict[str, Any]],
                                                                    after: list[dict[str, Any]], copy: bool) -> None:
    sent_back = [dict(m) for m in before] if copy else after
    assert _same_history(sent_back, before) == all(_same(m, b) for m, b in zip(sent_back, before))
