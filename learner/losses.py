"""The learner's loss math: pure functions on flat token tensors, no model, no store, no I/O.

Every tensor is flat over the token positions of one (packed) micro-batch:

- `logits (N, V)`: the policy's logits at each position, already divided by the sampling
  temperature, so that their log-softmax is the distribution the behaviour logprobs describe;
- `logprobs`, `old_logprobs`, `behaviour_logprobs`, `ref_logprobs`, `advantages`,
  `loss (N,)`: one float per position;
- `mask (N,)`: bool, or float weights, nonzero on trainable (sampled) tokens;
- `seq (N,)` int64: which sample (segment) of the micro-batch each position belongs to,
  `0..S-1`; `seq_weight (S,)`: that sample's weight in the step.

The per-token losses (`ppo_clip_loss`, `tis_pg_loss`, `kl_k3`) take no mask: their values at
non-trainable positions are discarded by the aggregation, which selects rather than multiplies,
so a finite but meaningless value there (a prompt token's behaviour logprob is usually 0) cannot
leak into the loss. Log-ratios are clamped to +-`MAX_LOG_RATIO` before `exp` so that such a
position can never produce inf, whose NaN gradient (0 * inf) would survive the selection.

The aggregations turn a per-token loss into this micro-batch's share of ONE scalar for the whole
optimizer step: the normalizers (`total_tokens`, `total_weight`) are computed by the caller over
every micro-batch of the step, so summing the micro-batch results (or accumulating their
gradients) gives exactly the loss of the step, however it was split.

Training statistics are returned as sums (`LossStats`) that add across micro-batches and turn
into means only in `LossStats.finalize`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch.autograd.function import once_differentiable

MAX_LOG_RATIO = 20.0  # exp(20) ~ 4.9e8: far past any clip or cap, still finite in float32
CHUNK_ELEMENTS = 1 << 25  # float32 elements per chunk of a (rows, V) block: 128 MiB


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if any(len(s) != 1 for s in shapes.values()) or any(s != first for s in shapes.values()):
        raise ValueError(
            f"loss inputs must be flat (N,) tensors of one length, got shapes {shapes}; "
            "flatten the micro-batch to token positions first (see the learner.losses docstring)"
        )


def _check_positive(**values: float) -> None:
    bad = {name: v for name, v in values.items() if not v > 0}
    if bad:
        raise ValueError(
            f"normalizers must be > 0, got {bad}; they count the whole optimizer step's trainable "
            "tokens / rollouts, so a step with none of them must be skipped before the loss"
        )


def _math_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits; float64 stays float64 (tests, gradcheck)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _chunk_rows(vocab: int, chunk_rows: int | None) -> int:
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return chunk_rows
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[targets] with float32 (or float64) math on chunks of rows.

    Autograd through a plain chunked `logits.float().logsumexp()` would keep every float32
    chunk for the backward pass, i.e. the full float32 (N, V) copy this avoids. Here only the
    logits themselves (in their own dtype) and the (N,) log-normalizers are kept; the backward
    pass recomputes softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:  # type: ignore[override]
        n, dtype = logits.shape[0], _math_dtype(logits)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, rows):
            x = logits[start:start + rows].to(dtype)
            chunk_lse = torch.logsumexp(x, dim=-1)
            out[start:start + rows] = x.gather(1, targets[start:start + rows, None]).squeeze(1) - chunk_lse
            lse[start:start + rows] = chunk_lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        rows: int = ctx.rows
        grad = torch.empty_like(logits)
        g = grad_out.to(lse.dtype)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            # d lp_t / d x_j = [j == t] - softmax(x)_j
            p = (logits[start:end].to(lse.dtype) - lse[start:end, None]).exp_()
            p.mul_(-g[start:end, None])
            p.scatter_add_(1, targets[start:end, None], g[start:end, None])
            grad[start:end] = p
        return grad, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *,
                   chunk_rows: int | None = None) -> torch.Tensor:
    """Log-probability of each target token under the softmax of its logits.

    logits (N, V) any float dtype (bf16 included); targets (N,) int64 in 0..V-1.
    Returns (N,) float32 (float64 for float64 logits), differentiable in logits; the gradient
    has the logits' dtype.
    Math is float32 on `chunk_rows` rows at a time (default: ~128 MiB of float32 per chunk),
    so a bf16 (N, V) never gets a full float32 copy, in the forward or the backward pass.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"token_logprobs wants logits (N, V) and targets (N,), got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}; flatten (B, T, V) logits with .flatten(0, 1) first"
        )
    rows = _chunk_rows(logits.shape[1], chunk_rows)
    return _TokenLogprobs.apply(logits, targets.long(), rows)


