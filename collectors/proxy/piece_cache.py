"""An exact cache of tokenized pieces: the text between added tokens is tokenized once per proxy.

A session's first call (and a fork) tokenizes its whole rendered history, yet most of that text is
shared with other sessions: every session of an agent sends the same system prompt and tool schemas,
and the sessions of a fan-out group send the very same first prompt. `PieceCache.encode` tokenizes
only the pieces it has not seen.

Why it is exact: a Hugging Face tokenizer splits a text at its added tokens (`<|im_start|>`,
`<|im_end|>`, ...) before it normalizes or pre-tokenizes anything, matching their contents
leftmost-longest, and tokenizes each piece between them on its own; an added token becomes its own
id. So the ids of the whole text are the ids of each piece, encoded alone, with the added tokens' ids
in between, provided the split here is the tokenizer's own and nothing downstream looks across a
piece's edge. That holds when (checked once, by `PieceCache.of`; otherwise there is no cache and
texts are encoded whole):

- no added token has `lstrip`, `rstrip` or `single_word` (those take in or depend on the
  neighbouring text) or `normalized=True` (those are matched after normalization, inside pieces);
- special tokens are split, not encoded as text (`encode_special_tokens` off);
- no pre-tokenizer treats the text's first piece apart (`Metaspace` with `prepend_scheme: first`
  prepends only at offset 0 of the whole text, which every piece alone would be);
- the model is deterministic (no BPE dropout).

The split is a compiled regular expression of the added tokens' contents, longest first: at each
position the first alternative that matches is the longest, and `finditer` scans left to right
without overlaps, which is leftmost-longest matching.

Hand-written because no library caches tokenization by piece: `tokenizers` keeps a cache of words
inside BPE, but still normalizes and pre-tokenizes the whole text on every call, which is most of
its cost. Missing pieces are tokenized together (by default in one `encode_batch_fast` call, as
each call has a fixed cost; the proxy's renderer passes `collectors.proxy.ascii_bpe`'s path) outside
the lock, so render threads never wait on each other's tokenizing; the cache is an LRU bounded by the
characters of its keys, and keeps ids as 32-bit arrays (a Python int list would take about ten times
the memory).
"""

from __future__ import annotations

import array
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIN_CHARS = 8192  # a shorter text is encoded whole: splitting and looking up would cost more than they save
MAX_CHARS = 16 << 20  # characters of pieces kept: 16-64 MB of keys (1-4 bytes a character) and ~20 MB of ids


@dataclass
class PieceCounters:
    """What the cache did, for GET /stats: pieces (and their characters) found or tokenized."""

    pieces_hit: int = 0
    pieces_tokenized: int = 0
    chars_hit: int = 0
    chars_tokenized: int = 0

    def as_json(self, held_pieces: int, held_chars: int) -> dict[str, int]:
        return {"pieces_hit": self.pieces_hit, "pieces_tokenized": self.pieces_tokenized,
                "chars_hit": self.chars_hit, "chars_tokenized": self.chars_tokenized,
                "held_pieces": held_pieces, "held_chars": held_chars}


def unsplittable(backend: Any) -> str | None:
    """Why encoding `backend`'s texts piece by piece would not give its whole-text ids, or None when it would."""
    if not backend.get_added_tokens_decoder():
        return "it has no added tokens to split at"
    problem = added_token_problem(backend)
    if problem is not None:
        return problem
    if getattr(backend.model, "dropout", None):
        return "its model samples (BPE dropout)"
    if backend.pre_tokenizer is not None and _first_only(json.loads(backend.pre_tokenizer.__getstate__())):
        return "its pre-tokenizer treats the text's first piece apart (Metaspace prepend_scheme 'first')"
    return None


def added_token_problem(backend: Any) -> str | None:
    """Why `backend`'s added tokens do not simply cut its texts (matched as they are, before anything else)."""
    for token in backend.get_added_tokens_decoder().values():
        for flag in ("lstrip", "rstrip", "single_word", "normalized"):
            if getattr(token, flag):
                return f"its added token {token.content!r} has {flag}"
    if backend.encode_special_tokens:
        return "it encodes special tokens as text"
    return None


