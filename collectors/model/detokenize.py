"""Incremental detokenization: the text of a growing list of sampled ids, at a cost per token, not per output.

Decoding the whole output again after every sampled token costs O(n) per step (O(n^2) per
request); stop strings need the text after each step. `IncrementalText` keeps the text decoded
so far and, per new token, decodes only a short window: the ids since the last point where the
text was stable, with and without the newest ones (vLLM's and transformers' TextStreamer's
method). A window whose text ends in U+FFFD is an incomplete UTF-8 sequence of byte-level BPE:
its text waits for the next token. The result equals decoding all ids at once for byte-level
BPE tokenizers (the kind `trajstore init-model` writes, and Qwen's); `text` lags by the bytes of
a character not yet complete.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


class IncrementalText:
    """The text of `ids` as they are appended one at a time; `push` returns the new text it adds."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the window: the text of ids[:_prefix] is settled
        self._read = 0  # ids[:_read] are in `text`

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = self._decode(self.ids[self._prefix:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""  # nothing complete yet (a partial character, or a token that writes nothing)
        delta = window[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta
