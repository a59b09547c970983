"""Integrity of the Delta log: every log entry trajstore relies on is checked before it is acted on.

delta-rs reads the log's JSON commits (and its Parquet checkpoints) without checksums: a
flipped byte made every command fail with a Rust error, a changed digit in a writer's
transaction version hid its events (and recovery then deleted them), and a changed digit in a
file's statistics made `shard()` skip the file. trajstore adds three checks, each where the
value is used:

- Commits: every commit trajstore makes carries in its commitInfo `trajstore.digest`, a SHA-256
  (first 16 hex digits) over the canonical form of the actions it relies on (add: path, size,
  dataChange, stats; remove: path, dataChange, size; txn: appId, version). The table checks
  each JSON commit it moves through (and, at first load, those since the last checkpoint) and
  `trajstore verify` checks every one present. A store created since issue 12 records
  `trajstore.digests` in version 0, after which a commit without a digest is damage; in an
  older store, digests are required from the first commit that has one. A commit that changes
  files without being trajstore's (another program wrote it) is reported as unverifiable.
- Files: a sealed file's name carries the CRC-32 of its size, row count and min/max statistics
  (`s........`, beside the footer and file CRCs), checked whenever the table lists the file,
  from a JSON commit or a checkpoint alike.
- Transaction versions (how far each writer's events are sealed) are checked where they are
  acted on: a reader hides live rows only if the table holds them, and sealing deletes
  segments only if the table holds their rows (`trajstore.writer`, `trajstore.read`).

A damaged entry raises `CorruptionError` naming it; nothing is cut, deleted or skipped on the
strength of it. Parse failures inside delta-rs are traced back to the entry by reading the
JSON commits here (`find_damage`).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from trajstore.errors import CorruptionError
from trajstore.location import Location

DIGEST_KEY = "trajstore.digest"
OPERATION_KEY = "trajstore.operation"
DIGESTS_KEY = "trajstore.digests"  # in version 0 of stores created since issue 12: every commit has a digest


def entry_path(location: Location, version: int) -> str:
    return f"{location.table_path}/_delta_log/{version:020d}.json"


def _canonical(kind: str, action: dict[str, Any]) -> list[Any]:
    if kind == "add":
        return ["add", action.get("path"), action.get("size"), action.get("dataChange"), action.get("stats")]
    if kind == "remove":
        return ["remove", action.get("path"), action.get("dataChange"), action.get("size")]
    return ["txn", action.get("appId"), action.get("version")]


def digest(actions: Iterable[tuple[str, dict[str, Any]]]) -> str:
    """The digest of (kind, action) pairs as they appear in a JSON commit (kind: add, remove, txn)."""
    rows = sorted(json.dumps(_canonical(kind, a), separators=(",", ":")) for kind, a in actions)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def read_entry(location: Location, version: int) -> list[dict[str, Any]] | None:
    """The actions of JSON commit `version` (None when it is not there: cleaned up, or not written yet);
    raises ValueError naming the line that is not valid JSON."""
    text = _read_object(location.filesystem, entry_path(location, version))
    if text is None:
        return None
    actions = []
    # Lines end at "\n" only: str.splitlines() also splits at U+0085 and U+2028, which a JSON
    # string may hold unescaped (a statistic of a name that contains one).
    for number, line in enumerate(text.decode("utf-8", errors="replace").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict) or len(obj) != 1:
            raise ValueError(f"line {number} is not one Delta action")
        actions.append(obj)
    return actions


def _read_object(fs: pafs.FileSystem, path: str) -> bytes | None:
    """A whole file, or None when it is not there (one open: no separate existence check, which on an
    object store is one more request per log entry)."""
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def check_entry(version: int, actions: list[dict[str, Any]], *, required: bool) -> str | None:
    """What is wrong with a commit's actions, or None. `required`: a commit of trajstore's must have a digest."""
    info: dict[str, Any] = {}
    relied: list[tuple[str, dict[str, Any]]] = []
    for action in actions:
        kind, body = next(iter(action.items()))
        if not isinstance(body, dict):
            return f"its {kind} action is not a JSON object"
        if kind == "commitInfo":
            info = body
        elif kind in ("add", "remove", "txn"):
            relied.append((kind, body))
    if version == 0 or not relied:
        return None  # the table's creation (protocol and schema, which delta-rs checks), or no file changes
    if OPERATION_KEY not in info:
        return "it adds, removes or marks files but was not written by trajstore, so it cannot be verified"
    if DIGEST_KEY not in info:
        return "it has no trajstore digest although the store's commits carry one" if required else None
    if digest(relied) != info[DIGEST_KEY]:
        return ("its actions do not match the digest trajstore recorded with them (the entry changed after it was "
                "written)")
    return None


def damaged(location: Location, version: int, problem: str) -> str:
    return (f"Delta log entry {entry_path(location, version)} (table version {version}) is damaged: {problem}. "
            "trajstore does not act on it; restore the file from a backup (or the object store's versioning). "
            "`trajstore verify` lists every damaged entry")


class LogChecker:
    """Checks a table's JSON commits as the table moves through them (see the module docstring)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.checked_through = -1
        self.required: bool | None = None  # digests required? (unknown until version 0 or a digest is seen)

    def _first_version(self) -> int:
        """Where delta-rs starts reading: after the last checkpoint, if there is one."""
        path = f"{self.location.table_path}/_delta_log/_last_checkpoint"
        try:
            text = _read_object(self.location.filesystem, path)
            return 0 if text is None else int(json.loads(text)["version"]) + 1
        except (ValueError, KeyError, TypeError):
            return 0  # a damaged pointer: check every commit there is

    def check_through(self, version: int) -> None:
        """Check every JSON commit up to `version` not checked yet; raises CorruptionError."""
        if version <= self.checked_through:
            return
        start = self.checked_through + 1 if self.checked_through >= 0 else self._first_version()
        for v in range(start, version + 1):
            actions = self._read(v)
            if actions is None:
                continue  # cleaned up behind a checkpoint
            problem = check_entry(v, actions, required=self.required is not False)
            if problem is not None and self.required is None:  # only a commit without a digest asks version 0
                zero = self._read(0)
                self.required = bool(zero) and any(
                    DIGESTS_KEY in a.get("commitInfo", {}) for a in zero if isinstance(a.get("commitInfo"), dict))
                problem = check_entry(v, actions, required=self.required)
            if problem is not None:
                raise CorruptionError(damaged(self.location, v, problem))
            if any(DIGEST_KEY in (a.get("commitInfo") or {}) for a in actions):
                self.required = True
        self.checked_through = version

    def _read(self, version: int) -> list[dict[str, Any]] | None:
        try:
            return read_entry(self.location, version)
        except ValueError as exc:
            raise CorruptionError(damaged(self.location, version, str(exc))) from exc


