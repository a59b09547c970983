"""The checkpoint announcement: what a learner says of a published version, and how a server is told to load it.

This is the one contract between the learner (which writes it) and the collectors and policy
servers (which read it); both import it from here, nobody re-parses its JSON keys.

- `Announcement` is one `checkpoint` event: the version, the learner step and table version it
  was trained to, the rollouts consumed since the previous version, its metrics, and where the
  weights are: `path` (the learner's directory, on the learner's host) and, when the version was
  also published where every host can read it, `uri` and `digest` (the manifest's sha256,
  `trajstore.artifacts`). It also carries the learner's batch size (`groups_per_version`) and
  staleness bound, which the collectors' admission needs.
  `to_event()` is the event the learner appends; `from_row()` reads a row of the `checkpoints`
  view, whose typed columns are extracted from the event's meta, so stores
  written before this type existed read the same way.
- `LoadRequest` is the body of a policy server's `POST /v1/load_weights`, derived from an
  announcement (`Announcement.load_request()`), written by a client (`to_body`) and checked by
  the server (`from_body`, which raises `BadLoadRequest` naming the field and the fix).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trajstore.events import Checkpoint

# This module stays light (no pyarrow until an event is built or a digest checked): the policy
# contract imports it for MAX_POLICY_VERSION.

MAX_POLICY_VERSION = 2**63 - 1  # versions are stored as int64 with every turn


def event_id(run: str, version: int) -> str:
    """The deterministic id of a version's announcement: announcing a version twice stores it once."""
    return f"checkpoint:{run}:{version}"


@dataclass(frozen=True, kw_only=True)
class Announcement:
    """One published version of a run's policy, as its `checkpoint` event says."""

    run: str
    version: int
    step: int
    path: str | None  # the learner's directory of this version, on the learner's host
    uri: str | None = None  # where every host can fetch it (always with `digest`)
    digest: str | None = None  # sha256 of the published manifest
    adapter: bool = False  # a LoRA adapter over `base_model` rather than full weights
    base_model: str | None = None
    groups_per_version: int | None = None  # the learner's batch: groups trained per published version
    max_staleness: int | None = None
    table_version: int | None = None  # the store's table version the last step read
    consumed: tuple[str, ...] = ()  # rollouts trained since the previous version
    metrics: Mapping[str, float] | None = None
    settings: Mapping[str, Any] | None = None  # the learner's resolved settings (version 0 carries them)

    def __post_init__(self) -> None:
        if (self.uri is None) != (self.digest is None):
            raise ValueError(f"version {self.version} names `uri` and `digest` together or neither "
                             f"(got uri={self.uri!r}, digest={self.digest!r})")

    def to_event(self) -> Checkpoint:
        """The `checkpoint` event announcing this version (idempotent: its id is deterministic)."""
        from trajstore.events import Checkpoint
        meta: dict[str, Any] = {"path": self.path, "adapter": self.adapter, "base_model": self.base_model,
                                "groups_per_version": self.groups_per_version, "max_staleness": self.max_staleness}
        if self.uri is not None:
            meta["uri"], meta["digest"] = self.uri, self.digest
        if self.settings is not None:
            meta["settings"] = dict(self.settings)
        return Checkpoint(run=self.run, policy_version=self.version, step=self.step, consumed=list(self.consumed),
                          table_version=self.table_version,
                          metrics=dict(self.metrics) if self.metrics is not None else None,
                          meta=meta, event_id=event_id(self.run, self.version))

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Announcement:
        """One row of the `checkpoints` view (`SELECT *`: its typed columns)."""
        settings = row.get("settings")
        return cls(run=row["run"], version=row["version"], step=row["step"], path=row["path"], uri=row["uri"],
                   digest=row["digest"], adapter=bool(row["adapter"]), base_model=row["base_model"],
                   groups_per_version=row["groups_per_version"], max_staleness=row["max_staleness"],
                   table_version=row["table_version"], consumed=tuple(row.get("consumed") or ()),
                   metrics=dict(row["metrics"]) if row.get("metrics") is not None else None,
                   settings=json.loads(settings) if settings is not None else None)

    def load_request(self) -> LoadRequest:
        """What a policy server is sent to load this version."""
        return LoadRequest(version=self.version, path=self.path, uri=self.uri, digest=self.digest)


class BadLoadRequest(ValueError):
    """A load body that does not name a version to load; `param` is the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """Load `version` from `path` (a directory on the server's host) or, when `uri` and `digest` are
    given, from the version published there (the server uses `path` when its disk holds the
    announced directory, else fetches `uri` into its cache and checks it against `digest`)."""

    version: int
    path: str | None = None
    uri: str | None = None
    digest: str | None = None

    @property
    def published(self) -> bool:
        return self.uri is not None and self.digest is not None

    def to_body(self) -> dict[str, Any]:
        return {name: value for name, value in (("version", self.version), ("path", self.path), ("uri", self.uri),
                                                ("digest", self.digest)) if value is not None}

    @classmethod
    def from_body(cls, body: object) -> LoadRequest:
        """Check a JSON body sent to `/v1/load_weights`; raises BadLoadRequest saying what is wrong."""
        from trajstore import artifacts
        body = body if isinstance(body, dict) else {}
        path, uri, digest, version = (body.get(k) for k in ("path", "uri", "digest", "version"))
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_POLICY_VERSION:
            raise BadLoadRequest(f"`version` must be an integer policy version from 0 to {MAX_POLICY_VERSION}, "
                                 f"got {version!r}", "version")
        if path is not None and (not isinstance(path, str) or not path):
            raise BadLoadRequest(f"`path` must be a checkpoint directory on this server's host, got {path!r}", "path")
        if uri is None and digest is None:
            if path is None:
                raise BadLoadRequest('`path` must be the checkpoint directory, e.g. {"path": "ckpt/v3", "version": 3}, '
                                     'or name a published version by `uri` and `digest` (its checkpoint '
                                     'announcement\'s uri and digest)', "path")
            return cls(version=version, path=path)
        if not isinstance(uri, str) or not uri:
            raise BadLoadRequest(f"`uri` must be where the version was published (the checkpoint announcement's uri, "
                                 f"e.g. s3://bucket/store/checkpoints/RUN/v000003), got {uri!r}", "uri")
        if not artifacts.is_digest(digest):
            raise BadLoadRequest(f"`digest` must be the published manifest's sha256 (64 lowercase hex digits, the "
                                 f"checkpoint announcement's digest), got {digest!r}", "digest")
        return cls(version=version, path=path, uri=uri, digest=digest)


LATEST_SQL = "SELECT * FROM checkpoints WHERE run = ? ORDER BY version DESC, time DESC LIMIT 1"
