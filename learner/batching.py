"""Micro-batches from a shard's samples: packed by a token budget (or padded, for comparison).

A sample (one row of `Shard.samples`) holds `tokens`, `loss_mask` and `logprobs` of equal
length: the prompt, the sampled outputs and the later turns' prompt deltas, with the mask
true and the behaviour logprob set only on sampled tokens (trajstore.views, `samples`).
A causal LM predicts token t+1 at position t, so a sample of n tokens feeds n-1 input
positions, tokens[:-1], whose targets are tokens[1:]; the mask and the behaviour logprobs
are shifted the same way. The first token of a sample is therefore never a target, and its
last token is never an input.

`pack` concatenates several samples into one row, first-fit-decreasing on their input
positions, with `position_ids` restarting at 0 for each sample and no attention mask:
transformers 5 finds the sample boundaries from the position ids (masking_utils
`find_packed_sequence_indices`, used when no attention mask and no cache are given, so
the forward must pass `use_cache=False`) and attends within each sample only.
tests/learner/test_batching.py checks that packed logprobs equal those of each sample
alone. A row holds at most `budget` input positions, except a sample longer than the
budget, which gets a micro-batch of its own rather than being cut (cutting would change
what the model conditions on).

`pad_batches` builds the usual padded (B, L) batches instead, in shard order, for
`benchmarks/learn.py` to measure what packing saves.

Every position also carries how its target was sampled (the sample's temperature, top_k and
top_p) and the kept set it was drawn from as the store recorded it (`support_sizes` per
position, `support_ids` concatenated), for `learner.support` to renormalize over.

Samples with no trainable target are left out of both: they add nothing to any loss.
Every flat tensor is over the B*L input positions in row-major order (B = 1 when packed).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from trajstore.events import SUPPORT_IDS_CAP


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass worth of samples, every flat tensor over the B*L input positions."""

    input_ids: torch.Tensor  # (B, L) int64
    position_ids: torch.Tensor  # (B, L) int64, restarting at 0 for each sample
    attention_mask: torch.Tensor | None  # (B, L) int64 for padded batches; None when packed
    targets: torch.Tensor  # (B*L,) int64: the token each position predicts
    mask: torch.Tensor  # (B*L,) bool: the target is a sampled (trainable) token
    behaviour_logprobs: torch.Tensor  # (B*L,) float32: what the policy server sampled it with
    advantages: torch.Tensor  # (B*L,) float32: the sample's (its rollout's) advantage
    seq: torch.Tensor  # (B*L,) int64: index into `rows` of the sample each position belongs to
    seq_weight: torch.Tensor  # (S,) float32: 1 / segments of the sample's rollout
    rows: tuple[int, ...]  # the samples table's rows, in `seq` order
    teacher_logprobs: torch.Tensor | None = None  # (B*L,) float32 when the samples carry a teacher's
    # (B*L, layers, top_k) int16 when some sample carries MoE routes: the experts each input position took when
    # sampled (-1: none recorded), for `learner.routing.replayed`
    routes: torch.Tensor | None = None
    temperature: torch.Tensor | None = None  # (B*L,) float32: the temperature each target was sampled at
    top_k: torch.Tensor | None = None  # (B*L,) int64: its top-k (0: off) ...
    top_p: torch.Tensor | None = None  # (B*L,) float32: ... and top-p, to rebuild a support no server recorded
    support_sizes: torch.Tensor | None = None  # (B*L,) int64: the target's recorded kept-set size m, 0: none
    support_ids: torch.Tensor | None = None  # int64: the stored kept sets (m <= SUPPORT_IDS_CAP), in position order

    @property
    def num_positions(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trainable(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


@dataclass(frozen=True)
class StepTotals:
    """Global normalizers of one optimizer step, computed before its first micro-batch."""

    trainable_tokens: int  # trainable targets over every sample of the step
    rollouts: float  # sum of the samples' seq_weight: each rollout counts once however it fans out
    samples: int


@dataclass(frozen=True)
class _Flat:
    """The samples' list columns as flat numpy arrays plus offsets."""

    tokens: np.ndarray  # int64
    mask: np.ndarray  # bool
    logprobs: np.ndarray  # float32
    offsets: np.ndarray  # (S+1,) int64
    advantage: np.ndarray  # (S,) float32
    weight: np.ndarray  # (S,) float32
    teacher: np.ndarray | None = None  # float32, aligned with tokens: the samples' `teacher_logprobs`
    routes: np.ndarray | None = None  # (tokens, layers, top_k) int16, aligned with tokens: `routed_experts`
    temperature: np.ndarray | None = None  # (S,) float32: each sample's sampling temperature
    top_k: np.ndarray | None = None  # (S,) int64: 0 off
    top_p: np.ndarray | None = None  # (S,) float32: 1 off
    support_sizes: np.ndarray | None = None  # int64, aligned with tokens: each token's kept-set size
    support_ids: np.ndarray | None = None  # int64: every sample's kept sets, concatenated
    support_offsets: np.ndarray | None = None  # (S+1,) int64: each sample's start in support_ids

    def positions(self, row: int) -> int:
        return int(self.offsets[row + 1] - self.offsets[row]) - 1

    def trainable(self, row: int) -> int:
        start, end = self.offsets[row], self.offsets[row + 1]
        return int(self.mask[start + 1:end].sum())


def _flat(samples: pa.Table) -> _Flat:
    def values(name: str, dtype: type, fill: object) -> np.ndarray:
        flat = pc.list_flatten(samples.column(name).combine_chunks())
        if flat.null_count:
            flat = pc.fill_null(flat, fill)
        return flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    tokens_col = samples.column("tokens").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(tokens_col), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = _Flat(
        tokens=values("tokens", np.int64, 0),
        mask=values("loss_mask", bool, False),
        logprobs=values("logprobs", np.float32, 0.0),
        offsets=offsets,
        advantage=pc.fill_null(samples.column("advantage"), 0.0).to_numpy().astype(np.float32),
        weight=(1.0 / samples.column("rollout_segments").to_numpy().astype(np.float64)).astype(np.float32),
        teacher=values("teacher_logprobs", np.float32, 0.0) if "teacher_logprobs" in samples.column_names else None,
        routes=_routes(samples, lengths),
        temperature=_temperatures(samples),
        **_truncation(samples),
        **_support(samples, n=int(offsets[-1])),
    )
    n = int(offsets[-1])
    if flat.teacher is not None and len(flat.teacher) != n:
        raise ValueError(f"the samples' teacher_logprobs hold {len(flat.teacher)} values but their tokens {n}; "
                         "each sample's teacher logprobs must be aligned with its tokens")
    if not (len(flat.tokens) == len(flat.mask) == len(flat.logprobs) == n):
        raise ValueError(f"the samples' tokens, loss_mask and logprobs hold {len(flat.tokens)}, {len(flat.mask)} "
                         f"and {len(flat.logprobs)} values in all; every sample needs the three of equal length")
    return flat


def _routes(samples: pa.Table, lengths: np.ndarray) -> np.ndarray | None:
    """The samples' `routed_experts` as one (tokens, layers, top_k) array aligned with their tokens, -1 rows for
    samples without routes; None when none has any (a dense model, or a store written before routes)."""
    if "routed_experts" not in samples.column_names or samples.column("routed_experts").null_count == len(samples):
        return None
    shapes = [s for s in samples.column("routed_experts_shape").to_pylist() if s is not None]
    row_shapes = {tuple(s[1:]) for s in shapes}
    if len(row_shapes) != 1:
        raise ValueError(f"the samples carry expert routes of different shapes {sorted(row_shapes)} [layers, top_k]; "
                         "train samples of one model together")
    layers, top_k = row_shapes.pop()
    out = np.full((int(lengths.sum()), layers, top_k), -1, dtype=np.int16)
    at = 0
    for n, flat, shape in zip(lengths, samples.column("routed_experts").to_pylist(),
                              samples.column("routed_experts_shape").to_pylist()):
        if flat is not None:
            if shape[0] != n:
                raise ValueError(f"a sample's expert routes cover {shape[0]} tokens but it has {n}; each row of "
                                 "routed_experts must align with one token")
            out[at:at + n] = np.asarray(flat, dtype=np.int16).reshape(n, layers, top_k)
        at += int(n)
    return out
GREEDY_TEMPERATURE = 1e-5  # below this a sampler draws greedily and reports logprobs at temperature 1 (as vLLM)


def _temperatures(samples: pa.Table) -> np.ndarray:
    """(S,) each sample's temperature: 1 where none is recorded or it sampled greedily."""
    if "temperature" not in samples.column_names:
        return np.ones(samples.num_rows, dtype=np.float32)
    t = pc.fill_null(samples.column("temperature").cast(pa.float64()), 1.0).to_numpy().astype(np.float32)
    return np.where(t < GREEDY_TEMPERATURE, np.float32(1.0), t)


def _truncation(samples: pa.Table) -> dict[str, np.ndarray]:
    """(S,) each sample's top_k (0 where off, unrecorded, or vLLM's -1) and top_p (1 where off or unrecorded)."""
    if "top_k" not in samples.column_names:
        return {}
    top_k = pc.fill_null(samples.column("top_k").cast(pa.int64()), 0).to_numpy().astype(np.int64)
    top_p = pc.fill_null(samples.column("top_p").cast(pa.float64()), 1.0).to_numpy().astype(np.float32)
    return {"top_k": np.maximum(top_k, 0), "top_p": top_p}


def _support(samples: pa.Table, n: int) -> dict[str, np.ndarray]:
    """The samples' recorded kept sets: sizes aligned with the tokens, ids, and each sample's start in them."""
    if "support_sizes" not in samples.column_names:
        return {}
    sizes_col = samples.column("support_sizes").combine_chunks()
    ids_col = samples.column("support_ids").combine_chunks()
    sizes = pc.fill_null(pc.list_flatten(sizes_col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(sizes) != n:  # a sample whose turns predate the columns has none: its tokens get size 0
        per_row = pc.fill_null(pc.list_value_length(sizes_col), 0).to_numpy(zero_copy_only=False)
        tokens = pc.fill_null(pc.list_value_length(samples.column("tokens").combine_chunks()), 0).to_numpy(
            zero_copy_only=False)
        if (per_row[per_row > 0] != tokens[per_row > 0]).any():
            raise ValueError("the samples' support_sizes are not aligned with their tokens; each sample needs one "
                             "size per token (the `samples` view builds them so)")
        sizes = np.concatenate([np.zeros(t, np.int64) if p == 0 else np.asarray(s, np.int64)
                                for p, t, s in zip(per_row, tokens, sizes_col.to_pylist())] or [np.zeros(0, np.int64)])
    ids = pc.list_flatten(ids_col).to_numpy(zero_copy_only=False).astype(np.int64)
    counts = pc.fill_null(pc.list_value_length(ids_col), 0).to_numpy(zero_copy_only=False)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    stored = int(sizes[sizes <= SUPPORT_IDS_CAP].sum())
    if stored != len(ids):
        raise ValueError(f"the samples' support_sizes of at most {SUPPORT_IDS_CAP} add up to {stored} but "
                         f"support_ids hold {len(ids)} ids; every stored kept set needs its size")
    return {"support_sizes": sizes, "support_ids": ids, "support_offsets": starts}


def step_totals(samples: pa.Table) -> StepTotals:
    """The step's global normalizers: trainable targets and rollouts (sum of 1/segments)."""
    if samples.num_rows == 0:
        return StepTotals(0, 0.0, 0)
    flat = _flat(samples)
    tokens = sum(flat.trainable(r) for r in range(samples.num_rows))
    return StepTotals(trainable_tokens=tokens, rollouts=float(flat.weight.astype(np.float64).sum()),
                      samples=samples.num_rows)


def _trainable_rows(flat: _Flat) -> list[int]:
    return [r for r in range(len(flat.advantage)) if flat.positions(r) > 0 and flat.trainable(r) > 0]


def _micro_batch(flat: _Flat, rows: list[int], width: int | None) -> MicroBatch:
    """Rows concatenated into one packed row (width None) or padded to `width`, one row each."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("inp", "pos", "tgt", "msk", "blp", "adv", "seq", "att",
                                                           "tlp", "rte", "tmp", "ssz", "sid", "tk", "tp")}
    for i, r in enumerate(rows):
        start, end = int(flat.offsets[r]), int(flat.offsets[r + 1])
        n = end - start - 1
        pad = 0 if width is None else width - n
        parts["inp"].append(np.pad(flat.tokens[start:end - 1], (0, pad)))
        parts["pos"].append(np.arange(n + pad, dtype=np.int64))
        parts["tgt"].append(np.pad(flat.tokens[start + 1:end], (0, pad)))
        parts["msk"].append(np.pad(flat.mask[start + 1:end], (0, pad)))
        parts["blp"].append(np.pad(flat.logprobs[start + 1:end], (0, pad)))
        parts["adv"].append(np.full(n + pad, flat.advantage[r], dtype=np.float32))
        parts["seq"].append(np.full(n + pad, i, dtype=np.int64))
        parts["att"].append(np.pad(np.ones(n, dtype=np.int64), (0, pad)))
        if flat.teacher is not None:
            parts["tlp"].append(np.pad(flat.teacher[start + 1:end], (0, pad)))
        if flat.routes is not None:  # input position i took the experts stored with token i + 1 (trajstore.routes)
            parts["rte"].append(np.pad(flat.routes[start + 1:end], ((0, pad), (0, 0), (0, 0)), constant_values=-1))
        parts["tmp"].append(np.full(n + pad, flat.temperature[r], dtype=np.float32))
        if flat.top_k is not None and flat.top_p is not None:
            parts["tk"].append(np.full(n + pad, flat.top_k[r], dtype=np.int64))
            parts["tp"].append(np.full(n + pad, flat.top_p[r], dtype=np.float32))
        if flat.support_sizes is not None:
            sizes = flat.support_sizes[start:end]
            stored = np.where(sizes <= SUPPORT_IDS_CAP, sizes, 0)  # larger sets are "the m most likely": no ids
            first = int(flat.support_offsets[r]) + int(stored[0])  # the first token is never a target
            parts["ssz"].append(np.pad(sizes[1:], (0, pad)))
            parts["sid"].append(flat.support_ids[first:first + int(stored[1:].sum())])
    rows_b = 1 if width is None else len(rows)

    def cat(key: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts[key]))

    return MicroBatch(
        input_ids=cat("inp").view(rows_b, -1),
        position_ids=cat("pos").view(rows_b, -1),
        attention_mask=None if width is None else cat("att").view(rows_b, -1),
        targets=cat("tgt"),
        mask=cat("msk"),
        behaviour_logprobs=cat("blp"),
        advantages=cat("adv"),
        seq=cat("seq"),
        seq_weight=torch.from_numpy(flat.weight[rows].copy()),
        rows=tuple(rows),
        teacher_logprobs=cat("tlp") if flat.teacher is not None else None,
        routes=cat("rte") if flat.routes is not None else None,
        temperature=cat("tmp"),
        top_k=cat("tk") if flat.top_k is not None else None,
        top_p=cat("tp") if flat.top_p is not None else None,
        support_sizes=cat("ssz") if flat.support_sizes is not None else None,
        support_ids=cat("sid") if flat.support_sizes is not None else None,
    )


def pack(samples: pa.Table, budget: int) -> list[MicroBatch]:
    """Packed micro-batches of at most `budget` input positions each (first-fit-decreasing).

    A sample with more than `budget` input positions gets a micro-batch of its own.
    """
    if budget < 1:
        raise ValueError(f"the micro-batch budget must be >= 1 token (got {budget})")
    if samples.num_rows == 0:
        return []
    flat = _flat(samples)
    bins: list[tuple[int, list[int]]] = []  # (free positions, rows)
    for r in sorted(_trainable_rows(flat), key=lambda r: (-flat.positions(r), r)):
        n = flat.positions(r)
        for i, (free, rows) in enumerate(bins):
            if n <= free:
                bins[i] = (free - n, rows + [r])
                break
        else:
            bins.append((max(budget - n, 0), [r]))
    return [_micro_batch(flat, sorted(rows), None) for _, rows in bins]


def pad_batches(samples: pa.Table, budget: int) -> list[MicroBatch]:
    """Padded (B, L) micro-batches in shard order: B rows padded to the longest, B * L <= budget.

    The baseline packing is measured against (`benchmarks/learn.py`); a sample longer than
    the budget is a batch of one.
    """
    if budget < 1:
        raise ValueError(f"the micro-batch budget must be >= 1 token (got {budget})")
    if samples.num_rows == 0:
        return []
    flat = _flat(samples)
    batches: list[list[int]] = []
    width = 0
    for r in _trainable_rows(flat):
        n = flat.positions(r)
        if batches and (len(batches[-1]) + 1) * max(width, n) <= budget:
            batches[-1].append(r)
            width = max(width, n)
        else:
            batches.append([r])
            width = n
    return [_micro_batch(flat, rows, max(flat.positions(r) for r in rows)) for rows in batches]
