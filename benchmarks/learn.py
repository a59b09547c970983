"""Learner step throughput: packed micro-batches against padding to the longest sample, and MFU on a GPU.

One shard, cut by the store from a generated agent run, trained on three ways with the same
model weights and the same token budget per micro-batch:

- padded           `learner.batching.pad_batches`: rows in shard order, each batch padded to
                   its longest sample (B * L <= budget), the LM head on every position, as
                   `learner.train.forward_logits` runs a padded batch: the usual baseline;
- padded, head K   the same batches, the LM head only on the K trainable positions: a
                   stronger baseline, so the ratio against it is what removing padding alone
                   saves (off with --no-head-baseline);
- packed           `learner.batching.pack`: first-fit-decreasing into rows of at most
                   `budget` positions, position ids restarting per sample, what the learner runs.

A timed step is one full learner step over every sample of the shard, as `learner.train.learn`
runs it: step totals, micro-batches, then per micro-batch forward (bf16 autocast on CUDA,
float32 on CPU), `token_logprobs`, the PPO-clip loss and the step's aggregation, backward,
loss statistics and entropy; then gradient clipping and one AdamW step. Before each timed
step the weights are restored and the optimizer is new (not timed), so every step of every
method starts from the same model: their losses and gradient norms must agree, and the
table prints how closely (float32 on CPU: ~1e-7; the proof the comparison is apples to
apples). Rows run round robin, so a busy moment of the machine hits every row alike; the
median step counts (CPU: no warm-up step, the median drops the first one's start-up).

The shard: `--groups` groups of 8 rollouts written into a temporary store as Turn, Reward
and Status events, then `store.shard(...)`, so the samples table is exactly what the learner
trains on. Sample lengths are long-tailed like agent traces: each rollout's main session is
lognormal (median `--median-len`, sigma 0.9) clipped to [`--min-len`, `--max-len`], 1-5
turns (a whole first prompt, then tool responses as prompt deltas, the sampled outputs
trainable); one rollout in five also runs a sub-agent (its own session, so a second
sample). Token ids are random; behaviour logprobs are -ln(vocab) plus noise, which is what
a random-init model assigns, so importance ratios start near 1 as in a real run.

Tokens/s counts real tokens (every sample's full length: context and trainable) over the
step time; "positions" counts the input positions the model computed, padding included.
"attn work" is what packing costs in attention: transformers hands sdpa a dense
block-diagonal mask for a packed row, and the kernel scores every query-key pair of the row
(width^2) where the samples need only the sum of their n^2; the column is that quotient
(padding has its own, smaller, waste). `--attn flex_attention` (a block mask that skips the
cross-sample blocks; compiled on first use, so give it a warm-up step) measures the way out.

--mfu: a 0.5B Qwen2-shaped model (Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151,936, tied embeddings), random init, float32 weights and AdamW
state with bf16 autocast (what learner/train.py does on CUDA), packed micro-batches of 16k
tokens, 1 warm-up step then 5 timed. The model is built from a Qwen2Config directly: the
benchmark trains on token ids, and `init_model`'s generated tokenizer cannot reach 151,936
entries. Model FLOPs of a step (PaLM, Chowdhery et al. 2022, appendix B):
6 * N_body * positions + 6 * vocab * hidden * trainable positions (the learner asks the LM
head for those only) + 12 * layers * hidden * sum over samples of n^2 (attention, each
sample's own context n, not the packed row's). MFU = model FLOPs / step time / peak; the
peak of an H100 or H200 (SXM) is 989 TFLOP/s dense bf16 (NVIDIA's datasheets list 1,979
"with sparsity"); other devices need --peak-tflops.

    python benchmarks/learn.py                          # CPU, 4M-parameter Qwen2: ~2 min on 2 idle cores
    python benchmarks/learn.py --quick                  # ~40 s
    python benchmarks/learn.py --device cuda --mfu      # 0.5B Qwen2 shape on the GPU, MFU against 989 TFLOP/s
    python benchmarks/learn.py --mfu --dry-run          # the 0.5B plan (shard, micro-batches, FLOPs) without training
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the Hub

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import trajstore  # noqa: E402
from collectors.model.build import ModelSize, init_model  # noqa: E402
from learner.batching import MicroBatch, StepTotals, pack, pad_batches, step_totals  # noqa: E402
from learner.losses import LossStats, entropy, loss_stats, token_logprobs  # noqa: E402
from learner.objectives import LOSSES, LossInputs  # noqa: E402
from learner.settings import LearnSettings  # noqa: E402
from learner.train import AGGREGATIONS, forward_logits, load_policy  # noqa: E402
from trajstore import Reward, Status, Turn  # noqa: E402

RUN = "bench-learn"
GROUP_SIZE = 8
SIGMA = 0.9  # lognormal spread of a main session's length: p90/p50 ~ 3.2, a long tail of long traces
SUBAGENT_SHARE = 0.2
EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
# Qwen2.5-0.5B's shape (its config.json on the Hub), random init here
QWEN25_05B = ModelSize(vocab_size=151_936, hidden_size=896, layers=24, heads=14, kv_heads=2,
                       intermediate_size=4864, max_positions=32_768)
PEAK_BF16_DENSE = {"H200": 989e12, "H100": 989e12}  # NVIDIA datasheets (SXM): 1,979 TFLOP/s with sparsity
PEAK_SOURCE = "NVIDIA H100/H200 SXM datasheet, bf16 tensor core dense (1,979 TFLOP/s listed with sparsity)"


# ---------------------------------------------------------------- the shard


@dataclass(frozen=True)
class ShardShape:
    """The generated run: `groups` groups of GROUP_SIZE rollouts with long-tailed lengths."""

    groups: int = 2
    median_len: int = 320
    min_len: int = 64
    max_len: int = 2048
    vocab: int = 4096
    seed: int = 0

    def problems(self) -> list[str]:
        out = [f"{k} must be >= 1 (got {v})" for k, v in asdict(self).items() if k != "seed" and v < 1]
        if self.min_len < 16:
            out.append(f"min_len must be >= 16 tokens to hold a prompt and an output (got {self.min_len})")
        if not self.min_len <= self.median_len <= self.max_len:
            out.append(f"need min_len <= median_len <= max_len (got {self.min_len}, {self.median_len}, "
                       f"{self.max_len})")
        return out


def _split(rng: np.random.Generator, total: int, parts: int, minimum: int) -> list[int]:
    """`total` split into `parts` positive sizes of at least `minimum` each, at random."""
    spare = total - parts * minimum
    cuts = np.sort(rng.integers(0, spare + 1, parts - 1)) if parts > 1 else np.array([], dtype=np.int64)
    sizes = np.diff(np.concatenate([[0], cuts, [spare]])) + minimum
    return [int(s) for s in sizes]


def _session(rng: np.random.Generator, shape: ShardShape, length: int, rollout: str, segment: str, session: str,
             t0: datetime) -> list[Turn]:
    """One session of `length` tokens: a whole first prompt, then (tool response, output) turns."""
    turns = int(min(rng.integers(1, 6), max(1, length // 32)))
    first_prompt = int(np.clip(rng.lognormal(math.log(120), 0.5), 8, length // 2))
    # outputs take ~60% of what follows the first prompt, tool responses the rest
    outputs = _split(rng, max(turns * 4, int((length - first_prompt) * 0.6)), turns, 4)
    deltas = [first_prompt] + _split(rng, max(0, length - first_prompt - sum(outputs)), turns - 1, 0)[:turns - 1]
    deltas[-1] += length - sum(deltas) - sum(outputs)  # rounding: the sample is exactly `length` long
    events = []
    for k, (p, o) in enumerate(zip(deltas, outputs, strict=True)):
        # a random-init model is near uniform, so its behaviour logprob of any token is ~ -ln(vocab)
        behaviour = np.minimum(-math.log(shape.vocab) + rng.normal(0.0, 0.05, o), 0.0).astype(np.float32)
        events.append(Turn(
            run=RUN, group_id=rollout.rsplit("-r", 1)[0], rollout_id=rollout, segment_id=segment, session_id=session,
            turn_index=k, policy_version=0, prompt_ids=rng.integers(0, shape.vocab, p, dtype=np.int32),
            output_ids=rng.integers(0, shape.vocab, o, dtype=np.int32), output_logprobs=behaviour,
            finish_reason="stop" if k == turns - 1 else "tool_calls", time=t0 + timedelta(milliseconds=k),
            event_id=f"{segment}-t{k}"))
    return events


def write_run(store_path: Path, shape: ShardShape) -> None:
    """The generated run's events, appended to the store at `store_path` in one durable call."""
    rng = np.random.default_rng(shape.seed)
    events: list[Turn | Reward | Status] = []
    for g in range(shape.groups):
        group_id = f"{RUN}-g{g:04d}"
        skill = rng.random()
        for k in range(GROUP_SIZE):
            rollout = f"{group_id}-r{k}"
            t0 = EPOCH + timedelta(seconds=10 * g, milliseconds=100 * k)
            length = int(np.clip(rng.lognormal(math.log(shape.median_len), SIGMA), shape.min_len, shape.max_len))
            events += _session(rng, shape, length, rollout, f"{rollout}-s0", "main", t0)
            if rng.random() < SUBAGENT_SHARE:
                sub = int(np.clip(rng.lognormal(math.log(shape.median_len / 2), SIGMA), shape.min_len, shape.max_len))
                events += _session(rng, shape, sub, rollout, f"{rollout}-s1", "subagent",
                                   t0 + timedelta(milliseconds=50))
            # a correctness component plus a small format one: rewards differ within every group
            events.append(Reward(run=RUN, group_id=group_id, rollout_id=rollout, reward_name="correct",
                                 reward=float(rng.random() < skill), time=t0 + timedelta(seconds=1),
                                 event_id=f"{rollout}-correct"))
            events.append(Reward(run=RUN, group_id=group_id, rollout_id=rollout, reward_name="format",
                                 reward=float(rng.uniform(0.0, 0.2)), time=t0 + timedelta(seconds=1),
                                 event_id=f"{rollout}-format"))
            events.append(Status(run=RUN, group_id=group_id, rollout_id=rollout, status="completed",
                                 group_size=GROUP_SIZE, time=t0 + timedelta(seconds=2), event_id=f"{rollout}-status"))
    store = trajstore.open_store(store_path)
    with store.writer("bench-collector") as w:
        w.append(events)


