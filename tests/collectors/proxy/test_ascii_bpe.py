"""The ASCII tokenizing path gives exactly the tokenizer's ids, for every byte-level BPE layout it takes; it
refuses the layouts it cannot read, a translation that differs is caught when the path is made, and a
difference met later turns it off; the proxy tokenizes through it and reports it."""

from __future__ import annotations

import re
import shutil
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from collectors.model.families import FAMILIES
from collectors.model.tokenizer import QWEN2_SPLIT, generated_corpus, train_tokenizer
from collectors.proxy import ascii_bpe
from collectors.proxy.ascii_bpe import LLAMA3_SPLIT, VERIFY_EVERY, AsciiBPE, Untranslatable, translate
from collectors.proxy.render import ChatRenderer
from tests.collectors.proxy_harness import MODEL, Scripted, call, running_proxy

ADDED = ["<|a|>", "<|ab|>", "</x>"]


def _trained(pre_tokenizer: Any, normalizer: Any = None, model: Any = None) -> Tokenizer:
    """A byte-level BPE trained on the generated corpus, with `ADDED` as special tokens."""
    tok = Tokenizer(model or models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=ADDED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generated_corpus(0, 300), trainer)
    return tok


def _split(pattern: str) -> Any:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.fixture(scope="module")
def backends() -> dict[str, Tokenizer]:
    made = {name: train_tokenizer(1024, family=name).backend_tokenizer for name in sorted(FAMILIES)}
    made["gpt2"] = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    made["llama3"] = _trained(_split(LLAMA3_SPLIT))
    made["qwen2, no normalizer"] = _trained(_split(QWEN2_SPLIT))
    made["qwen2, NFKC"] = _trained(_split(QWEN2_SPLIT), normalizers.Sequence([normalizers.NFKC()]))
    made["gaps"] = _trained(_split(r" ?\p{L}+|\p{N}{1,2}"))  # whitespace and punctuation fall between matches
    return made


