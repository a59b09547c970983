"""Decode a session's request body by what is new in it: the part its previous body also sent is not read again.

An agent resends its whole conversation on every call, so at 80k tokens of context each body is some 300 kB of
JSON of which a few kB are new. Decoding it whole costs time proportional to the history on every call (orjson
reads every byte and makes every string again), and so does everything after it that compares the history with
the call before (the stored request's delta, the reconciled history): new strings compare byte by byte.

`HeldBody` keeps a session's last body: its bytes, where each element of its conversation list (`messages`,
`input`) ends, the decoded elements, and the decoded top-level members before and after that list. The next
body of the session is decoded as the held elements whose bytes it repeats (a `memcmp` of the prefix, no
parse) plus what follows them:

- usually the bytes after the new elements (the tools, the sampling options) are the held body's too: only
  the new elements are parsed, as a list, and the members after the list are the held values;
- otherwise the rest of the body is parsed as `{"\\u0000": [` + the rest: it closes the list and the object
  just as it does in the whole body.

Either way the parse accepts exactly what a parse of the whole body accepts, and the value is the same. The
repeated elements and members are then the very objects of the previous call (so nothing may change a decoded
body in place), which makes the comparisons that follow with the previous call cheap. A session holds its last
body until its rollout closes.

What falls back to decoding the whole body (`None` from `splice`): no held body, a body that does not repeat
any held element's bytes, a trailing comma, a member of the rest that repeats one before the list (or is
named by the marker), anything orjson refuses or reads otherwise than `json` (`as_json_reads`). A list whose
elements are not all objects, arrays or strings is never held.

No JSON library offers this: a parser resumable at a byte offset with the values it made before. The element
ends are found by a scan of the structure over the new bytes only: strings and brackets by a regular expression
in C, except a long string, whose end is found by `bytes.find` of its next quote, taken when an even number of
backslashes precede it (a regular expression steps through every byte and escape, at a few nanoseconds a byte).
`python benchmarks/body_scan.py` times the scan of a body's list against one regular expression for every
string. A body decoded whole (a session's first, or one after a miss) is kept as it is (`WholeBody`) and
scanned whole once, when the next body shows it is worth it: it repeats the held list's first element, and what it
repeats of the held body's start and of its end (the members after the list: an agent's tools and system prompt)
make up at least half of the held body.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from collectors.serving import DECODE_OFF_LOOP_BYTES, BodyText, as_json_reads, decode_json_text, read_body

# the scan's tokens: a short string (whole: up to 512 bytes without escapes, or a few short runs between escapes, as
# a tool call's arguments), a bracket, or the opening quote of any other string (its end is found by `_string_end`:
# a long text, a base64 image); anything else (numbers, literals, commas, colons, whitespace) lies between them.
# Short strings are matched here because starting the scan again after each would cost more than the match.
_TOKEN = re.compile(rb'"[^"\\]{0,512}"|"[^"\\]{0,32}(?:\\.[^"\\]{0,32}){1,4}"|[][{}]|"')
_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*")  # a member's name ends here; the match ends at its value
_NEXT = re.compile(rb"[ \t\n\r]*([,\]])[ \t\n\r]*")
_MARK = "\x00"  # the rest's list is parsed under this name: JSON text can only write it as \u0000
_MARK_HEAD = b'{"\\u0000":['
_MARK_ESCAPE = b"\\u0000"
MIN_BYTES = 16 << 10  # a smaller body decodes whole faster than the prefix check and the scan
COMPARE_ON_LOOP_BYTES = 4 << 20  # a larger body is compared with the session's last off the event loop (0.4 ms)


@dataclass(frozen=True, slots=True)
class HeldBody:
    """A session's last decoded body, as the next one is spliced onto: see the module docstring."""

    raw: bytes
    key: str  # the conversation list's member
    head: dict[str, Any]  # the top-level members up to the list, in order; the list's own value is None
    ends: tuple[int, ...]  # where each element of the list ends in `raw` (the offset past its last byte)
    items: list[Any]  # the list's decoded elements
    close: int  # the offset of the list's closing bracket
    tail: dict[str, Any]  # the top-level members after the list, in order

    def shared(self, raw: bytes) -> int:
        """How many of the held elements `raw` repeats byte for byte from the start (0: none)."""
        view = memoryview(self.raw)
        ends = self.ends
        if raw.startswith(view[:ends[-1]]):  # the usual call: every held element again, then what is new
            return len(ends)
        lo, hi = 0, len(ends) - 1  # ends[:lo] repeated, ends[hi:] not: a prefix match is monotone
        while lo < hi:
            mid = (lo + hi) // 2
            if raw.startswith(view[:ends[mid]]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def same_tail(self, raw: bytes, close: int) -> bool:
        """Whether `raw` from `close` on (its list's closing bracket) is the held body's tail byte for byte."""
        return len(raw) - close == len(self.raw) - self.close and raw.endswith(memoryview(self.raw)[self.close:])


def _string_end(raw: bytes, at: int) -> int:
    """The offset past the JSON string whose opening quote is at `at`; -1 when it does not close. Its closing
    quote is the first one after an even number of backslashes (each pair is one escaped backslash)."""
    quote = at
    while True:
        quote = raw.find(b'"', quote + 1)
        if quote < 0:
            return -1
        before = quote - 1
        while raw[before] == 0x5C:  # a backslash; the opening quote ends the run at the latest
            before -= 1
        if (quote - before) % 2:  # quote - 1 - before backslashes: an even number
            return quote + 1


def _tokens(raw: bytes, pos: int) -> Iterator[tuple[int, int, int]]:
    """The scan's tokens from `pos`: each string and bracket as (its first byte, its offset, the offset past it),
    in order; a string that does not close ends the scan."""
    while True:
        for m in _TOKEN.finditer(raw, pos):
            at, end = m.span()
            if end - at == 1 and raw[at] == 0x22:  # a long string: past its end, then on from there
                pos = _string_end(raw, at)
                if pos < 0:
                    return
                yield 0x22, at, pos
                break
            yield raw[at], at, end
        else:
            return


def _elements(raw: bytes, pos: int, most: int = -1) -> tuple[list[int], int] | None:
    """The ends of a list's elements from `pos` (just inside the list or just past an element's comma) and
    the offset of the list's closing bracket; None when the list does not close (not JSON: the parse says why).
    With `most`, the scan stops at that many elements (the offset is then -1).
    Only objects, arrays and strings are seen: a list holding another kind of element shows fewer ends.
    `_tokens` written out (a generator's step per token made a scan of short strings half again slower): it
    runs over the new bytes of every call."""
    ends: list[int] = []
    depth = 0
    while True:
        for m in _TOKEN.finditer(raw, pos):
            at, end = m.span()
            c = raw[at]
            if c == 0x22:  # a string
                if end - at == 1:  # a long one: past its end, then on from there
                    pos = _string_end(raw, at)
                    if pos < 0:
                        return None
                    if not depth:
                        ends.append(pos)
                        if len(ends) == most:
                            return ends, -1
                    break
                if not depth:
                    ends.append(end)
                    if len(ends) == most:
                        return ends, -1
            elif c == 0x7B or c == 0x5B:  # { [
                depth += 1
            elif depth:
                depth -= 1
                if not depth:
                    ends.append(end)
                    if len(ends) == most:
                        return ends, -1
            else:
                return ends, at
        else:
            return None


def _members(raw: bytes, close: int) -> dict[str, Any]:
    """The top-level members after a list closing at `close`, parsed as the list's rest (see the docstring)."""
    after = orjson.loads(_MARK_HEAD + raw[close:])
    del after[_MARK]
    return after


def _list_opens(raw: bytes, key: str) -> int:
    """The offset of the opening bracket of the top-level member `key`'s list in `raw`; -1 when it is not a
    list, or a member before it is named twice."""
    depth, before = 0, set()
    for c, at, end in _tokens(raw, 0):
        if c == 0x22:
            colon = _COLON.match(raw, end) if depth == 1 else None
            if colon:
                name = orjson.loads(raw[at:end])
                if name in before:
                    return -1
                before.add(name)
                if name == key:
                    return colon.end() if raw[colon.end():colon.end() + 1] == b"[" else -1
        elif c == 0x7B or c == 0x5B:  # { [
            depth += 1
        else:
            depth -= 1
    return -1


def anchor(raw: bytes, value: Any, key: str) -> HeldBody | None:
    """Hold `raw` (decoded whole as `value`) for the session's next body, or None when its conversation list
    cannot be held (not a top-level list of objects, arrays or strings; a member named twice)."""
    items = value.get(key) if type(value) is dict else None
    if type(items) is not list or not items or len(raw) < MIN_BYTES:
        return None
    opened = _list_opens(raw, key)
    if opened < 0:
        return None
    found = _elements(raw, opened + 1)
    if found is None or len(found[0]) != len(items) or raw.find(_MARK_ESCAPE, found[1]) >= 0:  # a member the
        # marker would hide
        return None
    head = orjson.loads(raw[:opened + 1] + b"]}")
    tail = _members(raw, found[1])
    if any(name in head for name in tail):  # named again after the list
        return None
    head[key] = None
    return HeldBody(raw, key, head, tuple(found[0]), items, found[1], tail)


def splice(raw: bytes, held: HeldBody, shared: int | None = None) -> tuple[Any, HeldBody | None] | None:
    """`raw` decoded onto `held` (the same value as a whole decode) and the body to hold next; None when it
    must be decoded whole (see the module docstring). `shared`: `held.shared(raw)`, when the caller has it."""
    shared = held.shared(raw) if shared is None else shared
    if not shared:
        return None
    nxt = _NEXT.match(raw, held.ends[shared - 1])
    if nxt is None:
        return None
    if nxt.group(1) == b",":
        start = nxt.end()
        found = _elements(raw, start) if raw[start:start + 1] != b"]" else None  # `,]`: JSON refuses it
        if found is None:
            return None
        ends, close = found
    else:
        ends, start = [], nxt.start(1)
        close = start
    if held.same_tail(raw, close):  # the usual call: only the new elements are parsed, the rest is held
        try:
            new = orjson.loads(b"[" + raw[start:close + 1]) if ends or start < close else []
        except orjson.JSONDecodeError:
            return None
        if type(new) is not list or not as_json_reads({_MARK: new}):  # at the depth the whole body has it
            return None
        tail = held.tail
    else:
        if raw.find(_MARK_ESCAPE, start) >= 0:
            return None
        try:
            rest = orjson.loads(_MARK_HEAD + raw[start:])
        except orjson.JSONDecodeError:
            return None
        if type(rest) is not dict or not as_json_reads(rest):
            return None
        new = rest.pop(_MARK)
        if any(name in held.head for name in rest):  # a member named again after the list
            return None
        tail = rest
    items = held.items[:shared] + new
    value = {name: items if name == held.key else v for name, v in held.head.items()}
    value.update(tail)
    if len(ends) != len(new):  # an element the scan does not see: decoded right, but not held
        return value, None
    return value, HeldBody(raw, held.key, held.head, held.ends[:shared] + tuple(ends), items, close, tail)


@dataclass(frozen=True, slots=True)
class WholeBody:
    """A session's last body, decoded whole and not yet scanned. It is scanned into a `HeldBody` (`anchor`) only
    when the session's next body repeats at least half of it, counting its start and its end (the members after
    the list, which an agent sends again unchanged: an early call of Claude Code's is mostly tools after a short
    list): a session of one call (a single-turn rollout), or one whose bodies differ early (a system prompt with
    the time in it), never pays the scan."""

    raw: bytes
    value: Any
    key: str

    def held(self, raw: bytes) -> HeldBody | None:
        """This body held, for a next body `raw` that repeats its list's first element and half of it in all;
        None otherwise."""
        if len(raw) < MIN_BYTES:
            return None
        start = _common_start(self.raw, raw)
        need = len(self.raw) // 2 - start
        if need > 0 and not raw.endswith(memoryview(self.raw)[len(self.raw) - need:]):
            return None
        opened = _list_opens(self.raw, self.key)  # the scan of the head and the first element only
        first = _elements(self.raw, opened + 1, most=1) if 0 <= opened < start else None
        if not first or not first[0] or first[0][0] > start:
            return None
        return anchor(self.raw, self.value, self.key)


def _common_start(a: bytes, b: bytes) -> int:
    """How many bytes `b` repeats of the start of `a`: a binary search of `memcmp`s (17 for 100 kB), as Python
    has no call that returns where two byte strings first differ."""
    view = memoryview(a)
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if b.startswith(view[:mid]):
            low = mid
        else:
            high = mid - 1
    return low


Last = HeldBody | WholeBody  # what a session keeps of its last body


def decode_whole(raw: bytes, key: str) -> tuple[Any, BodyText | None, WholeBody | None]:
    """`decode_json_text(raw)`, and what the session keeps of it for its next call (None: nothing to splice
    onto, a body not strict JSON or too small)."""
    value, text = decode_json_text(raw)
    return value, text, WholeBody(raw, value, key) if text is not None and len(raw) >= MIN_BYTES else None


def decode_session(raw: bytes, last: Last | None, key: str, shared: int | None = None
                   ) -> tuple[Any, BodyText | None, Last | None, bool]:
    """A session's body `raw` decoded (spliced onto `last`, what the session kept of its last body, when it can
    be; whole otherwise), its `BodyText`, what to keep for the session's next call, and whether it was spliced.
    `shared`: `last.shared(raw)`, when the caller has it."""
    held = last.held(raw) if isinstance(last, WholeBody) and last.key == key else last
    if held is not None and held.key == key and len(raw) >= MIN_BYTES:
        got = splice(raw, held, shared if held is last else None)
        if got is not None:
            return got[0], BodyText(raw), got[1], True
    return *decode_whole(raw, key), False


async def read_session_body(request: web.Request, max_bytes: int, last: Last | None, key: str
                            ) -> tuple[Any, BodyText | None, Last | None, bool]:
    """`decode_session` of the request's body. As `collectors.serving.read_json_text` does, what is proportional
    to a body's size runs off the event loop: a splice runs on it when what is new in the body is small (what
    it repeats is checked there too, by a `memcmp`, for a body up to `COMPARE_ON_LOOP_BYTES`), and the scan of
    a `WholeBody` counts as its size."""
    raw = await read_body(request, max_bytes)
    shared = None
    if isinstance(last, HeldBody) and last.key == key and MIN_BYTES <= len(raw) <= COMPARE_ON_LOOP_BYTES:
        shared = last.shared(raw)
    if isinstance(last, HeldBody) and shared:
        work = len(raw) - last.ends[shared - 1]
    else:
        work = len(raw) + (len(last.raw) if isinstance(last, WholeBody) else 0)
    if work <= DECODE_OFF_LOOP_BYTES:
        return decode_session(raw, last, key, shared)
    return await asyncio.to_thread(decode_session, raw, last, key, shared)