@torch.no_grad()
def entropy(logits: torch.Tensor, *, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of the softmax at each position, for monitoring (no gradient).

    logits (N, V) any float dtype. Returns (N,) float32 (float64 for float64 logits), detached;
    tokens masked to -inf (top-k / top-p) contribute 0.
    """
    if logits.dim() != 2:
        raise ValueError(f"entropy wants logits (N, V), got {tuple(logits.shape)}")
    rows = _chunk_rows(logits.shape[1], chunk_rows)
    dtype = _math_dtype(logits)
    out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, logits.shape[0], rows):
        logp = torch.log_softmax(logits[start:start + rows].to(dtype), dim=-1)
        p = logp.exp()
        # p * logp is 0 * -inf = NaN where a token is masked out; its true contribution is 0
        out[start:start + rows] = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
    return out


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.28,
                  dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate with separate lower and upper clip ranges (DAPO's clip-higher).

    ratio = exp(logprobs - old_logprobs); loss = -min(ratio * A, clamp(ratio, 1 - clip_low,
    1 + clip_high) * A). `old_logprobs` are the recorded behaviour logprobs, so the ratio also
    corrects the train/inference mismatch.

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning", arXiv 1912.09729): with `dual_clip` = c > 1, a negative-advantage
    token's loss is also bounded above by -c * A, i.e. loss = min(loss_ppo, -c * A) where A < 0.
    PPO never clips a ratio far above 1 when A < 0, so one stale or mismatched token with a
    huge ratio could otherwise dominate the step; dual-clipped tokens get zero gradient.

    logprobs (N,) differentiable; old_logprobs, advantages (N,).
    Returns loss (N,) and clipped (N,) bool: where a clip is active (the clipped term is the
    smaller one, or the dual clip bounds the loss), i.e. the ratio left the trust region in
    the direction the advantage pushes it; those tokens get zero gradient.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high} (DAPO uses 0.2 and 0.28)")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (the paper uses 3), got {dual_clip}; None turns it off")
    ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped_term = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    clipped = clipped_term < unclipped
    # Where clipped, the clamp is active, so that branch carries no gradient into logprobs.
    loss = -torch.where(clipped, clipped_term, unclipped)
    if dual_clip is not None:
        bound = -dual_clip * advantages  # a constant: no gradient where it binds
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return loss, clipped


@torch.no_grad()
def truncated_is_weights(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, *,
                         cap: float = 2.0) -> torch.Tensor:
    """Truncated importance weights min(exp(logprobs - behaviour_logprobs), cap), detached.

    Corrects for the inference engine sampling from a slightly different distribution than the
    trainer computes (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"). logprobs, behaviour_logprobs (N,). Returns (N,) without gradient.
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs)
    if not cap > 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap} (Yao et al. use 2)")
    return (logprobs - behaviour_logprobs).clamp(max=math.log(cap)).exp()


