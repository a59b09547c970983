"""Routed experts of a mixture-of-experts policy: how a turn stores them, and their checks.

A turn's routes are one row of `[layers, top_k]` expert indices per token the turn adds to its
sample (its `prompt_ids`, then its `output_ids`), stored flattened as `routed_experts`
(int16) with their shape `[tokens, layers, top_k]` in `routed_experts_shape`.

Alignment (the one rule the learner relies on): row i holds the experts of the *position that
predicted token i*, i.e. the routes the model took on the token before it. That is exactly what
a sampled token's logprob was computed through, and it is what the learner needs at the same
input position (`learner.batching` shifts routes as it shifts behaviour logprobs). It also makes
every row of a turn known to the call that sampled it: the prompt delta's rows come from that
call's prefill, including the row of the previous turn's last sampled token, which only the next
call feeds to the model. Rows nobody computed hold -1 (`ABSENT`): the first token of a segment
(nothing predicted it). A later turn of a segment thus carries the routes its own call used for
its prompt, so a sample whose weights changed between turns replays what each turn saw.

Policy servers report routes per *fed* token (vLLM's `routed_experts`: `[prompt + output - 1,
layers, top_k]`, row i = the routes of token i as input); `turn_rows` turns that into a turn's rows.
Expert indices fit int16 (up to 32,767 experts; vLLM reports uint8 up to 256 experts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

ABSENT = -1  # no route recorded for this row
EXPERT_MAX = np.iinfo(np.int16).max


def turn_rows(fed: np.ndarray, prompt_len: int, output_len: int, delta_len: int) -> np.ndarray:
    """The rows a turn stores (delta_len + output_len, layers, top_k) int16.

    `fed` (n, layers, top_k): the routes of each token of prompt + output as the model's input, in
    order (n is prompt_len + output_len - 1 when the last sampled token was never fed; fewer rows
    leave the rest ABSENT). `delta_len` is how many prompt tokens the turn stores (its `prompt_ids`:
    the whole prompt on a segment's first turn, the part after the previous turn otherwise)."""
    if fed.ndim != 3:
        raise ValueError(f"routes must be (tokens, layers, top_k), got shape {fed.shape}")
    if not 0 <= delta_len <= prompt_len:
        raise ValueError(f"the turn stores {delta_len} prompt tokens of a {prompt_len}-token prompt")
    total = prompt_len + output_len
    if len(fed) > total:
        raise ValueError(f"{len(fed)} rows of routes for {total} tokens (prompt {prompt_len} + output {output_len})")
    shifted = np.full((total, *fed.shape[1:]), ABSENT, dtype=np.int16)
    known = min(len(fed), total - 1)
    shifted[1:1 + known] = fed[:known]
    return shifted[prompt_len - delta_len:]


def turn_columns(rows: np.ndarray | None) -> dict[str, Any]:
    """The Turn fields for `turn_rows`' output: {} when the server reported no routes."""
    if rows is None:
        return {}
    return {"routed_experts": np.ascontiguousarray(rows, dtype=np.int16).reshape(-1),
            "routed_experts_shape": [int(n) for n in rows.shape]}


def problems(rec: Mapping[str, Any]) -> list[str]:
    """What is wrong with a turn's routes (none when it has none), O(1) but for one range check."""
    flat, shape = rec.get("routed_experts"), rec.get("routed_experts_shape")
    if flat is None and shape is None:
        return []
    if flat is None or shape is None:
        return ["routed_experts and routed_experts_shape go together: give both or neither"]
    try:
        dims = [int(n) for n in shape]
        values = np.asarray(flat)
    except (TypeError, ValueError):
        return ["routed_experts_shape must be [tokens, layers, top_k] and routed_experts a list of expert indices"]
    if len(dims) != 3 or min(dims) < 0 or values.ndim != 1:
        return [f"routed_experts_shape must be [tokens, layers, top_k] (got {list(shape)}) and routed_experts flat"]
    out = []
    if values.size != dims[0] * dims[1] * dims[2]:
        out.append(f"routed_experts holds {values.size} values but its shape {dims} needs {int(np.prod(dims))}")
    if values.size and (values.dtype.kind not in "iu" or values.min() < ABSENT or values.max() > EXPERT_MAX):
        out.append(f"routed_experts must hold expert indices 0..{EXPERT_MAX} or {ABSENT} (absent)")
    tokens = _length(rec.get("prompt_ids")) + _length(rec.get("output_ids"))
    if dims[0] != tokens:
        out.append(f"routed_experts has {dims[0]} rows but the turn has {tokens} tokens (prompt_ids + output_ids); "
                   "it needs one row per token")
    return out


def _length(value: Any) -> int:
    try:
        return len(value)
    except TypeError:
        return 0


def column(values: list[Any]) -> pa.Array:
    """The `routed_experts` column (list<int16>) of checked rows (sequences or numpy arrays, None for none)."""
    rows = [None if v is None else np.asarray(v, dtype=np.int16).reshape(-1) for v in values]
    lengths = np.array([0 if r is None else len(r) for r in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([r for r in rows if r is not None] or [np.empty(0, np.int16)])
    mask = pa.array([r is None for r in rows]) if any(r is None for r in rows) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=pa.list_(pa.int16()), mask=mask)
