"""Directories published where every host can read them (checkpoints), and fetched into a local cache.

The learner writes each checkpoint on its own disk; `upload` copies it to a directory URI (an
`s3://bucket/prefix/...` beside the store's table, or a path on a shared mount) and `fetch`
brings it into a local cache on any other host. Both reach object storage through the store's
own client (`trajstore.location.directory`: pyarrow's S3 filesystem, the same AWS_* settings and
endpoint as an `s3://` store).

Promises:
- Atomic for readers: `upload` copies every file first and writes the manifest
  `trajstore_manifest.json` (each file's size and sha256) last. A reader goes by the manifest
  only, so a directory without one (an upload in progress, or one a crash cut short) is never
  read. The announcement carries the manifest's own sha256 (`digest`), so a reader also knows
  the manifest it found is the one announced.
- `upload` is idempotent (a finished upload of the same files is left alone, an interrupted one
  is redone) and refuses to replace a finished upload of other files: versions are published once.
- `fetch` downloads into `CACHE/.partial-KEY-RANDOM/`, checks every file's size and sha256
  against the manifest, then renames the directory to `CACHE/KEY/` (KEY: a hash of the URI). A
  partial or damaged download is never at a name a reader uses; damage raises ArtifactError
  naming the file. Collectors sharing a cache on one host serialize on an exclusive `flock` of
  `CACHE/.lock-KEY`: one downloads, the others then find its copy. A lock dies with its process,
  so a fetch killed midway never blocks the next one, which first removes its leftovers.
- On a shared disk, `fetch` reads plain files only: a symbolic link anywhere below the published
  directory (a file or folder swapped for a link to another file of the server's user) is
  refused, never followed, and no message tells the size or hash of anything read.

`local_copy` is what a consumer calls with an announcement (path on the publisher's host, URI,
digest): the announced path when this host's disk holds that very directory, else a verified copy
in the cache, which then keeps only the KEEP most recently used copies. Collectors call it for
their vLLM; `trajstore serve` calls it itself when a collector on another host names a version by
its URI (`/v1/load_weights`).

Limits: files are hashed on both sides (one pass to publish, one to fetch; about 1 GB/s a core).
The cache keeps every version it fetched; `prune` removes all but the newest few (`local_copy`
calls it after each fetch). A manifest on a shared mount (not S3) is written in place, so a
reader racing the writer may see it torn: that reads as damage and is retried, never used.
Hand-written because pyarrow's filesystems copy files but have no notion of a finished
directory, and no library on the registries publishes one with a checksummed manifest over the
store's S3 client.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import pyarrow.fs as pafs

from trajstore.durable import staged_directory, write_durably
from trajstore.errors import ArtifactError
from trajstore.location import directory

MANIFEST = "trajstore_manifest.json"
CACHE_ENV = "TRAJSTORE_CHECKPOINT_CACHE"
KEEP = 3  # fetched copies `local_copy` keeps: the one served, the one loading, one spare
_CHUNK = 8 << 20
_PARTIAL = ".partial-"
_DIGEST = re.compile(r"[0-9a-f]{64}")


def is_digest(text: object) -> bool:
    """True for what `digest` returns: 64 lowercase hex digits."""
    return isinstance(text, str) and _DIGEST.fullmatch(text) is not None


def default_cache() -> Path:
    """`$TRAJSTORE_CHECKPOINT_CACHE`, else `~/.cache/trajstore/checkpoints`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache/trajstore/checkpoints")


def digest(manifest_bytes: bytes) -> str:
    """The sha256 of a manifest: what an announcement names a published directory by."""
    return hashlib.sha256(manifest_bytes).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A file's size and sha256, as a manifest lists it (and as `fetch_beside` checks it)."""
    return {"size": Path(path).stat().st_size, "sha256": _sha256_file(Path(path))}


def manifest(local: str | os.PathLike[str], exclude: Collection[str] = ()) -> bytes:
    """The manifest of `local`'s files (relative POSIX paths; `exclude` names files left out)."""
    root = Path(local)
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel != MANIFEST and rel not in exclude:
            files[rel] = file_entry(p)
    return (json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True) + "\n").encode()


def _read(fs: pafs.FileSystem, path: str) -> bytes | None:
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _open_plain(root: str, rel: str) -> BinaryIO:
    """Open `root/rel` on a local disk, refusing a symbolic link anywhere below `root` and anything
    but a regular file at the end: a published directory a collector fetches from must not reach
    other files of the server's user (their sizes and hashes, or their bytes into the cache).

    Each component is opened relative to its parent with O_NOFOLLOW, so a link swapped in between
    a check and the open is refused too. Raises FileNotFoundError, or ArtifactError for a link."""
    parts = PurePosixPath(rel).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                link = exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                    os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                if not link:
                    raise
                raise ArtifactError(f"{'/'.join(parts[:i + 1])} is a symbolic link; a published directory holds "
                                    "plain files only, so it is not read: publish it again") from None
            os.close(fd)
            fd = child
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactError(f"{rel} is not a plain file; a published directory holds plain files only, so it is "
                                "not read: publish it again")
        f = os.fdopen(fd, "rb")
        fd = -1
        return f
    finally:
        if fd >= 0:
            os.close(fd)


