"""A real byte-level BPE tokenizer, trained on the spot, for models made by `trajstore init-model`.

Nothing is downloaded: `generated_corpus(seed)` writes a deterministic mix of chat-like
English, Python code, shell lines and JSON tool calls and schemas, and `train_tokenizer`
trains a byte-level BPE on it with the `tokenizers` library, in the layout of Qwen2's
tokenizer (Qwen's pre-tokenizer regex, byte-level decoder, ChatML special tokens), wrapped
as a transformers fast tokenizer with the chat template of `collectors.model.chat_template`.

Every byte sequence is encodable (the 256 byte symbols are in the initial alphabet), and
decoding inverts encoding for NFC text. The NFC normalizer is Qwen2's: transformers 5 loads
any `model_type: qwen2` checkpoint with its own `Qwen2Tokenizer`, which rebuilds the pipeline
with NFC, so leaving it out would make tokenizer.json and transformers disagree on non-NFC
input. Token exactness does not depend on it: collectors keep the sampled ids and never
re-tokenize model output.

Only the corpus is hand-written (a tokenizer needs text and none may be downloaded); the
training, the file formats and the template engine are the libraries'.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from collectors.model.families import FAMILIES, family as named_family
from collectors.model.toolcalls import render_call

# Hermes (the default family): ChatML control tokens are special (skipped when decoding with
# skip_special_tokens); the tool and reasoning markers are plain added tokens, as in
# Qwen2.5/Qwen3, so they stay in decoded text where tool-call and reasoning parsers look for them.
SPECIAL_TOKENS = FAMILIES["hermes"].special
MARKUP_TOKENS = FAMILIES["hermes"].markup

# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = """the a an and or but if then when while because so that this these those it its is are was were
be been being have has had do does did can could will would should may might must shall not no yes
i you he she we they me him her us them my your his our their what which who whom whose where why how
all any both each few more most other some such only own same than too very just also again once here
there about above after before below between into through during under over out up down off on in at
by for from of to with without within across along around against among time year day week month hour
minute second people person way thing world life hand part child eye woman man place work case point
company number group problem fact question answer idea reason result change example file folder line
code test value list item key name path error message request response server client model token
function class method module package project version data table query store event log rollout agent
tool call weather city temperature search result document page user assistant system help please thanks
hello sorry sure okay great good bad new old first last long short big small high low right left next
early late young important public private real best better able free full open close start stop run
read write send receive find make take give get go come see know think look want use tell ask feel try
leave keep let begin seem show hear play move live believe hold bring happen provide sit stand lose pay
meet include continue set learn lead understand watch follow create speak allow add spend grow offer
remember love consider appear buy wait serve die expect build stay fall cut reach kill remain suggest
raise pass sell require report decide pull explain check fix update delete install configure compute
return print import define train evaluate sample generate parse render load save merge split sort
filter count sum mean average total number string integer float boolean array object null true false
monday tuesday wednesday thursday friday saturday sunday january march june london paris tokyo berlin sydney
toronto celsius fahrenheit forecast rain snow sun wind fog storm pack coat boots hat jacket lamp lantern umbrella
kilometers miles dollars euros percent meters python rust javascript linux docker git shell json http""".split()

_TOOLS = {
    "get_weather": {"city": "CITY", "unit": ["celsius", "fahrenheit"]},
    "search_web": {"query": "TEXT", "max_results": "INT"},
    "read_file": {"path": "PATH"},
    "write_file": {"path": "PATH", "content": "TEXT"},
    "run_shell": {"command": "CMD", "timeout": "INT"},
    "calculator": {"expression": "EXPR"},
    "send_email": {"to": "EMAIL", "subject": "TEXT", "body": "TEXT"},
    "list_directory": {"path": "PATH", "recursive": "BOOL"},
}
_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Sydney", "Toronto", "Lagos", "Lima", "Oslo", "Seoul"]
_WEATHER = ["rain", "snow", "sun", "wind", "fog", "storm", "clear", "cloudy"]


_ONSETS = ["b", "br", "c", "ch", "d", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl", "r", "s", "sh",
           "st", "t", "th", "tr", "v", "w", "z", ""]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "x", "ck"]


def _name(rng: random.Random) -> str:
    """A pronounceable made-up word: names of people, places and products keep the vocabulary open."""
    word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
    return word.capitalize() if rng.random() < 0.5 else word


def _sentence(rng: random.Random) -> str:
    words = [_name(rng) if rng.random() < 0.15 else w for w in rng.choices(_WORDS, k=rng.randint(4, 14))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ":", ","])


def _ident(rng: random.Random) -> str:
    parts = [_name(rng).lower() if rng.random() < 0.2 else w for w in rng.choices(_WORDS, k=rng.randint(1, 3))]
    return "_".join(parts) if rng.random() < 0.7 else "".join(p.capitalize() for p in parts)


def _argument(rng: random.Random, kind: object) -> object:
    if isinstance(kind, list):
        return rng.choice(kind)
    return {
        "CITY": lambda: rng.choice(_CITIES), "INT": lambda: rng.randint(1, 500), "BOOL": lambda: rng.random() < 0.5,
        "PATH": lambda: "/" + "/".join(_ident(rng) for _ in range(rng.randint(1, 3))) + rng.choice([".py", ".txt", ".json", ""]),
        "CMD": lambda: rng.choice(["ls -la", "git status", "pytest -q", "cat README.md", "pip install numpy", "make test"]),
        "EXPR": lambda: f"{rng.randint(1, 999)} {rng.choice('+-*/')} {rng.randint(1, 999)}",
        "EMAIL": lambda: f"{_ident(rng)}@example.com",
        "TEXT": lambda: _sentence(rng),
    }[str(kind)]()


def _tool_call(rng: random.Random) -> str:
    name = rng.choice(list(_TOOLS))
    args = {k: _argument(rng, v) for k, v in _TOOLS[name].items()}
    return render_call(name, args)


def _tool_schema(rng: random.Random) -> str:
    name = rng.choice(list(_TOOLS))
    props = {k: ({"type": "string", "enum": v} if isinstance(v, list) else
                 {"type": {"INT": "integer", "BOOL": "boolean"}.get(str(v), "string"), "description": _sentence(rng)})
             for k, v in _TOOLS[name].items()}
    schema = {"type": "function", "function": {"name": name, "description": _sentence(rng),
                                               "parameters": {"type": "object", "properties": props,
                                                              "required": list(props)[:1]}}}
    return json.dumps(schema)


def _code(rng: random.Random) -> str:
    fn, a, b = _ident(rng), _ident(rng), _ident(rng)
    body = rng.choice([
        f"    return {a} + {b}\n",
        f"    for item in {a}:\n        if item > {rng.randint(0, 99)}:\n            {b}.append(item)\n    return {b}\n",
        f"    with open({a}) as f:\n        return json.load(f)[\"{b}\"]\n",
        f"    if not {a}:\n        raise ValueError(f\"{b} is empty: {{{a}!r}}\")\n    return len({a})\n",
    ])
    return f"def {fn}({a}, {b}={rng.randint(0, 9)}):\n    \"\"\"{_sentence(rng)}\"\"\"\n{body}"


def _tool_output(rng: random.Random) -> str:
    return json.dumps({"city": rng.choice(_CITIES), "weather": rng.choice(_WEATHER),
                       "temperature": round(rng.uniform(-20, 40), 1),
                       "results": [_sentence(rng) for _ in range(rng.randint(0, 2))], "ok": rng.random() < 0.9})


def _chat(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))


def _chat_with_call(rng: random.Random) -> str:
    return _sentence(rng) + "\n" + _tool_call(rng)


def _thinking(rng: random.Random) -> str:
    return "<think>\n" + _sentence(rng) + "\n</think>\n\n" + _sentence(rng)


def _shell(rng: random.Random) -> str:
    return f"$ {_argument(rng, 'CMD')}\n{rng.randint(0, 9999)} {_ident(rng)}.{rng.choice(['py', 'md'])}"


_MAKERS = (_chat, _chat_with_call, _tool_schema, _code, _thinking, _tool_output, _shell)


def generated_corpus(seed: int = 0, documents: int = 2000) -> Iterator[str]:
    """A deterministic mix of the texts an agent model sees: chat, code, tool calls and results."""
    rng = random.Random(seed)
    for _ in range(documents):
        yield rng.choice(_MAKERS)(rng)


def train_tokenizer(vocab_size: int = 4096, seed: int = 0, family: str = "hermes") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly `vocab_size` entries (special tokens included), with the control
    tokens and chat template of `family` (`collectors.model.families`)."""
    spec = named_family(family)
    reserved = len(spec.special) + len(spec.markup)
    if vocab_size < 256 + reserved + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens, "
                         f"{reserved} special tokens and at least one merge; use at least {256 + reserved + 1}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - reserved, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generated_corpus(seed, documents=max(1000, vocab_size // 2)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size - reserved:
        raise ValueError(f"the generated corpus only supports {tok.get_vocab_size() + reserved} tokens, "
                         f"fewer than vocab_size {vocab_size}; choose a smaller --vocab-size")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.markup])
    named = {spec.eos, spec.pad, spec.bos}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=spec.eos, pad_token=spec.pad, unk_token=None, bos_token=spec.bos,
        additional_special_tokens=[t for t in spec.special if t not in named or t == spec.eos],
        chat_template=spec.template, model_max_length=1 << 20, clean_up_tokenization_spaces=False,
    )