def make_samples(store_path: Path, shape: ShardShape) -> pa.Table:
    """The generated run as the learner sees it: every group, through `store.shard`."""
    write_run(store_path, shape)
    shard = trajstore.open_store(store_path, create=False).shard(
        policy_version=0, max_staleness=0, max_rollouts=1 << 40, estimator="grpo", run=RUN)
    if len(shard.group_ids) != shape.groups:
        raise RuntimeError(f"the store cut a shard of {len(shard.group_ids)} groups from the {shape.groups} "
                           "complete groups written; the generated run and the shard planner disagree")
    return shard.samples


# ---------------------------------------------------------------- one learner step


Forward = Callable[[torch.nn.Module, MicroBatch, float], torch.Tensor]
Batcher = Callable[[pa.Table, int], list[MicroBatch]]


def forward_head_on_trainable(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """`forward_logits` for a padded batch, but the LM head runs on the K trainable positions only (K, V)."""
    keep = mb.mask.nonzero().squeeze(1)
    hidden = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids,  # type: ignore[operator]
                         attention_mask=mb.attention_mask, use_cache=False).last_hidden_state
    return model.lm_head(hidden.flatten(0, 1)[keep]) / temperature  # type: ignore[operator]


@dataclass(frozen=True)
class Method:
    name: str
    batcher: Batcher
    forward: Forward