def tis_pg_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                cap: float = 2.0) -> torch.Tensor:
    """REINFORCE with truncated importance weights: -w * A * logprobs, w detached.

    logprobs (N,) differentiable; behaviour_logprobs, advantages (N,). Returns loss (N,);
    d loss / d logprobs = -w * A.
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages)
    weights = truncated_is_weights(logprobs, behaviour_logprobs, cap=cap)
    return -weights * advantages.detach() * logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) on tokens sampled from pi.

    With d = ref_logprobs - logprobs: exp(d) - d - 1, which is >= 0 everywhere and 0 exactly
    where the two agree. logprobs (N,) differentiable; ref_logprobs (N,). Returns (N,).
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = (ref_logprobs.detach() - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return d.exp() - d - 1


KL_K3_MAX = 10.0  # the k3 penalty's clamp: a token whose k3 exceeds 10 adds 10 and no gradient


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logprobs - ref_logprobs: unbiased for KL(pi || ref) on pi's samples, high variance,
    may be negative; as a loss its gradient is the score function, zero in expectation (Schulman
    2020, "Approximating KL Divergence"). logprobs (N,) differentiable; ref_logprobs (N,)."""
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return logprobs - ref_logprobs.detach()


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (logprobs - ref_logprobs)^2 / 2: biased, low variance; its gradient
    (logprobs - ref) * grad(logprobs) is the exact gradient of KL(pi || ref) on pi's own samples
    (Schulman 2020). logprobs (N,) differentiable; ref_logprobs (N,)."""
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return (logprobs - ref_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).square() / 2


def kl_k3_clamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """`kl_k3` clamped to at most KL_K3_MAX = 10, as verl's `low_var_kl`: k3 = exp(d) - d - 1 with
    d = ref - logprobs grows as exp(d) where the policy has made a token far less likely than the
    reference, and one such token could swamp the step; past the clamp it adds 10 and no gradient."""
    return kl_k3(logprobs, ref_logprobs).clamp(max=KL_K3_MAX)


def _masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """loss * mask, with untrainable positions replaced by 0 rather than multiplied (NaN-safe)."""
    weight = mask.to(loss.dtype)
    return torch.where(mask != 0, loss * weight, torch.zeros_like(loss))


def token_mean(loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float) -> torch.Tensor:
    """Every trainable token of the step weighs the same: sum(loss * mask) / total_tokens.

    loss, mask (N,); total_tokens: trainable tokens in the whole optimizer step. Returns a
    scalar: this micro-batch's share of the step's loss.
    """
    _check_same_shape(loss=loss, mask=mask)
    _check_positive(total_tokens=total_tokens)
    return _masked(loss, mask).sum() / total_tokens


def _per_sample_sums(loss: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor,
                     samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) sums of the masked loss and of the mask, per sample."""
    zeros = torch.zeros(samples, dtype=loss.dtype, device=loss.device)
    sums = zeros.index_add(0, seq, _masked(loss, mask))
    counts = zeros.index_add(0, seq, mask.to(loss.dtype))
    return sums, counts


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor,
                        seq_weight: torch.Tensor, *, total_weight: float) -> torch.Tensor:
    """Every rollout of the step weighs the same, whatever its length (GRPO's sample mean).

    Each sample's mean trainable-token loss, times seq_weight[s], summed, / total_weight.
    loss, mask, seq (N,); seq_weight (S,). With seq_weight = 1 / (segments of the sample's
    rollout) and total_weight = rollouts in the step, a rollout that fanned out into several
    samples counts once. A sample without trainable tokens contributes 0. Returns a scalar.
    """
    _check_same_shape(loss=loss, mask=mask, seq=seq)
    _check_positive(total_weight=total_weight)
    sums, counts = _per_sample_sums(loss, mask, seq, seq_weight.shape[0])
    means = sums / torch.where(counts > 0, counts, torch.ones_like(counts))
    return (means * seq_weight.to(loss.dtype)).sum() / total_weight


def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor,
                       seq_weight: torch.Tensor, *, normalizer: float, total_weight: float) -> torch.Tensor:
    """Dr. GRPO: each sample's token-loss SUM over a constant, so length does not rescale it.

    Each sample's summed trainable-token loss / normalizer (a constant such as the maximum
    generation length), times seq_weight[s], summed, / total_weight. Shapes and weights as in
    `seq_mean_token_mean`. Returns a scalar.
    """
    _check_same_shape(loss=loss, mask=mask, seq=seq)
    _check_positive(normalizer=normalizer, total_weight=total_weight)
    sums, _ = _per_sample_sums(loss, mask, seq, seq_weight.shape[0])
    return (sums / normalizer * seq_weight.to(loss.dtype)).sum() / total_weight


