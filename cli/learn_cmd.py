"""`trajstore learn`: a thin click shell over `learner.train.learn`."""

from __future__ import annotations

from typing import Any, get_args

import click

from cli.options import seal_interval_option, setting_default, store_option
from learner.settings import AggregationName, DeviceName, KlEstimatorName, LearnSettings, LossName
from trajstore import ESTIMATORS


def _default(name: str) -> Any:
    return setting_default(LearnSettings, name)


def _ratio_band(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[float, float] | None:
    """--mask-ratio LOW,HIGH -> (LOW, HIGH); the settings check the band itself."""
    if value is None:
        return None
    try:
        low, high = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not LOW,HIGH (two numbers, e.g. 0.5,5)") from None
    return low, high


def _reject(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, float, float]:
    """--reject none | geo:LOW,HIGH | k3:BOUND -> (mode, low, high); the settings check the bounds."""
    mode, _, bounds = value.partition(":")
    try:
        if mode == "none" and not bounds:
            return "none", 0.0, 0.0
        if mode == "geo":
            low, high = (float(v) for v in bounds.split(","))
            return "geo", low, high
        if mode == "k3":
            return "k3", 0.0, float(bounds)
    except ValueError:
        pass
    raise click.BadParameter(f"{value!r} is not none, geo:LOW,HIGH (e.g. geo:0.5,2) or k3:BOUND (e.g. k3:0.05)")


@click.command("learn")
@store_option
@click.option("--run", required=True, help="The run whose rollouts to train on (the name `collect --run` wrote).")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The initial policy: a Hugging Face checkpoint directory (trajstore init-model makes one).")
@click.option("--checkpoints", "checkpoints_dir", required=True, type=click.Path(file_okay=False),
              help="Where versions v000001/, v000002/, ... are published; resumes from the newest one in it.")
@click.option("--checkpoint-uri", metavar="URI",
              help="Where every host can load the versions from too: s3://bucket/prefix or a directory every host "
                   "mounts; `none`: only --checkpoints. Default: STORE/checkpoints/RUN for an s3:// store, none "
                   "for a local one.")
@click.option("--max-staleness", type=click.IntRange(min=0), default=_default("max_staleness"), show_default=True,
              help="Train on groups whose oldest tokens are at most this many versions old.")
@click.option("--groups-per-step", type=click.IntRange(min=1), default=_default("groups_per_step"), show_default=True,
              help="Complete groups per optimizer step.")
@click.option("--micro-batch-tokens", type=click.IntRange(min=1), default=_default("micro_batch_tokens"), show_default=True,
              help="Packed tokens per forward pass.")
@click.option("--lr", type=float, default=_default("lr"), show_default=True, help="AdamW learning rate.")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=_default("warmup_steps"), show_default=True,
              help="Raise the learning rate linearly to --lr over these first steps.")
@click.option("--max-grad-norm", type=float, default=_default("max_grad_norm"), show_default=True)
@click.option("--steps", type=click.IntRange(min=1), help="Total optimizer steps to reach (counted across restarts).")
@click.option("--follow", is_flag=True, help="Keep training as data arrives, until killed.")
@click.option("--publish-every", type=click.IntRange(min=1), default=_default("publish_every"), show_default=True,
              help="Optimizer steps per published version.")
@click.option("--estimator", type=click.Choice(ESTIMATORS), default=_default("estimator"), show_default=True,
              help="Advantage estimator (computed by the store's SQL; batch: the shard's mean reward as baseline).")
@click.option("--loss", type=click.Choice(get_args(LossName)), default=_default("loss"), show_default=True,
              help="ppo: clipped ratio to the behaviour logprobs; tis: REINFORCE with truncated IS weights; "
                   "gspo: the sequence's geometric-mean ratio, clipped per sequence (--seq-clip-low/-high); "
                   "cispo: clipped IS weight (stop-gradient) times the token logprob (--clip-low/-high); "
                   "distill: per-token reverse KL to a teacher's logprobs (--teacher).")
@click.option("--dual-clip", type=float, metavar="C",
              help="ppo: bound a negative advantage's loss at -C*A (C > 1, the paper uses 3). Default: off.")