@dataclass(frozen=True)
class StepResult:
    seconds: float
    loss: float
    grad_norm: float
    micro_batches: int
    positions: int  # input positions computed, padding included


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: torch.nn.Module, samples: pa.Table, method: Method, s: LearnSettings, budget: int,
               device: torch.device, autocast: AbstractContextManager[object]) -> StepResult:
    """One optimizer step over every sample, as `learner.train.learn` runs it (kl_coef 0, one process)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sync(device)
    started = time.perf_counter()
    totals: StepTotals = step_totals(samples)
    batches = method.batcher(samples, budget)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    stats = LossStats()
    for mb in batches:
        mb = mb.to(device)
        keep = mb.mask.nonzero().squeeze(1)
        behaviour, advantages, seq = mb.behaviour_logprobs[keep], mb.advantages[keep], mb.seq[keep]
        with autocast:
            logits = method.forward(model, mb, s.temperature or 1.0)  # the generated shard samples at 1
        logprobs = token_logprobs(logits, mb.targets[keep])
        out = LOSSES[s.loss](LossInputs(logprobs, behaviour, advantages, seq, samples=int(mb.seq_weight.shape[0])), s)
        loss = AGGREGATIONS[s.aggregation](out.loss, seq, mb.seq_weight, totals, s)
        loss.backward()
        loss_sum += loss.item()
        stats = stats + loss_stats(logprobs, behaviour, torch.ones_like(keep, dtype=torch.bool),
                                   out.clipped_low | out.clipped_high, entropy(logits))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
    optimizer.step()
    sync(device)
    seconds = time.perf_counter() - started
    return StepResult(seconds, loss_sum, float(grad_norm), len(batches), sum(mb.num_positions for mb in batches))


# ---------------------------------------------------------------- model FLOPs


@dataclass(frozen=True)
class ShardStats:
    samples: int
    tokens: int  # every sample's full length
    positions: int  # input positions: length - 1 per sample
    trainable: int  # positions whose target is a sampled token
    squares: int  # sum over samples of positions^2 (attention)
    lengths: np.ndarray


def shard_stats(samples: pa.Table, packed: list[MicroBatch]) -> ShardStats:
    """What a step trains on: the samples both batchers keep (those with a trainable target)."""
    rows = sorted(r for mb in packed for r in mb.rows)
    lengths = samples.column("num_tokens").to_numpy()[rows].astype(np.int64)
    positions = lengths - 1
    return ShardStats(samples=len(rows), tokens=int(lengths.sum()), positions=int(positions.sum()),
                      trainable=sum(mb.num_trainable for mb in packed), squares=int((positions ** 2).sum()),
                      lengths=lengths)


def attention_cells(batches: list[MicroBatch]) -> int:
    """Query-key pairs a dense-mask attention kernel scores: each row's width squared (causality aside)."""
    return sum(mb.input_ids.shape[0] * mb.input_ids.shape[1] ** 2 for mb in batches)


