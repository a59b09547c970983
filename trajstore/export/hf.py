"""The `hf` export: a Hugging Face dataset directory (Parquet shards plus a dataset card), one row per sample.

    OUT/README.md                    the card: YAML front matter (features, splits, config, the
                                     store/run/version it came from) and a description
    OUT/data/train-00000.parquet     export rows (`trajstore.export.source`), 50,000 rows a shard

`datasets.load_dataset("parquet", data_dir=OUT)` or `load_dataset(OUT)` loads it. Rows are
written one record batch at a time, so the export holds one batch, never the run.
`trajstore.export.hf_import` reads it back into a store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trajstore.views import ESTIMATOR_TITLES, ESTIMATORS

ROWS_PER_SHARD = 50_000
_ESTIMATOR_LIST = ", ".join(f"`{name}` ({ESTIMATOR_TITLES[name]})" for name in ESTIMATORS)
DATA_DIR = "data"


def _feature(typ: pa.DataType) -> dict[str, Any]:
    """The card's YAML form of one column type, as `datasets.Features` writes it."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        inner = _feature(typ.value_type)
        return {"list": inner.get("dtype", inner.get("struct", inner))}
    if pa.types.is_struct(typ):
        return {"struct": [{"name": f.name, **_feature(f.type)} for f in typ]}
    names = {pa.float32(): "float32", pa.float64(): "float64", pa.bool_(): "bool", pa.string(): "string",
             pa.large_string(): "large_string"}
    return {"dtype": names.get(typ, str(typ))}


def _yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists and scalars (scalars as JSON, which YAML reads)."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{key}:\n{_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {json.dumps(item, ensure_ascii=False)}")
        return "\n".join(lines)
    if isinstance(value, list):
        lines = []
        for item in value:
            text = _yaml(item, indent + 2) if isinstance(item, (dict, list)) else pad + "  " + json.dumps(item)
            lines.append(f"{pad}- {text.lstrip()}")
        return "\n".join(lines)
    return pad + json.dumps(value, ensure_ascii=False)


def card(schema: pa.Schema, rows: int, source: dict[str, Any]) -> str:
    """The dataset card: YAML front matter a hub and `datasets` read, then what the columns mean."""
    front = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": f"{DATA_DIR}/train-*.parquet"}]}],
        "dataset_info": {"features": [{"name": f.name, **_feature(f.type)} for f in schema],
                         "splits": [{"name": "train", "num_examples": rows}]},
        "tags": ["trajstore", "reinforcement-learning", "rollouts"],
        "trajstore": source,
    }
    made = " ".join(f"--{k} {json.dumps(v)}" for k, v in source.items() if k in ("run", "where") and v)
    return f"""---
{_yaml(front)}
---

# trajstore rollouts: run {source["run"]!r}

Samples exported from the trajstore store `{source["store"]}` at table version {source["table_version"]}
with `trajstore export --format hf {made}`: {rows} rows, one per trainable sample (segment).

- `tokens`, `loss_mask`, `logprobs`: the sample's token ids, its loss mask (false on prompt and tool tokens)
  and the behaviour logprob of each sampled token (0 on prompt tokens); all the same length.
  `prompt_ids`/`completion_ids` split `tokens` after the first turn's prompt (`prompt_tokens`).
- `reward` (sum of the latest value of each component), `reward_components`, `status`, `trainable`;
  `segment_reward`/`segment_reward_components` for rewards given to this segment alone.
- {_ESTIMATOR_LIST}: the rollout's advantage under each estimator (null when untrainable).
- `min_version`/`max_version`: the policy versions that sampled it; `turn_*`: per turn, in order, its prompt and
  output token counts, policy version, finish reason, time, and the request (whole)/response/sampling/meta JSON stored.

Read it back into a store with `trajstore ingest --format hf DIR`.
"""


def write_hf(batches: Iterable[pa.RecordBatch], out: Path, source: dict[str, Any],
             *, rows_per_shard: int = ROWS_PER_SHARD) -> int:
    """Write `batches` as Parquet shards under `out/data/` and the card; the number of rows written."""
    data = out / DATA_DIR
    data.mkdir(parents=True)
    writer: pq.ParquetWriter | None = None
    schema: pa.Schema | None = None
    rows = shard_rows = shards = 0
    try:
        for batch in batches:
            schema = batch.schema
            if writer is None or shard_rows >= rows_per_shard:
                if writer is not None:
                    writer.close()
                writer = pq.ParquetWriter(data / f"train-{shards:05d}.parquet", schema, compression="zstd")
                shards, shard_rows = shards + 1, 0
            writer.write_batch(batch)
            rows, shard_rows = rows + batch.num_rows, shard_rows + batch.num_rows
    finally:
        if writer is not None:
            writer.close()
    assert schema is not None, "Snapshot.batches yields at least one batch"
    (out / "README.md").write_text(card(schema, rows, source), encoding="utf-8")
    return rows