def whole(backend: Tokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


def _ascii_texts(added: list[str]) -> st.SearchStrategy[str]:
    """ASCII texts of pieces the split patterns tell apart: contractions in any case, words, digit runs,
    punctuation runs, whitespace runs of every kind, the added tokens and their partial forms, any ASCII."""
    partial = [t[:k] for t in added for k in (1, 2, len(t) - 1)]
    pieces = ["'s", "'S", "'ll", "'LL", "'d", "'ve", "'", "''", "don't", "IT'S", "12", "12345", "3.14", "x1",
              "def", " def", "Hello", "__init__", "()", "!!!", " !?", "->", "\n", "\n\n", "\r\n", "\t", " ", "  ",
              "   ", " \n ", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", "{\"a\": 1}"]
    piece = st.one_of(st.sampled_from(pieces), st.sampled_from(added), st.sampled_from(partial),
                      st.text(alphabet=[chr(c) for c in range(128)], max_size=10),
                      st.text(alphabet=string.ascii_letters + string.digits + " \n'", max_size=10))
    return st.lists(piece, max_size=40).map("".join)


@pytest.mark.parametrize("name", [*sorted(FAMILIES), "gpt2", "llama3", "qwen2, no normalizer", "qwen2, NFKC", "gaps"])
def test_ascii_texts_get_the_tokenizers_ids(backends: dict[str, Tokenizer], name: str) -> None:
    backend = backends[name]
    fast, why = AsciiBPE.of(backend)
    assert fast is not None, why
    added = [t.content for t in backend.get_added_tokens_decoder().values()]

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_ascii_texts(added))
    def check(text: str) -> None:
        assert fast.encode(text) == whole(backend, text)
        pieces = [p for p in text.split(added[0]) if p and not any(a in p for a in added)] if added else [text]
        assert fast.encode_pieces(pieces) == [whole(backend, p) for p in pieces]

    check()
    assert fast.enabled  # no verified call found a difference
    assert (fast.fallbacks > 0) == (name == "gaps")  # a piece with a gap between matches went to the tokenizer
    if ascii_bpe._ascii_words is not None:  # Qwen2's and Llama 3's regex are cut in C, the others by `re`
        assert fast.as_json()["scan"] == ("re" if name in ("gpt2", "gaps") else "C")


# The C scan (collectors/proxy/_ascii_words.c) is built with the package wherever a C compiler is (CI has gcc).
NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None
needs_c_scan = pytest.mark.skipif(NO_COMPILER, reason="no C compiler here: the package was installed without its "
                                                      "C scan, and the proxy tokenizes through `re`")


@needs_c_scan
def test_the_c_scan_is_built() -> None:
    assert ascii_bpe._ascii_words is not None, (
        "collectors/proxy/_ascii_words.c was not built although a C compiler is here: reinstall with "
        "`pip install -e .` and read its output")


@needs_c_scan
@pytest.mark.parametrize(("pattern", "digits"), [(QWEN2_SPLIT, 1), (LLAMA3_SPLIT, 3)])
def test_the_c_scan_cuts_ascii_text_as_the_regex_does(pattern: str, digits: int) -> None:
    words = re.compile(translate(pattern), re.ASCII)
    scan = ascii_bpe._ascii_words

    @settings(max_examples=1000, deadline=None)
    @given(st.one_of(_ascii_texts(["<|a|>"]), st.text(alphabet=[chr(c) for c in range(128)], max_size=60)))
    def check(text: str) -> None:
        assert scan.split(text, digits) == words.findall(text)

    check()


@needs_c_scan
def test_the_c_scan_names_what_the_cache_lacks_and_refuses_what_it_cannot_take() -> None:
    scan = ascii_bpe._ascii_words
    assert scan.encode("ab cd", {"ab": [1], " cd": [2, 3]}, 1) == ([1, 2, 3], [])
    assert scan.encode("ab cd ab", {"ab": [1]}, 1) == (None, [" cd", " ab"])
    assert scan.encode("", {}, 1) == ([], [])
    with pytest.raises(ValueError, match="ASCII"):
        scan.encode("caf\u00e9", {}, 1)
    with pytest.raises(TypeError, match="a list of ids"):
        scan.encode("ab", {"ab": (1,)}, 1)


@needs_c_scan
def test_the_c_scans_table_of_recent_words_answers_as_the_word_cache_does(backends: dict[str, Tokenizer]) -> None:
    """The table in front of the word cache (words found lately, looked up without making their strings) gives
    the cache's own ids: when full of them, after the cache starts over (a word's ids never change), and for
    another tokenizer's cache, which it starts over for."""
    scan = ascii_bpe._ascii_words
    fast, _ = AsciiBPE.of(backends["hermes"])
    assert fast is not None
    text = "def f(x):\n    return x + 1  # the same words again and again: " * 50
    cold = fast.encode(text)
    assert cold == whole(backends["hermes"], text) == fast.encode(text)  # the second from the table
    fast._cache.clear()  # noqa: SLF001 - the dict starts over; the table still knows its words, rightly
    assert scan.encode(text, fast._cache, 1)[0] == cold  # noqa: SLF001
    scan.clear_front()
    assert scan.encode(text, fast._cache, 1)[0] is None  # noqa: SLF001 - the dict alone lacks them now
    mine, other = {"ab": [1], " cd": [2, 3]}, {"ab": [9], " cd": [8]}
    assert scan.encode("ab cd", mine, 1) == ([1, 2, 3], [])
    assert scan.encode("ab cd", other, 1) == ([9, 8], [])  # another cache: the table started over
    assert scan.encode("ab cd", mine, 1) == ([1, 2, 3], [])


def test_ids_are_right_while_the_word_cache_starts_over(backends: dict[str, Tokenizer],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A text of more distinct words than the cache holds: learning them clears the cache over and over."""
    monkeypatch.setattr(ascii_bpe, "MAX_WORDS", 3)
    fast, _ = AsciiBPE.of(backends["hermes"])
    assert fast is not None
    text = "one two three four five six seven, 1234 and 'll\n\n  done"
    assert fast.encode(text) == whole(backends["hermes"], text) and len(fast._cache) <= 3


def test_python_source_gets_the_tokenizers_ids(backends: dict[str, Tokenizer]) -> None:
    """Real text: this repository's own code and docs (ASCII parts), with the chat markup in them."""
    source = "".join(p.read_text() for p in sorted(Path(ascii_bpe.__file__).parent.glob("*.py")))
    text = "".join(c for c in source if c.isascii())
    for name in ("hermes", "gpt2", "llama3"):
        fast, _ = AsciiBPE.of(backends[name])
        assert fast is not None and fast.encode(text) == whole(backends[name], text)


def test_text_with_any_other_character_is_left_to_the_tokenizer(backends: dict[str, Tokenizer]) -> None:
    fast, _ = AsciiBPE.of(backends["hermes"])
    assert fast is not None
    assert fast.encode("caf\u00e9") is None and fast.encode_pieces(["ok", "\u00e9"]) is None


@pytest.mark.parametrize(("onig", "python"), [
    (r"\p{N}{1,3}", "[0-9]{1,3}"),
    (r"[^\s\p{L}\p{N}]+", r"[^\t\n\x0b\x0c\r A-Za-z0-9]+"),
    (r"\s+(?!\S)", r"[\t\n\x0b\x0c\r ]+(?![^\t\n\x0b\x0c\r ])"),
    (r"\p{Lo}|[\p{Lo}]|[^\p{M}]", r"[^\x00-\x7f]|[^\x00-\x7f]|[\x00-\x7f]"),
    (r"(ab)|(?i:'s)", r"(?:ab)|(?i:'s)"),
    (r"\P{L}\d\w\x41\.", r"[^A-Za-z][0-9][A-Za-z0-9_]\x41\."),
])
def test_the_translation_of_each_construct(onig: str, python: str) -> None:
    assert translate(onig) == python


@pytest.mark.parametrize("pattern", [r"\p{P}+", r"\bx", r"^x", r"x$", r"(?<n>x)", r"[[:alpha:]]", r"[a&&b]",
                                     r"[^\P{L}]", r"\k<n>", r"\h", "x\\", "[ab"])
def test_constructs_not_known_here_are_not_translated(pattern: str) -> None:
    with pytest.raises(Untranslatable):
        translate(pattern)


def _untrained(pre_tokenizer: Any, normalizer: Any = None, model: Any = None) -> Tokenizer:
    tok = Tokenizer(model or models.BPE())
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    return tok


@pytest.mark.parametrize(("made", "reason"), [
    (lambda: _untrained(_split(QWEN2_SPLIT), normalizers.Lowercase()), "normalizer"),
    (lambda: _untrained(pre_tokenizers.Metaspace()), "pre-tokenizer"),
    (lambda: _untrained(pre_tokenizers.ByteLevel(add_prefix_space=True)), "pre-tokenizer"),
    (lambda: _untrained(_split(r"\p{P}+|\s+|[^\s\p{P}]+")), "property"),
    (lambda: _untrained(_split(QWEN2_SPLIT), model=models.BPE(dropout=0.5)), "deterministic"),
    (lambda: _untrained(_split(QWEN2_SPLIT), model=models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")),
     "deterministic"),
    (lambda: _untrained(_split(r"x*")), "match nothing"),
])
def test_layouts_the_path_cannot_read_get_none(made: Any, reason: str) -> None:
    fast, why = AsciiBPE.of(made())
    assert fast is None and why is not None and reason in why


def test_a_translation_that_differs_is_caught_when_the_path_is_made(
        backends: dict[str, Tokenizer], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ascii_bpe._PROPERTIES, "L", "a-z")  # \p{L} without the capitals
    fast, why = AsciiBPE.of(backends["hermes"])
    assert fast is None and "does not give the tokenizer's ids" in why


def test_a_difference_met_later_turns_the_path_off(
        backends: dict[str, Tokenizer], caplog: pytest.LogCaptureFixture) -> None:
    backend = backends["hermes"]
    fast, _ = AsciiBPE.of(backend)
    assert fast is not None
    text = "the weather in Paris"
    fast.encode(text)
    fast._cache[" Paris"] = [0]  # a wrong entry: only a verified call can find it
    if ascii_bpe._ascii_words is not None:  # the C scan's table of recent words holds the right one: let it go
        ascii_bpe._ascii_words.clear_front()
    fast.calls = 0
    answers = [fast.encode(text) for _ in range(VERIFY_EVERY)]
    assert answers[0] != whole(backend, text) and all(a == answers[0] for a in answers[:-1])
    assert answers[-1] == whole(backend, text)  # the verified call: the tokenizer's ids, and the path off
    assert not fast.enabled and fast.encode(text) is None
    assert "tokenizing every text with the tokenizer from now on" in caplog.text


def test_the_renderer_tokenizes_through_the_path_short_and_long(tiny_model: Path) -> None:
    tok: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(tiny_model)
    renderer = ChatRenderer(tok)
    short = renderer.render([{"role": "user", "content": "What's the weather in Paris?"}], None, generation_prompt=True)
    long = renderer.render([{"role": "system", "content": "You help. " * 900},
                            {"role": "user", "content": "def f(x):\n    return x  # 42\n" * 100}], None,
                           generation_prompt=True)
    for text in (short, long, long + "caf\u00e9"):
        assert renderer.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
    stats = renderer.ascii_stats()
    assert stats["on"] and stats["texts"] == 2 and stats["words_held"] > 0  # the short text, the long one's pieces


def test_the_proxy_reports_the_path(tiny_model: Path, tmp_path: Path) -> None:
    upstream = Scripted(AutoTokenizer.from_pretrained(tiny_model))
    with running_proxy(upstream, tmp_path / "store", tiny_model) as h:
        rollout = h.open()
        reply = call(rollout["base_urls"]["openai"] + "/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}]}, key=rollout["api_key"])
        assert reply.status == 200, reply.body
        stats = call(h.url + "/stats").body["ascii_tokenizing"]
        assert stats["on"] and stats["texts"] >= 2  # the prompt, and the reply tokenized again