def model_flops(model: torch.nn.Module, stats: ShardStats) -> tuple[float, int]:
    """Model FLOPs of one step over the shard (PaLM appendix B, see the module doc) and N_body.

    N_body: every parameter but the embedding matrix, which is a lookup on input and, tied, the
    LM head on output, counted apart on the trainable positions only.
    """
    config = model.config
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    embedding = model.get_input_embeddings().weight.numel()
    n_body = sum(p.numel() for p in model.parameters()) - embedding
    if not config.tie_word_embeddings:
        n_body -= model.get_output_embeddings().weight.numel()
    flops = 6 * n_body * stats.positions + 6 * vocab * h * stats.trainable + 12 * layers * h * stats.squares
    return float(flops), n_body


# ---------------------------------------------------------------- the run


def build_model(args: argparse.Namespace, size: ModelSize, tmp: Path, settings_of: Callable[[Path], LearnSettings],
                device: torch.device) -> tuple[torch.nn.Module, LearnSettings, str]:
    """The policy, its settings and how it was built. --mfu: from a Qwen2Config on the device (see module doc)."""
    if not args.mfu:
        model_dir = tmp / "model"
        init_model(model_dir, size, seed=args.seed)
        s = settings_of(model_dir)
        return load_policy(s, None).to(device).eval(), s, "init_model (collectors.model.build), float32 weights"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=size.vocab_size, hidden_size=size.hidden_size,
                         intermediate_size=size.intermediate_size,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, max_position_embeddings=size.max_positions,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(args.seed)
    with torch.device("meta" if args.dry_run else device):
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    return model, settings_of(tmp / "model"), "Qwen2Config, random init, float32 weights"


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "given by --peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16_DENSE.items():
            if key in name:
                return peak, PEAK_SOURCE
    return None, "unknown for this device; pass --peak-tflops"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch intra-op threads (default: all cores)")
    ap.add_argument("--mfu", action="store_true",
                    help="0.5B Qwen2 shape, bf16 autocast, 16k-token micro-batches, 32 groups; report MFU")
    ap.add_argument("--dry-run", action="store_true",
                    help="build the shard, micro-batches and FLOPs plan (the model on the meta device); train nothing")
    ap.add_argument("--hidden", type=int, help="model hidden size (default 256; 896 with --mfu)")
    ap.add_argument("--layers", type=int, help="model layers (default 4; 24 with --mfu)")
    ap.add_argument("--heads", type=int, help="attention heads (default 4; 14 with --mfu)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads (default 2)")
    ap.add_argument("--intermediate", type=int, help="MLP size (default 3 x hidden; 4864 with --mfu)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default 4096; 151936 with --mfu)")
    ap.add_argument("--groups", type=int,
                    help=f"groups of {GROUP_SIZE} rollouts in the shard (default 2; 32 with --mfu)")
    ap.add_argument("--median-len", type=int, default=ShardShape.median_len, help="median main-session length")
    ap.add_argument("--min-len", type=int, default=ShardShape.min_len, help="shortest sample (default 64)")
    ap.add_argument("--max-len", type=int, default=ShardShape.max_len, help="longest sample (default 2048)")
    ap.add_argument("--budget", type=int, help="input positions per micro-batch (default 4096; 16384 with --mfu)")
    ap.add_argument("--aggregation", default="token_mean", choices=sorted(AGGREGATIONS),
                    help="the learner's loss aggregation (default token_mean, the learner's)")
    ap.add_argument("--repeats", type=int, help="timed steps per method; the median counts (default 3; 5 with --mfu)")
    ap.add_argument("--warmup", type=int, help="untimed steps per method first (default 0 on CPU, 1 on CUDA)")
    ap.add_argument("--no-head-baseline", action="store_true", help="leave out the 'padded, head K' row")
    ap.add_argument("--attn", help="attention implementation (default: transformers' default, sdpa, what the "
                    "learner loads; e.g. flex_attention, whose block mask skips a packed row's cross-sample blocks)")
    ap.add_argument("--peak-tflops", type=float, help="the device's peak dense bf16 TFLOP/s, for MFU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 group, 2 repeats, no 'padded, head K' row")
    args = ap.parse_args(argv)
    big = args.mfu
    defaults = dict(hidden=896 if big else 256, layers=24 if big else 4, heads=14 if big else 4, kv_heads=2,
                    vocab=151_936 if big else 4096, groups=32 if big else 2, budget=16_384 if big else 4096,
                    repeats=5 if big else 3, warmup=1 if args.device.startswith("cuda") else 0)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.intermediate is None:
        args.intermediate = 4864 if big and args.hidden == 896 else 3 * args.hidden
    if args.quick:
        args.groups, args.repeats, args.no_head_baseline = 1, 2, True
    return args


