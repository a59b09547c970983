"""`learn(settings)`: the training loop of `trajstore learn`, top to bottom.

settings -> model (+ frozen reference, + LoRA) -> optimizer -> resume from the newest
checkpoint -> `for step in ...`: wait for `groups_per_step` complete groups, pack them,
forward, loss, backward, clip, step, log a Metric event, and every `publish_every` steps
publish a version (uploaded to the checkpoint URI when there is one, so every host can load
it) and announce it with a Checkpoint event.

Exactly-once. Rollouts trained since the last published version are held in `pending` and
excluded from the next shards; a Checkpoint event lists them as `consumed`, after which the
store excludes them itself. A learner killed at any point restarts from its newest
checkpoint (weights, optimizer state, RNG, step, version) and trains the unpublished steps'
rollouts again, so every rollout ends up in exactly one published version. A version whose
directory was renamed into place but whose event never reached the store is announced on
restart (same deterministic event id). A retrained step appears twice in `metrics` (one per
attempt); `checkpoints.consumed` is the record of what was trained. The restart may be on another
host: the run's newest version is fetched from where it was published (`learner.resume`).

Loss of one step: the chosen per-token loss (`learner.objectives.LOSSES`), plus kl_coef * the
chosen KL estimate to the initial model, less the tokens IcePop masks and the samples rejection
drops (`learner.objectives.kept_tokens`), aggregated over the step (`AGGREGATIONS`) with normalizers computed over all of its
micro-batches before the first one, so gradient accumulation gives the step's exact
gradient however the samples were packed. Behaviour logprobs (what the policy server
sampled with) are the PPO "old" logprobs: one optimizer step per shard, the ratio measures
staleness plus the inference/training mismatch.

Precision: float32 weights and optimizer state; the forward runs under bfloat16 autocast on
CUDA and in float32 on CPU (one code path); log-softmax math is float32 either way.

Several processes (torchrun, WORLD_SIZE > 1): the same loop on every rank, with the model
sharded by FSDP2 (parameters, gradients and optimizer state split across ranks). Rank 0 alone
reads the store, writes events and publishes checkpoints (gathered, the same Hugging Face
directory as one process writes); it broadcasts each shard, every rank trains on its share of
the micro-batches (padding passes keep the ranks in step when the shares differ), and the
ranks' gradients add up to the step's. `learner.distributed` holds all of it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import AutoModelForCausalLM

from learner import checkpoints, distributed
from learner.batching import MicroBatch, StepTotals, pack, step_totals
from learner.losses import (
    LossStats,
    loss_stats,
    seq_mean_token_mean,
    seq_mean_token_sum,
    token_logprobs,
    token_mean,
)
from learner.objectives import KL_ESTIMATORS, LOSSES, LossInputs, kept_tokens, objective_stats
from learner.support import Support, kept_positions, replay_entropy, replay_logprobs
from learner.errors import LearnerError
from learner.routing import replayed, replayed_share
from learner.resume import announce_missing, catch_up, check_still_newest, upload
from learner.settings import LearnSettings, SettingsError
from trajstore import Metric, Scope, Store, Writer, artifacts, open_store
from trajstore.follow import Follower
from trajstore.shard import Shard

# the shard planner's rollout budget: a step is bounded by its group count, not its rollouts
_NO_ROLLOUT_LIMIT = 1 << 40


# ---- the choices of the settings, one visible dict each ------------------------------------------

# (per-token loss over one micro-batch's trainable tokens, their sample index, the micro-batch's
# sample weights, the step's totals, settings) -> this micro-batch's share of the step's loss
Aggregation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepTotals, LearnSettings], torch.Tensor]
AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": lambda loss, seq, w, totals, s: token_mean(
        loss, torch.ones_like(loss), total_tokens=totals.trainable_tokens),
    "seq_mean_token_mean": lambda loss, seq, w, totals, s: seq_mean_token_mean(
        loss, torch.ones_like(loss), seq, w, total_weight=totals.rollouts),
    "seq_mean_token_sum": lambda loss, seq, w, totals, s: seq_mean_token_sum(
        loss, torch.ones_like(loss), seq, w, normalizer=s.normalizer, total_weight=totals.rollouts),
}


@dataclass(frozen=True)
class LearnSummary:
    run: str
    step: int  # the last step trained, counted across restarts
    version: int  # the newest published version
    steps_trained: int  # by this call
    published: tuple[int, ...]  # versions this call published
    resumed_from: int | None  # the version this call started from, None when fresh
    stopped: Literal["steps", "no_data"]  # reached `steps`, or waited `wait_timeout` for data in vain
    last_metrics: dict[str, float] = field(default_factory=dict)
    waiting: str | None = None  # with "no_data": what it waited for, and what the store held


# ---- small pieces the loop reads as one line each --------------------------------------------------

def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SettingsError([f"device cuda was asked for but torch {torch.__version__} sees no GPU on this "
                                 "machine; use --device cpu, or auto (a GPU when there is one)"])
        return torch.device("cuda", local_rank)
    return torch.device(name)


def load_policy(s: LearnSettings, resume: checkpoints.CheckpointInfo | None) -> torch.nn.Module:
    """The policy to train: the initial model, or the newest checkpoint (full or LoRA adapter)."""
    if s.lora:
        from learner.lora import apply_lora, load_adapter_for_training  # peft only when LoRA is on

        if resume is not None:
            return load_adapter_for_training(s.model, resume.path)
        base = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
        return apply_lora(base, rank=s.lora_rank, alpha=s.lora_alpha)
    return AutoModelForCausalLM.from_pretrained(str(resume.path if resume else s.model), dtype=torch.float32)


def forward_logits(model: torch.nn.Module, mb: MicroBatch, temperature: float | None = None) -> torch.Tensor:
    """Logits (K, V) at the micro-batch's K trainable positions, divided by the sampling temperature: `temperature`,
    or (None) the temperature each target was sampled at (`MicroBatch.temperature`).

    `use_cache=False` matters: transformers detects packed samples from the position ids only
    when no cache is passed. A packed row asks the LM head for the trainable positions only.
    A mixture-of-experts model takes the experts the sampler took where the micro-batch carries
    them (`learner.routing`; `LearnSettings.replay_routes` off drops them from the micro-batches).
    """
    keep = mb.mask.nonzero().squeeze(1)
    with replayed(model, mb.routes):
        if mb.input_ids.shape[0] == 1:  # packed
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, logits_to_keep=keep)
            logits = out.logits[0]
        else:  # padded (B, L): select after the head
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask,
                        use_cache=False)
            logits = out.logits.flatten(0, 1)[keep]
    if temperature is None and mb.temperature is not None:
        return logits / mb.temperature[keep].to(logits.dtype)[:, None]
    return logits / (1.0 if temperature is None else temperature)


def waiting_for(store: Store, s: LearnSettings, version: int, found: int) -> str:
    """What the learner waits for and what the store holds of the run, in one line."""
    lo = version - s.max_staleness
    row = store.query(
        """SELECT count(*) AS groups, count(*) FILTER (WHERE complete) AS complete,
                  count(*) FILTER (WHERE NOT complete) AS open,
                  count(*) FILTER (WHERE complete AND min_version < $lo) AS stale
           FROM groups WHERE run = $run""", {"run": s.run, "lo": lo}, scope=Scope(runs=(s.run,))).to_pylist()[0]
    want = (f"waiting for {s.groups_per_step} complete, unconsumed groups of run {s.run!r} sampled at version "
            f">= {max(lo, 0)} (have {found})")
    if not row["groups"]:
        runs = store.query("SELECT DISTINCT run FROM rollouts ORDER BY run").column("run").to_pylist()
        shown = ", ".join(map(repr, runs[:10])) or "none yet"
        return f"{want}: the store has no rollouts of run {s.run!r} (its runs: {shown}); is --run right?"
    return (f"{want}: the store holds {row['groups']} group(s) of the run, {row['open']} still collecting, "
            f"{row['complete']} complete ({row['stale']} of them too stale, the rest consumed or in this shard)")


WAIT_REPORT_S = 30.0  # how often a waiting learner says what it waits for


def ready_groups(follower: Follower, s: LearnSettings, version: int, exclude: list[str]) -> int:
    """How many groups a shard would find now: complete groups of the run whose oldest tokens are fresh
    and of which no rollout is consumed or held (`exclude`), from the follower's incremental snapshot
    (a poll with nothing new reads no sealed file)."""
    with follower.snapshot() as snap:
        snap.register("_exclude", pa.table({"rollout_id": pa.array(exclude, pa.string())}))
        return snap.query(
            """WITH gone AS (SELECT rollout_id FROM consumed WHERE run = $run
                             UNION ALL SELECT rollout_id FROM _exclude),
                    taken AS (SELECT DISTINCT group_id FROM rollouts JOIN gone USING (rollout_id) WHERE run = $run)
               SELECT count(*) AS n FROM groups
               WHERE run = $run AND complete AND min_version >= $lo AND group_id NOT IN (SELECT group_id FROM taken)""",
            {"run": s.run, "lo": version - s.max_staleness}).column("n")[0].as_py()


def wait_for_shard(store: Store, s: LearnSettings, version: int, exclude: Iterable[str],
                   say: Callable[[str], None] | None = None, follower: Follower | None = None) -> Shard | None:
    """The next `groups_per_step` complete, fresh, unconsumed groups; None after `wait_timeout` without them.

    With a `follower`, each poll first counts the ready groups on its incremental snapshot and plans
    a shard (which reads the token lists of the files that hold them) only once enough are there, or
    every WAIT_REPORT_S seconds regardless. While it waits, `say` hears what it waits for (at once,
    then every WAIT_REPORT_S seconds)."""
    exclude = list(exclude)
    deadline = None if s.follow else time.monotonic() + s.wait_timeout
    report_at = plan_at = time.monotonic()
    found = 0
    while True:
        now = time.monotonic()
        if follower is None or now >= plan_at or ready_groups(follower, s, version, exclude) >= s.groups_per_step:
            shard = store.shard(policy_version=version, max_staleness=s.max_staleness,
                                max_rollouts=_NO_ROLLOUT_LIMIT, estimator=s.estimator, run=s.run, exclude=exclude,
                                max_groups=s.groups_per_step, teacher=s.teacher)
            found = len(shard.group_ids)
            if found >= s.groups_per_step:
                return shard
            plan_at = now + WAIT_REPORT_S
        if deadline is not None and time.monotonic() >= deadline:
            return None
        if say is not None and time.monotonic() >= report_at:
            say(waiting_for(store, s, version, found))
            report_at = time.monotonic() + WAIT_REPORT_S
        time.sleep(s.poll_interval)


def check_vocabulary(samples: pa.Table, vocab_size: int) -> None:
    """Every token id of a shard must be one the model has; otherwise say which rollout holds which id."""
    tokens = samples.column("tokens")
    flat = pc.list_flatten(tokens)
    if not len(flat) or pc.max(flat).as_py() < vocab_size:
        return
    parents = pc.list_parent_indices(tokens).filter(pc.greater_equal(flat, vocab_size))
    row = parents[0].as_py()
    bad = max(t for t in tokens[row].as_py() if t >= vocab_size)
    raise LearnerError(f"rollout {samples.column('rollout_id')[row].as_py()} (run "
                       f"{samples.column('run')[row].as_py()}) holds token id {bad}, but the model has "
                       f"{vocab_size} tokens (ids 0..{vocab_size - 1}): its run was collected with another "
                       "tokenizer or model. Train it with the model that sampled it (--model), or keep runs of "
                       "different models apart (--run)")


def check_teacher(samples: pa.Table, teacher: str | None) -> None:
    """With a teacher, every sample must carry its logprobs; otherwise say which one lacks them and how to fix it."""
    if teacher is None:
        return
    missing = samples.filter(pc.is_null(samples.column("teacher_logprobs")))
    if missing.num_rows:
        first = missing.slice(0, 1).to_pylist()[0]
        raise LearnerError(f"{missing.num_rows} of the step's {samples.num_rows} samples have no complete "
                           f"logprobs from teacher {teacher!r} (the first: rollout {first['rollout_id']}, segment "
                           f"{first['segment_id']} of run {first['run']!r}); score them first with `trajstore "
                           f"annotate --store ... --run {first['run']} --teacher-model DIR --name {teacher}`")


TEMPERATURE_TOLERANCE = 1e-6


def check_sampling(samples: pa.Table, guard: float | None) -> pa.Table:
    """The samples with each one's temperature resolved: its recorded one; `guard` (else 1) where none was recorded
    (older stores). A sample whose turns were sampled differently, or whose recorded temperature is not `guard`,
    is refused, saying which and what to do."""
    if "temperature" not in samples.column_names:
        return samples
    varies = samples.filter(pc.fill_null(samples.column("sampling_varies"), False))
    if varies.num_rows:
        first = varies.slice(0, 1).to_pylist()[0]
        raise LearnerError(f"{varies.num_rows} of the step's samples mix sampling parameters across their turns (the "
                           f"first: rollout {first['rollout_id']}, segment {first['segment_id']} of run {first['run']!r}); "
                           "the learner trains each sample at one temperature: sample every turn of a segment with the "
                           "same temperature, top_p, top_k and min_p")
    recorded = samples.column("temperature")
    if guard is not None:
        off = pc.and_(pc.is_valid(recorded), pc.greater(pc.abs(pc.subtract(recorded, guard)), TEMPERATURE_TOLERANCE))
        wrong = samples.filter(pc.fill_null(off, False))
        if wrong.num_rows:
            first = wrong.slice(0, 1).to_pylist()[0]
            raise LearnerError(f"--temperature {guard:g} does not match what sampled: {wrong.num_rows} of the step's "
                               f"samples were recorded at temperature {first['temperature']:g} (the first: rollout "
                               f"{first['rollout_id']} of run {first['run']!r}). The learner trains each sample at its "
                               "recorded temperature; drop --temperature, or give the one the collectors used")
    fill = 1.0 if guard is None else guard
    return samples.set_column(samples.schema.get_field_index("temperature"), "temperature",
                              pc.fill_null(recorded.cast(pa.float64()), fill))


def shard_metrics(samples: pa.Table, version: int) -> dict[str, float]:
    """Reward, advantage and staleness of a step's data (one value per rollout for the first two), and how
    many of its groups had no reward spread (`groups_no_spread`: every rollout of the group got the same
    reward, so a group-relative advantage is 0 and the group teaches nothing)."""
    per_rollout = {r: (rew, adv, g) for r, rew, adv, g in zip(samples.column("rollout_id").to_pylist(),
                                                              samples.column("reward").to_pylist(),
                                                              samples.column("advantage").to_pylist(),
                                                              samples.column("group_id").to_pylist())}
    rewards = np.array([v[0] for v in per_rollout.values()], dtype=np.float64)
    advantages = np.array([v[1] for v in per_rollout.values()], dtype=np.float64)
    staleness = version - samples.column("min_version").to_numpy().astype(np.float64)
    group_rewards: dict[str, list[float]] = {}
    for reward, _, group in per_rollout.values():
        group_rewards.setdefault(group, []).append(reward)
    flat = sum(1 for values in group_rewards.values() if max(values) - min(values) <= NO_SPREAD)
    return {"reward_mean": float(rewards.mean()), "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std()), "advantage_abs_max": float(np.abs(advantages).max()),
            "staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max()),
            "rollouts": float(len(per_rollout)), "groups": float(len(group_rewards)),
            "groups_no_spread": float(flat), "samples": float(samples.num_rows),
            "tokens": float(samples.column("num_tokens").to_numpy().sum())}


NO_SPREAD = 1e-9  # rewards of a group this close are equal: float noise, not a signal


def spread_note(step: int, metrics: Mapping[str, float], run: str, said_before: bool) -> str | None:
    """What to tell the user when a step's groups had no reward spread: always when the step trained on
    nothing (every advantage 0), once per run of `learn` when only some groups were flat."""
    flat, groups = int(metrics["groups_no_spread"]), int(metrics["groups"])
    if metrics["advantage_abs_max"] <= NO_SPREAD:
        return (f"step {step} trained on nothing: {flat} of its {groups} groups had no reward spread (every "
                f"rollout of a group got the same reward) and every advantage is 0, so the gradient is 0. The "
                f"reward cannot tell the rollouts of run {run!r} apart: check that the reward scores them "
                f"(trajstore query \"SELECT reward, count(*) FROM rollouts WHERE run = '{run}' GROUP BY 1\"), "
                "give easier tasks, or start from a model that sometimes succeeds (a warm start)")
    if flat and not said_before:
        return (f"step {step}: {flat} of its {groups} groups had no reward spread; their rollouts get advantage 0 "
                "and teach nothing (the `groups_no_spread` metric counts them every step)")
    return None


def rejected_meta(samples: pa.Table, rows: list[int]) -> dict[str, list[list[str]]] | None:
    """The step's metric-event meta naming the samples --reject left out of its loss (the `rejected`
    view and the token ledger read it): [[rollout_id, segment_id], ...]; None when none was."""
    if not rows:
        return None
    picked = samples.take(rows)
    return {"rejected": [[r, g] for r, g in zip(picked.column("rollout_id").to_pylist(),
                                                 picked.column("segment_id").to_pylist())]}
def sampled_logprobs(logits: torch.Tensor, mb: MicroBatch, replay: bool = True) -> tuple[torch.Tensor, Support]:
    """The policy's logprob of each trainable target (K,) from `forward_logits`' logits, over the support the
    sampler drew it from where the store recorded one (`learner.support`; all of the vocabulary with `replay`
    off), and that support: the ratio, the KL estimates and the entropy all use it."""
    keep = mb.mask.nonzero().squeeze(1)
    targets = mb.targets[keep]
    if not replay:
        return token_logprobs(logits, targets), Support.none(keep.device)
    support = kept_positions(mb.support_sizes, mb.support_ids, keep)
    if mb.top_k is not None and mb.top_p is not None:  # truncated calls whose server recorded no support
        support = support.rebuilt(logits.detach(), mb.top_k[keep], mb.top_p[keep])
    return replay_logprobs(logits, targets, token_logprobs(logits, targets), support), support


def backward_micro_batch(model: torch.nn.Module, reference: torch.nn.Module | None, mb: MicroBatch,
                         totals: StepTotals, s: LearnSettings, autocast: Callable[[], torch.autocast],
                         grad_scale: float = 1.0) -> tuple[float, float, LossStats, list[int]]:
    """Forward one micro-batch, add its share of the step's loss gradient (times `grad_scale`, see
    `learner.distributed.micro_batches`); returns (loss, kl, stats) unscaled and the rows of the
    shard's samples the rejection test left out of the loss."""
    keep = mb.mask.nonzero().squeeze(1)  # only trainable targets enter the loss
    behaviour, advantages, seq, targets = (mb.behaviour_logprobs[keep], mb.advantages[keep], mb.seq[keep],
                                           mb.targets[keep])
    with autocast():
        logits = forward_logits(model, mb)
    logprobs, support = sampled_logprobs(logits, mb, s.support_replay)
    inputs = LossInputs(logprobs, behaviour, advantages, seq, samples=int(mb.seq_weight.shape[0]),
                        teacher=mb.teacher_logprobs[keep] if mb.teacher_logprobs is not None else None)
    out = LOSSES[s.loss](inputs, s)
    per_token = out.loss
    kl_value = 0.0
    if s.kl_coef > 0:
        with torch.no_grad(), autocast():
            if reference is not None:
                ref_logits = forward_logits(reference, mb)
            else:  # LoRA: the base model is the reference
                with model.disable_adapter():  # type: ignore[operator]
                    ref_logits = forward_logits(model, mb)
            ref_logprobs = replay_logprobs(ref_logits, targets, token_logprobs(ref_logits, targets), support)
        kl = KL_ESTIMATORS[s.kl_estimator](logprobs, ref_logprobs)
        per_token = per_token + s.kl_coef * kl
        kl_value = AGGREGATIONS[s.aggregation](kl.detach(), seq, mb.seq_weight, totals, s).item()
    # IcePop-masked tokens and rejected samples leave the loss (selected out: no gradient, NaN-safe)
    kept, masked, rejected = kept_tokens(inputs, s)
    per_token = torch.where(kept, per_token, torch.zeros_like(per_token))
    loss = AGGREGATIONS[s.aggregation](per_token, seq, mb.seq_weight, totals, s)
    (loss * grad_scale).backward()
    stats = loss_stats(logprobs, behaviour, torch.ones_like(keep, dtype=torch.bool),
                       out.clipped_low | out.clipped_high, replay_entropy(logits, support))
    support_stats = LossStats(replayed_tokens=float(support.positions()))
    rejected_rows = [mb.rows[i] for i in rejected.nonzero().flatten().tolist()]
    return (loss.item(), kl_value, stats + objective_stats(inputs, out, masked, rejected) + support_stats,
            rejected_rows)


