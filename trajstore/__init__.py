"""trajstore: an event-sourced store of LLM-agent trajectories, exact to the token, queryable by SQL.

    store = trajstore.open_store("runs/store")          # or "s3://bucket/prefix"
    with store.writer("collector-0") as w:
        w.append([Turn(...), Reward(...), Status(...)])  # durable when it returns
    store.query("SELECT * FROM rollouts")                # a pyarrow.Table
    shard = store.shard(policy_version=3, max_staleness=2)

The names below load their module on first use (PEP 562), so `import trajstore`, or one of
its light modules (`trajstore.errors`), costs nothing until the store is used: the CLI's
`--help` and commands that never open a store do not pay for pyarrow, DuckDB and delta-rs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajstore.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("ArtifactError", "CommitConflictError", "CorruptionError", "InvalidEventError", "QueryError",
                     "StoreNotFoundError", "TrajstoreError", "VersionNotFoundError", "WriterBusyError",
                     "WriterClosedError"), "trajstore.errors"),
    **dict.fromkeys(("Checkpoint", "Event", "Metric", "Reward", "Status", "Teacher", "Turn"), "trajstore.events"),
    "PreparedBatch": "trajstore.prepared",
    "JSONText": "trajstore.json_text",
    "Follower": "trajstore.follow",
    "new_id": "trajstore.ids",
    "Scope": "trajstore.read", "Snapshot": "trajstore.read",
    "EVENT_SCHEMA": "trajstore.schema", "SCHEMA_VERSION": "trajstore.schema",
    "Shard": "trajstore.shard",
    "Store": "trajstore.store", "open_store": "trajstore.store",
    **dict.fromkeys(("ESTIMATORS", "ESTIMATOR_TITLES", "Estimator", "GROUP_ESTIMATORS", "VIEW_NAMES"), "trajstore.views"),
    "AppendResult": "trajstore.writer", "Staged": "trajstore.writer", "Writer": "trajstore.writer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from trajstore.errors import (
        ArtifactError,
        CommitConflictError,
        CorruptionError,
        InvalidEventError,
        QueryError,
        StoreNotFoundError,
        TrajstoreError,
        VersionNotFoundError,
        WriterBusyError,
        WriterClosedError,
    )
    from trajstore.events import Checkpoint, Event, Metric, Reward, Status, Teacher, Turn
    from trajstore.prepared import PreparedBatch
    from trajstore.json_text import JSONText
    from trajstore.follow import Follower
    from trajstore.ids import new_id
    from trajstore.read import Scope, Snapshot
    from trajstore.schema import EVENT_SCHEMA, SCHEMA_VERSION
    from trajstore.shard import Shard
    from trajstore.store import Store, open_store
    from trajstore.views import ESTIMATOR_TITLES, ESTIMATORS, GROUP_ESTIMATORS, VIEW_NAMES, Estimator
    from trajstore.writer import AppendResult, Staged, Writer