def added_tokens(backend: Any) -> tuple[dict[str, int], re.Pattern[str]]:
    """`backend`'s added tokens by content, and the regex that finds them as the tokenizer splits at them: the
    contents longest first, so the first alternative that matches is the longest (leftmost-longest)."""
    ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.content}
    return ids, re.compile("|".join(map(re.escape, sorted(ids, key=len, reverse=True))))


def _first_only(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("prepend_scheme") == "first" or any(_first_only(v) for v in node.values())
    return isinstance(node, list) and any(_first_only(v) for v in node)


class PieceCache:
    """Whole-text ids of long texts, each piece between added tokens tokenized once (see the module docstring)."""

    def __init__(self, backend: Any, max_chars: int = MAX_CHARS, min_chars: int = MIN_CHARS,
                 encode_pieces: Callable[[list[str]], list[list[int]]] | None = None) -> None:
        self._backend = backend
        # how missing pieces are tokenized (by default in one `encode_batch_fast` call)
        self._encode_pieces = encode_pieces or (lambda pieces: [e.ids for e in backend.encode_batch_fast(
            pieces, add_special_tokens=False)])
        self.max_chars, self.min_chars = max_chars, min_chars
        self._ids, self._split = added_tokens(backend)
        self._pieces: OrderedDict[str, array.array[int]] = OrderedDict()
        self._held = 0  # characters of the keys in `_pieces`
        self._lock = threading.Lock()
        self.counters = PieceCounters()

    @classmethod
    def of(cls, backend: Any, encode_pieces: Callable[[list[str]], list[list[int]]] | None = None,
           **limits: int) -> PieceCache | None:
        """A cache for `backend`, or None when its splitting is not exact (texts are then encoded whole)."""
        return None if unsplittable(backend) is not None else cls(backend, encode_pieces=encode_pieces, **limits)

    def encode(self, text: str) -> list[int]:
        if len(text) < self.min_chars:
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        pieces: list[str] = []
        between: list[int] = []  # the added token's id after each piece but the last
        start = 0
        for m in self._split.finditer(text):
            pieces.append(text[start:m.start()])
            between.append(self._ids[m.group()])
            start = m.end()
        pieces.append(text[start:])
        found = self._lookup(pieces)
        missing = list(dict.fromkeys(p for p in pieces if p and p not in found))
        if missing:
            made = {p: array.array("I", ids) for p, ids in zip(missing, self._encode_pieces(missing))}
            self._store(made)
            found.update(made)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids.extend(found[piece])
            if i < len(between):
                ids.append(between[i])
        return ids

    def _lookup(self, pieces: list[str]) -> dict[str, array.array[int]]:
        found: dict[str, array.array[int]] = {}
        hits = chars = 0
        with self._lock:
            for piece in pieces:
                ids = self._pieces.get(piece) if piece else None
                if ids is not None:
                    self._pieces.move_to_end(piece)
                    found[piece] = ids
                    hits, chars = hits + 1, chars + len(piece)
            self.counters.pieces_hit += hits
            self.counters.chars_hit += chars
        return found

    def _store(self, made: dict[str, array.array[int]]) -> None:
        with self._lock:
            self.counters.pieces_tokenized += len(made)
            self.counters.chars_tokenized += sum(map(len, made))
            for piece, ids in made.items():
                if len(piece) > self.max_chars or piece in self._pieces:  # too big to keep, or another thread's
                    continue
                self._pieces[piece] = ids
                self._held += len(piece)
            while self._held > self.max_chars:
                old, _ = self._pieces.popitem(last=False)
                self._held -= len(old)

    def as_json(self) -> dict[str, int]:
        with self._lock:
            return self.counters.as_json(len(self._pieces), self._held)
