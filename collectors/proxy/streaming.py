"""A reply as it is sampled: token ids to text, text to reasoning, content and tool calls, piece by piece. Pure.

The capture proxy streams a reply while the policy server samples it, and stores the whole
reply once sampling ends. What was streamed must be exactly what is stored, so the pieces are
only ever *prefixes* of the final parse (`collectors.model.toolcalls.parse_output`, applied to
the final text by `ChatRenderer.reply`), and whatever could still change is held back:

- `TextStream` (ids -> text, special tokens kept, as `ChatRenderer.decode`): the newest token
  waits for the next one when it could be the stop token that ends the reply (a special token)
  or the end of a stop string (when stop strings are set), and so do the last characters that
  could begin a stop string; the final text comes from the whole sample.
- `ReplyStream` (text -> pieces): reasoning streams inside a leading `<think>` until
  `</think>` (a trailing newline and a partial `</think>` wait); content streams until the first
  `<tool_call>` (a trailing newline and a partial tag wait); from the first `<tool_call>` on,
  nothing streams until the end, because a later malformed block turns every block back into
  content. `finish(reply)` then sends the rest of the final reasoning and content and the tool
  calls, each whole. That is the Hermes format; `reply_stream(fmt, ...)` picks the stream of
  the model's format: `Llama3Stream` streams a reply as content unless it starts with `{` or
  `<|python_tag|>` (it may be tool calls: then all of it waits for the end), `HarmonyStream`
  streams the analysis channel as reasoning and the final channel as content, as
  `collectors.model.harmony`'s reader (the parser of the final reply) reads them.

So the first tokens of text reach the agent as they are sampled; tool calls arrive when the
reply is complete (one delta with their whole arguments, as the proxy has always streamed them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from collectors.model.detokenize import IncrementalText
from collectors.model.toolcalls import CALL_OPEN, PYTHON_TAG, THINK_CLOSE, THINK_OPEN, ToolCall
from collectors.policy import Chunk
from collectors.proxy.chat import ChatReply

if TYPE_CHECKING:
    from collectors.proxy.chat import ChatRequest
    from collectors.proxy.render import ChatRenderer

Event = tuple[str, str] | tuple[str, int, ToolCall]  # ("reasoning" | "content", text) or ("tool_call", index, call)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that may still grow into `tag` or into a newline and `tag`."""
    for n in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(("\n" + tag)[:n]) or (n < len(tag) and text.endswith(tag[:n])):
            return n
    return 0


class TextStream:
    """The sampled text as ids arrive (see the module docstring); `push(ids)` returns the text released."""

    def __init__(self, decode: Callable[[list[int]], str], special_ids: Iterable[int], stops: tuple[str, ...]) -> None:
        self._text = IncrementalText(decode)
        self._special, self._stops = frozenset(special_ids), stops
        self._hold_chars = max(map(len, stops), default=1) - 1
        self._ids: list[int] = []
        self._released = 0  # characters of text handed out

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        if not self._ids:
            return ""
        upto = len(self._ids) - (1 if self._stops or self._ids[-1] in self._special else 0)
        for token in self._ids[len(self._text.ids):upto]:
            self._text.push(token)
        end = max(self._released, len(self._text.text) - self._hold_chars)
        out, self._released = self._text.text[self._released:end], end
        return out


