"""Tokenizing huge texts in a process of its own: no hold of the proxy's GIL, and a lower CPU priority.

The Rust tokenizer releases the GIL while it tokenizes, but handing its ids to Python does not: a
text of megabytes is millions of ids, and turning them into a Python list holds the GIL for tens
of milliseconds at once (the event loop and every other thread stopped meanwhile). A text over
`FAR_CHARS` characters is therefore tokenized by a helper process (started on the first such
text, holding only the tokenizer, at the nice value of `collectors.proxy.priority`'s threads: on
busy cores the proxy's other work goes first) which sends the ids back as raw 32-bit integers;
they become a Python list here a slice at a time. The ids are those the tokenizer gives in this
process (the same tokenizer, from its JSON). One text at a time: a second huge call waits.

A helper that dies (killed, out of memory) is started again on the next text; a text it could not
tokenize is tokenized here, as before.
"""

from __future__ import annotations

import array
import logging
import os
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from collectors.policy.token_ids import listed
from collectors.proxy.priority import HEAVY_NICE

log = logging.getLogger(__name__)
FAR_CHARS = 1 << 20  # a text this long is tokenized in the helper process
_SIZE = struct.Struct("<Q")  # each message: its length, then its bytes (a text as UTF-8; ids as native uint32)


def _read(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError("the other end closed the pipe")
    return data


def _message(stream: IO[bytes]) -> bytes:
    return _read(stream, _SIZE.unpack(_read(stream, _SIZE.size))[0])


def _send(stream: IO[bytes], data: bytes) -> None:
    stream.write(_SIZE.pack(len(data)))
    stream.write(data)
    stream.flush()


def serve(nice: int = HEAVY_NICE) -> None:
    """The helper process, at `nice`: its tokenizer's JSON first, then texts to ids until its input closes."""
    from tokenizers import Tokenizer

    try:
        os.nice(nice)
    except OSError:  # not permitted here: it runs at the proxy's priority
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer = Tokenizer.from_str(_message(stdin).decode())
    while True:
        try:
            text = _message(stdin).decode("utf-8", "surrogatepass")
        except EOFError:
            return
        ids = tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        _send(stdout, array.array("I", ids).tobytes())


def ids_from_bytes(raw: bytes) -> list[int]:
    """Raw native 32-bit ids as a list of Python ints, built a slice at a time (no long hold of the GIL)."""
    ids = array.array("I")
    ids.frombytes(raw)
    return listed(ids)


class FarTokenizer:
    """A tokenizer's `encode` for huge texts, run in a helper process (module docstring); one text at a time."""

    def __init__(self, backend: Any, nice: int = HEAVY_NICE) -> None:
        self._backend, self._nice = backend, nice  # a `tokenizers.Tokenizer`; the helper's nice value
        self._helper: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._helper is None or self._helper.poll() is not None:
            self._helper = subprocess.Popen(
                [sys.executable, "-c", f"from collectors.proxy.far_tokenizer import serve; serve({int(self._nice)})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in sys.path if p)})
            _send(self._helper.stdin, self._backend.to_str().encode())
        return self._helper

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text` (special tokens not added), or None when the helper could not tokenize it."""
        with self._lock:
            try:
                helper = self._started()
                _send(helper.stdin, text.encode("utf-8", "surrogatepass"))
                raw = _message(helper.stdout)
            except (OSError, EOFError, ValueError) as exc:  # ValueError: a pipe closed here
                log.warning("the tokenizer's helper process failed (%s: %s); this text is tokenized in the proxy, "
                            "the next one starts a new helper", type(exc).__name__, exc)
                self._stop()
                return None
        return ids_from_bytes(raw)

    def _stop(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.kill()
            helper.wait()
            for pipe in (helper.stdin, helper.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        with self._lock:
            self._stop()
