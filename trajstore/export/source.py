"""The rows every export reads: one per sample of a run, with its rollout's outcome and its turns' boundaries.

A row is a `samples` row (tokens, loss_mask, logprobs: all one length) joined with what an
exporter needs beside it, all computed by SQL over the store's views and streamed in record
batches (`Snapshot.batches`), so an export never holds a run whole. The views deduplicate
events across the whole store and aggregate every turn of a sample: over a whole run their
memory grows with it. So the run is read a chunk of whole groups at a time (the snapshot
narrowed to those groups' events, as the shard planner does: a group is the unit advantages
are computed over), and the one statistic that spans groups, the run's mean reward behind
the `batch` estimator, is taken in a first pass over the same chunks that reads no token lists.
Memory is then bounded by a chunk, whatever the run's size. Each row has:

- the rollout's reward, status, trainable flag and planned group size (`rollouts`), its
  reward components (the latest value of each, by name) and the sample's segment-level ones;
- its advantages under every estimator (`advantages`; null when the rollout is not trainable);
- per turn, in order: prompt and output token counts, policy version, finish reason, time,
  and the request (whole: a request stored as a delta of an earlier turn's is resolved, see
  `trajstore.requests`), response, sampling and meta JSON the collector stored. With the counts the token lists split
  back into the turns they were built from (`trajstore ingest --format hf` does).

`where` is a SQL condition over these columns (`reward > 0.5 AND status = 'completed'`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from trajstore.read import Snapshot
from trajstore.requests import full_requests
from trajstore.views import ESTIMATORS

# Rows per record batch: a few MB of token lists for typical agent samples.
BATCH_ROWS = 256
# Groups read at once: ~1k rollouts of 8-sample groups (tens of MB of events for agent runs).
GROUPS_PER_CHUNK = 128
# What the first pass reads: the columns the `rollouts` view needs, no token lists or JSON.
_OUTCOME_COLUMNS = ("event_id", "kind", "time", "writer", "writer_seq", "run", "group_id", "rollout_id", "session_id",
                    "segment_id", "policy_version", "prompt_tokens", "output_tokens", "trainable_tokens", "reward",
                    "reward_name", "status", "error", "group_size")

# Each estimator's column: the group ones from `advantages` (a chunk holds whole groups); `batch` is over the
# whole run, not the chunk, so its mean comes from `run_mean`.
_ESTIMATOR_COLUMNS = {name: f"a.{name}" for name in ESTIMATORS} | {
    "batch": "CASE WHEN r.trainable THEN r.reward - $run_mean END AS batch"}

_LATEST_REWARDS = """
    SELECT rollout_id, segment_id, reward_name AS name, last(reward ORDER BY time, writer, writer_seq) AS value
    FROM events WHERE kind = 'reward' AND run = $run GROUP BY rollout_id, segment_id, reward_name
"""

SAMPLE_ROWS = f"""
    WITH per_turn AS (
        SELECT rollout_id, segment_id,
               list(prompt_tokens ORDER BY turn_index) AS turn_prompt_tokens,
               list(output_tokens ORDER BY turn_index) AS turn_output_tokens,
               list(policy_version ORDER BY turn_index) AS turn_policy_versions,
               list(finish_reason ORDER BY turn_index) AS turn_finish_reasons,
               list(time ORDER BY turn_index) AS turn_times,
               list(request ORDER BY turn_index) AS turn_requests,
               list(response ORDER BY turn_index) AS turn_responses,
               list(sampling ORDER BY turn_index) AS turn_sampling,
               list(meta ORDER BY turn_index) AS turn_meta
        FROM turns WHERE run = $run GROUP BY rollout_id, segment_id
    ),
    latest AS ({_LATEST_REWARDS}),
    rollout_rewards AS (
        SELECT rollout_id, list({{'name': name, 'value': value}} ORDER BY name) AS reward_components
        FROM latest WHERE segment_id IS NULL GROUP BY rollout_id
    ),
    segment_rewards AS (
        SELECT rollout_id, segment_id,
               list({{'name': name, 'value': value}} ORDER BY name) AS segment_reward_components
        FROM latest WHERE segment_id IS NOT NULL GROUP BY rollout_id, segment_id
    ),
    exported AS (
        SELECT s.run, s.group_id, s.rollout_id, s.session_id, s.segment_id,
               s.tokens[1:s.prompt_tokens] AS prompt_ids, s.tokens[s.prompt_tokens + 1:] AS completion_ids,
               s.tokens, s.loss_mask, s.logprobs, s.prompt_tokens, s.num_tokens, s.trainable_tokens,
               s.turns, s.min_version, s.max_version,
               r.reward, r.status, r.error, r.trainable, r.group_size, rr.reward_components,
               s.segment_reward, sr.segment_reward_components,
               {", ".join(_ESTIMATOR_COLUMNS[name] for name in ESTIMATORS)},
               t.turn_prompt_tokens, t.turn_output_tokens, t.turn_policy_versions, t.turn_finish_reasons,
               t.turn_times, t.turn_requests, t.turn_responses, t.turn_sampling, t.turn_meta
        FROM samples s
        JOIN per_turn t USING (rollout_id, segment_id)
        LEFT JOIN rollouts r USING (rollout_id)
        LEFT JOIN advantages a USING (rollout_id)
        LEFT JOIN rollout_rewards rr USING (rollout_id)
        LEFT JOIN segment_rewards sr USING (rollout_id, segment_id)
        WHERE s.run = $run
    )
    SELECT * FROM exported
