"""Which experts each token went through, recorded by the embedded engine (mixture-of-experts models).

transformers' MoE models route with a router module of their own (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter`, ...) whose forward returns `(router_logits, routing_weights, expert_indices)`,
indices `(tokens, top_k)`. `RouteRecorder` hooks every router of a model, in layer order, and after
each forward pass hands each batch row the indices of its real (unpadded) positions as
`(tokens, layers, top_k)` int16. The engine appends them to the row's sequence: the prompt's at
prefill, then one row per decode step (the token fed in that step). A completion's routes are
therefore vLLM's `routed_experts` layout: one row per token of prompt + output as the model's
input, `prompt + output - 1` rows (the last sampled token is never fed). Dense models have no
routers and get no recorder: nothing is recorded or returned.

The wire carries them as vLLM does (`encode`: base64 of the `.npy` bytes of the array).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


class RouteRecorder:
    """Forward hooks on a model's routers that keep the expert indices of the last forward pass."""

    def __init__(self, found: Sequence[torch.nn.Module]) -> None:
        self._taken: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in found]

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RouteRecorder | None:
        found = routers(model)
        return cls(found) if found else None

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._taken.append(output[2])  # (tokens, top_k): the chosen experts

    def begin(self) -> None:
        """Forget what a failed forward may have left."""
        self._taken.clear()

    def take(self, mask: torch.Tensor) -> list[np.ndarray]:
        """Per batch row, the routes of its real positions (`mask` (B, T) nonzero) as (tokens, layers, top_k)."""
        b, t = mask.shape
        taken, self._taken = self._taken, []
        routes = torch.stack(taken).view(len(taken), b, t, -1).permute(1, 2, 0, 3)  # (B, T, layers, top_k)
        routes = routes.to(device="cpu", dtype=torch.int16).numpy()
        keep = mask.bool().cpu().numpy()
        return [routes[r][keep[r]] for r in range(b)]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def joined(parts: list[np.ndarray]) -> np.ndarray | None:
    """A sequence's recorded routes as one (tokens, layers, top_k) array; None when nothing was recorded."""
    return np.concatenate(parts) if parts else None


def encode(routes: np.ndarray) -> str:
    """vLLM's wire form of `routed_experts`: base64 of the array's `.npy` bytes."""
    with io.BytesIO() as buffer:
        np.save(buffer, routes, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")
