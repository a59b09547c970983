"""Read an `hf` export back into a store: the events that rebuild its samples, rewards and statuses.

Each exported row is one sample; from it this regenerates:

- its turns: `tokens`, `loss_mask` and `logprobs` split at the `turn_prompt_tokens` /
  `turn_output_tokens` boundaries back into each turn's prompt delta, output ids, behaviour
  logprobs and output mask (left null when every sampled token is trainable, which the views
  read the same as all true), with the turn's policy version, finish reason, time and
  request/response/sampling/meta JSON;
- the rollout's reward components (one reward event per name with its latest value) and
  the segment's own reward components;
- the rollout's latest status (with its error and planned group size).

So `samples`, `rollouts`, `groups` and `advantages` of the new store equal the exported
store's for these rows. Not regenerated: superseded reward and status values (only the latest
is exported), checkpoint and metric events, writer names and sequence numbers, and rollouts
with no turn (they have no sample to export). Reward and status events are stamped with the
time of the sample's last turn. Event ids are derived from what they identify (turn: its
rollout, segment and index; reward: its rollout, segment and name), so ingesting the same
export twice stores each event once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from trajstore.errors import ExportError
from trajstore.export.hf import DATA_DIR
from trajstore.ids import content_id

# The columns a row must carry to be read back (the rest of an export's columns are derived).
REQUIRED = ("run", "group_id", "rollout_id", "session_id", "segment_id", "tokens", "loss_mask", "logprobs",
            "status", "error", "group_size", "reward_components", "segment_reward_components",
            "turn_prompt_tokens", "turn_output_tokens", "turn_policy_versions", "turn_finish_reasons", "turn_times",
            "turn_requests", "turn_responses", "turn_sampling", "turn_meta")


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def open_export(directory: str | Path) -> ds.Dataset:
    """The export's Parquet shards as one dataset; ExportError when `directory` is not an `hf` export."""
    data = Path(directory) / DATA_DIR
    shards = sorted(data.glob("*.parquet")) if data.is_dir() else []
    if not shards:
        raise ExportError(f"{directory} holds no {DATA_DIR}/*.parquet: it is not a `trajstore export --format hf` "
                          "directory. Export one with `trajstore export --format hf --run RUN DIR`")
    dataset = ds.dataset([str(p) for p in shards], format="parquet")
    missing = [c for c in REQUIRED if c not in dataset.schema.names]
    if missing:
        raise ExportError(f"{directory} lacks the columns {missing}: it was not written by `trajstore export "
                          "--format hf` (or was written by a version without them); export it again")
    return dataset


def _turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    tokens, mask, logprobs = row["tokens"], row["loss_mask"], row["logprobs"]
    turns, at = [], 0
    base = {k: row[k] for k in ("run", "group_id", "rollout_id", "session_id", "segment_id")}
    for i, (n_prompt, n_out) in enumerate(zip(row["turn_prompt_tokens"], row["turn_output_tokens"])):
        out = slice(at + n_prompt, at + n_prompt + n_out)
        out_mask = mask[out]
        turns.append(dict(
            base, kind="turn", turn_index=i, policy_version=row["turn_policy_versions"][i],
            event_id=content_id({"turn": [row["rollout_id"], row["segment_id"], i]}),
            prompt_ids=tokens[at:at + n_prompt], output_ids=tokens[out],
            output_logprobs=np.asarray(logprobs[out], dtype=np.float32).tolist(),
            output_mask=None if all(out_mask) else out_mask,
            finish_reason=row["turn_finish_reasons"][i], time=row["turn_times"][i],
            request=_json(row["turn_requests"][i]), response=_json(row["turn_responses"][i]),
            sampling=_json(row["turn_sampling"][i]), meta=_json(row["turn_meta"][i])))
        at = out.stop
    if at != len(tokens):
        raise ExportError(f"sample {row['segment_id']!r} of rollout {row['rollout_id']!r}: its turns count {at} "
                          f"tokens but it holds {len(tokens)}; the export is damaged, export it again")
    return turns


def _outcome(row: dict[str, Any], time: Any) -> list[dict[str, Any]]:
    base = {k: row[k] for k in ("run", "group_id", "rollout_id")}
    events = [dict(base, kind="reward", reward_name=c["name"], reward=c["value"], time=time,
                   event_id=content_id({"reward": [row["rollout_id"], None, c["name"]]}))
              for c in row["reward_components"] or []]
    events += [dict(base, kind="reward", segment_id=row["segment_id"], reward_name=c["name"], reward=c["value"],
                    time=time, event_id=content_id({"reward": [row["rollout_id"], row["segment_id"], c["name"]]}))
               for c in row["segment_reward_components"] or []]
    if row["status"] is not None:
        events.append(dict(base, kind="status", status=row["status"], error=row["error"],
                           group_size=row["group_size"], time=time,
                           event_id=content_id({"status": row["rollout_id"]})))
    return events


def events_of(batch: pa.RecordBatch, seen: set[str]) -> list[dict[str, Any]]:
    """The events one batch of export rows stands for. `seen` holds the rollouts whose rewards and
    status were already emitted (a rollout's samples may span batches)."""
    events: list[dict[str, Any]] = []
    for row in batch.select(list(REQUIRED)).to_pylist():
        turns = _turns(row)
        events += turns
        outcome = _outcome(row, max(t["time"] for t in turns))
        if row["rollout_id"] in seen:
            outcome = [e for e in outcome if e.get("segment_id") is not None]
        seen.add(row["rollout_id"])
        events += outcome
    return events


def read_export(directory: str | Path, *, rows: int = 256) -> Iterator[list[dict[str, Any]]]:
    """The events of an `hf` export, one list per `rows` exported rows (the export is never read whole)."""
    seen: set[str] = set()
    for batch in open_export(directory).to_batches(batch_size=rows, columns=list(REQUIRED)):
        if batch.num_rows:
            yield events_of(batch, seen)
