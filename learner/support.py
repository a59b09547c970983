"""Sampling-support replay: the learner's logprobs over the support each token was drawn from.

A call with top_p < 1, top_k > 0 or min_p > 0 samples from a truncated distribution: the
sampler keeps a set S of token ids, renormalizes over it, and records the sampled token's
logprob under that renormalized distribution. The learner's log-softmax over the whole
vocabulary is smaller by log(mass of S), for every token, so the importance ratio
pi / mu is biased below 1 (and the KL estimates above 0) even with identical weights. The
store keeps each sampled token's S (the `support_sizes` / `support_ids` columns); here the
learner renormalizes over the same S:

    log pi_S(t) = x_t - logsumexp_{i in S} x_i        (x: the logits / temperature)

which is exactly what the sampler computed when the weights are the same. A set stored by its
size m alone (above SUPPORT_IDS_CAP ids) is the learner's own m most likely tokens. A token of
a truncated call that carries no support at all (a server that cannot return it, such as
vLLM's CPU build) gets its set rebuilt from the learner's logits by the sampler's rule
(`truncated_sizes`: top-k, ties kept, then top-p). Both are exact whenever the learner ranks
the boundary tokens as the sampler did (same weights in float32: always, measured in
tests/cli/test_sampling_replay.py). Tokens of untruncated calls keep the full-vocabulary
log-softmax.

The support arrives sparse: `rows (M,)` (which of the K trainable positions) and `ids (M,)`
(a kept token id), so memory is O(M), never a dense (K, V) mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.losses import entropy as full_entropy
from trajstore.events import SUPPORT_IDS_CAP


@dataclass(frozen=True)
class Support:
    """The recorded supports of K trainable positions: stored sets as (rows (M,), ids (M,)) pairs, and the
    sets above SUPPORT_IDS_CAP ids as (top_rows (R,), top_sizes (R,)): "the m most likely tokens"."""

    rows: torch.Tensor
    ids: torch.Tensor
    top_rows: torch.Tensor
    top_sizes: torch.Tensor

    @classmethod
    def none(cls, device: torch.device) -> Support:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(empty, empty, empty, empty)

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0 and self.top_rows.numel() == 0

    def rebuilt(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> Support:
        """This support plus, for each truncated position (top_k > 0 or top_p < 1) without a recorded one, the set
        the sampler's rule keeps under these logits (K, V), as "the m most likely tokens"."""
        missing = (top_k > 0) | (top_p < 1.0)
        missing[self.rows] = False
        missing[self.top_rows] = False
        rows = missing.nonzero().squeeze(1)
        if not rows.numel():
            return self
        sizes = truncated_sizes(logits[rows], top_k[rows], top_p[rows])
        return Support(self.rows, self.ids, torch.cat([self.top_rows, rows]), torch.cat([self.top_sizes, sizes]))

    def positions(self) -> int:
        """How many of the K positions have a recorded support."""
        return int(torch.unique(torch.cat([self.rows, self.top_rows])).numel())


@torch.no_grad()
def truncated_sizes(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(R,) how many tokens each row (R, V) of (temperature-scaled) logits keeps under its top_k (0: off; ties at
    the k-th value kept) and then its top_p (the most likely tokens until their mass reaches p: a token stays when
    the mass of the tokens before it is below p), as vLLM's sampler and the embedded server truncate."""
    vocab = logits.shape[-1]
    ordered = logits.float().sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    in_k = ordered >= ordered.gather(1, (k - 1)[:, None])
    probs = torch.where(in_k, ordered, torch.full_like(ordered, float("-inf"))).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    in_p = (before < top_p.to(probs.dtype)[:, None]) | (top_p >= 1.0)[:, None]  # 1: off, even where mass rounds to 1
    return (in_k & in_p).sum(dim=-1)


def kept_positions(sizes: torch.Tensor | None, ids: torch.Tensor | None, keep: torch.Tensor) -> Support:
    """The supports of the trainable positions `keep` (K,) (ascending indexes into the micro-batch's positions).

    sizes (P,) int64: each position's kept-set size m (0: none recorded); ids: the stored sets (those of
    m <= SUPPORT_IDS_CAP) in position order.
    """
    if sizes is None or ids is None:
        return Support.none(keep.device)
    stored = torch.where(sizes <= SUPPORT_IDS_CAP, sizes, torch.zeros_like(sizes))
    index = torch.full((sizes.numel(),), -1, dtype=torch.long, device=sizes.device)
    index[keep] = torch.arange(keep.numel(), device=sizes.device)
    rows = index[torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), stored)]
    chosen = rows >= 0
    at_keep = sizes[keep]
    top_rows = (at_keep > SUPPORT_IDS_CAP).nonzero().squeeze(1)
    return Support(rows[chosen], ids[chosen].long(), top_rows, at_keep[top_rows])


