"""What a collection run has done so far: counters, the live display, and the final summary.

`Progress` is updated by the runner as rollouts start and end. `show` keeps it on screen: a
rich live table on a terminal, or one plain line every few seconds (logs, CI, `--plain`).
`CollectSummary` is what `collect()` returns and the CLI prints as a table at the end.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class CollectSummary:
    """The outcome of one `collect()` call."""

    run: str
    rollouts: dict[str, int]  # final status -> count (completed, truncated, failed, aborted)
    retries: int  # attempts after a slot's first try in this call
    groups_complete: int  # groups this call completed
    groups_incomplete: int  # groups this call worked on that are still not complete
    groups_skipped: int  # groups already complete in the store
    output_tokens: int
    elapsed_s: float
    reward_by_version: dict[int, tuple[float, int]]  # oldest policy version -> (mean reward, rollouts)
    served_version: int
    latest_version: int | None  # newest version the learner published (None: no learner seen)
    reloads: int
    reload_failures: int
    forks: int
    orphans_closed: int
    interrupted: bool
    scored: bool = True  # False with --no-reward: complete groups are collected, not trainable until scored

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_reward(self) -> float | None:
        n = sum(c for _, c in self.reward_by_version.values())
        return sum(m * c for m, c in self.reward_by_version.values()) / n if n else None


@dataclass
class Progress:
    run: str
    started: float = field(default_factory=time.monotonic)
    statuses: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    retries: int = 0
    groups_complete: int = 0
    groups_incomplete: int = 0
    groups_skipped: int = 0
    output_tokens: int = 0
    rewards: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    served_version: int = 0
    latest_version: int | None = None
    reloads: int = 0
    reload_failures: int = 0
    forks: int = 0
    orphans_closed: int = 0
    waiting: str | None = None  # why admission waits, when it does
    server_waits: int = 0  # model calls waiting for an unreachable policy server now (the proxy's count)
    reload_error: str | None = None
    scored: bool = True  # rollouts get a reward (else: groups are collected, unscored)

    def finished(self, status: str, reward: float | None, version: int | None, output_tokens: int) -> None:
        self.statuses[status] += 1
        self.output_tokens += output_tokens
        if reward is not None:
            self.rewards[version if version is not None else self.served_version].append(reward)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def staleness(self) -> int | None:
        return None if self.latest_version is None else self.latest_version - self.served_version

    def summary(self, interrupted: bool) -> CollectSummary:
        return CollectSummary(
            run=self.run, rollouts=dict(self.statuses), retries=self.retries, groups_complete=self.groups_complete,
            groups_incomplete=self.groups_incomplete, groups_skipped=self.groups_skipped,
            output_tokens=self.output_tokens, elapsed_s=self.elapsed,
            reward_by_version={v: (sum(r) / len(r), len(r)) for v, r in sorted(self.rewards.items()) if r},
            served_version=self.served_version, latest_version=self.latest_version, reloads=self.reloads,
            reload_failures=self.reload_failures, forks=self.forks, orphans_closed=self.orphans_closed,
            interrupted=interrupted, scored=self.scored)

    def line(self) -> str:
        s = self.statuses
        rewards = " ".join(f"v{v}:{sum(r) / len(r):.3f}" for v, r in sorted(self.rewards.items()) if r)
        parts = [f"[{self.run}] {self.elapsed:6.0f}s", f"done {s['completed'] + s['truncated']}",
                 f"in flight {self.in_flight}", f"failed {s['failed']}", f"aborted {s['aborted']}",
                 f"groups {self.groups_complete}", f"{self.output_tokens / max(self.elapsed, 1e-9):.1f} tok/s",
                 f"version {self.served_version}" + (f" (staleness {self.staleness})" if self.latest_version is not None
                                                     else ""),
                 f"forks {self.forks}"]
        if rewards:
            parts.append(f"reward {rewards}")
        if self.waiting:
            parts.append(f"waiting: {self.waiting}")
        if self.server_waits:
            parts.append(self.outage)
        if self.reload_error:
            parts.append(f"reload error: {self.reload_error}")
        return " | ".join(parts)

    @property
    def outage(self) -> str:
        return f"policy server unreachable: {self.server_waits} model call(s) waiting for it"

    def table(self) -> Table:
        t = Table(title=f"trajstore collect: run {self.run}", show_header=False, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        s = self.statuses
        rows: list[tuple[str, Any]] = [
            ("elapsed", f"{self.elapsed:.0f} s"),
            ("rollouts done", f"{s['completed'] + s['truncated']} ({s['truncated']} truncated)"),
            ("in flight", self.in_flight), ("failed", s["failed"]), ("aborted", s["aborted"]),
            ("retries", self.retries), ("groups complete", self.groups_complete),
            ("tokens/s", f"{self.output_tokens / max(self.elapsed, 1e-9):.1f}"),
            ("policy version", self.served_version),
            ("staleness (L - v)", "-" if self.staleness is None else self.staleness),
            ("forks", self.forks)]
        rows += [(f"mean reward v{v}", f"{sum(r) / len(r):.4f} over {len(r)}") for v, r in sorted(self.rewards.items())
                 if r]
        if self.waiting:
            rows.append(("waiting", self.waiting))
        if self.server_waits:
            rows.append(("outage", self.outage))
        if self.reload_error:
            rows.append(("reload error", self.reload_error))
        for name, value in rows:
            t.add_row(name, str(value))
        return t


def summary_table(summary: CollectSummary) -> Table:
    t = Table(title=f"run {summary.run}: collected in {summary.elapsed_s:.1f} s"
                    + (" (interrupted; run the same command again to resume)" if summary.interrupted else ""),
              title_justify="left")
    t.add_column("")
    t.add_column("", justify="right")
    rows: list[tuple[str, Any]] = [(f"rollouts {k}", v) for k, v in sorted(summary.rollouts.items())]
    completed = "groups completed" if summary.scored else \
        "groups collected, unscored (not trainable until `trajstore reward` scores them)"
    rows += [("retries", summary.retries), (completed, summary.groups_complete),
             ("groups left incomplete", summary.groups_incomplete),
             ("groups already complete (skipped)", summary.groups_skipped),
             ("output tokens", summary.output_tokens), ("tokens/s", f"{summary.tokens_per_s:.1f}"),
             ("policy version served", summary.served_version),
             ("learner's latest version", "-" if summary.latest_version is None else summary.latest_version),
             ("reloads", summary.reloads), ("reload failures", summary.reload_failures), ("forks", summary.forks),
             ("orphans closed as aborted", summary.orphans_closed)]
    rows += [(f"mean reward, version {v}", f"{m:.4f} ({c})") for v, (m, c) in summary.reward_by_version.items()]
    for name, value in rows:
        t.add_row(name, str(value))
    return t


async def show(progress: Progress, mode: str, stop: asyncio.Event, refresh: Callable[[], Any] | None = None, *,
               stream: TextIO | None = None, plain_every_s: float = 5.0) -> None:
    """Keep `progress` on screen until `stop` is set. `mode`: live | plain | off. `refresh` (async)
    is awaited before each update (e.g. to fetch the proxy's fork count)."""
    if mode == "off":
        await stop.wait()
        return
    stream = stream or sys.stderr
    interval = 0.5 if mode == "live" else plain_every_s

    async def tick() -> bool:
        if refresh is not None:
            await refresh()
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            return True
        return False

    if mode == "live":
        from rich.live import Live

        with Live(progress.table(), console=Console(file=stream), refresh_per_second=4, transient=True) as live:
            while await tick():
                live.update(progress.table())
        return
    while await tick():
        print(progress.line(), file=stream, flush=True)
