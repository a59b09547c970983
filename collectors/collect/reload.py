"""Hot reload: follow the learner's checkpoint events and load each newer version into the policy server.

The learner announces itself (version 0, its initial model) and every published version with
a `checkpoint` event, read back as a `trajstore.announcement.Announcement`: the checkpoint
directory (`path`) and the learner's batch size (`groups_per_version`). `Reloader.sync(head)`
loads the newest version when it is newer than the one served: intermediate versions are skipped, since only the newest matters for
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
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from collectors.collect.admission import Queryable
from collectors.errors import VersionConflict
from collectors.policy import PolicyClient, PublishedLoader
from trajstore import artifacts
from trajstore.announcement import LATEST_SQL, Announcement, LoadRequest

log = logging.getLogger(__name__)


def read_head(snapshot: Queryable, run: str) -> Announcement | None:
    """The newest announcement of `run`, as the store (or one snapshot of it) sees it; None before the
    learner announced itself."""
    rows = snapshot.query(LATEST_SQL, [run]).to_pylist()
    return Announcement.from_row(rows[0]) if rows else None


def local_checkpoint(request: LoadRequest, cache: Path) -> str | None:
    """A directory on this host holding the requested version: the learner's own when this host has it,
    else a verified copy fetched into `cache` (blocking: run it in a thread). Raises ArtifactError."""
    if request.uri is None or request.digest is None:
        return request.path
    return str(artifacts.local_copy(request.path, request.uri, request.digest, cache))


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

    async def sync(self, head: Announcement | None) -> bool:
        """Load `head` if it is newer than what is served; True when the served version changed."""
        await self._notice_restart()
        if head is None or head.version <= self.served or (head.path is None and head.uri is None):
            return False
        if time.monotonic() < self._retry_at:
            return False
        where = path = head.uri or head.path  # `path`: what the server loaded, once it says
        try:
            request = head.load_request()
            if request.published and isinstance(self.client, PublishedLoader):
                path = await self.client.load_published(request)  # the server resolves it on its disk
            else:
                path = await asyncio.to_thread(local_checkpoint, request, self.cache)
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