def check(args: argparse.Namespace, size: ModelSize, shape: ShardShape, device: torch.device) -> None:
    """Every problem with the options at once, before any work."""
    problems = size.problems() + shape.problems()
    problems += [f"--{k} must be >= 1 (got {v})" for k, v in (("budget", args.budget), ("repeats", args.repeats),
                                                                ("threads", args.threads)) if v < 1]
    if args.warmup < 0:
        problems.append(f"--warmup must be >= 0 (got {args.warmup})")
    if device.type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        problems.append("--device cuda but torch sees no GPU; use --device cpu, or --dry-run for the plan alone")
    if problems:
        raise SystemExit("benchmarks/learn.py: fix these options and run again:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def plan_columns(batches: list[MicroBatch], stats: ShardStats) -> str:
    positions = sum(mb.num_positions for mb in batches)
    return (f"{len(batches):>13} {positions:>10,} {1 - stats.positions / positions:>7.1%} "
            f"{attention_cells(batches) / stats.squares:>8.2f}x")


PLAN_HEADER = f"{'method':<16} {'micro-batches':>13} {'positions':>10} {'padding':>8} {'attn work':>9}"
FLOPS_NOTE = ("model FLOPs count real tokens only (PaLM appendix B: 6 N_body per position, 6 V h per trainable "
              "position, 12 L h n per position of an n-position sample); 'attn work': query-key pairs a dense-mask "
              "kernel (sdpa) scores, over the sum of n^2 the samples need")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the benchmark and print its table; returns the headline numbers (for the smoke test)."""
    args = parse(argv)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = ModelSize(vocab_size=args.vocab, hidden_size=args.hidden, layers=args.layers, heads=args.heads,
                     kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                     max_positions=max(args.max_len, 32_768 if args.mfu else 4096))
    shape = ShardShape(groups=args.groups, median_len=args.median_len, min_len=args.min_len, max_len=args.max_len,
                       vocab=args.vocab, seed=args.seed)
    check(args, size, shape, device)
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)  # as learner.train.learn
    methods = [Method("padded", pad_batches, forward_logits)]
    if not args.no_head_baseline:
        methods.append(Method("padded, head K", pad_batches, forward_head_on_trainable))
    methods.append(Method("packed", pack, forward_logits))

    with tempfile.TemporaryDirectory(prefix="learn-bench-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        samples = make_samples(tmp / "store", shape)
        made = time.perf_counter() - t0

        def settings_of(model_dir: Path) -> LearnSettings:
            return LearnSettings(store=str(tmp / "store"), run=RUN, model=str(model_dir), checkpoints=str(tmp / "ckpt"),
                                 aggregation=args.aggregation, micro_batch_tokens=args.budget, device=device.type)

        model, s, built = build_model(args, size, tmp, settings_of, device)
        if args.attn:
            model.set_attn_implementation(args.attn)
        plan = {m.name: m.batcher(samples, args.budget) for m in methods}
        stats = shard_stats(samples, plan["packed"])
        flops, n_body = model_flops(model, stats)
        gpu = f" ({torch.cuda.get_device_name(device)})" if cuda and torch.cuda.is_available() else ""
        print(f"device: {device.type}{gpu}{', DRY RUN: nothing is trained' if args.dry_run else ''}; machine: "
              f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start; torch {torch.__version__}, "
              f"intra-op threads {torch.get_num_threads()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        precision = ("bf16 autocast, float32 weights and AdamW state (as learner/train.py on CUDA)" if cuda
                     else "float32 (as learner/train.py on CPU)")
        print(f"model: Qwen2, {sum(p.numel() for p in model.parameters()):,} parameters ({n_body:,} without the "
              f"tied embedding; hidden {size.hidden_size}, layers {size.layers}, heads {size.heads}, KV "
              f"heads {size.kv_heads}, MLP {size.intermediate_size}, vocab {size.vocab_size}), {built}; "
              f"{precision}; attention {model.config._attn_implementation}")
        lengths = stats.lengths
        print(f"shard: {shape.groups} group(s) of {GROUP_SIZE} rollouts -> {stats.samples} samples, {stats.tokens:,} "
              f"tokens ({stats.trainable:,} trainable); sample length p50 {int(np.median(lengths))}, p90 "
              f"{int(np.percentile(lengths, 90))}, max {int(lengths.max())} (lognormal, clipped to "
              f"[{shape.min_len}, {shape.max_len}]); written and cut by store.shard in {made:.1f} s")
        print(f"step: {args.budget:,}-position micro-batches, loss {s.loss}, aggregation {s.aggregation}, AdamW, "
              f"clip {s.max_grad_norm}; {args.warmup} warm-up + median of {args.repeats} steps per method, round "
              "robin, weights restored before each")
        if args.dry_run:
            peak = (args.peak_tflops or 989) * 1e12
            print(f"\n  {PLAN_HEADER}")
            for name, batches in plan.items():
                print(f"  {name:<16} {plan_columns(batches, stats)}")
            need = flops / (0.4 * peak)
            print(f"\n{FLOPS_NOTE}.\nmodel FLOPs per step {flops:.3e}: at 40% MFU of {peak / 1e12:.0f} TFLOP/s a "
                  f"step takes {need:.3f} s, {stats.tokens / need:,.0f} tokens/s")
            return {"flops": flops}

        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results: dict[str, list[StepResult]] = {m.name: [] for m in methods}
        for i in range(args.warmup + args.repeats):  # round robin: a busy moment of the machine hits every row alike
            for m in methods:
                model.load_state_dict(initial)
                r = train_step(model, samples, m, s, args.budget, device, autocast)
                if i >= args.warmup:
                    results[m.name].append(r)

    peak, source = peak_flops(args, device)
    medians = {name: statistics.median(r.seconds for r in rs) for name, rs in results.items()}
    ref = results["packed"][0]

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    print(f"\n  {PLAN_HEADER} {'step s':>8} {'best s':>8} {'tokens/s':>10} {'TFLOP/s':>8}"
          f"{'    MFU' if peak else ''} {'vs padded':>10} {'loss diff':>10} {'grad diff':>10}")
    for name, rs in results.items():
        med = medians[name]
        mfu = f" {flops / med / peak:>6.1%}" if peak else ""
        print(f"  {name:<16} {plan_columns(plan[name], stats)} {med:>8.3f} {min(x.seconds for x in rs):>8.3f} "
              f"{stats.tokens / med:>10,.0f} {flops / med / 1e12:>8.3f}{mfu} {medians['padded'] / med:>9.2f}x "
              f"{rel(rs[0].loss, ref.loss):>10.1e} {rel(rs[0].grad_norm, ref.grad_norm):>10.1e}")
    print(f"\n{FLOPS_NOTE}: {flops:.3e} per step; MFU peak: "
          + (f"{peak / 1e12:.0f} TFLOP/s ({source})" if peak else source)
          + ". 'loss diff', 'grad diff': relative to the packed step's loss and gradient norm (same weights).")
    out = {"ratio": medians["padded"] / medians["packed"], "loss_rel_diff": rel(results["padded"][0].loss, ref.loss)}
    against_k = (f"; against 'padded, head K': {medians['padded, head K'] / medians['packed']:.2f}x"
                 if "padded, head K" in medians else "")
    print(f"packed / padded tokens/s: {out['ratio']:.2f}x on {device.type}{against_k}; loss differs by "
          f"{out['loss_rel_diff']:.1e} (relative)")
    if peak:
        out["mfu"] = flops / medians["packed"] / peak
        print(f"MFU of the packed step: {out['mfu']:.1%}; target >= 40%: {'met' if out['mfu'] >= 0.4 else 'MISSED'}")
    return out


if __name__ == "__main__":
    main()
