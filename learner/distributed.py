"""The learner on several processes (torchrun): FSDP2 sharding, one store reader, ranks in step, gathered checkpoints.

Under torchrun (WORLD_SIZE > 1) `learner.train` runs the same loop on every rank; this module
holds everything that differs from one process, so that the loop reads the same either way:

- `start()`: the process group (NCCL on GPUs, gloo on CPUs), from torchrun's environment.
- `shard(model)`: PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) on every decoder
  layer (the classes a transformers model lists in `_no_split_modules`), then on the whole
  model. Parameters, gradients and AdamW's state are split across ranks; a layer's full
  weights exist only while it runs. In one process the model is just moved to its device.
- `broadcast(value)`: rank 0 alone reads the store (and alone writes events and checkpoints);
  every shard it reads is broadcast, so all ranks train on the same data.
- `micro_batches(batches)`: rank r takes micro-batches r, r + world, ... FSDP2 gathers
  parameters in every forward and reduces gradients in every backward, collectives all ranks
  must join, so a rank with fewer micro-batches this step runs padding passes (its first
  micro-batch again, with its gradient scaled by 0) until every rank has run as many passes
  as the busiest. FSDP2 averages gradients over ranks; the step's loss is normalized over the
  whole step already (`learner.train`), so real passes scale their loss by the world size and
  the ranks' gradients add up to the step's gradient. (`set_gradient_divide_factor(1)` would
  say this directly, but it reduces with PREMUL_SUM, which gloo does not have.)
- `gather_state(model, optimizer)`: the full weights and the full, name-keyed AdamW state,
  gathered to rank 0 (CPU) for a checkpoint, which is therefore the same Hugging Face
  directory whatever the number of ranks; `load_optimizer_state` puts a saved one back, split
  over the ranks that resume (any number of them, one included).
- `memory()`: per-rank training-state bytes and peak RSS, the numbers that show the sharding.

Limits: every rank loads the full initial (or resumed) model on its CPU before sharding it
(a model must fit one host's memory, not one GPU's); LoRA under torchrun is refused (its
adapters are small: run one learner process); tested here on CPU with gloo and 2 processes
on one host, not on GPUs or several hosts.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

T = TypeVar("T")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class Ranks:
    """This process's place: `world` processes, this one `rank` (`local_rank` on its host)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: reads the store, writes events and checkpoints."""
        return self.rank == 0


@dataclass(frozen=True)
class GatheredState:
    """A checkpoint's content gathered to rank 0: full weights and the name-keyed optimizer state."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def start() -> Ranks:
    """Join torchrun's process group when there is one (WORLD_SIZE > 1); one process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    ranks = Ranks(world, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")))
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return ranks


def stop(ranks: Ranks) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def shard(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> torch.nn.Module:
    """FSDP2 over the decoder layers and the whole model (see the module docstring); one process: `.to(device)`."""
    if ranks.world == 1:
        return model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (ranks.world,))
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder layer classes (`_no_split_modules`) to shard "
                         "one by one; FSDP2 would gather the whole model at once")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def broadcast(value: T, ranks: Ranks) -> T:
    """Rank 0's `value` on every rank."""
    if ranks.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def micro_batches(batches: Sequence[T], ranks: Ranks) -> Iterator[tuple[T, float]]:
    """This rank's micro-batches with the factor on its loss: the world size for its own ones, 0 for
    padding passes, until every rank has run as many passes as the busiest one (module docstring)."""
    mine = list(batches[ranks.rank::ranks.world])
    passes = -(-len(batches) // ranks.world)  # rank 0 always has the most
    for i in range(passes):
        if i < len(mine):
            yield mine[i], float(ranks.world)
        else:
            yield batches[0], 0.0


def all_ranks(values: T, ranks: Ranks) -> list[T]:
    """Every rank's `values` (any picklable), in rank order; one process: `[values]`."""
    if ranks.world == 1:
        return [values]
    parts: list[Any] = [None] * ranks.world
    dist.all_gather_object(parts, values)
    return parts


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the gradient's global norm (sharded gradients included) to `max_norm`; returns the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
    return float(full() if full is not None else norm)


def gather_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> GatheredState | None:
    """The full state for a checkpoint, on rank 0 (a collective: every rank calls it). None in one process:
    the model saves itself, and `optimizer_state` gives the optimizer's."""
    if ranks.world == 1:
        return None
    return GatheredState(get_model_state_dict(model, options=_FULL), get_optimizer_state_dict(model, optimizer,
                                                                                             options=_FULL))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name: what a checkpoint stores, whatever the number of ranks."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a saved (full, name-keyed) optimizer state back; under FSDP2 each rank keeps its shard of it."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict[str, float]:
    """The largest per-rank training state (parameters, gradients, AdamW moments held by a rank) and peak
    resident memory, in MiB; the first is exact, the second includes the Python runtime and libraries."""

    def local_bytes(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    held = sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
    held += sum(local_bytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    per_rank = all_ranks((held, rss), ranks)
    return {"state_mb_per_rank": max(h for h, _ in per_rank) / 2**20,
            "rss_peak_mb_per_rank": max(r for _, r in per_rank) / 2**20}
