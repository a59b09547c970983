"""Where a learner starts from, on this host or another: its own versions, the run's newest version when a
learner elsewhere published it (`catch_up`), and the announcements the store lacks (`announce_missing`).

A run has one learner at a time, wherever it runs: its identity is the chain of versions the store
announces, not the machine or the writer name. So a learner resumes from the newest announced
version (fetched from where it was published, `learner.checkpoints.fetch`), and never publishes over
a version another learner announced meanwhile (`check_still_newest`): two learners of one run would
train the same rollouts into two versions.
"""

from __future__ import annotations

from learner import checkpoints
from learner.settings import LearnSettings
from trajstore import Store, Writer
from trajstore.announcement import LATEST_SQL, Announcement


def newest_announced(store: Store, run: str) -> Announcement | None:
    """The run's newest announced version (None before its learner announced itself)."""
    rows = store.query(LATEST_SQL, [run]).to_pylist()
    return Announcement.from_row(rows[0]) if rows else None


def catch_up(store: Store, s: LearnSettings,
             infos: list[checkpoints.CheckpointInfo]) -> list[checkpoints.CheckpointInfo]:
    """The versions to resume from: `infos` (this host's), plus the store's newest version when another host's
    learner published it (fetched from where it was published, `checkpoints.fetch`, which refuses at once,
    saying what to do, when it cannot be)."""
    head = newest_announced(store, s.run)
    newest_here = infos[-1].version if infos else 0
    if head is None or head.version <= newest_here:
        return infos
    if head.adapter != s.lora:  # before a download: the same refusal the local check makes
        raise checkpoints.CheckpointError(
            f"run {s.run!r} was trained {'with' if head.adapter else 'without'} LoRA (its version {head.version}); "
            "resume with the same --lora setting")
    try:
        return [*infos, checkpoints.fetch(head, s.checkpoints)]
    except checkpoints.CheckpointError as exc:
        raise checkpoints.CheckpointError(
            f"{s.checkpoints} holds versions of run {s.run!r} only up to {newest_here}, but the store already "
            f"holds checkpoints up to version {head.version}: {exc}") from exc


def check_still_newest(store: Store, run: str, version: int) -> None:
    """Refuse to publish over a version another learner of the run announced meanwhile (a learner thought dead,
    still running on another host): their versions would train the same rollouts twice."""
    head = newest_announced(store, run)
    if head is not None and head.version > version:
        raise checkpoints.CheckpointError(
            f"another learner of run {run!r} announced version {head.version} (step {head.step}, {head.path}) while "
            f"this one trained on version {version}: two learners of one run would train rollouts twice, so this one "
            "stops without publishing. Run one learner per run; restart this one to resume from the newest version")


def announce_missing(store: Store, writer: Writer, s: LearnSettings,
                     infos: list[checkpoints.CheckpointInfo]) -> None:
    """Append the Checkpoint event of every published version the store lacks."""
    known = store.query("SELECT DISTINCT version FROM checkpoints WHERE run = $run", {"run": s.run})
    missing = checkpoints.missing_events(infos, set(known.column("version").to_pylist()))
    if missing:  # uploaded (again: a crash may have cut the upload short) before they are announced
        writer.append([checkpoints.checkpoint_event(i, s.run, i.metrics, s.groups_per_version, s.max_staleness,
                                                    upload(s, i)) for i in missing])


def upload(s: LearnSettings, info: checkpoints.CheckpointInfo) -> tuple[str, str] | None:
    """Publish a version for every host when the settings name a checkpoint URI: (its URI, its digest)."""
    return checkpoints.upload(info, s.publish_uri) if s.publish_uri is not None else None