# ---- the loop ---------------------------------------------------------------------------------------

def learn(settings: LearnSettings, *,
          show: Callable[[int, int, Mapping[str, float]], None] | None = None,
          say: Callable[[str], None] | None = None) -> LearnSummary:
    """Train `settings.run` from the store until `settings.steps` (or forever with `follow`).

    `show(step, version, metrics)` is called after every step (the CLI prints a line), `say(text)`
    while it waits for data, and when a step's groups had no reward spread (`spread_note`). Raises
    SettingsError listing every problem before any work starts, and StoreNotFoundError when the
    store does not exist (unless `create_store`).
    """
    s = settings
    s.check()
    ranks = distributed.start()  # torchrun's process group; one process otherwise
    if ranks.world > 1 and s.lora:
        distributed.stop(ranks)
        raise SettingsError(["--lora under torchrun is not supported: adapters are small, so train them in one "
                             "process (drop torchrun), or train the full model sharded"])
    device = resolve_device(s.device, ranks.local_rank)
    store = open_store(s.store, create=s.create_store) if ranks.main else None  # before any work: a wrong --store
    if ranks.main and s.publish_uri is not None:
        artifacts.check_destination(s.publish_uri)  # and a checkpoint URI that cannot take uploads
    # bfloat16 autocast on CUDA, plain float32 on CPU: one code path
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(s.seed)

    # resume point: the newest published version, if any (partial leftovers are removed), fetched when a
    # learner on another host published it. Every refusal comes before the model loads.
    infos = checkpoints.published(s.checkpoints, clean=ranks.main)  # leftovers of a crash mid-publish go
    if store is not None:
        infos = catch_up(store, s, infos)
    infos = distributed.broadcast(infos, ranks)  # every rank loads the same version (from a directory they share)
    resume = infos[-1] if infos else None
    if resume is not None and resume.adapter != s.lora:
        raise checkpoints.CheckpointError(
            f"{resume.path} is a {'LoRA adapter' if resume.adapter else 'full'} checkpoint but the settings "
            f"{'ask for' if s.lora else 'do not ask for'} LoRA; resume with the same --lora setting")
    if resume is not None and resume.run != s.run:
        raise checkpoints.CheckpointError(
            f"{resume.path} belongs to run {resume.run!r}, not {s.run!r}; give each run its own --checkpoints")

    # one writer name per machine (a restart here reopens its write-ahead directory, a learner moved to another
    # host takes that host's): opened before the model loads, so a name another machine holds is refused at once
    writer = store.writer(s.writer or store.machine_writer_name(s.writer_name),
                          seal_interval=s.seal_interval) if store is not None else None
    try:
        # model, optional frozen reference (the initial policy), optimizer; sharded by FSDP2 under torchrun
        model = distributed.shard(load_policy(s, resume), ranks, device).eval()  # eval: the sampling policy
        reference = None
        if s.kl_coef > 0 and not s.lora:  # with LoRA the reference is the base, adapter disabled
            reference = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
            reference.requires_grad_(False)
            reference = distributed.shard(reference, ranks, device).eval()
        vocab_size = int(model.get_input_embeddings().num_embeddings)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)

        version = step_done = 0
        if resume is not None:
            checkpoints.restore(checkpoints.load_state(resume), optimizer, model)
            version, step_done = resume.version, resume.step
    except BaseException:
        if writer is not None:
            writer.close()
        raise

    pending: list[str] = []  # rollouts trained since the last published version
    pending_steps = 0
    table_version: int | None = None
    published: list[int] = []
    metrics: dict[str, float] = {}
    stopped: Literal["steps", "no_data"] = "steps"
    waiting: str | None = None
    steps_trained = 0
    said_flat = False  # told the user some groups had no reward spread
    last_step = step_done
    steps = itertools.count(step_done + 1) if s.steps is None else range(step_done + 1, s.steps + 1)
    follower = store.follower() if store is not None else None  # the waits' polls read only what is new
    try:
        if store is not None and writer is not None:
            announce_missing(store, writer, s, infos)
            if resume is None:
                writer.append([checkpoints.initial_event(s.model, s.run, s.groups_per_version, s.max_staleness,
                                                         s.resolved())])
        for step in steps:
            shard = wait_for_shard(store, s, version, pending, say, follower) if store is not None else None
            shard = distributed.broadcast(shard, ranks)
            if shard is None:
                stopped = "no_data"
                waiting = waiting_for(store, s, version, 0) if store is not None else None
                break
            started = time.perf_counter()
            check_vocabulary(shard.samples, vocab_size)
            check_teacher(shard.samples, s.teacher)
            samples = check_sampling(shard.samples, s.temperature)
            totals = step_totals(samples)
            batches = pack(samples, s.micro_batch_tokens)
            routed = replayed_share(batches)  # None: no sample of the step carries MoE routes
            if not s.replay_routes:  # the learner's own routing: to measure what replay changes
                batches = [dataclasses.replace(mb, routes=None) for mb in batches]
            optimizer.zero_grad(set_to_none=True)
            loss_sum = kl_sum = 0.0
            stats = LossStats()
            rejected: list[int] = []  # rows of shard.samples left out of the loss by --reject
            for mb, grad_scale in distributed.micro_batches(batches, ranks):  # as many passes on every rank
                loss, kl, mb_stats, mb_rejected = backward_micro_batch(model, reference, mb.to(device), totals, s,
                                                                       autocast, grad_scale)
                if grad_scale:  # a padding pass only keeps the ranks in step
                    loss_sum, kl_sum, stats = loss_sum + loss, kl_sum + kl, stats + mb_stats
                    rejected += mb_rejected
            parts = distributed.all_ranks((loss_sum, kl_sum, stats, rejected), ranks)
            loss_sum, kl_sum, stats = (sum(p[0] for p in parts), sum(p[1] for p in parts),
                                       sum((p[2] for p in parts), LossStats()))
            rejected = sorted({row for p in parts for row in p[3]})
            grad_norm = distributed.clip_grad_norm(params, s.max_grad_norm)
            lr = s.lr * min(1.0, step / s.warmup_steps) if s.warmup_steps else s.lr  # from the step count: resumable
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            elapsed = time.perf_counter() - started

            metrics = {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr, **stats.finalize(),
                       **shard_metrics(shard.samples, version),  # its "tokens" (all of them) replaces the stats'
                       "trainable_tokens": float(totals.trainable_tokens), "micro_batches": float(len(batches)),
                       "step_time": elapsed, "ranks": float(ranks.world),
                       **distributed.memory(model, optimizer, ranks)}
            if s.kl_coef > 0:
                metrics["kl_ref"] = kl_sum
            if routed is not None:  # share of trainable tokens whose routes were replayed (0 with replay off)
                metrics["routes_replayed"] = routed if s.replay_routes else 0.0
            metrics["tokens_per_s"] = metrics["tokens"] / elapsed if elapsed > 0 else 0.0
            pending += shard.rollout_ids
            pending_steps += 1
            steps_trained += 1
            last_step = step
            table_version = shard.table_version
            if writer is not None:
                writer.append([Metric(run=s.run, step=step, metrics=metrics, policy_version=version,
                                      table_version=shard.table_version, consumed=list(shard.rollout_ids),
                                      meta=rejected_meta(shard.samples, rejected))])
            if show is not None and ranks.main:
                show(step, version, metrics)
            note = spread_note(step, metrics, s.run, said_flat)
            said_flat = said_flat or (note is not None and metrics["advantage_abs_max"] > NO_SPREAD)
            if note is not None and say is not None and ranks.main:
                say(note)

            if pending_steps == s.publish_every:
                version = _publish(s, store, model, optimizer, writer, version + 1, step, pending,
                                   table_version, metrics, ranks)
                published.append(version)
                pending, pending_steps = [], 0
        if pending_steps:  # the last steps of a finished run are published too
            version = _publish(s, store, model, optimizer, writer, version + 1, last_step, pending,
                               table_version, metrics, ranks)
            published.append(version)
    finally:
        if writer is not None:
            writer.close()
        if follower is not None:
            follower.close()
        distributed.stop(ranks)
    return LearnSummary(run=s.run, step=last_step, version=version, steps_trained=steps_trained,
                        published=tuple(published), resumed_from=resume.version if resume else None,
                        stopped=stopped, last_metrics=metrics, waiting=waiting)


def _publish(s: LearnSettings, store: Store | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             writer: Writer | None, version: int, step: int, consumed: list[str], table_version: int | None,
             metrics: Mapping[str, float], ranks: distributed.Ranks) -> int:
    """Write version `version` and announce it (rank 0, from the state every rank gathers), then go on together."""
    gathered = distributed.gather_state(model, optimizer, ranks)
    if ranks.main:
        check_still_newest(store, s.run, version - 1)  # type: ignore[arg-type]
        info = {"run": s.run, "parent": version - 1, "table_version": table_version, "consumed": consumed,
                "metrics": dict(metrics), "settings": s.resolved()}
        path = checkpoints.publish(s.checkpoints, version, step, model, s.model, optimizer, info=info,
                                   adapter=s.lora, gathered=gathered)
        written = checkpoints.read_info(path)
        event = checkpoints.checkpoint_event(written, s.run, metrics, s.groups_per_version, s.max_staleness,
                                             upload(s, written))
        writer.append([event])  # type: ignore[union-attr]
    distributed.all_ranks(None, ranks)  # a barrier: no rank runs ahead of a version rank 0 is writing
    return version

