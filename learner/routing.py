"""Rollout routing replay ("R3") for mixture-of-experts policies: the learner's forward pass takes the
experts the sampler took.

A MoE policy's logprob of a token depends on which experts its router picked, at every layer, for
every position before it. The policy server and the learner compute the router's top-k on
hidden states that differ a little (other kernels, batching, precision; or weights updated since
sampling), and where two experts are nearly tied they pick different ones: the learner then
computes the logprob of a different network than the one that sampled, and the importance ratio
mixes that in with the weights' change. Replaying the stored routes removes that part: under
`replayed(model, routes)` each router returns the recorded experts of each position, with their
weights recomputed from the learner's own router logits (softmax, gathered at the replayed
experts, renormalized when the router renormalizes), so the router still gets a gradient
through the weights of the experts that were used, as in rollout routing replay.

`routes` is (positions, layers, top_k) over the forward's flattened (B*T) input positions
(`learner.batching` builds it: a sample's stored row i+1 is the route of its input position i,
see `trajstore.routes`). A position whose row holds -1 (nothing recorded: a sample's first token,
a sample without routes, padding) keeps the learner's own choice. Prompt tokens are replayed too:
their routes shaped the keys and values every sampled token attended to.

Routers are transformers' MoE router modules that return `(router_logits, routing_weights,
expert_indices)` (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`, ...), in layer order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from learner.batching import MicroBatch
from learner.errors import LearnerError


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules in layer order; empty for a dense model."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def _forced(layer: int, routes: torch.Tensor, module: torch.nn.Module, args: Any, output: Any) -> Any:
    logits, _, own = output
    forced = routes[:, layer].to(device=own.device, dtype=own.dtype)  # (N, top_k)
    keep_own = (forced < 0).any(dim=-1, keepdim=True)
    chosen = torch.where(keep_own, own, forced)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
    if getattr(module, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), chosen


@contextmanager
def replayed(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Inside, every forward of `model` routes position n through the experts `routes[n]` (see the module doc).

    A no-op for `routes` None. Raises LearnerError when the routes do not fit the model (another
    layer count or top-k: the samples were collected with another model)."""
    if routes is None:
        yield
        return
    found = moe_routers(model)
    top_k = int(getattr(found[0], "top_k", -1)) if found else -1
    if len(found) != routes.shape[1] or top_k != routes.shape[2]:
        raise LearnerError(f"the samples carry expert routes of {routes.shape[1]} layers x top-{routes.shape[2]}, "
                           f"but the model has {len(found)} MoE layers (top-{top_k}): they were collected with "
                           "another model; train them with the model that sampled them (--model)")
    handles = [r.register_forward_hook(functools.partial(_forced, layer, routes)) for layer, r in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def replayed_share(batches: Iterable[MicroBatch]) -> float | None:
    """The share of the batches' trainable targets predicted at a position with recorded routes (every layer):
    what replay covers. None when no micro-batch carries routes (a dense model, a store without them)."""
    covered = total = 0
    for mb in batches:
        if mb.routes is None:
            continue
        known = (mb.routes >= 0).flatten(1).all(dim=1)  # (positions,)
        covered += int((known & mb.mask).sum())
        total += int(mb.mask.sum())
    return covered / total if total else None
