"""Exact ids of ASCII text for byte-level BPE tokenizers, at a fraction of the `tokenizers` pipeline's cost.

Every call tokenizes what is new in it: the tool results an agent sends back, a few hundred to a few
thousand tokens. The `tokenizers` pipeline spends most of that time on bookkeeping, not on BPE: it
tracks an alignment for every byte through normalization, copies it into every pre-token, and builds
an `Encoding` holding each token's string and offsets. Here a 5.8 kB tool result (1,736 ids) costs
1.4 ms through `encode_batch_fast` and 0.25 ms on this path; 200 kB of Python source 84 ms and 11 ms
(25 ms with every word new). No library does it exactly: tiktoken merges by the rank of the merged
token, which differs from a tokenizer's merge list wherever a token can be made from more than one
pair, and nothing else in the package registry reads a `tokenizer.json`.

The path is the tokenizer's own pipeline, step by step, each step exact on ASCII text:

- the text is split at the added tokens, leftmost-longest (`collectors.proxy.piece_cache`, whose
  conditions hold here too: the tokenizer splits there first and tokenizes each piece alone);
- the normalizer is none or a Unicode normalization form, which leaves ASCII text as it is;
- each piece is cut into pre-tokens by the tokenizer's own `Split` regex (or `ByteLevel`'s GPT-2 regex),
  translated for ASCII text into a Python `re` pattern: among ASCII characters `\\p{L}` is `[A-Za-z]`,
  `\\p{N}` is `[0-9]`, and Oniguruma's `\\s` is `[\\t\\n\\v\\f\\r ]` (Python's `\\s` also takes
  `\\x1c`-`\\x1f`, which Unicode's White_Space does not). Both engines match alternatives leftmost-first
  with backtracking, so they cut at the same places. A pattern with anything else (another property,
  a word boundary, a back-reference) is not translated. A pattern that can match nothing, or a piece whose
  matches leave a gap, goes to the tokenizer;
- each pre-token is mapped through the byte-level alphabet and tokenized by the tokenizer's own BPE
  model (`model.tokenize`), once per distinct pre-token: a bounded dict keeps its ids.

For the split regex of Qwen2 and Llama 3 tokenizers (most byte-level BPE models in use), the cut and the
lookups run in C (`collectors/proxy/_ascii_words.c`, built with the package when a C compiler is there): Python's
`re.findall` and the loop over its words cost ~400 ns a pre-token on a 2-core machine here, the C pass ~100 ns
(a 7 kB tool result: 550 us against 150 us), ~40 ns with its table of recent words in front of the dict. The C
scan is that regex's alternation written out for ASCII text; it is taken only when it cuts the corpus below exactly as the translated regex does, and the corpus's
ids are checked through it. Other regexes, and an install without the compiled module, use `re`.

Text with any non-ASCII character is tokenized by the tokenizer, as before. The path is taken only
when it gives the tokenizer's ids on a corpus of every ASCII character in context (checked when it is
made), and one call in `VERIFY_EVERY` is tokenized by both and compared: any difference turns the path
off for good (logged) and the tokenizer's ids are used.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from typing import Any

from collectors.errors import CollectorError
from collectors.model.tokenizer import QWEN2_SPLIT
from collectors.proxy.piece_cache import added_token_problem, added_tokens

try:
    from collectors.proxy import _ascii_words  # the C scan (module docstring); optional
except ImportError:  # built without a C compiler: the same ids through `re`
    _ascii_words = None

log = logging.getLogger(__name__)

VERIFY_EVERY = 64  # one call in this many is also tokenized by the tokenizer and compared
MAX_WORDS = 1 << 16  # distinct pre-tokens kept (about 10 MB); the dict starts over when full

# The regex `ByteLevel(use_regex=True)` splits with (GPT-2's), as the `tokenizers` library writes it.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# The split regexes the C scan knows, as the tokenizers write them: Qwen2's, and Llama 3's (digits in runs of 3).
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# What each Unicode property holds among ASCII characters (a class body); the rest are not translated.
_PROPERTIES = {"L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "", "N": "0-9", "Nd": "0-9",
               "Nl": "", "No": "", "M": "", "Mn": "", "Mc": "", "Me": ""}
_SPACE = r"\t\n\x0b\x0c\r "  # Oniguruma's \s among ASCII characters
_CLASS_ESCAPES = {"s": _SPACE, "d": "0-9", "w": "A-Za-z0-9_"}  # \s \d \w (Unicode) among ASCII characters
_NOTHING = r"[^\x00-\x7f]"  # a class no ASCII character is in
_PASSED = set("rntfv") | set(r"\.^$|?*+()[]{}-/'\"#&~!@%=:;,<> ")  # escapes with one meaning in both engines
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}  # identities on ASCII text


class Untranslatable(CollectorError):
    """A tokenizer layout, or a pre-tokenizer regex construct, whose steps on ASCII text are not known here."""


def translate(pattern: str) -> str:
    """`pattern` (Oniguruma syntax) as a Python `re` pattern that matches the same on ASCII text."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            body, i = _escape(pattern, i, in_class=False)
            out.append(body)
        elif c == "[":
            body, i = _class(pattern, i)
            out.append(body)
        elif c == "(":
            if pattern.startswith("(?", i):
                kind = next((k for k in ("(?:", "(?i:", "(?=", "(?!", "(?<=", "(?<!", "(?>") if pattern.startswith(k, i)),
                            None)
                if kind is None:
                    raise Untranslatable(f"group {pattern[i:i + 4]!r}")
                out.append(kind)
                i += len(kind)
            else:  # a capturing group: Python's findall would return its text, not the match's
                out.append("(?:")
                i += 1
        elif c in "^$":  # line anchors in Oniguruma, string anchors in Python
            raise Untranslatable(f"anchor {c!r}")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _property(pattern: str, i: int) -> tuple[str, int]:
    """The ASCII class body of the `\\p{X}` / `\\P{X}` at `i` (its letter excluded), and where it ends."""
    end = pattern.find("}", i)
    if not pattern.startswith("{", i + 2) or end < 0 or pattern[i + 3:end] not in _PROPERTIES:
        raise Untranslatable(f"property {pattern[i:end + 1]!r}")
    return _PROPERTIES[pattern[i + 3:end]], end + 1