def _open_published(fs: pafs.FileSystem, root: str, rel: str) -> BinaryIO:
    """A file of a published directory, for reading: on a local disk only a plain file (`_open_plain`)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return _open_plain(root, rel)
    return fs.open_input_stream(f"{root}/{rel}")  # type: ignore[return-value]  # object stores have no links


def upload(local: str | os.PathLike[str], uri: str, *, exclude: Collection[str] = (),
           storage_options: Mapping[str, str] | None = None) -> str:
    """Publish directory `local` (less `exclude`) at `uri`: files, then the manifest. Returns its digest.

    The manifest is also left in `local`, so that a reader on this host can tell that `local` is
    the announced directory (`holds`) and use it without a download.
    """
    local = Path(local)
    data = manifest(local, exclude)
    fs, root = directory(uri, storage_options=dict(storage_options or {}))
    found = _read(fs, f"{root}/{MANIFEST}")
    if found is not None and found != data:
        raise ArtifactError(f"{uri} already holds another published directory (its {MANIFEST} lists other files); "
                            "a version is published once: give each run its own checkpoint URI")
    write_durably(local / MANIFEST, data.decode())
    if found is None:
        for rel in json.loads(data)["files"]:
            if isinstance(fs, pafs.LocalFileSystem):  # object stores have no directories to make
                fs.create_dir(str(PurePosixPath(f"{root}/{rel}").parent), recursive=True)
            pafs.copy_files(str(local / rel), f"{root}/{rel}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
        with fs.open_output_stream(f"{root}/{MANIFEST}") as out:  # last: the directory is now published
            out.write(data)
    return digest(data)


def upload_beside(local_file: str | os.PathLike[str], uri: str, *,
                  storage_options: Mapping[str, str] | None = None) -> None:
    """Copy one file into the directory `uri` without listing it in the manifest: readers of the published
    directory never fetch it. Whoever needs it reads it with `fetch_beside`, checked against a size and
    sha256 it learned elsewhere (typically from a file the manifest does list). Upload it before the
    directory itself: once the manifest is there, so is the file."""
    fs, root = directory(uri, storage_options=dict(storage_options or {}))
    name = Path(local_file).name
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(root, recursive=True)
    pafs.copy_files(str(local_file), f"{root}/{name}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def fetch_beside(uri: str, name: str, dest: str | os.PathLike[str], entry: Mapping[str, Any], *,
                 storage_options: Mapping[str, str] | None = None) -> None:
    """Download the file `name` that `upload_beside` put into `uri` to `dest`, checking its size and sha256
    against `entry` (`file_entry`'s); raises ArtifactError, leaving nothing at `dest`, when it is missing
    or damaged."""
    fs, root = directory(uri, storage_options=dict(storage_options or {}))
    dest = Path(dest)
    try:
        _download(fs, root, dest, entry, uri, name)
    except ArtifactError:
        dest.unlink(missing_ok=True)
        raise


def check_destination(uri: str, storage_options: Mapping[str, str] | None = None) -> None:
    """Raise ArtifactError now, before any work, when `uri` cannot take uploads: no such bucket,
    no credentials, no server, or a local directory that cannot be made."""
    try:
        fs, root = directory(uri, storage_options=dict(storage_options or {}))
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(root, recursive=True)
            return
        bucket = root.split("/", 1)[0]
        found = fs.get_file_info(bucket).type
    except OSError as exc:
        raise ArtifactError(f"cannot publish to {uri}: {exc}") from exc
    if found == pafs.FileType.NotFound:
        raise ArtifactError(f"cannot publish to {uri}: bucket {bucket!r} does not exist (or these credentials "
                            "cannot see it); create it, or give another checkpoint URI")


def holds(local: str | os.PathLike[str], expect: str) -> bool:
    """True when `local` is a directory whose manifest is the one announced as `expect`."""
    try:
        return digest((Path(local) / MANIFEST).read_bytes()) == expect
    except OSError:
        return False


def _entries(data: bytes, uri: str) -> dict[str, dict[str, Any]]:
    """The files a manifest lists, each a relative path that stays inside the directory."""
    try:
        files = json.loads(data)["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values())
    except (ValueError, KeyError, TypeError):
        ok = False
    if ok:
        directories = {str(parent) for rel in files for parent in PurePosixPath(rel).parents}
        for rel in files:
            parts = PurePosixPath(rel).parts
            if (not parts or PurePosixPath(rel).is_absolute() or ".." in parts or rel == MANIFEST
                    or rel != PurePosixPath(rel).as_posix() or rel in directories):  # a file is nobody's folder
                ok = False
    if not ok:
        raise ArtifactError(f"{uri}/{MANIFEST} is not a manifest trajstore wrote (damaged or foreign); "
                            "publish the directory again")
    return files


def _download(fs: pafs.FileSystem, root: str, dest: Path, entry: Mapping[str, Any], uri: str, rel: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, size = hashlib.sha256(), 0
    try:
        with _open_published(fs, root, rel) as f, open(dest, "wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
                out.write(chunk)
    except FileNotFoundError as exc:
        raise ArtifactError(f"{uri} is damaged: {rel}, listed in its manifest, is missing; publish it again") from exc
    except ArtifactError as exc:
        raise ArtifactError(f"{uri} is damaged: {exc}") from None
    # Neither the size nor the hash of what was read is told: that would describe a file the
    # caller may not read (a published file swapped for another on a shared disk).
    if size != entry["size"]:
        raise ArtifactError(f"{uri} is damaged: {rel} does not have the size its manifest says; publish it again")
    if h.hexdigest() != entry["sha256"]:
        raise ArtifactError(f"{uri} is damaged: {rel} does not have the sha256 its manifest says; publish it again")


def _read_manifest(fs: pafs.FileSystem, root: str, uri: str) -> bytes | None:
    """A published directory's manifest (None when there is none), read as its files are."""
    try:
        with _open_published(fs, root, MANIFEST) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except ArtifactError as exc:
        raise ArtifactError(f"{uri} is damaged: {exc}") from None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the process ends, however it ends
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _key(uri: str) -> str:
    return hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]


