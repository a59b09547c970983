"""Streaming a reply as pure functions: every piece streamed is a prefix of the final parse, for any split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.proxy.chat import ChatReply
from collectors.proxy.streaming import ReplyStream, TextStream
from collectors.model.toolcalls import parse_output

PARTS = ["<think>", "</think>", "\n", "\n\n", "<tool_call>", "</tool_call>", "hello", " world", "<", "tool",
         '\n{"name": "f", "arguments": {"a": 1}}\n', "{bad json", "think>", "/", "x"]


def reply_of(text: str, parse_tools: bool) -> ChatReply:
    parsed = parse_output(text, parse_tools=parse_tools)
    return ChatReply("r", "m", 0, parsed.content, parsed.reasoning, parsed.tool_calls, "stop", None, 1, [], [], [], 0)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PARTS), max_size=12), st.lists(st.integers(0, 200), max_size=6), st.booleans())
def test_streamed_pieces_join_into_exactly_the_final_reply(parts: list[str], cuts: list[int],
                                                            parse_tools: bool) -> None:
    text = "".join(parts)
    stream, streamed = ReplyStream(parse_tools=parse_tools), {"reasoning": "", "content": ""}
    at = 0
    for cut in sorted(c % (len(text) + 1) for c in cuts) + [len(text)]:
        for kind, piece in stream.feed(text[at:cut]):
            streamed[kind] += piece
        at = max(at, cut)
    reply = reply_of(text, parse_tools)
    calls = []
    for event in stream.finish(reply):
        if event[0] == "tool_call":
            calls.append(event[2])
        else:
            streamed[event[0]] += event[1]
    assert streamed == {"reasoning": reply.reasoning or "", "content": reply.content}
    assert tuple(calls) == reply.tool_calls


def test_content_streams_before_the_reply_ends_and_calls_wait_for_it() -> None:
    stream = ReplyStream(parse_tools=True)
    assert stream.feed("<think>\nplan") == [("reasoning", "plan")]
    assert stream.feed("\n</think>\n\nOn it.\n") == [("content", "On it.")]  # the newline may precede a call
    assert stream.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>') == []
    assert ReplyStream(parse_tools=False).feed("a <tool_call> b") == [("content", "a <tool_call> b")]


def test_text_waits_for_what_may_still_end_the_reply() -> None:
    texts = {1: "a", 2: "b", 3: "<|im_end|>", 4: "S", 5: "T"}

    def decode(ids: list[int]) -> str:
        return "".join(texts[i] for i in ids)

    plain = TextStream(decode, special_ids={3}, stops=())
    assert plain.push([1, 2]) == "ab"
    assert plain.push([3]) == ""  # a special token: the end of the reply, unless more follows
    assert plain.push([1]) == "<|im_end|>a"
    stops = TextStream(decode, special_ids={3}, stops=("ST",))
    assert stops.push([1]) == ""  # the newest token may complete a stop string
    assert stops.push([4]) == ""  # "a" is past the newest token, but one character is held: it may begin "ST"
    assert stops.push([5]) == "a"  # "S" waits: the newest token "T" would complete "ST"
    assert stops.push([2]) == "S"
