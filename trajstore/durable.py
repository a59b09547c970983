"""Making bytes on a local disk durable: the one fsync helper of the project.

A file's data is durable after `fsync(file)`; its name (a create, rename or delete) after
`fsync(directory)`. Everything that promises durability (write-ahead segments, epochs,
sealed files, checkpoints) goes through these.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file's data, or a directory's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