@click.option("--seq-clip-low", type=float, default=_default("seq_clip_low"), show_default=True, help="gspo's sequence clip band.")
@click.option("--seq-clip-high", type=float, default=_default("seq_clip_high"), show_default=True)
@click.option("--mask-ratio", callback=_ratio_band, metavar="LOW,HIGH",
              help="IcePop: drop tokens whose ratio pi/behaviour leaves [LOW, HIGH] from the loss (e.g. 0.5,5); "
                   "counted as masked_tokens.")
@click.option("--reject", callback=_reject, default=_default("reject"), show_default=True, metavar="none|geo:LOW,HIGH|k3:BOUND",
              help="Drop whole samples whose mismatch to the behaviour policy is too large: geometric-mean ratio "
                   "outside [LOW, HIGH], or mean per-token k3 above BOUND; counted as rejected_samples/tokens.")
@click.option("--teacher", metavar="NAME",
              help="distill: the teacher annotation to learn from (the --name of `trajstore annotate`).")
@click.option("--distill-reward-coef", type=float, default=_default("distill_reward_coef"), show_default=True,
              help="distill: weight of the task advantage beside the reverse KL (0: pure distillation).")
@click.option("--aggregation", type=click.Choice(get_args(AggregationName)), default=_default("aggregation"),
              show_default=True, help="How token losses become the step's loss.")
@click.option("--normalizer", type=click.IntRange(min=1), default=_default("normalizer"), show_default=True,
              help="seq_mean_token_sum's constant divisor (e.g. the max generation length).")
@click.option("--clip-low", type=float, default=_default("clip_low"), show_default=True)
@click.option("--clip-high", type=float, default=_default("clip_high"), show_default=True)
@click.option("--is-cap", type=float, default=_default("is_cap"), show_default=True, help="Truncated IS cap (--loss tis).")
@click.option("--kl-coef", type=float, default=_default("kl_coef"), show_default=True,
              help="Weight of the KL to the initial model (with --lora: the base, adapters off).")
@click.option("--kl-estimator", type=click.Choice(get_args(KlEstimatorName)), default=_default("kl_estimator"), show_default=True,
              help="k1: log(pi/ref); k2: log(pi/ref)^2/2; k3: ref/pi - 1 - log(ref/pi), clamped to <= 10.")
@click.option("--temperature", type=float, default=_default("temperature"),
              help="A guard: refuse samples recorded with another sampling temperature (each sample is trained "
                   "at its own recorded temperature; samples recorded without one, at this value or 1).")
@click.option("--support-replay/--no-support-replay", default=_default("support_replay"), show_default=True,
              help="Renormalize each token's logprobs over the support it was sampled from (top-p / top-k): the "
                   "one the store recorded, else rebuilt from the recorded top_k / top_p; off only to measure what "
                   "that corrects.")
@click.option("--replay-routes/--no-replay-routes", default=_default("replay_routes"), show_default=True,
              help="Mixture-of-experts policies: route every position through the experts it took when sampled "
                   "(rollout routing replay), where the store holds them.")
@click.option("--seed", type=int, default=_default("seed"), show_default=True)
@click.option("--lora", is_flag=True, help="Train LoRA adapters and publish adapter checkpoints.")
@click.option("--lora-rank", type=click.IntRange(min=1), default=_default("lora_rank"), show_default=True)
@click.option("--lora-alpha", type=click.IntRange(min=1), default=_default("lora_alpha"), show_default=True)
@click.option("--device", type=click.Choice(get_args(DeviceName)), default=_default("device"), show_default=True)
@click.option("--poll-interval", type=float, default=_default("poll_interval"), show_default=True,
              help="Seconds between looks at the store while waiting for groups.")
@click.option("--wait-timeout", type=float, default=_default("wait_timeout"), show_default=True,
              help="Without --follow: stop after this many seconds without a full step of data.")
@click.option("--writer", help="Store writer name (default: learner-RUN-ID, ID this machine's spool id, so a "
                                "learner resumed on another host takes its own).")
