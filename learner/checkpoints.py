"""The checkpoint directory: atomic numbered versions the collectors load, and the learner resumes from.

Layout (the contract between learner and collectors; they share nothing else but the store):

    CKPTS/v000001/   config.json, model.safetensors, tokenizer files, chat_template.jinja,
                     generation_config.json                      (full weights)
                     or adapter_config.json, adapter_model.safetensors, tokenizer files (LoRA;
                     base_model_name_or_path = absolute path of the base model directory)
                     trajstore_checkpoint.json  {"version", "step", "parent", "run", "table_version",
                                                 "consumed", "adapter", "base_model", "metrics", "settings",
                                                 "learner_state": learner_state.pt's size and sha256}
                     learner_state.pt           optimizer state (keyed by parameter name, full: the same
                                                whatever the number of ranks) and RNG states (learner-private)
                     trajstore_manifest.json    when uploaded for other hosts: every other file's size and
                                                sha256 (trajstore.artifacts), the same as in URI/v000001/

A version is written under `CKPTS/.partial-v000001-<random>/`, every file and the directory
fsynced, then renamed into place: a reader sees a whole version or none. A `.partial-*`
directory is what a crash left behind (or a version being written): readers skip it, and the
learner that owns the directory removes leftovers when it starts (`published(clean=True)`).

The store learns of a version from its announcement (`checkpoint_event`: a
`trajstore.announcement.Announcement`, the type collectors read back), appended after
the rename with the deterministic id `checkpoint:{run}:{version}`: after a crash between the
rename and the append, the resumed learner appends the same event again from the JSON here.
Version 0 is the initial model, announced by `initial_event` so that collectors know the
learner's batch size before the first checkpoint.

Other hosts cannot read CKPTS. With a checkpoint URI (`LearnSettings.publish_uri`: by default
`<store>/checkpoints/<run>` for an `s3://` store), `upload` also publishes each version at
`URI/v000001/` through `trajstore.artifacts` (files, then a manifest of sizes and sha256s)
before the event is appended, and the event's meta names it: `uri` (where every host finds it)
and `digest` (the manifest's sha256) beside `path` (this host's directory). A crash mid-upload
leaves no manifest: readers ignore it, and the resumed learner uploads the version again before
announcing it.

Resuming on another host (a preempted machine, a spare): learner_state.pt is uploaded beside
the version, first and outside the manifest (collectors never download it), and
trajstore_checkpoint.json, which the manifest lists, records its size and sha256. A learner
whose CKPTS lacks the store's newest version `fetch`es it (files checked against the announced
digest, the state against the recorded sha256) into CKPTS and resumes from it as from its own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from learner import distributed
from learner.distributed import GatheredState
from learner.errors import LearnerError
from trajstore import ArtifactError, Checkpoint, artifacts
from trajstore.announcement import Announcement
from trajstore.durable import staged_directory

INFO_FILE = "trajstore_checkpoint.json"
STATE_FILE = "learner_state.pt"
PARTIAL_PREFIX = ".partial-"
# copied from the initial model so that every version is a self-describing, servable directory
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                                    "generation_config.json")


class CheckpointError(LearnerError):
    """A checkpoint directory is not what the contract says it should be."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What `trajstore_checkpoint.json` of one published version says."""

    path: Path
    version: int
    step: int
    parent: int | None
    run: str
    table_version: int | None
    consumed: tuple[str, ...]
    adapter: bool
    base_model: str
    metrics: dict[str, float]
    settings: dict[str, Any]
    learner_state: dict[str, Any] | None = None  # STATE_FILE's size and sha256 (None: written before they were)


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def _copy_tokenizer(tokenizer_dir: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, dest / name)


def _keep_compat_keys(initial: Path, dest: Path) -> None:
    """Keys the initial config.json carried that transformers did not write back (older loaders'
    names such as `torch_dtype`, `rope_theta`, which vLLM pinned to transformers 4 reads)."""
    source, written = initial / "config.json", dest / "config.json"
    if not (source.is_file() and written.is_file()):
        return
    old, new = json.loads(source.read_text()), json.loads(written.read_text())
    merged = {**{k: v for k, v in old.items() if k not in new}, **new}
    if merged != new:
        written.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")


def publish(root: str | Path, version: int, step: int, model: torch.nn.Module, tokenizer_dir: str | Path,
            optimizer: torch.optim.Optimizer, *, info: Mapping[str, Any], adapter: bool,
            gathered: GatheredState | None = None) -> Path:
    """Write version `version` atomically under `root` and return its directory.

    `model` is the policy (a PeftModel when `adapter`); `tokenizer_dir` the initial model's
    directory, whose tokenizer files (and, for an adapter, weights) the version refers to.
    `info` fills trajstore_checkpoint.json (run, parent, table_version, consumed, metrics,
    settings, ...); version, step, adapter and base_model are set here. Under FSDP2, `gathered`
    holds the full weights and optimizer state (`learner.distributed.gather_state`, rank 0).
    """
    root = Path(root)
    final = version_dir(root, version)
    if final.exists():
        raise CheckpointError(f"{final} already exists; versions only go up. Another learner may be publishing "
                              "into this checkpoint directory; give each run its own --checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    base = Path(tokenizer_dir).resolve()
    with staged_directory(final, PARTIAL_PREFIX) as tmp:
        if adapter:
            from learner.lora import save_adapter  # peft only when LoRA is on

            save_adapter(model, tmp, base)  # type: ignore[arg-type]
        else:
            weights = {}
            if gathered is not None:  # a tied copy (lm_head of a tied model) is saved once, as save_pretrained does
                tied = getattr(model, "all_tied_weights_keys", None) or {}
                weights = {"state_dict": {k: v for k, v in gathered.weights.items() if k not in tied}}
            model.save_pretrained(str(tmp), safe_serialization=True, **weights)  # type: ignore[operator]
            _copy_tokenizer(base, tmp)
            _keep_compat_keys(base, tmp)
        optimizer_state = gathered.optimizer if gathered is not None else distributed.optimizer_state(model, optimizer)
        torch.save(_learner_state(optimizer_state), tmp / STATE_FILE)
        record = {**dict(info), "version": version, "step": step, "adapter": adapter, "base_model": str(base),
                  "consumed": list(info.get("consumed", ())),
                  "learner_state": artifacts.file_entry(tmp / STATE_FILE)}  # how a learner elsewhere checks it
        (tmp / INFO_FILE).write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    return final


def _learner_state(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {"optimizer": optimizer_state, "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def read_info(path: str | Path) -> CheckpointInfo:
    """The CheckpointInfo of one version directory."""
    path = Path(path)
    try:
        raw = json.loads((path / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / INFO_FILE} cannot be read ({exc}); a published version always has it, "
                              f"so {path} was not written by `trajstore learn`: move it out of the directory") from exc
    return CheckpointInfo(
        path=path, version=int(raw["version"]), step=int(raw["step"]), parent=raw.get("parent"),
        run=str(raw.get("run", "default")), table_version=raw.get("table_version"),
        consumed=tuple(raw.get("consumed", ())), adapter=bool(raw.get("adapter", False)),
        base_model=str(raw.get("base_model", "")), metrics=dict(raw.get("metrics") or {}),
        settings=dict(raw.get("settings") or {}), learner_state=raw.get("learner_state"),
    )


def published(root: str | Path, *, clean: bool = False) -> list[CheckpointInfo]:
    """Every published version under `root`, oldest first. `clean` removes `.partial-*` leftovers of a
    crash mid-publish: only the learner that owns `root`, when it starts, may do that (a reader
    that did would delete a version its learner is writing)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(PARTIAL_PREFIX):
            if clean:
                shutil.rmtree(entry, ignore_errors=True)  # a crash mid-publish; never visible as a version
        elif entry.is_dir() and entry.name.startswith("v") and entry.name[1:].isdigit():
            out.append(read_info(entry))
    return sorted(out, key=lambda info: info.version)


def latest(root: str | Path) -> CheckpointInfo | None:
    """The newest published version under `root`, or None (reads only; see `published`)."""
    versions = published(root)
    return versions[-1] if versions else None


@dataclass(frozen=True)
class LearnerState:
    optimizer: dict[str, Any]
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


def load_state(info: CheckpointInfo) -> LearnerState:
    """The optimizer and RNG states saved with a version (load them with `restore`)."""
    raw = torch.load(info.path / STATE_FILE, map_location="cpu", weights_only=True)
    return LearnerState(optimizer=raw["optimizer"], torch_rng=raw["torch_rng"], cuda_rng=raw.get("cuda_rng"))


def restore(state: LearnerState, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Put the saved optimizer and RNG states back (after the model's weights are loaded, and sharded
    under FSDP2: each rank keeps its part of the optimizer state)."""
    distributed.load_optimizer_state(model, optimizer, state.optimizer)
    torch.set_rng_state(state.torch_rng)
    if state.cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state.cuda_rng)


def upload(info: CheckpointInfo, base_uri: str) -> tuple[str, str]:
    """Publish a version at `base_uri`/v000001 where every host can read it; returns (its URI, its digest).

    The learner state goes beside it, outside the manifest (collectors never download it), so that a
    learner on any host can resume from the version (`fetch`)."""
    uri = f"{base_uri.rstrip('/')}/{info.path.name}"
    if (info.path / STATE_FILE).is_file():
        artifacts.upload_beside(info.path / STATE_FILE, uri)
    return uri, artifacts.upload(info.path, uri, exclude=(STATE_FILE,))


def fetch(announced: Announcement, root: str | Path) -> CheckpointInfo:
    """Bring an announced version, published by a learner on another host, into this learner's `root`:
    its files, verified against the announced digest, and its learner state, verified against the
    size and sha256 its trajstore_checkpoint.json records; then it is a version of `root` like any other.
    Raises CheckpointError saying what to do when that cannot be done."""
    root = Path(root)
    where = f"version {announced.version} of run {announced.run!r}"
    if announced.uri is None or announced.digest is None:
        raise CheckpointError(
            f"the store's newest checkpoint of run {announced.run!r} is version {announced.version} (step "
            f"{announced.step}), in {announced.path} on the host of the learner that published it, but it was not "
            f"published where other hosts can read it, and {root} does not hold it. Resume there with --checkpoints "
            f"{announced.path}, or copy that directory here; to resume on any host, publish checkpoints for every "
            "host (an s3:// store does by default; else --checkpoint-uri), or start a new run with another --run")
    staging = root / f"{PARTIAL_PREFIX}fetch"  # removed by the next start if this one is killed
    try:
        copy = artifacts.fetch(announced.uri, staging, expect=announced.digest)
        info = read_info(copy)
        if info.learner_state is None:
            raise CheckpointError(
                f"{where} at {announced.uri} was published without its learner state (by an older trajstore), so "
                f"no other host can resume from it: resume on the learner's host with --checkpoints "
                f"{announced.path}, or start a new run with another --run")
        artifacts.fetch_beside(announced.uri, STATE_FILE, copy / STATE_FILE, info.learner_state)
        final = version_dir(root, announced.version)
        copy.rename(final)
    except ArtifactError as exc:
        raise CheckpointError(f"cannot resume from {where}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return read_info(final)


def checkpoint_event(info: CheckpointInfo, run: str, metrics: Mapping[str, float], groups_per_version: int,
                     max_staleness: int, published: tuple[str, str] | None = None) -> Checkpoint:
    """The store's announcement of a published version (idempotent: a deterministic event id);
    `published` is what `upload` returned, when the version was uploaded."""
    uri, digest = published if published is not None else (None, None)
    return Announcement(
        run=run, version=info.version, step=info.step, path=str(info.path.resolve()), uri=uri, digest=digest,
        adapter=info.adapter, base_model=info.base_model, groups_per_version=groups_per_version,
        max_staleness=max_staleness, table_version=info.table_version, consumed=info.consumed, metrics=dict(metrics),
    ).to_event()


def initial_event(model_dir: str | Path, run: str, groups_per_version: int, max_staleness: int,
                  settings: Mapping[str, Any] | None = None) -> Checkpoint:
    """Version 0: the initial model, announced by a fresh learner so collectors learn its batch size."""
    path = str(Path(model_dir).resolve())
    return Announcement(run=run, version=0, step=0, path=path, base_model=path, groups_per_version=groups_per_version,
                        max_staleness=max_staleness, settings=settings).to_event()


def missing_events(infos: Sequence[CheckpointInfo], announced: set[int]) -> list[CheckpointInfo]:
    """Published versions whose Checkpoint event the store lacks (a crash between rename and append)."""
    return [info for info in infos if info.version not in announced]