def _escape(pattern: str, i: int, *, in_class: bool) -> tuple[str, int]:
    """The escape at `i`: its translation (a class body inside a class) and where it ends."""
    if i + 1 >= len(pattern):
        raise Untranslatable("a trailing backslash")
    c = pattern[i + 1]
    if c in "pP":
        body, end = _property(pattern, i)
        if in_class:
            if c == "P":
                raise Untranslatable("a negated property inside a class")
            return body, end
        return (f"[{body}]" if body else _NOTHING) if c == "p" else (f"[^{body}]" if body else r"[\x00-\x7f]"), end
    if c in _CLASS_ESCAPES:
        return (_CLASS_ESCAPES[c] if in_class else f"[{_CLASS_ESCAPES[c]}]"), i + 2
    if c in "SDW":
        if in_class:
            raise Untranslatable(f"\\{c} inside a class")
        return f"[^{_CLASS_ESCAPES[c.lower()]}]", i + 2
    if c == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", pattern[i + 2:i + 4]):
        return pattern[i:i + 4], i + 4
    if c in _PASSED:
        return pattern[i:i + 2], i + 2
    raise Untranslatable(f"escape \\{c}")


def _class(pattern: str, i: int) -> tuple[str, int]:
    """The character class at `i`, translated, and where it ends."""
    out = ["["]
    i += 1
    if pattern.startswith("^", i):
        out.append("^")
        i += 1
    first = True
    while i < len(pattern):
        c = pattern[i]
        if c == "]" and not first:
            body = "".join(out[2:] if out[1:2] == ["^"] else out[1:])
            if not body:  # every part was empty among ASCII characters
                return (r"[\x00-\x7f]" if out[1:2] == ["^"] else _NOTHING), i + 1
            return "".join(out) + "]", i + 1
        if c == "\\":
            body, i = _escape(pattern, i, in_class=True)
            out.append(body)
        elif c == "[" or pattern.startswith("&&", i):
            raise Untranslatable("a nested class or a class intersection")
        else:
            out.append(c)
            i += 1
        first = False
    raise Untranslatable("an unclosed class")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is written as (ASCII bytes only are used)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars = list(shown)
    extra = 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(shown, chars) if b < 128}


