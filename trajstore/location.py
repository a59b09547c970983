"""Where a store lives: a local directory or an `s3://bucket/prefix` URI.

A local store keeps everything in one directory: `events/` (the Delta table) and `wal/`
(the write-ahead segments). Object stores cannot append, so for an `s3://` store the
write-ahead segments live in a local spool directory of the writing machine until sealed
(`$TRAJSTORE_SPOOL`, default `~/.cache/trajstore/spool/<hash of the URI>`).

S3 settings come from the usual AWS environment variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL for S3-compatible servers) or from
`storage_options`, and feed both delta-rs (the log) and pyarrow (the Parquet files).
Several writers (processes or machines) may commit to one `s3://` store at once: delta-rs
commits with S3 conditional writes (`If-None-Match: *`), which the server must support
(AWS S3, MinIO and Cloudflare R2 do). A writer's name owns its spool directory only
on its own machine, so writer names must differ across machines: the default names carry
the machine's spool id, and a writer claims its name in the table when it opens
(`trajstore.owner`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class Location:
    uri: str
    table_uri: str
    remote: bool
    filesystem: pafs.FileSystem
    table_path: str  # the table's path inside `filesystem`
    wal_root: Path
    storage_options: dict[str, str] = field(default_factory=dict)

    def data_path(self, name: str) -> str:
        return f"{self.table_path}/{name}"


@dataclass(frozen=True)
class Scheme:
    """How one kind of storage is reached: the one place a new object store is added.

    `options(given)` resolves its settings (environment plus `storage_options`), `filesystem(options)`
    makes the pyarrow filesystem for the Parquet files and checkpoints, and `table_uri(bucket, key)`
    the URI delta-rs opens. Remote schemes keep write-ahead segments in a local spool."""

    name: str
    example: str
    options: Callable[[dict[str, str]], dict[str, str]]
    filesystem: Callable[[dict[str, str]], pafs.FileSystem]
    table_uri: Callable[[str, str], str]


def _s3_table_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def _remote_scheme(text: str, what: str) -> tuple[Scheme, str, str] | None:
    """(scheme, bucket, prefix) of a remote URI; None for a local path; ValueError for anything else."""
    parsed = urlparse(text)
    if parsed.scheme in ("", "file"):
        return None
    scheme = REMOTE_SCHEMES.get(parsed.scheme)
    if scheme is None:
        shown = " or ".join(f"an {s.example} URI" for s in REMOTE_SCHEMES.values())
        raise ValueError(f"{what} {text!r}: use a directory path or {shown}")
    if not parsed.netloc:
        raise ValueError(f"{what} {text!r} names no bucket; write {scheme.example}")
    return scheme, parsed.netloc, parsed.path.strip("/")


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether `location` names an object store (an `s3://...` URI) rather than a local path."""
    return urlparse(os.fspath(location)).scheme in REMOTE_SCHEMES


def _local_path(text: str) -> Path:
    parsed = urlparse(text)
    return Path(parsed.path if parsed.scheme == "file" else text).expanduser().resolve()


def resolve(location: str | os.PathLike[str], *, spool: str | os.PathLike[str] | None = None,
            storage_options: dict[str, str] | None = None) -> Location:
    text = os.fspath(location)
    remote = _remote_scheme(text, "store location")
    if remote is None:
        root = _local_path(text)
        return Location(
            uri=str(root),
            table_uri=str(root / "events"),
            remote=False,
            filesystem=pafs.LocalFileSystem(),
            table_path=str(root / "events"),
            wal_root=root / "wal",
        )
    scheme, bucket, prefix = remote
    options = scheme.options(storage_options or {})
    key = f"{prefix}/events" if prefix else "events"
    spool_root = Path(spool or os.environ.get("TRAJSTORE_SPOOL") or Path.home() / ".cache/trajstore/spool")
    digest = hashlib.sha256(text.rstrip("/").encode()).hexdigest()[:16]
    return Location(
        uri=text.rstrip("/"),
        table_uri=scheme.table_uri(bucket, key),
        remote=True,
        filesystem=scheme.filesystem(options),
        table_path=f"{bucket}/{key}",
        wal_root=spool_root / digest / "wal",
        storage_options=options,
    )


def directory(location: str | os.PathLike[str], *,
              storage_options: dict[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """A filesystem and the path inside it of a directory that is not a store: a local path, or a
    remote URI reached with the same settings as a store there (published checkpoints)."""
    text = os.fspath(location)
    remote = _remote_scheme(text, "location")
    if remote is None:
        return pafs.LocalFileSystem(), str(_local_path(text))
    scheme, bucket, prefix = remote
    return scheme.filesystem(scheme.options(storage_options or {})), f"{bucket}/{prefix}" if prefix else bucket


def _s3_options(given: dict[str, str]) -> dict[str, str]:
    options = {k: os.environ[k] for k in _ENV_KEYS if os.environ.get(k)}
    if "AWS_REGION" not in options and os.environ.get("AWS_DEFAULT_REGION"):
        options["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"]
    options.update({k.upper(): v for k, v in given.items()})
    options.setdefault("AWS_REGION", "us-east-1")
    endpoint = options.get("AWS_ENDPOINT_URL", "")
    if endpoint.startswith("http://"):
        # delta-rs (object_store) refuses plain-http endpoints unless told otherwise.
        options.setdefault("AWS_ALLOW_HTTP", "true")
    # Path-style URLs (endpoint/bucket/key), as S3-compatible servers on an IP:port need
    # and pyarrow uses by default; both clients must agree (see _s3_filesystem).
    options.setdefault("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", os.environ.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "false"))
    # Safe concurrent commits: delta-rs creates `_delta_log/N.json` with `If-None-Match: *`,
    # so of two writers racing for version N exactly one wins and the other retries at N+1.
    # S3 has had these conditional writes since 2024; delta-rs turns them on for S3 by
    # default since 0.23, and 1.x commits no other way (AWS_S3_ALLOW_UNSAFE_RENAME and the
    # DynamoDB AWS_S3_LOCKING_PROVIDER no longer apply; a server without conditional writes
    # fails the commit instead of racing). Spelled out so it holds whatever the defaults.
    options.setdefault("AWS_CONDITIONAL_PUT", "etag")
    return options


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _s3_filesystem(options: dict[str, str]) -> pafs.S3FileSystem:
    endpoint = options.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, object] = {"region": options["AWS_REGION"]}
    if options.get("AWS_ACCESS_KEY_ID"):
        kwargs["access_key"] = options["AWS_ACCESS_KEY_ID"]
        kwargs["secret_key"] = options.get("AWS_SECRET_ACCESS_KEY", "")
        if options.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = options["AWS_SESSION_TOKEN"]
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme or "https"
    kwargs["force_virtual_addressing"] = _truthy(options.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST"))
    return pafs.S3FileSystem(**kwargs)


# The object stores a location may name, by URI scheme (local paths need none).
REMOTE_SCHEMES: dict[str, Scheme] = {
    "s3": Scheme("s3", "s3://bucket/prefix", _s3_options, _s3_filesystem, _s3_table_uri),
}
