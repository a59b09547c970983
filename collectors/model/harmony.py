"""gpt-oss harmony replies read with `openai-harmony`'s own parser, as text arrives or whole.

A harmony reply is a run of messages after the prompt's `<|start|>assistant`:

    <|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant to=functions.N<|channel|>commentary <|constrain|>json<|message|>{arguments}   (<|call|>)
    <|start|>assistant<|channel|>final<|message|>{answer}                                             (<|return|>)

`HarmonyReader` feeds the reply's text to `openai_harmony.StreamableParser` (the library's
incremental parser; the same one `parse_messages_from_completion_tokens` runs) and reads it as
reasoning (analysis channel), content (final channel, and commentary without a recipient: a
preamble) and tool calls (messages to `functions.NAME`). The stream and the whole reply go
through the same reader, so every piece streamed is a prefix of the final parse. Text the
parser refuses (the model broke the format) and a header never finished are content, as
they were written.

The library works on o200k token ids, not on the model's: the text is encoded with the
harmony encoding (`allowed_special="all"`, so control tokens the model sampled are control
tokens again). Rendering does not go through the library: the proxy renders every model with
its chat template (`collectors.model.family_templates`, checked against the library's
rendering), so the library is used for parsing only.

The encoding's vocabulary (`o200k_base.tiktoken`) is never downloaded here. `openai-harmony`
would fetch it from openaipublic.blob.core.windows.net unless `TIKTOKEN_ENCODINGS_BASE` names a
directory holding it, and it checks the file's sha256 wherever it comes from. `encoding()`
uses `TIKTOKEN_ENCODINGS_BASE` when it is set; otherwise it looks for an exact copy already on
this machine (tiktoken's cache, or the copy litellm ships) and, finding none, says what to do.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from collectors.errors import CollectorError

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken caches a downloaded file under the sha1 of its URL; litellm ships its copy under the same name
_CACHED_NAME = hashlib.sha1(b"https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken").hexdigest()
FUNCTIONS = "functions."
SEPARATOR = "\n\n"  # between two messages of one kind (two analysis messages are one reasoning text)
_CONTROL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
            "<|endoftext|>")
_load_lock = threading.Lock()


class HarmonyVocabMissing(CollectorError):
    """No offline copy of the harmony encoding's vocabulary file was found."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _offline_copies() -> list[Path]:
    """Where an exact copy of o200k_base.tiktoken may already be on this machine."""
    places = [Path(os.environ[v]) / _CACHED_NAME for v in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR") if v in os.environ]
    places.append(Path(tempfile.gettempdir()) / "data-gym-cache" / _CACHED_NAME)
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.origin:
        places.append(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers" / _CACHED_NAME)
    return places


def vocab_dir() -> Path:
    """A directory holding o200k_base.tiktoken for `TIKTOKEN_ENCODINGS_BASE` (see the module docstring)."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return Path(os.environ["TIKTOKEN_ENCODINGS_BASE"])
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trajstore" / "harmony"
    if (home / VOCAB_FILE).is_file() and _sha256(home / VOCAB_FILE) == VOCAB_SHA256:
        return home
    for copy in _offline_copies():
        if copy.is_file() and _sha256(copy) == VOCAB_SHA256:
            home.mkdir(parents=True, exist_ok=True)
            partial = home / f".{VOCAB_FILE}.{os.getpid()}"
            shutil.copyfile(copy, partial)
            partial.replace(home / VOCAB_FILE)  # atomic: a concurrent reader sees the whole file or none
            return home
    raise HarmonyVocabMissing(
        f"parsing harmony (gpt-oss) replies needs the file {VOCAB_FILE} (sha256 {VOCAB_SHA256[:12]}...), which "
        "openai-harmony would download; none was found on this machine. Copy it from a machine that has it "
        f"(https://openaipublic.blob.core.windows.net/encodings/{VOCAB_FILE}) into a directory and set "
        "TIKTOKEN_ENCODINGS_BASE to that directory")


@functools.cache
def encoding() -> Any:
    """The harmony encoding of gpt-oss, loaded from a local vocabulary file (never downloaded)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    directory = str(vocab_dir())
    with _load_lock:  # the variable is read by the library at load time only; put it back after
        before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = directory
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            if before is None:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def _held(text: str) -> int:
    """Length of the end of `text` that may still grow into a control token (held back: never split one)."""
    start = text.rfind("<")
    if start < 0 or ">" in text[start:]:
        return 0
    tail = text[start:]
    return len(tail) if any(c.startswith(tail) for c in _CONTROL) else 0


class HarmonyReader:
    """A harmony reply's reasoning, content and calls as its text arrives (see the module docstring)."""

    def __init__(self, parse_tools: bool = True) -> None:
        from openai_harmony import Role, StreamableParser

        self.parse_tools = parse_tools
        self._enc = encoding()
        self._parser = StreamableParser(self._enc, Role.ASSISTANT, strict=False)
        self._pending = ""  # text that may still begin a control token
        self._tokens: list[int] = []  # o200k ids fed so far
        self._header_from = 0  # where the header being read started (its text is content if never finished)
        self._broken_from: int | None = None  # the parser refused the token here: the rest is content as written

    def feed(self, text: str) -> None:
        text = self._pending + text
        keep = _held(text)
        self._pending = text[len(text) - keep:] if keep else ""
        self._push(text[:len(text) - keep])

    def _push(self, text: str) -> None:
        from openai_harmony import HarmonyError, StreamState

        for token in self._enc.encode(text, allowed_special="all") if text else []:
            self._tokens.append(token)
            if self._broken_from is not None:
                continue
            try:
                self._parser.process(token)
            except HarmonyError:  # the model broke the format here
                self._broken_from = len(self._tokens) - 1
                continue
            if self._parser.state != StreamState.HEADER:
                self._header_from = len(self._tokens)

    def _kinds(self, messages: list[Any]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        for message in messages:
            text = "".join(getattr(part, "text", "") for part in message.content)
            recipient = message.recipient or ""
            if message.channel == "analysis":
                reasoning.append(text)
            elif recipient.startswith(FUNCTIONS) and self.parse_tools:
                calls.append((recipient[len(FUNCTIONS):], text))
            else:
                content.append(text)
        return reasoning, content, calls

    def view(self, *, final: bool = False) -> tuple[str | None, str, list[tuple[str, str]]]:
        """(reasoning, content, calls) of the text so far; `final`: the reply is complete."""
        from openai_harmony import Author, Message, Role, StreamState, TextContent

        if final and self._pending:
            self._push(self._pending)
            self._pending = ""
        parser = self._parser
        messages = list(parser.messages)
        tail: list[str] = []
        if parser.state == StreamState.CONTENT:  # the open message: complete when the reply is
            messages.append(Message(author=Author(role=Role.ASSISTANT), content=[TextContent(text=parser.current_content)],
                                    channel=parser.current_channel, recipient=parser.current_recipient))
        elif final and parser.state == StreamState.HEADER and self._broken_from is None:
            tail.append(self._enc.decode(self._tokens[self._header_from:]))
        if self._broken_from is not None:
            tail.append(self._enc.decode(self._tokens[self._broken_from:]))
        reasoning, content, calls = self._kinds(messages)
        return (SEPARATOR.join(reasoning) if reasoning else None), SEPARATOR.join(content + tail), calls


def parse_harmony(text: str, parse_tools: bool = True) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments JSON text)]) of a whole harmony reply."""
    reader = HarmonyReader(parse_tools)
    reader.feed(text)
    return reader.view(final=True)