def _split_pattern(pre_tokenizer: Any) -> str:
    """The regex a byte-level pre-tokenizer cuts with, or Untranslatable with why not."""
    if pre_tokenizer is None:
        raise Untranslatable("there is no byte-level pre-tokenizer")
    node = json.loads(pre_tokenizer.__getstate__())
    if node.get("type") == "ByteLevel" and node.get("use_regex") and not node.get("add_prefix_space"):
        return GPT2_SPLIT
    steps = node.get("pretokenizers") if node.get("type") == "Sequence" else None
    if (steps and len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex") and not steps[1].get("add_prefix_space")
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and "Regex" in (steps[0].get("pattern") or {})):
        return steps[0]["pattern"]["Regex"]
    raise Untranslatable(f"the pre-tokenizer is not a byte-level split this path knows ({node.get('type')})")


def _shortest_match(pattern: str) -> int:
    """The fewest characters a match of `pattern` can take (0 when Python's parser cannot say: not taken)."""
    try:
        return int(re._parser.parse(pattern).getwidth()[0])  # type: ignore[attr-defined]
    except AttributeError:  # the parser is private to `re`: a Python without it gets no path
        return 0


def _normalizes_ascii(normalizer: Any) -> bool:
    """Whether `normalizer` leaves every ASCII text as it is."""
    if normalizer is None:
        return True
    node = json.loads(normalizer.__getstate__())
    steps = node.get("normalizers") if node.get("type") == "Sequence" else [node]
    return all(step.get("type") in _NORMALIZERS for step in steps or [])


def _corpus(added: list[str]) -> list[str]:
    """ASCII texts that put every character, the patterns' edge cases and the added tokens in context."""
    chars = [chr(c) for c in range(128)]
    edges = ["It's", "IT'S", "we'll", "I'D", "'ve", "'Ll", "don't", "x'", "''s", "12345", "a1b22c333", "3.14",
             "  x", "x  ", "   ", "\n\n\n", "a\n\n  b", " \n x", "\r\n\r\n", "\t\tdef f():\n\treturn 1\n", "!!!\n\n",
             " !? ", "a!b", "( x )", "__init__", "x\x0by\x0cz", "\x1c\x1d\x1e\x1f a", " \x1c ", "\x00\x01 \x7f",
             "<|x|>", "{'a': [1, 2]}", 'print("hi")  # ok', "$ ls -la /tmp", "a.b,c;d:e", "   \n", "x \n", "\n x"]
    rng = random.Random(0)
    weights = "   \n\n\t\r'0123456789" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" * 2 + "".join(chars)
    mixed = ["".join(rng.choice(weights) for _ in range(rng.randint(1, 40))) for _ in range(400)]
    pairs = [a + b for a in chars for b in "a A1 '\n\t!"]
    around = [f"{a}x {b}\n{a}{a} {b}" for a, b in zip(added, [*added[1:], *added[:1]]) if a.isascii() and b.isascii()]
    return [*chars, *pairs, *edges, *mixed, *around, "".join(chars), "".join(reversed(chars))]


# The C scan's regexes as `translate` writes them (what `AsciiBPE` compiles), and the digits each takes at most.
_SCANNED = {translate(QWEN2_SPLIT): 1, translate(LLAMA3_SPLIT): 3}


