"""The `tokens` export: one Parquet row per token of every sample, to debug train/inference mismatch.

Columns: run, group_id, rollout_id, segment_id, `position` (in the sample), `turn_index`,
`token_id`, `sampled` (an output token of a model call, not prompt or tool text), `loss_mask`,
`policy_version` (of the turn the token belongs to), `behaviour_logprob` (the logprob the
sampler recorded; null on prompt tokens), `learner_logprob` and `ratio` (exp(learner -
behaviour)), `reward`, and the rollout's advantage under each estimator.

`learner_logprob` and `ratio` are null: the learner does not log per-token logprobs (its
metric events carry aggregates only: `mismatch_kl_k3`, `is_weight_mean`, `clip_fraction`).
The columns are there so a table joined with a learner's own per-token dump has the layout
researchers expect.

Each record batch of sample rows becomes one batch of token rows, flattened with Arrow's list
kernels and numpy (no Python loop over tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajstore.views import ESTIMATORS

_PER_SAMPLE = ("run", "group_id", "rollout_id", "segment_id")


def _chunks(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """Per token, its turn index and whether it was sampled: each turn is a prompt chunk, then an output chunk."""
    prompt = batch.column("turn_prompt_tokens")
    lengths = np.column_stack([pc.list_flatten(prompt).to_numpy(),
                               pc.list_flatten(batch.column("turn_output_tokens")).to_numpy()]).ravel()
    offsets = prompt.offsets.to_numpy()
    turn_index = np.arange(len(lengths) // 2) - np.repeat(offsets[:-1], np.diff(offsets))
    sampled = np.tile([False, True], len(lengths) // 2)
    return np.repeat(np.repeat(turn_index, 2), lengths), np.repeat(sampled, lengths)


def token_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The token rows of a batch of export rows (see `trajstore.export.source`)."""
    tokens = batch.column("tokens")
    parent = pc.list_parent_indices(tokens)
    offsets = tokens.offsets.to_numpy()
    position = np.arange(len(parent)) - offsets[parent.to_numpy()]
    turn_index, sampled = _chunks(batch)
    turn_versions = pc.list_flatten(batch.column("turn_policy_versions")).to_numpy()
    first_turn = batch.column("turn_policy_versions").offsets.to_numpy()[:-1]
    behaviour = pc.list_flatten(batch.column("logprobs"))
    columns = {name: batch.column(name).take(parent) for name in _PER_SAMPLE}
    columns |= {
        "position": pa.array(position, pa.int32()),
        "turn_index": pa.array(turn_index, pa.int32()),
        "token_id": pc.list_flatten(tokens),
        "sampled": pa.array(sampled),
        "loss_mask": pc.list_flatten(batch.column("loss_mask")),
        "policy_version": pa.array(turn_versions[first_turn[parent.to_numpy()] + turn_index], pa.int64()),
        "behaviour_logprob": pc.if_else(pa.array(sampled), behaviour, pa.scalar(None, pa.float32())),
        "learner_logprob": pa.nulls(len(parent), pa.float32()),
        "ratio": pa.nulls(len(parent), pa.float32()),
        "reward": batch.column("reward").take(parent),
    }
    columns |= {f"advantage_{name}": batch.column(name).take(parent) for name in ESTIMATORS}
    return pa.RecordBatch.from_pydict(columns)


def write_tokens(batches: Iterable[pa.RecordBatch], out: Path) -> int:
    """Write every batch's token rows to the Parquet file `out`; the number of token rows."""
    writer: pq.ParquetWriter | None = None
    rows = 0
    try:
        for batch in batches:
            tokens = token_rows(batch)
            if writer is None:
                writer = pq.ParquetWriter(out, tokens.schema, compression="zstd")
            writer.write_batch(tokens)
            rows += tokens.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows
