"""`LearnSettings`: every knob of `trajstore learn`, validated all at once before any work starts;
`WarmStartSettings`: those of the supervised warm start (`trajstore sft`).

Kept free of torch so that `trajstore --help` and the CLI's option parsing stay fast; the
names of the loss and aggregation choices map to functions in one dict each in
`learner.train`, so a new choice is one name and one function. `resolved()` is what gets
written next to every checkpoint.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from learner.errors import LearnerError
from trajstore import Estimator

LossName = Literal["ppo", "tis", "gspo", "cispo", "distill"]
KlEstimatorName = Literal["k1", "k2", "k3"]
RejectName = Literal["none", "geo", "k3"]
AggregationName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
DeviceName = Literal["auto", "cpu", "cuda"]

_WRITER_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class SettingsError(LearnerError, ValueError):
    """The settings have problems; `problems` lists every one of them."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("the learner settings have {} problem(s); fix them and start again:\n{}".format(
            len(problems), "\n".join(f"  - {p}" for p in problems)))


@dataclass(frozen=True, kw_only=True)
class LearnSettings:
    """One learner run. Paths may be relative; `resolved()` makes them absolute."""

    store: str  # a directory or s3://bucket/prefix
    run: str  # the run to train: explicit, so a forgotten name never trains on nothing
    model: str  # the initial policy: a Hugging Face checkpoint directory
    checkpoints: str  # where v000001/, v000002/, ... are published
    # where every host can read them too: s3://bucket/prefix or a shared directory, "none" for nowhere
    # else; None: <store>/checkpoints/<run> for an s3:// store, nowhere else for a local one
    checkpoint_uri: str | None = None
    max_staleness: int = 1  # train on groups whose oldest tokens are at most this many versions old
    groups_per_step: int = 8  # complete groups in one optimizer step
    micro_batch_tokens: int = 4096  # packed tokens per forward pass (a longer sample gets its own)
    lr: float = 1e-5  # AdamW, betas (0.9, 0.95), no weight decay
    warmup_steps: int = 0  # the lr rises linearly to `lr` over these first steps (AdamW's first steps move every
    # weight by about lr, whatever the size of its gradient: a noisy first step can undo a warm start)
    max_grad_norm: float = 1.0
    steps: int | None = None  # the total step count to reach (counted across restarts)
    follow: bool = False  # keep waiting for data forever (no step limit needed)
    publish_every: int = 1  # optimizer steps per published version
    estimator: Estimator = "grpo"  # any of trajstore.ESTIMATORS: the store computes each by SQL
    loss: LossName = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0  # truncated importance-sampling cap (losses "tis" and "distill")
    dual_clip: float | None = None  # ppo: bound a negative advantage's loss at -dual_clip * A (> 1; None: off)
    seq_clip_low: float = 3e-4  # gspo: the sequence ratio's clip band (the GSPO paper's values)
    seq_clip_high: float = 4e-4
    mask_ratio: tuple[float, float] | None = None  # IcePop: drop tokens whose pi / behaviour leaves [low, high]
    reject: RejectName = "none"  # sequence rejection: by geometric-mean ratio ("geo") or mean k3 ("k3")
    reject_low: float = 0.0  # geo: reject a sample whose geometric-mean ratio is below this ...
    reject_high: float = 0.0  # ... or above this; k3: whose mean k3 exceeds this
    teacher: str | None = None  # distill: the annotation name (`trajstore annotate --name`) to learn from
    distill_reward_coef: float = 0.0  # distill: weight of the task advantage beside the reverse KL
    aggregation: AggregationName = "token_mean"
    normalizer: int = 1024  # seq_mean_token_sum: the fixed divisor of each sample's token sum (Dr. GRPO)
    kl_coef: float = 0.0  # KL to the initial model (LoRA: the base); the reference is loaded only when > 0
    kl_estimator: KlEstimatorName = "k3"  # k1, k2, or k3 clamped to <= 10 (learner.losses)
    # Each sample's own recorded temperature is what the learner divides its logits by. This is a guard: when
    # set, a sample recorded with another temperature is refused; samples recorded without one (stores from
    # before the `sampling` column was read) are trained at it (None: at 1).
    temperature: float | None = None
    # renormalize each token's logprobs over the support it was sampled from (recorded, or rebuilt from the
    # recorded top_k / top_p: learner.support); off only to measure what it corrects (benchmarks/sampling_replay.py)
    support_replay: bool = True
    replay_routes: bool = True  # MoE: route each position through the experts it took when sampled (learner.routing)
    seed: int = 0
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: int = 16
    device: DeviceName = "auto"
    poll_interval: float = 1.0  # seconds between looks at the store while waiting for groups
    wait_timeout: float = 600.0  # without --follow: stop after this long without a full step of data
    writer: str | None = None  # store writer name; default learner-<run>-<this machine's spool id>
    seal_interval: float = 60.0  # seconds before metrics are sealed (checkpoint events are sealed at once)
    create_store: bool = False  # create the store when none exists (else: refuse, a mistyped --store waits forever)

    def problems(self) -> list[str]:
        """Every problem with these settings, each saying what would fix it."""
        out: list[str] = []
        model = Path(self.model)
        if not model.is_dir():
            out.append(f"model {self.model!r} is not a directory; pass a Hugging Face checkpoint "
                       "(make one with `trajstore init-model`)")
        elif not (model / "config.json").is_file():
            out.append(f"model {self.model!r} has no config.json; it must be a full Hugging Face checkpoint "
                       "(a LoRA adapter directory cannot start a run: pass its base model and --lora)")
        ckpts = Path(self.checkpoints)
        if ckpts.exists() and not ckpts.is_dir():
            out.append(f"checkpoints {self.checkpoints!r} exists and is not a directory")
        if not self.run:
            out.append("run must be a non-empty name")
        out += self._checkpoint_uri_problems()
        for name in ("groups_per_step", "micro_batch_tokens", "publish_every", "normalizer", "lora_rank",
                     "lora_alpha"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("lr", "max_grad_norm", "is_cap", "temperature", "poll_interval", "wait_timeout",
                     "seal_interval"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) < math.inf:
                out.append(f"{name} must be > 0 and finite (got {getattr(self, name)})")
        for name in ("clip_low", "clip_high", "kl_coef"):
            if not math.isfinite(getattr(self, name)):
                out.append(f"{name} must be a finite number (got {getattr(self, name)})")
        if self.max_staleness < 0:
            out.append(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if not 0 <= self.clip_low < 1:
            out.append(f"clip_low must be in [0, 1) so that 1 - clip_low stays positive (got {self.clip_low})")
        if self.clip_high < 0:
            out.append(f"clip_high must be >= 0 (got {self.clip_high})")
        if self.warmup_steps < 0:
            out.append(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.kl_coef < 0:
            out.append(f"kl_coef must be >= 0 (got {self.kl_coef})")
        out += self._loss_problems()
        if self.steps is None and not self.follow:
            out.append("say when to stop: give steps (a total step count) or follow=True (run until killed)")
        if self.steps is not None and self.steps < 1:
            out.append(f"steps must be >= 1 (got {self.steps})")
        for name, typ in (("estimator", Estimator), ("loss", LossName), ("aggregation", AggregationName),
                          ("device", DeviceName), ("kl_estimator", KlEstimatorName), ("reject", RejectName)):
            if getattr(self, name) not in get_args(typ):
                out.append(f"{name} {getattr(self, name)!r} is not one of {list(get_args(typ))}")
        if self.writer is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", self.writer):
            out.append(f"writer {self.writer!r} must be 1-100 letters, digits, '.', '_' or '-'")
        return out

    def _loss_problems(self) -> list[str]:
        """The loss choice's own knobs: dual clip, GSPO's band, IcePop's band, rejection, distillation."""
        out: list[str] = []
        if self.dual_clip is not None and not 1 < self.dual_clip < math.inf:
            out.append(f"dual_clip must be > 1 (the dual-clip paper uses 3), got {self.dual_clip}; leave it out "
                       "to turn it off")
        if not (0 <= self.seq_clip_low < 1 and 0 <= self.seq_clip_high < math.inf):
            out.append(f"seq_clip_low must be in [0, 1) and seq_clip_high >= 0 (got {self.seq_clip_low}, "
                       f"{self.seq_clip_high}; GSPO uses 3e-4 and 4e-4)")
        if self.mask_ratio is not None and not (len(self.mask_ratio) == 2
                                                and 0 < self.mask_ratio[0] < 1 < self.mask_ratio[1] < math.inf):
            out.append(f"mask_ratio must be LOW,HIGH with 0 < LOW < 1 < HIGH (got {self.mask_ratio}; "
                       "IcePop uses 0.5,5)")
        if self.reject == "geo" and not 0 < self.reject_low < 1 < self.reject_high < math.inf:
            out.append(f"reject geo needs 0 < low < 1 < high (got {self.reject_low}, {self.reject_high}); "
                       "e.g. --reject geo:0.5,2")
        if self.reject == "k3" and not 0 < self.reject_high < math.inf:
            out.append(f"reject k3 needs a bound > 0 (got {self.reject_high}); e.g. --reject k3:0.05")
        if not (0 <= self.distill_reward_coef < math.inf):
            out.append(f"distill_reward_coef must be >= 0 and finite (got {self.distill_reward_coef})")
        if self.loss == "distill" and not self.teacher:
            out.append("loss distill needs teacher: the --name a `trajstore annotate` run wrote the teacher's "
                       "logprobs under")
        if self.teacher is not None and self.loss != "distill":
            out.append(f"teacher {self.teacher!r} is only read by loss distill (got loss {self.loss!r})")
        return out

    def check(self) -> None:
        """Raise SettingsError listing every problem, if there is any."""
        problems = self.problems()
        if problems:
            raise SettingsError(problems)

    def _checkpoint_uri_problems(self) -> list[str]:
        if self.checkpoint_uri in (None, "none"):
            return []
        from trajstore.location import directory  # pyarrow: not at import, `--help` stays fast

        uri = self.checkpoint_uri
        if not uri or uri.strip() != uri:
            return [f"checkpoint_uri {uri!r}: give s3://bucket/prefix, a directory every host mounts, or none"]
        try:
            _, where = directory(uri)
        except ValueError as exc:
            return [f"checkpoint_uri: {exc}, or none"]
        if "://" not in uri and Path(where) == Path(self.checkpoints).resolve():
            return [f"checkpoint_uri {uri!r} is the --checkpoints directory itself; give a directory every host "
                    "mounts, an s3:// URI, or none"]
        return []

    @property
    def publish_uri(self) -> str | None:
        """Where versions are uploaded for other hosts (`learner.checkpoints.upload`), or None."""
        if self.checkpoint_uri == "none":
            return None
        if self.checkpoint_uri is not None:
            return self.checkpoint_uri.rstrip("/")
        from trajstore.location import is_remote

        if is_remote(self.store):
            return f"{self.store.rstrip('/')}/checkpoints/{_WRITER_UNSAFE.sub('_', self.run)}"
        return None

    @property
    def groups_per_version(self) -> int:
        """What collectors pace admission by: groups trained into each published version."""
        return self.groups_per_step * self.publish_every

    @property
    def writer_name(self) -> str:
        """The explicit writer name, else the prefix the store completes with the machine's id."""
        return self.writer or ("learner-" + _WRITER_UNSAFE.sub("_", self.run))[:100]

    def resolved(self) -> dict[str, Any]:
        """The settings as JSON-ready values with absolute local paths (written beside each checkpoint)."""
        out = asdict(self)
        out["model"] = str(Path(self.model).resolve())
        out["checkpoints"] = str(Path(self.checkpoints).resolve())
        if "://" not in self.store:
            out["store"] = str(Path(self.store).resolve())
        out["writer"] = self.writer_name
        uri = self.publish_uri
        out["checkpoint_uri"] = uri if uri is None or "://" in uri else str(Path(uri).resolve())
        return out


@dataclass(frozen=True)
class WarmStartSettings:
    """One warm start's settings; saved with its checkpoint."""

    steps: int = 200
    lr: float = 1e-2  # for a model built on the spot; a pretrained model wants far less (1e-5)
    batch_size: int = 16
    seed: int = 0
    warmup_steps: int = 10  # linear warm-up, then cosine decay to lr / 10
    weight_decay: float = 0.0

    def problems(self) -> list[str]:
        """Every invalid setting at once, each with what would fix it."""
        out = []
        if self.steps < 1:
            out.append(f"steps must be >= 1 (got {self.steps})")
        if not self.lr > 0:
            out.append(f"lr must be > 0 (got {self.lr})")
        if self.batch_size < 1:
            out.append(f"batch_size must be >= 1 (got {self.batch_size})")
        if self.warmup_steps < 0:
            out.append(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.weight_decay < 0:
            out.append(f"weight_decay must be >= 0 (got {self.weight_decay})")
        return out