@click.option("--create-store", is_flag=True,
              help="Create the store if it does not exist (without it, a store that is not there is an error).")
@seal_interval_option(_default("seal_interval"))
def learn(store_loc: str, run: str, model_dir: str, checkpoints_dir: str, checkpoint_uri: str | None,
          max_staleness: int, groups_per_step: int,
          micro_batch_tokens: int, lr: float, warmup_steps: int, max_grad_norm: float, steps: int | None, follow: bool,
          publish_every: int, estimator: str, loss: str, dual_clip: float | None, seq_clip_low: float,
          seq_clip_high: float, mask_ratio: tuple[float, float] | None, reject: tuple[str, float, float],
          teacher: str | None, distill_reward_coef: float, aggregation: str, normalizer: int, clip_low: float,
          clip_high: float, is_cap: float, kl_coef: float, kl_estimator: str, temperature: float | None,
          support_replay: bool, replay_routes: bool, seed: int, lora: bool,
          lora_rank: int, lora_alpha: int, device: str, poll_interval: float, wait_timeout: float,
          writer: str | None, create_store: bool, seal_interval: float) -> None:
    """Train the policy on the store's complete groups and publish checkpoints the collectors load.

    Each step takes the oldest GROUPS_PER_STEP complete, unconsumed groups within
    MAX_STALENESS versions, packs them into micro-batches, and takes one AdamW step.
    Every PUBLISH_EVERY steps a version is published atomically and announced in the store
    with the rollouts it consumed. Killed and restarted, it resumes from its newest version
    and trains the unpublished steps' rollouts again (each rollout lands in one version).
    With an s3:// store each version is also uploaded beside the table (or to
    --checkpoint-uri), so collectors on other hosts fetch it from there.

    \b
    Example:
      trajstore learn --store runs/s --run exp1 --model tiny-model --checkpoints runs/ckpts \\
          --groups-per-step 4 --max-staleness 1 --steps 20 --lr 1e-5
    """
    from learner.metrics_log import show
    from learner.train import learn as run_learner

    settings = LearnSettings(
        store=store_loc, run=run, model=model_dir, checkpoints=checkpoints_dir, checkpoint_uri=checkpoint_uri,
        max_staleness=max_staleness,
        groups_per_step=groups_per_step, micro_batch_tokens=micro_batch_tokens, lr=lr, warmup_steps=warmup_steps,
        max_grad_norm=max_grad_norm,
        steps=steps, follow=follow, publish_every=publish_every, estimator=estimator,  # type: ignore[arg-type]
        loss=loss, aggregation=aggregation, normalizer=normalizer, clip_low=clip_low,  # type: ignore[arg-type]
        clip_high=clip_high, is_cap=is_cap, kl_coef=kl_coef, temperature=temperature,
        support_replay=support_replay, replay_routes=replay_routes, seed=seed, lora=lora,
        dual_clip=dual_clip, seq_clip_low=seq_clip_low, seq_clip_high=seq_clip_high, mask_ratio=mask_ratio,
        reject=reject[0], reject_low=reject[1], reject_high=reject[2], teacher=teacher,  # type: ignore[arg-type]
        distill_reward_coef=distill_reward_coef, kl_estimator=kl_estimator,  # type: ignore[arg-type]
        lora_rank=lora_rank, lora_alpha=lora_alpha, device=device, poll_interval=poll_interval,  # type: ignore[arg-type]
        wait_timeout=wait_timeout, writer=writer, create_store=create_store, seal_interval=seal_interval,
    )
    summary = run_learner(settings, show=show, say=click.echo)
    why = "reached --steps" if summary.stopped == "steps" else f"no new groups for {wait_timeout:g} s"
    published = ", ".join(str(v) for v in summary.published) or "none"
    click.echo(f"stopped at step {summary.step} ({why}); {summary.steps_trained} steps trained, "
               f"versions published: {published}; newest version {summary.version} in {checkpoints_dir}")
    if summary.stopped == "no_data" and not summary.steps_trained:
        raise click.ClickException(f"trained nothing in {wait_timeout:g} s: {summary.waiting}")
