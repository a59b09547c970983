"""A local, size-bounded on-disk cache of sealed files, for stores on object storage.

Sealed files never change and their names carry the CRC-32 of their bytes, so a file fetched
once serves every later read on this host, by every process: `SealedFileCache.local_paths()`
downloads the files a scan is about to read that are not cached yet (in parallel, each whole in
one GET after a HEAD), checks each one's whole-file CRC-32 against its name, and moves it into
the cache directory; the scan then reads local copies. Scans still verify the Parquet page
checksums of what they read.

Files are fetched before a scan, in Python, not from inside it: a pyarrow filesystem written in
Python would be called from pyarrow's scan threads, which then need the GIL that a DuckDB query
holds while it waits for those threads (a deadlock, seen here).

- Key: the file's name (unique per sealed file, CRC included), under a directory per store URI.
- Bound: `max_bytes` (default 4 GiB, `TRAJSTORE_FILE_CACHE_BYTES`); past it the least recently
  used files (by modification time, refreshed on each use) are removed. A removed file is
  fetched again the next time a scan is prepared; a reader holding it open keeps reading it.
- Where: `TRAJSTORE_FILE_CACHE`, default `~/.cache/trajstore/files`.

A local store needs no cache: its files already are on this host's disk.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs

from trajstore.errors import CorruptionError

DEFAULT_MAX_BYTES = 4 << 30
FETCH_THREADS = 16  # object stores answer many small GETs at once far faster than one after another


def default_root() -> Path:
    return Path(os.environ.get("TRAJSTORE_FILE_CACHE") or Path.home() / ".cache/trajstore/files")


def default_max_bytes() -> int:
    text = os.environ.get("TRAJSTORE_FILE_CACHE_BYTES")
    return int(text) if text else DEFAULT_MAX_BYTES


class SealedFileCache:
    """Sealed files of one remote store, copied on first use into a local directory."""

    def __init__(self, source: pafs.FileSystem, store_uri: str, *, root: Path | None = None,
                 max_bytes: int | None = None) -> None:
        self.source = source
        self.dir = (root or default_root()) / hashlib.sha256(store_uri.encode()).hexdigest()[:16]
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.fetches = 0  # files downloaded by this process (tests and benchmarks read it)
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._added = 0  # bytes added since the directory's size was last summed

    def local(self, remote_path: str, size: int, crc: int | None) -> str:
        """The local copy of the sealed file at `remote_path` (`size` bytes, whole-file CRC-32 `crc`)."""
        path = self.dir / remote_path.rsplit("/", 1)[-1]
        try:
            os.utime(path)  # a hit: most recently used now
            return str(path)
        except FileNotFoundError:
            pass
        with self._lock:
            fetching = self._fetching.setdefault(path.name, threading.Lock())
        with fetching:  # scan threads opening one file at once fetch it once
            if path.exists():
                return str(path)
            return self._fetch(remote_path, path, size, crc)

    def _fetch(self, remote_path: str, path: Path, size: int, crc: int | None) -> str:
        with self.source.open_input_stream(remote_path) as fh:
            body = fh.read()
        self.fetches += 1
        if len(body) != size or (crc is not None and zlib.crc32(body) != crc):
            raise CorruptionError(
                f"sealed file {remote_path.rsplit('/', 1)[-1]} fails the CRC-32 recorded in its name ({len(body)} bytes "
                "read, the log says {size}): its bytes changed after writing; run `trajstore verify` for the full report")
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)  # whole or absent: a crash leaves at most a .tmp file
        with self._lock:
            self._fetching.pop(path.name, None)
            self._added += len(body)
            if self._added > self.max_bytes // 8:
                self._added = 0
                self._evict()
        return str(path)

    def _evict(self) -> None:
        """Remove the least recently used files until the directory holds at most `max_bytes`."""
        entries = []
        for p in self.dir.iterdir():
            try:
                st = p.stat()
            except FileNotFoundError:
                continue  # another process removed it
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    def local_paths(self, files: list[tuple[str, int, int | None]]) -> list[str]:
        """Local copies of sealed files given as (remote path, size, whole-file CRC-32), fetching the
        missing ones in parallel."""
        if not files:
            return []
        with ThreadPoolExecutor(min(FETCH_THREADS, len(files))) as pool:
            return list(pool.map(lambda f: self.local(*f), files))