"""


def groups(snapshot: Snapshot, run: str) -> list[str]:
    """The run's group ids that have turns, in order (read from the raw rows: three columns, no deduplication)."""
    return snapshot.query("SELECT DISTINCT group_id FROM _raw WHERE run = $run AND kind = 'turn' ORDER BY group_id",
                          {"run": run}).column("group_id").to_pylist()


def _chunks(ids: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(ids), size):
        yield ids[i:i + size]


def run_mean(snapshot: Snapshot, run: str, group_ids: list[str], *, groups_per_chunk: int = GROUPS_PER_CHUNK) -> float | None:
    """The mean reward of the run's trainable rollouts (the `batch` baseline), a chunk of groups at a time."""
    total, count = 0.0, 0
    for chunk in _chunks(group_ids, groups_per_chunk):
        snapshot.narrow("group_id", chunk, columns=_OUTCOME_COLUMNS)
        part = snapshot.query("SELECT sum(reward) AS s, count(*) AS n FROM rollouts WHERE run = $run AND trainable",
                              {"run": run}).to_pylist()[0]
        total, count = total + (part["s"] or 0.0), count + part["n"]
    return total / count if count else None


def sample_batches(snapshot: Snapshot, run: str, *, where: str | None = None, rows: int = BATCH_ROWS,
                   groups_per_chunk: int = GROUPS_PER_CHUNK) -> Iterator[pa.RecordBatch]:
    """The run's export rows (see the module docstring), ordered by group chunk, then rollout and segment, in
    batches of at most `rows`. `where` is a SQL condition over the row's columns. The snapshot's views see one
    chunk at a time meanwhile; they see its whole pinned version again before and after."""
    snapshot.repin(snapshot.pinned)
    try:
        group_ids = groups(snapshot, run)
        params = {"run": run, "run_mean": run_mean(snapshot, run, group_ids, groups_per_chunk=groups_per_chunk)}
        sql = SAMPLE_ROWS + (f" WHERE ({where})" if where else "") + " ORDER BY rollout_id, segment_id"
        for chunk in _chunks(group_ids, groups_per_chunk):
            snapshot.narrow("group_id", chunk)
            stored = _stored_requests(snapshot)  # read before the batches: the snapshot streams one query at a time
            for batch in snapshot.batches(sql, params, rows=rows):
                yield with_full_requests(stored, batch) if stored else batch
    finally:
        snapshot.repin(snapshot.pinned)


def _stored_requests(snapshot: Snapshot) -> list[dict[str, Any]]:
    """The turns of the snapshot's chunk with their stored requests (oldest first per segment), when any of them
    is stored as a delta (`trajstore.requests`); else none (nothing to resolve, nothing read)."""
    if not snapshot.query("SELECT count(*) AS n FROM turns WHERE request_base IS NOT NULL").column("n")[0].as_py():
        return []
    return snapshot.query("SELECT event_id, rollout_id, segment_id, turn_index, request, request_base, request_shared, "
                          "request_kept FROM turns ORDER BY rollout_id, segment_id, turn_index").to_pylist()


def with_full_requests(stored: list[dict[str, Any]], batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with every turn's request whole, resolved from `stored` (`_stored_requests`: the bases lie in their
    rollouts, which a chunk holds whole)."""
    keys = list(zip(batch.column("rollout_id").to_pylist(), batch.column("segment_id").to_pylist()))
    wanted = set(keys)
    mine = [r for r in stored if (r["rollout_id"], r["segment_id"]) in wanted]
    full = full_requests(stored, [r["event_id"] for r in mine])
    by_segment: dict[tuple[str, str], list[str | None]] = {}
    for row in mine:
        by_segment.setdefault((row["rollout_id"], row["segment_id"]), []).append(full[row["event_id"]])
    at = batch.schema.get_field_index("turn_requests")
    columns = list(batch.columns)
    columns[at] = pa.array([by_segment[key] for key in keys], type=batch.schema.field(at).type)
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def check_where(snapshot: Snapshot, run: str, where: str) -> None:
    """Raise QueryError when `where` is not a condition over the export rows (plans the query, reads nothing)."""
    snapshot.query(f"SELECT * FROM ({SAMPLE_ROWS}) WHERE ({where}) LIMIT 0", {"run": run, "run_mean": 0.0})


def columns(snapshot: Snapshot, run: str) -> list[str]:
    """The export rows' column names."""
    return snapshot.query(f"SELECT * FROM ({SAMPLE_ROWS}) LIMIT 0", {"run": run, "run_mean": 0.0}).column_names


def runs(snapshot: Snapshot) -> list[str]:
    """The runs the pinned store holds turns of (to say which exist when one is misspelled)."""
    return snapshot.query("SELECT DISTINCT run FROM _raw WHERE kind = 'turn' ORDER BY run").column("run").to_pylist()
