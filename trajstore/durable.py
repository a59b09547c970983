"""Making bytes on a local disk durable: the one fsync helper of the project.

A file's data is durable after `fsync(file)`, or when a write to a file opened with `O_DSYNC`
returns (`create_synchronous`); its name (a create, rename or delete) after `fsync(directory)`.
Everything that promises durability (write-ahead segments, epochs, sealed files, checkpoints)
goes through these.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


_O_DSYNC = getattr(os, "O_DSYNC", 0)
SYNCHRONOUS_WRITES = bool(_O_DSYNC)  # whether `create_synchronous`'s writes return durable


def create_synchronous(path: str | os.PathLike[str]) -> IO[bytes]:
    """A new file (an error if it exists), unbuffered, whose every write returns once its bytes are on disk
    (`O_DSYNC`: what write + fdatasync does, in one system call) where the system has it; elsewhere call
    `sync_file` after writing. Its name is not durable until its directory is fsync'd."""
    return open(path, "xb", buffering=0, opener=lambda p, flags: os.open(p, flags | _O_DSYNC, 0o666))


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file's data, or a directory's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(f: IO[Any]) -> None:
    """Flush an open file's buffer and fsync its data."""
    f.flush()
    os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, then `root` itself."""
    for p in sorted(root.rglob("*")):
        fsync_path(p)
    fsync_path(root)


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically and durably (write beside, fsync, rename, fsync the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        sync_file(f)
    os.replace(tmp, path)
    fsync_path(path.parent)


@contextmanager
def staged_directory(final: Path, prefix: str, *, replace: bool = False) -> Iterator[Path]:
    """A new directory beside `final` (`<prefix><final name>-<random>`) for the caller to fill.

    When the block ends without error, the directory is made durable and renamed to `final`, so
    readers see all of it or nothing; with `replace`, a `final` already there (a stale copy) is
    moved aside and removed first, else a `final` that appeared meanwhile fails the rename. On
    any error the new directory is removed and the error raised."""
    tmp = final.parent / f"{prefix}{final.name}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if replace and final.exists():
            stale = final.parent / f"{prefix}{final.name}-stale"
            os.rename(final, stale)
            shutil.rmtree(stale)
        os.rename(tmp, final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