@dataclass
class ReplyStream:
    """Reasoning and content pieces of a reply as its text grows (see the module docstring)."""

    parse_tools: bool
    text: str = ""
    sent: dict[str, str] = field(default_factory=lambda: {"reasoning": "", "content": ""})
    _calls_started: bool = False

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        reasoning, content = self._safe()
        events: list[Event] = []
        for kind, value in (("reasoning", reasoning), ("content", content)):
            if value is not None and len(value) > len(self.sent[kind]):
                events.append((kind, value[len(self.sent[kind]):]))
                self.sent[kind] = value
        return events

    def _safe(self) -> tuple[str | None, str | None]:
        """The reasoning and content that no later text can change (None: nothing known yet)."""
        text = self.text
        if THINK_OPEN.startswith(text):
            return None, None  # may still open a think block
        rest = text
        if text.startswith(THINK_OPEN):
            inner = text[len(THINK_OPEN):]
            end = inner.find(THINK_CLOSE)
            if end < 0:
                inner = inner[1:] if inner.startswith("\n") else inner
                hold = _partial_suffix(inner, THINK_CLOSE)
                return (inner[:len(inner) - hold] if inner or text.endswith("\n") else None), None
            rest = inner[end + len(THINK_CLOSE):]
            if len(rest) < 2 and rest.strip("\n") == "":
                return None, None  # up to two newlines after </think> are not content
            rest = rest[1:] if rest.startswith("\n") else rest
            rest = rest[1:] if rest.startswith("\n") else rest
        if not self.parse_tools:
            return None, rest
        start = rest.find(CALL_OPEN)
        if start >= 0:
            self._calls_started = True
            head = rest[:start]
            return None, head[:-1] if head.endswith("\n") else head
        hold = _partial_suffix(rest, CALL_OPEN)
        return None, rest[:len(rest) - hold]

    def finish(self, reply: ChatReply) -> list[Event]:
        """The rest of the final reply: what is left of its reasoning and content, then its tool calls."""
        events: list[Event] = []
        for kind, value in (("reasoning", reply.reasoning or ""), ("content", reply.content)):
            done = self.sent[kind]
            if not value.startswith(done):  # cannot happen when the pieces were prefixes; never send them twice
                raise AssertionError(f"streamed {kind} {done!r} is not a prefix of the final {value!r}")
            if len(value) > len(done):
                events.append((kind, value[len(done):]))
                self.sent[kind] = value
        events.extend(("tool_call", i, call) for i, call in enumerate(reply.tool_calls))
        return events


class Llama3Stream(ReplyStream):
    """Llama 3 JSON calls: content streams unless the reply may be tool calls (see the module docstring)."""

    def _safe(self) -> tuple[str | None, str | None]:
        text = self.text
        body = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
        if self.parse_tools and (PYTHON_TAG.startswith(text) or not body.strip() or body.lstrip().startswith("{")):
            return None, None
        return None, text


@dataclass
class HarmonyStream(ReplyStream):
    """gpt-oss harmony: reasoning and content as the harmony reader reads the text so far."""

    def __post_init__(self) -> None:
        from collectors.model.harmony import HarmonyReader  # loads openai-harmony and its vocabulary

        self._reader = HarmonyReader(self.parse_tools)

    def feed(self, delta: str) -> list[Event]:
        self._reader.feed(delta)
        return super().feed(delta)

    def _safe(self) -> tuple[str | None, str | None]:
        reasoning, content, _ = self._reader.view()
        return reasoning, content


def reply_stream(fmt: str, parse_tools: bool) -> ReplyStream:
    """The stream of a reply in tool-call format `fmt` (`collectors.model.toolcalls.FORMATS`)."""
    kind = {"llama3": Llama3Stream, "harmony": HarmonyStream}.get(fmt, ReplyStream)
    return kind(parse_tools=parse_tools)


class LocalPieces:
    """A stream's pieces parsed here: `TextStream` then the format's `ReplyStream` (the proxy's own renderer)."""

    def __init__(self, renderer: ChatRenderer, req: ChatRequest) -> None:
        self.texts = TextStream(renderer.decode, renderer.special_ids, req.sampling.stop)
        self.reply = reply_stream(renderer.format, req.parse_tools and bool(req.tools))

    async def feed(self, chunk: Chunk) -> list[Event]:
        return self.reply.feed(self.texts.push(chunk.output_ids))

    async def finish(self, reply: ChatReply) -> list[Event]:
        return self.reply.finish(reply)
