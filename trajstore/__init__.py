"""trajstore: an event-sourced store of LLM-agent trajectories, exact to the token, queryable by SQL.

    store = trajstore.open_store("runs/store")          # or "s3://bucket/prefix"
    with store.writer("collector-0") as w:
        w.append([Turn(...), Reward(...), Status(...)])  # durable when it returns
    store.query("SELECT * FROM rollouts")                # a pyarrow.Table
    shard = store.shard(policy_version=3, max_staleness=2)
"""

from trajstore.errors import (
    CommitConflictError,
    CorruptionError,
    InvalidEventError,
    QueryError,
    StoreNotFoundError,
    TrajstoreError,
    WriterBusyError,
    WriterClosedError,
)
from trajstore.events import Checkpoint, Event, Metric, Reward, Status, Turn
from trajstore.ids import new_id
from trajstore.read import Snapshot
from trajstore.schema import EVENT_SCHEMA, SCHEMA_VERSION
from trajstore.shard import Shard
from trajstore.store import Store, open_store
from trajstore.views import ESTIMATORS, VIEW_NAMES, Estimator
from trajstore.writer import AppendResult, Writer

__all__ = [
    "ESTIMATORS", "EVENT_SCHEMA", "SCHEMA_VERSION", "VIEW_NAMES", "AppendResult", "Checkpoint", "CommitConflictError",
    "CorruptionError", "Estimator", "Event", "InvalidEventError", "Metric", "QueryError", "Reward", "Shard", "Snapshot",
    "Status", "Store", "StoreNotFoundError", "TrajstoreError", "Turn", "Writer", "WriterBusyError",
    "WriterClosedError", "new_id", "open_store",
]
