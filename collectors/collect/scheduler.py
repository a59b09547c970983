"""The collection loop of `trajstore collect`: admit groups, run their slots, poll the store.

`Collection.schedule` walks the (task, epoch) plans of `collectors.collect.resume` in order. Each
group waits for admission (`collectors.collect.admission`, when a staleness bound is set), then its
slots start as concurrency allows; a slot retries failed or timed-out attempts. Alongside,
`poll_forever` reads the store: the learner's newest checkpoint (loaded by
`collectors.collect.reload`) and, for admission, every group of the run. Admission (a staleness bound,
`--follow`) waits on those reads, so they come every `poll_interval_s`; a run without it reads
only to notice checkpoints, every `RELOAD_POLL_S` at most, since each read pins a store
snapshot (about 0.1 s of CPU that the rollouts need more).

Concurrency is `concurrency` worker tasks taking slots from a short hand-off queue that the
admission loop keeps filled (at most one group's slots ahead). A worker that finishes a slot
takes the next one in the same event-loop turn: under load a loop turn is long, and a slot
started through a semaphore, a task per slot and `asyncio.wait` waited several of them, so
most slots sat empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from collectors.collect.admission import (
    LocalGroup,
    StoreGroup,
    admissible,
    count_pending,
    read_collectors,
    read_group_rows,
    room,
    share,
    staleness_if_admitted,
    turn_now,
)
from collectors.collect.progress import Progress
from collectors.collect.reload import Reloader, read_head
from collectors.collect.resume import GroupPlan, PastRollout, orphans, plans, read_history
from collectors.collect.rollout import Job, Outcome, RolloutEnv, play
from collectors.collect.settings import CollectSettings
from collectors.collect.tasks import task_id
from trajstore import Follower, Status, Store, new_id
from trajstore.announcement import Announcement
from trajstore.schema import TRAINABLE_STATUSES

log = logging.getLogger(__name__)
RELOAD_POLL_S = 5.0  # store reads without admission to feed: hot reload alone need not be prompt


@dataclass
class _Group:
    plan: GroupPlan
    group_id: str
    left: int  # slots still running
    usable: int  # slots with a usable rollout (including those done before this run)


@dataclass(frozen=True)
class _Start:
    """One slot of an admitted group, waiting for a worker."""

    group: _Group
    slot: int
    attempt: int  # its first attempt


@dataclass
class Collection:
    """The shared state of one `collect` call."""

    settings: CollectSettings
    store: Store
    env: RolloutEnv
    reloader: Reloader
    progress: Progress
    stop: asyncio.Event
    needs_reward: bool
    head: Announcement | None = None  # the learner's newest announcement
    store_groups: list[StoreGroup] = field(default_factory=list)
    local: dict[str, LocalGroup] = field(default_factory=dict)
    collectors: list[str] = field(default_factory=list)  # the run's active collectors, at the last poll
    admitted_since_poll: int = 0  # groups this collector admitted since the last poll read the store
    tick: int = 0
    polled: asyncio.Event = field(default_factory=asyncio.Event)
    follower: Follower = field(init=False)  # polls read only what is new since the last one

    def __post_init__(self) -> None:
        self.follower = self.store.follower()

    # ------------------------------------------------------------ the store poller
    def _read(self) -> tuple[Announcement | None, list[StoreGroup] | None, list[str]]:
        run = self.settings.run
        with self.follower.snapshot() as snap:
            head = read_head(snap, run)
            if self.settings.max_staleness is None:
                return head, None, []
            return head, read_group_rows(snap, run), read_collectors(snap, run)

    async def poll_once(self) -> None:
        self.tick += 1
        tick, admitted = self.tick, self.admitted_since_poll
        try:
            self.head, groups, self.collectors = await asyncio.to_thread(self._read)
        except Exception as exc:  # noqa: BLE001 - a failed poll is retried at the next one
            log.warning("reading the store failed (%s); retrying", exc)
            return
        if groups is not None:
            self.store_groups = groups
            self.admitted_since_poll -= admitted  # the store shows those now; later ones count on
        # a group that finished before this poll began is in its rows: the store knows it from now on
        for gid in [g for g, loc in self.local.items() if loc.done and loc.done_tick < tick]:
            del self.local[gid]
        await self.reloader.sync(self.head)
        p = self.progress
        p.served_version, p.latest_version = self.reloader.served, self.latest_version
        p.reloads, p.reload_failures, p.reload_error = (self.reloader.reloads, self.reloader.failures,
                                                        self.reloader.last_error)
        self.polled.set()
        self.polled = asyncio.Event()

    @property
    def latest_version(self) -> int | None:
        """The learner's newest announced version (None before it announced itself)."""
        return self.head.version if self.head is not None else None

    @property
    def poll_every_s(self) -> float:
        s = self.settings
        if s.follow or s.max_staleness is not None:
            return s.poll_interval_s
        return max(s.poll_interval_s, RELOAD_POLL_S)

    async def poll_forever(self, done: asyncio.Event) -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.poll_every_s)
            if not done.is_set():
                await self.poll_once()

    async def _next_poll(self) -> None:
        """Wait for the next store poll (or for `stop`)."""
        waiters = {asyncio.ensure_future(self.stop.wait()), asyncio.ensure_future(self.polled.wait())}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    # ------------------------------------------------------------ admission
    async def admit(self, plan: GroupPlan) -> tuple[str, tuple[tuple[int, int], ...]] | None:
        """Wait until the group may start: its id and the (slot, attempt) pairs to run; None when stopped."""
        s = self.settings
        if s.follow:
            while self.head is None and not self.stop.is_set():
                self.progress.waiting = f"the learner of run {s.run} has not announced itself yet (checkpoint v0)"
                await self._next_poll()
        while not self.stop.is_set():  # `else` below: stopped while waiting
            served, k = self.reloader.served, s.max_staleness
            if k is None:
                break
            g = s.groups_per_version or (self.head.groups_per_version if self.head is not None else None)
            if g is None:
                self.progress.waiting = ("the learner has not announced groups_per_version (its checkpoint v0); "
                                         "pass --groups-per-version to start without it")
                await self._next_poll()
                continue
            latest = served if self.head is None else self.head.version
            p = count_pending(self.store_groups, self.local, latest=self.latest_version, max_staleness=k,
                              exclude=plan.group_id)
            # the room the last poll saw is shared with the run's other collectors (`admission`'s docstring)
            mine = share(room(latest, served, p - self.admitted_since_poll, g, k), self.collectors, self.env.collector,
                         turn_now())
            if room(latest, served, p, g, k) > 0 and self.admitted_since_poll >= mine:
                others = len(set(self.collectors) - {self.env.collector})
                self.progress.waiting = (f"admitted this collector's share of the room ({mine} group(s); {others} "
                                         "other collector(s) of the run) since the last store poll")
                await self._next_poll()
                continue
            oldest = min(served, plan.oldest_version) if plan.oldest_version is not None else served
            if admissible(latest, oldest, p, g, k):
                break
            if plan.group_id is not None and admissible(latest, served, p, g, k):
                log.info("group %s of task %s epoch %d is too stale to finish; starting a fresh group", plan.group_id,
                         plan.task_id, plan.epoch)
                plan = GroupPlan(plan.task, plan.task_id, plan.epoch, None, tuple((i, 0) for i in range(s.n)))
                break
            self.progress.waiting = (f"staleness would be {staleness_if_admitted(latest, served, p, g)} > {k} "
                                     f"(learner at v{latest}, serving v{served}, {p} groups pending, {g} per version)")
            await self._next_poll()
        else:
            return None
        self.progress.waiting = None
        self.admitted_since_poll += s.max_staleness is not None
        group_id = plan.group_id or new_id()
        served = self.reloader.served
        self.local[group_id] = LocalGroup(served if plan.oldest_version is None else min(served, plan.oldest_version))
        return group_id, plan.todo

    # ------------------------------------------------------------ running slots
    def usable(self, outcome: Outcome) -> bool:
        return outcome.status in TRAINABLE_STATUSES and (bool(outcome.rewards) or not self.needs_reward)

    async def run_slot(self, group: _Group, slot: int, first_attempt: int) -> None:
        s, p = self.settings, self.progress
        try:
            for attempt in range(first_attempt, first_attempt + s.retries + 1):
                if self.stop.is_set():
                    break
                p.retries += attempt > first_attempt
                job = Job(group.plan.task, group.plan.task_id, group.plan.epoch, group.group_id, slot, attempt, s.n,
                          self.reloader.served)
                p.in_flight += 1
                try:
                    outcome = await play(job, self.env, self.stop)
                except Exception as exc:  # noqa: BLE001 - the proxy refused to open or close it: a failed attempt
                    log.error("rollout of task %s slot %d attempt %d failed at the proxy: %s", job.task_id, slot, attempt,
                              exc)
                    outcome = Outcome("failed", error=str(exc), retry=True)
                finally:
                    p.in_flight -= 1
                reward = sum(outcome.rewards.values()) if outcome.rewards else None
                p.finished(outcome.status, reward if self.usable(outcome) else None, outcome.facts.min_version,
                           outcome.facts.output_tokens)
                if outcome.status == "failed" or outcome.error:
                    log.info("rollout %s (task %s slot %d attempt %d): %s: %s", outcome.rollout_id, job.task_id, slot,
                             attempt, outcome.status, (outcome.error or "")[:300])
                if self.usable(outcome):
                    group.usable += 1
                    break
                if not outcome.retry:
                    break
        finally:
            group.left -= 1
            if group.left == 0:
                complete = group.usable >= s.n
                p.groups_complete += complete
                p.groups_incomplete += not complete
                local = self.local.get(group.group_id)
                if local is not None:
                    local.done, local.complete, local.done_tick = True, complete, self.tick

    async def schedule(self, tasks: list[dict[str, Any]]) -> None:
        s, p = self.settings, self.progress
        history = await asyncio.to_thread(read_history, self.store, s.run)
        history = await self.close_orphans(history, {task_id(t) for t in tasks})
        epochs = None if s.forever or s.follow else s.epochs
        # admitted slots wait here for a worker; small, so a group is admitted only shortly before it runs
        starts: asyncio.Queue[_Start | None] = asyncio.Queue(maxsize=min(s.concurrency, s.n))
        errors: list[BaseException] = []
        workers = [asyncio.create_task(self._work(starts, errors)) for _ in range(s.concurrency)]
        try:
            for plan in plans(tasks, history, n=s.n, epochs=epochs, needs_reward=self.needs_reward):
                if self.stop.is_set():
                    break
                if not plan.todo:
                    p.groups_skipped += 1
                    continue
                admitted = await self.admit(plan)
                if admitted is None:
                    break
                group_id, todo = admitted
                group = _Group(plan, group_id, left=len(todo), usable=s.n - len(todo))
                for index, (slot, attempt) in enumerate(todo):
                    # no race with `stop` needed: once it is set, workers end their slots quickly and
                    # drop whatever is queued, so this put returns
                    await starts.put(_Start(group, slot, attempt))
                    if self.stop.is_set():
                        group.left -= len(todo) - index - 1  # never queued: the group stays partial for the next run
                        break
            for _ in workers:
                await starts.put(None)
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
        if errors:
            raise errors[0]

    async def _work(self, starts: asyncio.Queue[_Start | None], errors: list[BaseException]) -> None:
        """One concurrency slot: run queued slots one after another until told to end (None)."""
        while (start := await starts.get()) is not None:
            if self.stop.is_set():
                start.group.left -= 1  # never started: the group stays partial for the next run
                continue
            try:
                await self.run_slot(start.group, start.slot, start.attempt)
            except Exception as exc:  # noqa: BLE001 - a bug in one slot must not stall the others; raised at the end
                log.exception("running slot %d of group %s failed", start.slot, start.group.group_id)
                errors.append(exc)

    async def close_orphans(self, history: list[PastRollout], task_ids: set[str]) -> list[PastRollout]:
        found = orphans(history, task_ids)
        if found:
            with self.store.writer(self.store.unique_writer_name(f"collect-resume-{self.env.collector}-")) as writer:
                await asyncio.to_thread(writer.append, [Status(
                    run=self.settings.run, group_id=r.group_id, rollout_id=r.rollout_id, status="aborted",
                    error="its collector stopped without closing it (closed when the run resumed)",
                    meta={"task_id": r.task_id, "epoch": r.epoch, "slot": r.slot, "attempt": r.attempt})
                    for r in found])
            self.progress.orphans_closed = len(found)
        ids = {r.rollout_id for r in found}
        return [replace(r, status="aborted") if r.rollout_id in ids else r for r in history]