@dataclass(frozen=True)
class LossStats:
    """Sums over trainable tokens that add up across micro-batches (and steps).

    `LossStats()` is the empty total: `sum(parts, LossStats())` accumulates, `finalize()`
    turns the sums into means. All values are detached Python floats.
    """

    tokens: float = 0.0
    clipped: float = 0.0
    is_weight_sum: float = 0.0
    is_weight_min: float = math.inf
    is_weight_max: float = -math.inf
    mismatch_k1_sum: float = 0.0
    mismatch_k3_sum: float = 0.0
    entropy_sum: float = 0.0
    entropy_tokens: float = 0.0
    # the loss choice's own (learner.objectives.objective_stats)
    clipped_low: float = 0.0
    clipped_high: float = 0.0
    masked_tokens: float = 0.0
    rejected_samples: float = 0.0
    rejected_tokens: float = 0.0
    seq_samples: float = 0.0
    seq_ratio_sum: float = 0.0
    seq_ratio_min: float = math.inf
    seq_ratio_max: float = -math.inf
    distill_kl_sum: float = 0.0
    distill_tokens: float = 0.0
    replayed_tokens: float = 0.0  # tokens whose logprobs were renormalized over their recorded support

    def __add__(self, other: LossStats) -> LossStats:
        if not isinstance(other, LossStats):
            return NotImplemented
        values = {}
        for f in fields(self):  # *_min and *_max fields combine by min and max, the rest add
            a, b = getattr(self, f.name), getattr(other, f.name)
            values[f.name] = min(a, b) if f.name.endswith("_min") else max(a, b) if f.name.endswith("_max") else a + b
        return LossStats(**values)

    def finalize(self) -> dict[str, float]:
        """Means over the accumulated tokens. Keys:

        tokens; clip_fraction (share of tokens whose PPO clip was active); is_weight_mean/min/max
        (untruncated exp(logprobs - behaviour)); mismatch_kl_k1 / mismatch_kl_k3 (two estimates
        of KL(behaviour || current) from the behaviour's samples); entropy (when given). With the
        loss choice's sums (`learner.objectives.objective_stats`): clip_fraction_low/_high (the
        share of tokens clipped below / above the band), masked_tokens (IcePop), rejected_samples
        and rejected_tokens, seq_ratio_mean/min/max (each sample's geometric-mean ratio
        exp(mean_t log(pi / mu))), distill_kl (mean per-token log pi - log teacher); replayed_tokens
        (renormalized over their recorded sampling support, `learner.support`). Means over zero
        tokens are left out rather than reported as NaN.
        """
        out = {"tokens": self.tokens}
        if self.tokens > 0:
            out |= {
                "clip_fraction": self.clipped / self.tokens,
                "is_weight_mean": self.is_weight_sum / self.tokens,
                "is_weight_min": self.is_weight_min,
                "is_weight_max": self.is_weight_max,
                "mismatch_kl_k1": self.mismatch_k1_sum / self.tokens,
                "mismatch_kl_k3": self.mismatch_k3_sum / self.tokens,
                "replayed_tokens": self.replayed_tokens,
            }
        if self.entropy_tokens > 0:
            out["entropy"] = self.entropy_sum / self.entropy_tokens
        if self.seq_samples > 0:
            out |= {
                "clip_fraction_low": self.clipped_low / max(self.tokens, 1.0),
                "clip_fraction_high": self.clipped_high / max(self.tokens, 1.0),
                "masked_tokens": self.masked_tokens,
                "rejected_samples": self.rejected_samples,
                "rejected_tokens": self.rejected_tokens,
                "seq_ratio_mean": self.seq_ratio_sum / self.seq_samples,
                "seq_ratio_min": self.seq_ratio_min,
                "seq_ratio_max": self.seq_ratio_max,
            }
            if self.distill_tokens > 0:
                out["distill_kl"] = self.distill_kl_sum / self.distill_tokens
        return out


@torch.no_grad()
def loss_stats(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
               clipped: torch.Tensor, entropy: torch.Tensor | None = None) -> LossStats:
    """This micro-batch's training statistics over its trainable tokens, as addable sums.

    logprobs, behaviour_logprobs, mask, clipped (N,); entropy (N,) or None (from `entropy()`).
    Math in float64; the importance weight is the raw exp(logprobs - behaviour), not truncated.
    """
    _check_same_shape(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask, clipped=clipped)
    keep = mask != 0
    lp = logprobs.detach().double()[keep]
    behaviour = behaviour_logprobs.double()[keep]
    log_ratio = lp - behaviour
    weights = log_ratio.exp()
    tokens = int(keep.sum())
    stats = LossStats(
        tokens=float(tokens),
        clipped=float(clipped[keep].sum()),
        is_weight_sum=float(weights.sum()),
        is_weight_min=float(weights.min()) if tokens else math.inf,
        is_weight_max=float(weights.max()) if tokens else -math.inf,
        mismatch_k1_sum=float((-log_ratio).sum()),
        # k3 of KL(behaviour || current) on behaviour samples: r - log r - 1, r = current / behaviour
        mismatch_k3_sum=float(kl_k3(behaviour, lp).sum()),
    )
    if entropy is not None:
        _check_same_shape(logprobs=logprobs, entropy=entropy)
        stats = replace(stats, entropy_sum=float(entropy.double()[keep].sum()), entropy_tokens=float(tokens))
    return stats
