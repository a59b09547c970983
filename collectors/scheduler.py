"""The collection loop of `trajstore collect`: admit groups, run their slots, poll the store.

`Collection.schedule` walks the (task, epoch) plans of `collectors.resume` in order. Each
group waits for admission (`collectors.admission`, when a staleness bound is set), then its
slots start as concurrency allows; a slot retries failed or timed-out attempts. Alongside,
`poll_forever` reads the store every `poll_interval_s`: the learner's newest checkpoint
(loaded by `collectors.reload`) and, for admission, every group of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from collectors.admission import (
    LocalGroup,
    StoreGroup,
    admissible,
    count_pending,
    read_group_rows,
    staleness_if_admitted,
)
from collectors.collect_settings import CollectSettings
from collectors.progress import Progress
from collectors.reload import Head, Reloader, read_head
from collectors.resume import GroupPlan, PastRollout, orphans, plans, read_history
from collectors.rollout import Job, Outcome, RolloutEnv, play
from collectors.tasks import task_id
from trajstore import Status, Store, new_id
from trajstore.schema import TRAINABLE_STATUSES

log = logging.getLogger(__name__)


@dataclass
class _Group:
    plan: GroupPlan
    group_id: str
    left: int  # slots still running
    usable: int  # slots with a usable rollout (including those done before this run)


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
    head: Head = field(default_factory=Head)
    store_groups: list[StoreGroup] = field(default_factory=list)
    local: dict[str, LocalGroup] = field(default_factory=dict)
    tick: int = 0
    polled: asyncio.Event = field(default_factory=asyncio.Event)

    # ------------------------------------------------------------ the store poller
    def _read(self) -> tuple[Head, list[StoreGroup] | None]:
        with self.store.snapshot() as snap:
            head = read_head(snap, self.settings.run)
            groups = read_group_rows(snap, self.settings.run) if self.settings.max_staleness is not None else None
        return head, groups

    async def poll_once(self) -> None:
        self.tick += 1
        tick = self.tick
        try:
            self.head, groups = await asyncio.to_thread(self._read)
        except Exception as exc:  # noqa: BLE001 - a failed poll is retried at the next one
            log.warning("reading the store failed (%s); retrying", exc)
            return
        if groups is not None:
            self.store_groups = groups
        # a group that finished before this poll began is in its rows: the store knows it from now on
        for gid in [g for g, loc in self.local.items() if loc.done and loc.done_tick < tick]:
            del self.local[gid]
        await self.reloader.sync(self.head)
        p = self.progress
        p.served_version, p.latest_version = self.reloader.served, self.head.version
        p.reloads, p.reload_failures, p.reload_error = (self.reloader.reloads, self.reloader.failures,
                                                        self.reloader.last_error)
        self.polled.set()
        self.polled = asyncio.Event()

    async def poll_forever(self, done: asyncio.Event) -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.settings.poll_interval_s)
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
            while self.head.version is None and not self.stop.is_set():
                self.progress.waiting = f"the learner of run {s.run} has not announced itself yet (checkpoint v0)"
                await self._next_poll()
        while not self.stop.is_set():  # `else` below: stopped while waiting
            served, k = self.reloader.served, s.max_staleness
            if k is None:
                break
            g = s.groups_per_version or self.head.groups_per_version
            if g is None:
                self.progress.waiting = ("the learner has not announced groups_per_version (its checkpoint v0); "
                                         "pass --groups-per-version to start without it")
                await self._next_poll()
                continue
            latest = served if self.head.version is None else self.head.version
            p = count_pending(self.store_groups, self.local, latest=self.head.version, max_staleness=k,
                              exclude=plan.group_id)
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
        group_id = plan.group_id or new_id()
        served = self.reloader.served
        self.local[group_id] = LocalGroup(served if plan.oldest_version is None else min(served, plan.oldest_version))
        return group_id, plan.todo

    # ------------------------------------------------------------ running slots
    def usable(self, outcome: Outcome) -> bool:
        return outcome.status in TRAINABLE_STATUSES and (bool(outcome.rewards) or not self.needs_reward)

    async def run_slot(self, group: _Group, slot: int, first_attempt: int, limit: asyncio.Semaphore) -> None:
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
            limit.release()
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
        limit = asyncio.Semaphore(s.concurrency)
        running: set[asyncio.Task[None]] = set()
        history = await asyncio.to_thread(read_history, self.store, s.run)
        history = await self.close_orphans(history, {task_id(t) for t in tasks})
        epochs = None if s.forever or s.follow else s.epochs
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
                if not await _acquire(limit, self.stop):
                    group.left -= len(todo) - index  # never started: the group stays partial for the next run
                    break
                task = asyncio.create_task(self.run_slot(group, slot, attempt, limit))
                running.add(task)
                task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)

    async def close_orphans(self, history: list[PastRollout], task_ids: set[str]) -> list[PastRollout]:
        found = orphans(history, task_ids)
        if found:
            with self.store.writer(f"collect-{socket.gethostname()}-{os.getpid()}-resume") as writer:
                await asyncio.to_thread(writer.append, [Status(
                    run=self.settings.run, group_id=r.group_id, rollout_id=r.rollout_id, status="aborted",
                    error="its collector stopped without closing it (closed when the run resumed)",
                    meta={"task_id": r.task_id, "epoch": r.epoch, "slot": r.slot, "attempt": r.attempt})
                    for r in found])
            self.progress.orphans_closed = len(found)
        ids = {r.rollout_id for r in found}
        return [replace(r, status="aborted") if r.rollout_id in ids else r for r in history]


async def _acquire(limit: asyncio.Semaphore, stop: asyncio.Event) -> bool:
    """Take a concurrency slot, unless `stop` comes first."""
    acquire, stopped = asyncio.ensure_future(limit.acquire()), asyncio.ensure_future(stop.wait())
    await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if acquire.done() and not stop.is_set():
        return True
    if acquire.done() and not acquire.cancelled():
        limit.release()
    acquire.cancel()
    return False