def _support_lse(logits: torch.Tensor, support: Support,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(has (K,) bool, lse (K,): logsumexp over each row's support, expected (K,): E_q[x] under the
    renormalized distribution q (for the entropy), in `dtype`."""
    k, vocab = logits.shape
    has = torch.zeros(k, dtype=torch.bool, device=logits.device)
    has[support.rows] = True
    has[support.top_rows] = True
    rows = support.rows
    g = logits[rows, support.ids].to(dtype)
    peak = torch.full((k,), float("-inf"), dtype=dtype, device=logits.device)
    peak = peak.scatter_reduce(0, rows, g.detach(), reduce="amax", include_self=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    mass = torch.zeros(k, dtype=dtype, device=logits.device).index_add(0, rows, (g - peak[rows]).exp())
    # mass >= 1 where a row has stored ids (its peak contributes exp(0)); 1 elsewhere keeps log finite, NaN-free
    lse = peak + torch.where(mass > 0, mass, torch.ones_like(mass)).log()
    with torch.no_grad():
        expected = torch.zeros_like(lse).index_add(0, rows, (g - lse[rows]).exp() * g)
    if support.top_rows.numel():  # the m most likely tokens: the learner's own top m of the row
        ordered = logits[support.top_rows].to(dtype).sort(dim=-1, descending=True).values
        inside = torch.arange(vocab, device=logits.device)[None, :] < support.top_sizes[:, None]
        top = torch.where(inside, ordered, torch.full_like(ordered, float("-inf")))
        top_lse = top.logsumexp(dim=-1)
        lse = lse.scatter(0, support.top_rows, top_lse)
        with torch.no_grad():
            q = (top - top_lse[:, None]).exp()
            top_expected = torch.where(inside, q * ordered, torch.zeros_like(ordered)).sum(dim=-1)
            expected = expected.scatter(0, support.top_rows, top_expected)
    return has, lse, expected


def replay_logprobs(logits: torch.Tensor, targets: torch.Tensor, full_logprobs: torch.Tensor,
                    support: Support) -> torch.Tensor:
    """Each target's logprob renormalized over its recorded support; `full_logprobs` where none was recorded.

    logits (K, V) (already divided by the temperature); targets (K,); full_logprobs (K,) from
    `learner.losses.token_logprobs`. Differentiable in logits.
    """
    if support.empty:
        return full_logprobs
    has, lse, _ = _support_lse(logits, support, full_logprobs.dtype)
    target = logits.gather(1, targets[:, None]).squeeze(1).to(full_logprobs.dtype)
    return torch.where(has, target - lse, full_logprobs)


@torch.no_grad()
def replay_entropy(logits: torch.Tensor, support: Support) -> torch.Tensor:
    """Entropy of each position's sampling distribution: over its recorded support where there is one,
    H = lse_S - E_q[x]. Returns (K,), detached."""
    out = full_entropy(logits)
    if support.empty:
        return out
    has, lse, expected = _support_lse(logits, support, out.dtype)
    return torch.where(has, lse - expected, out)