def scan(location: Location, latest: int | None) -> list[str]:
    """Every damaged JSON commit present, each as a message (`trajstore verify`)."""
    problems = []
    listing = location.filesystem.get_file_info(pafs.FileSelector(f"{location.table_path}/_delta_log",
                                                                  allow_not_found=True))
    versions = sorted(int(i.base_name[:-5]) for i in listing
                      if i.base_name.endswith(".json") and i.base_name[:-5].isdigit())
    required = False
    for v in versions:
        try:
            actions = read_entry(location, v)
        except ValueError as exc:
            problems.append(damaged(location, v, str(exc)))
            continue
        if actions is None:
            continue
        if v == 0:
            required = any(DIGESTS_KEY in (a.get("commitInfo") or {}) for a in actions)
        problem = check_entry(v, actions, required=required)
        if problem is not None:
            problems.append(damaged(location, v, problem))
        elif any(DIGEST_KEY in (a.get("commitInfo") or {}) for a in actions):
            required = True
    if latest is not None and versions and versions[-1] < latest:
        problems.append(f"the Delta log's newest JSON commit is version {versions[-1]} but the table reads as "
                        f"version {latest}")
    return problems


def find_damage(location: Location) -> str | None:
    """The first JSON commit that does not parse (to explain an error delta-rs raised), or None."""
    problems = [p for p in scan(location, None) if "not valid JSON" in p or "not one Delta action" in p
                or "is not a JSON object" in p]
    return problems[0] if problems else None


# ---------------------------------------------------------------------------- file statistics


def stat_time(value: datetime) -> str:
    """A time statistic as the log writes it: UTC, milliseconds, a four-digit year.

    The year is padded by hand: `strftime("%Y")` writes year 1 as "1" on Linux, which delta-rs
    reads back as no statistic at all, so the file's statistics no longer matched its name.
    """
    value = value.astimezone(timezone.utc)
    return f"{value.year:04d}-{value:%m-%dT%H:%M:%S}.{value.microsecond // 1000:03d}Z"


def _stat_text(value: Any) -> str:
    if isinstance(value, datetime):
        value = stat_time(value)
    return json.dumps(value, separators=(",", ":"))


def stats_crc(size: int, rows: int, mins: dict[str, Any], maxs: dict[str, Any]) -> int:
    """CRC-32 of a sealed file's size, row count and min/max statistics, as written (strings) or as
    delta-rs parses them back (datetimes): the same number either way."""
    parts = [str(size), str(rows)]
    for name in sorted(mins):
        parts.append(f"{name}:{_stat_text(mins[name])}:{_stat_text(maxs.get(name))}")
    return zlib.crc32("|".join(parts).encode())


def commit_actions(actions: Iterable[Any], txn: tuple[str, int] | None) -> list[tuple[str, dict[str, Any]]]:
    """delta-rs AddAction / RemoveAction objects (and a writer transaction) as their JSON commit shows them."""
    out: list[tuple[str, dict[str, Any]]] = []
    for a in actions:
        if hasattr(a, "stats"):  # AddAction
            out.append(("add", {"path": a.path, "size": a.size, "dataChange": a.data_change, "stats": a.stats}))
        else:
            out.append(("remove", {"path": a.path, "dataChange": a.data_change, "size": a.size}))
    if txn is not None:
        out.append(("txn", {"appId": txn[0], "version": txn[1]}))
    return out
