"""Hot reload: follow the learner's checkpoint events and load each newer version into the policy server.

The learner announces itself (version 0, its initial model) and every published version with
a `checkpoint` event whose meta holds the checkpoint directory (`path`) and its batch size
(`groups_per_version`). `Reloader.sync(head)` loads the newest version when it is newer than
the one served: intermediate versions are skipped, since only the newest matters for
sampling. A failed load is reported and retried on a later poll with a growing pause; it
never stops collection (the server keeps serving the weights it has). A server that reports
serving an older version than the one loaded (it restarted on its start-up weights) gets the
newest loaded again at once, without waiting for the learner's next publish.

Across hosts: the `path` is the learner's own directory. When the learner also published the
version where every host can read it, the event carries `uri` and `digest`
(`learner.checkpoints.upload`). Then the directory a policy server loads comes from
`trajstore.artifacts.local_copy`: the learner's own when that disk holds the announced
directory, else a copy fetched from `uri` into a checkpoint cache and verified file by file.
Who fetches depends on the server:

- `trajstore serve` (the in-process server of `collect`, or one at `--server`, perhaps on its
  own host) fetches for itself (`PublishedLoader`): the collector sends path, uri and digest,
  and the server resolves them on its own disk, into its own cache (`serve --checkpoint-cache`;
  for the in-process server, the collector's `--checkpoint-cache`). Nothing is fetched on a
  collector host whose server is elsewhere.
- vLLM (started beside the collector on its host) is given a local path: the collector fetches
  into its own cache (`--checkpoint-cache`, default `trajstore.artifacts.default_cache()`).

An unfinished or damaged upload, or an unreachable store, is a failed load like any other:
reported, retried, never loaded. The cache keeps the `artifacts.KEEP` most recently used copies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from collectors.collect.admission import Queryable
from collectors.errors import VersionConflict
from collectors.policy import PolicyClient, PublishedLoader
from trajstore import artifacts

log = logging.getLogger(__name__)
HEAD_SQL = "SELECT version, meta FROM checkpoints WHERE run = ? ORDER BY version DESC LIMIT 1"
G_SQL = """SELECT meta FROM checkpoints WHERE run = ? AND json_extract(meta, '$.groups_per_version') IS NOT NULL
           ORDER BY version DESC LIMIT 1"""


@dataclass(frozen=True)
class Head:
    """The learner as its newest checkpoint event shows it (all None before it announced itself)."""

    version: int | None = None
    path: str | None = None  # the learner's directory, on the learner's host
    groups_per_version: int | None = None
    max_staleness: int | None = None
    uri: str | None = None  # where every host can fetch the version (with the manifest's `digest`)
    digest: str | None = None


def _meta(text: Any) -> dict[str, Any]:
    try:
        meta = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return {}
    return meta if isinstance(meta, dict) else {}


def read_head(snapshot: Queryable, run: str) -> Head:
    """The newest checkpoint of `run`, as the store (or one snapshot of it) sees it."""
    rows = snapshot.query(HEAD_SQL, [run]).to_pylist()
    if not rows:
        return Head()
    meta = _meta(rows[0]["meta"])
    if not isinstance(meta.get("groups_per_version"), int):
        older = snapshot.query(G_SQL, [run]).to_pylist()
        meta = {**(_meta(older[0]["meta"]) if older else {}), **meta}
    g, k = meta.get("groups_per_version"), meta.get("max_staleness")
    text = {name: value if isinstance(value := meta.get(name), str) else None for name in ("path", "uri", "digest")}
    return Head(version=int(rows[0]["version"]), path=text["path"],
                groups_per_version=g if isinstance(g, int) and g >= 1 else None,
                max_staleness=k if isinstance(k, int) and k >= 0 else None,
                uri=text["uri"] if text["digest"] else None, digest=text["digest"] if text["uri"] else None)


def local_checkpoint(head: Head, cache: Path) -> str | None:
    """A directory on this host holding `head`'s checkpoint: the learner's own when this host has it,
    else a verified copy fetched into `cache` (blocking: run it in a thread). Raises ArtifactError."""
    if head.uri is None or head.digest is None:
        return head.path
    return str(artifacts.local_copy(head.path, head.uri, head.digest, cache))


async def served_version(client: PolicyClient, fallback: int = 0) -> int:
    """The version the policy server serves now: the client's own record (vLLM), else the
    embedded server's /health, else `fallback`."""
    known = getattr(client, "policy_version", None)
    if isinstance(known, int) and not isinstance(known, bool):
        return known
    try:
        async with aiohttp.ClientSession() as session, session.get(
                client.base_url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            body = await resp.json(content_type=None)
        version = body.get("policy_version") if isinstance(body, dict) else None
        return version if isinstance(version, int) else fallback
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return fallback


@dataclass
class Reloader:
    """Keeps the policy server on the learner's newest version."""

    client: PolicyClient
    served: int
    cache: Path = field(default_factory=artifacts.default_cache)  # copies of versions published on other hosts
    reloads: int = 0
    failures: int = 0
    last_error: str | None = None
    _retry_at: float = 0.0
    _backoff_s: float = 1.0

    async def sync(self, head: Head) -> bool:
        """Load `head` if it is newer than what is served; True when the served version changed."""
        await self._notice_restart()
        if head.version is None or head.version <= self.served or (head.path is None and head.uri is None):
            return False
        if time.monotonic() < self._retry_at:
            return False
        where = path = head.uri or head.path  # `path`: what the server loaded, once it says
        try:
            if head.uri is not None and head.digest is not None and isinstance(self.client, PublishedLoader):
                path = await self.client.load_published(head.version, uri=head.uri, digest=head.digest,
                                                        path=head.path)  # the server resolves it on its disk
            else:
                path = await asyncio.to_thread(local_checkpoint, head, self.cache)
                await self.client.load_weights(path, head.version)  # type: ignore[arg-type]
        except VersionConflict:
            # someone else (another collector on the same server) loaded it or a newer one already
            log.info("the policy server already serves version %d or newer", head.version)
        except Exception as exc:  # noqa: BLE001 - a failed reload must not stop collection
            self.failures += 1
            self.last_error = f"loading version {head.version} from {where} failed: {exc}"
            log.warning("%s; retrying in %.0f s (the server keeps serving version %d)", self.last_error,
                        self._backoff_s, self.served)
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 30.0)
            return False
        self.served, self.last_error, self._backoff_s, self._retry_at = head.version, None, 1.0, 0.0
        self.reloads += 1
        log.info("policy server now serves version %d (%s)", head.version, path)
        return True

    async def _notice_restart(self) -> None:
        """Believe the server when it reports an older version than the one loaded (it restarted): then
        `sync` loads the newest again. Only `trajstore serve` reports it (`EmbeddedClient.reported_version`)."""
        ask = getattr(self.client, "reported_version", None)
        reported = await ask() if ask is not None else None
        if isinstance(reported, int) and reported < self.served:
            log.warning("the policy server at %s reports serving version %d, not the version %d it was loaded with "
                        "(restarted?); loading the newest again", self.client.base_url, reported, self.served)
            self.served, self._retry_at = reported, 0.0