class AsciiBPE:
    """The ids of ASCII text through a byte-level BPE tokenizer's own steps (see the module docstring)."""

    def __init__(self, backend: Any, pattern: str) -> None:
        self._backend = backend
        self._model = backend.model
        self._words = re.compile(pattern, re.ASCII)
        self._digits = _SCANNED.get(pattern) if _ascii_words is not None else None  # the C scan's, when it applies
        self._added, split = added_tokens(backend)
        self._split = split if self._added else None
        self._alphabet = str.maketrans(_byte_alphabet())
        self._cache: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.enabled = True
        self.calls = 0  # calls tokenized here (a text, or a list of pieces)
        self.fallbacks = 0  # pieces handed to the tokenizer (a gap between matches)

    @classmethod
    def of(cls, backend: Any) -> tuple[AsciiBPE | None, str | None]:
        """An encoder for `backend`, or None and why there is none."""
        try:
            if type(backend.model).__name__ != "BPE" or getattr(backend.model, "dropout", None):
                raise Untranslatable("the model is not a deterministic BPE")
            problem = added_token_problem(backend)
            if problem is not None:
                raise Untranslatable(problem)
            if not _normalizes_ascii(backend.normalizer):
                raise Untranslatable("the normalizer can change ASCII text")
            pattern = translate(_split_pattern(backend.pre_tokenizer))
            if _shortest_match(pattern) == 0:
                raise Untranslatable("the pre-tokenizer regex can match nothing")
            made = cls(backend, pattern)
        except (Untranslatable, re.error) as exc:
            return None, str(exc)
        corpus = _corpus(list(made._added))
        if made._digits is not None and any(_ascii_words.split(text, made._digits) != made._words.findall(text)
                                            for text in corpus if text.isascii()):
            log.warning("the compiled pre-token scan cuts text otherwise than the tokenizer's regex; using `re`")
            made._digits = None
        theirs = backend.encode_batch_fast(corpus, add_special_tokens=False)
        for text, expected in zip(corpus, theirs):
            if made._encode(text) != expected.ids:
                return None, f"it does not give the tokenizer's ids for {text!r}"
        made.calls = made.fallbacks = 0
        made._cache.clear()  # the corpus's words are not the calls'
        return made, None

    def encode(self, text: str) -> list[int] | None:
        """The tokenizer's ids of ASCII `text` (special tokens not added), or None when it is not ASCII or the
        path is off."""
        if not self.enabled or not text.isascii():
            return None
        return self._checked([text], [self._encode(text)])[0]

    def encode_pieces(self, pieces: list[str]) -> list[list[int]] | None:
        """The ids of pieces that hold no added token (the piece cache's misses), or None when one is not
        ASCII or the path is off."""
        if not self.enabled or not all(map(str.isascii, pieces)):
            return None
        return self._checked(pieces, [self._piece(p) for p in pieces])

    def _checked(self, texts: list[str], ids: list[list[int]]) -> list[list[int]]:
        """`ids`, or the tokenizer's own when this call is one to verify and they differ (the path then off)."""
        with self._lock:
            self.calls += 1
            verify = self.calls % VERIFY_EVERY == 0
        if not verify:
            return ids
        theirs = [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        if theirs != ids:
            with self._lock:
                if self.enabled:
                    log.warning("the ASCII tokenizing path gave other ids than the tokenizer for a %d-character text; "
                                "tokenizing every text with the tokenizer from now on", sum(map(len, texts)))
                self.enabled = False
            return theirs
        return ids

    def _encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._piece(text)
        ids: list[int] = []
        start = 0
        for m in self._split.finditer(text):
            if m.start() > start:
                ids += self._piece(text[start:m.start()])
            ids.append(self._added[m.group()])
            start = m.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        if self._digits is not None:
            ids, missing = _ascii_words.encode(piece, self._cache, self._digits)
            if ids is None:
                self._learn(missing)
                ids, _ = _ascii_words.encode(piece, self._cache, self._digits)
            if ids is not None:  # else the cache started over while it learned: the words one by one, below
                return ids
        words = self._words.findall(piece)
        if sum(map(len, words)) != len(piece):  # a gap between matches: the tokenizer keeps it as its own split
            self.fallbacks += 1
            return self._backend.encode_batch_fast([piece], add_special_tokens=False)[0].ids
        cache = self._cache
        ids: list[int] = []
        for word in words:
            got = cache.get(word)
            if got is None:
                got = self._learn([word])[0]
            ids += got
        return ids

    def _learn(self, words: list[str]) -> list[list[int]]:
        """The ids of pre-tokens not in the cache, tokenized by the BPE model and kept (the cache starts over
        when full)."""
        cache, learnt = self._cache, []
        for word in dict.fromkeys(words):
            got = [t.id for t in self._model.tokenize(word.translate(self._alphabet))]
            if len(cache) >= MAX_WORDS:
                cache.clear()
            cache[word] = got
            learnt.append(got)
        return learnt

    def as_json(self) -> dict[str, Any]:
        return {"on": self.enabled, "texts": self.calls, "gaps": self.fallbacks, "words_held": len(self._cache),
                "scan": "C" if self._digits is not None else "re"}