def fetch(uri: str, cache: str | os.PathLike[str], *, expect: str | None = None,
          storage_options: Mapping[str, str] | None = None) -> Path:
    """The local copy of the directory published at `uri`, downloaded into `cache` unless already there.

    `expect` is the announced digest: a manifest with another digest is refused (and a cached
    copy with another digest fetched again). Raises ArtifactError when the upload is unfinished
    (no manifest yet) or damaged; nothing partial is ever returned.
    """
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    key = _key(uri)
    final = cache / key
    with _locked(cache / f".lock-{key}"):
        if (final / MANIFEST).is_file() and (expect is None or holds(final, expect)):
            os.utime(final)  # recently used: `prune` keeps it
            return final
        fs, root = directory(uri, storage_options=dict(storage_options or {}))
        data = _read_manifest(fs, root, uri)
        if data is None:
            raise ArtifactError(f"{uri} has no {MANIFEST}: its upload has not finished (or was cut short), so it "
                                "is not read, and the learner uploads it again when it restarts; or nothing was "
                                "published there (check the URI's bucket and prefix)")
        if expect is not None and digest(data) != expect:
            raise ArtifactError(f"{uri}/{MANIFEST} is not the one announced (announced sha256 {expect[:12]}...): "
                                "the directory was replaced after it was published")
        files = _entries(data, uri)
        for old in cache.glob(f"{_PARTIAL}{key}-*"):  # what a killed fetch left
            shutil.rmtree(old, ignore_errors=True)
        with staged_directory(final, _PARTIAL, replace=True) as tmp:  # replace: a stale copy of a replaced directory
            for rel, entry in files.items():
                _download(fs, root, tmp / rel, entry, uri, rel)
            (tmp / MANIFEST).write_bytes(data)
    return final


def prune(cache: str | os.PathLike[str], keep: int) -> list[Path]:
    """Remove all but the `keep` most recently fetched copies in `cache`; returns what was removed.

    A copy being fetched or checked right now (its lock held) is left alone.
    """
    cache = Path(cache)
    copies = sorted((p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")),
                    key=lambda p: p.stat().st_mtime, reverse=True) if cache.is_dir() else []
    removed = []
    for old in copies[keep:]:
        with open(cache / f".lock-{old.name}", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            gone = cache / f"{_PARTIAL}{old.name}-pruned"
            os.rename(old, gone)
            shutil.rmtree(gone, ignore_errors=True)
            removed.append(old)
    return removed


def local_copy(path: str | None, uri: str, expect: str, cache: str | os.PathLike[str], *,
               keep: int = KEEP, storage_options: Mapping[str, str] | None = None) -> Path:
    """A directory on this host holding the directory announced at `uri` with digest `expect`:
    `path` (the publisher's own directory) when this host's disk holds that very one, else a
    verified copy `fetch`ed into `cache`, which then keeps its `keep` most recently used copies.

    Blocking (downloads and hashes): run it off an event loop. Raises ArtifactError (unfinished,
    damaged, or not the announced directory), ValueError (`uri` is not a path or `s3://` URI) and
    OSError (the object store cannot be reached or refuses).
    """
    if path is not None and holds(path, expect):
        return Path(path)
    local = fetch(uri, cache, expect=expect, storage_options=storage_options)
    prune(cache, keep)
    return local
