"""Training shards: complete, fresh, unconsumed groups, oldest first, within a budget, with
each rollout's advantage from the advantages view on every one of its samples.

The hand-built scenario (policy_version 10, max_staleness 2, so the oldest allowed version is 8):

  group  started  versions  state                                         in the shard?
  gC     t=5      9, 10     complete                                      yes, first (oldest)
  gA     t=10     8, 9      complete                                      yes (8 is the bound)
  gB     t=20     7, 9      complete                                      no: a turn older than 8
  gD     t=30     10, 10    one rollout only started                      no: incomplete
  gE     t=40     9, 9, 9   complete, e1 consumed by the checkpoint       no: consumed
  gF     t=50     10, 10    complete                                      yes (unless excluded)
  gG     t=60     9, 9      incomplete: both failed                       no: nothing trainable

The planner reads sealed files selectively (by their statistics), so the same scenario runs
live (unsealed), sealed into one file, and sealed into one file per append call; and a
seeded random store is compared with an oracle written directly against the views.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pytest

import trajstore
from trajstore import Checkpoint, Reward, Status, Turn

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "batch")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def rollout_events(group: str, rollout: str, version: int | list[int], reward: float | None, state: str | None,
                   *, size: int, t: float, run: str = "exp") -> list[Any]:
    """One rollout: a turn per version (one segment), then its reward and status."""
    versions = [version] if isinstance(version, int) else version
    events: list[Any] = [
        Turn(run=run, group_id=group, rollout_id=rollout, segment_id=f"{rollout}-s", turn_index=i,
             policy_version=v, prompt_ids=[i + 1, 2], output_ids=[3 + i, 4], output_logprobs=[-0.5, -0.25],
             time=at(t + i * 0.1))
        for i, v in enumerate(versions)
    ]
    if reward is not None:
        events.append(Reward(run=run, group_id=group, rollout_id=rollout, reward=reward, time=at(t + 1)))
    if state is not None:
        events.append(Status(run=run, group_id=group, rollout_id=rollout, status=state, group_size=size,
                             time=at(t + 2)))
    return events


def scenario_calls() -> list[list[Any]]:
    return [
        rollout_events("gA", "a1", 8, 1.0, "completed", size=2, t=10)
        + rollout_events("gA", "a2", 9, 0.0, "completed", size=2, t=11),
        rollout_events("gB", "b1", [9, 7], 1.0, "completed", size=2, t=20)
        + rollout_events("gB", "b2", 9, 0.0, "completed", size=2, t=21),
        rollout_events("gC", "c1", 9, 3.0, "completed", size=2, t=5)
        + rollout_events("gC", "c2", 10, 1.0, "truncated", size=2, t=6),
        rollout_events("gD", "d1", 10, 1.0, "completed", size=2, t=30)
        + rollout_events("gD", "d2", 10, None, "started", size=2, t=31),
        rollout_events("gE", "e1", 9, 1.0, "completed", size=3, t=40)
        + rollout_events("gE", "e2", 9, 2.0, "completed", size=3, t=41)
        + rollout_events("gE", "e3", 9, 0.0, "completed", size=3, t=42),
        [Checkpoint(run="exp", policy_version=10, step=3, consumed=["e1"], time=at(45))],
        rollout_events("gF", "f1", 10, 0.5, "completed", size=2, t=50)
        + rollout_events("gF", "f2", 10, 0.0, "failed", size=2, t=51)
        + rollout_events("gF", "f3", 10, 2.5, None, size=2, t=52)[:1],  # a third rollout's turn...
        rollout_events("gF", "f3", 10, 2.5, "completed", size=2, t=52)[1:],  # ...finished later
        rollout_events("gG", "g1", 9, 1.0, "failed", size=2, t=60)
        + rollout_events("gG", "g2", 9, 1.0, "failed", size=2, t=61),
    ]


def fill(store: trajstore.Store, calls: list[list[Any]], mode: str, name: str = "shard-w") -> None:
    """Append the calls; `mode` live: leave them unsealed, sealed: one seal, many: seal after each."""
    with store.writer(name, seal_on_close=False) as writer:
        for call in calls:
            writer.append(call)
            if mode == "many":
                writer.seal()
        if mode == "sealed":
            writer.seal()
    if mode != "live":
        assert store.query("SELECT count(*) FROM events").column(0)[0].as_py() == \
            sum(f.rows for f in store.table.snapshot().files)


def view_advantages(store: trajstore.Store) -> dict[str, dict[str, float]]:
    return {r["rollout_id"]: r for r in store.query("SELECT * FROM advantages").to_pylist()}


def summary(shard: trajstore.Shard) -> tuple[Any, ...]:
    return shard.group_ids, shard.rollout_ids


def test_shard_selection(store: trajstore.Store) -> None:
    fill(store, scenario_calls(), "many")  # the planner prunes sealed files: the hard case

    shard = store.shard(policy_version=10, max_staleness=2)
    assert shard.group_ids == ("gC", "gA", "gF")  # oldest first
    assert shard.rollout_ids == ("c1", "c2", "a1", "a2", "f1", "f3")  # trainable ones only (f2 failed)
    assert (shard.policy_version, shard.max_staleness, shard.estimator) == (10, 2, "grpo")
    assert shard.table_version == store.version()
    assert shard.num_rollouts == 6 and len(shard) == 6
    assert shard.num_tokens == sum(r["num_tokens"] for r in shard.samples.to_pylist()) == 6 * 4
    times = store.query("SELECT segment_id, first_time FROM samples").to_pylist()
    first_time = {r["segment_id"]: r["first_time"] for r in times}
    order = [first_time[s] for s in shard.samples.column("segment_id").to_pylist()]
    assert order == sorted(order)  # samples oldest first too

    # staleness: every turn of a group must be at most max_staleness versions old
    assert summary(store.shard(policy_version=10, max_staleness=1))[0] == ("gC", "gF")
    assert summary(store.shard(policy_version=12, max_staleness=2))[0] == ("gF",)
    assert store.shard(policy_version=20, max_staleness=2).rollout_ids == ()

    # budget: a prefix of the oldest groups whose trainable rollouts fit, and at least one group
    assert summary(store.shard(policy_version=10, max_staleness=2, max_rollouts=4))[0] == ("gC", "gA")
    assert summary(store.shard(policy_version=10, max_staleness=2, max_rollouts=5))[0] == ("gC", "gA")
    assert summary(store.shard(policy_version=10, max_staleness=2, max_rollouts=1))[0] == ("gC",)

    # rollouts the learner holds but has not checkpointed are skipped with their groups
    assert summary(store.shard(policy_version=10, max_staleness=2, exclude={"c2", "f1"}))[0] == ("gA",)

    # the checkpoint's consumed rollouts are skipped: without it gE would be in (wider staleness too)
    wide = store.shard(policy_version=10, max_staleness=5)
    assert wide.group_ids == ("gC", "gA", "gB", "gF")
    assert not {"e1", "e2", "e3"} & set(wide.rollout_ids)


def test_consuming_removes_groups_from_later_shards(store: trajstore.Store) -> None:
    fill(store, scenario_calls(), "live")
    first = store.shard(policy_version=10, max_staleness=2, max_rollouts=4)
    assert first.group_ids == ("gC", "gA")
    with store.writer("learner") as learner:
        learner.append([Checkpoint(policy_version=11, step=4, consumed=list(first.rollout_ids),
                                   table_version=first.table_version)])
    nxt = store.shard(policy_version=11, max_staleness=3)
    assert nxt.group_ids == ("gF",)
    consumed = store.query("SELECT rollout_id FROM consumed ORDER BY rollout_id").column(0).to_pylist()
    assert consumed == sorted(["e1", *first.rollout_ids])


def test_shard_advantages_equal_the_advantages_view(store: trajstore.Store) -> None:
    fill(store, scenario_calls(), "sealed")
    view = view_advantages(store)
    for estimator, budget in [(e, b) for e in ESTIMATORS for b in (512, 2)]:  # all, and one group
        shard = store.shard(policy_version=10, max_staleness=2, estimator=estimator, max_rollouts=budget)
        assert shard.estimator == estimator and shard.rollout_ids
        rewards = {s["rollout_id"]: (s["run"], s["reward"]) for s in shard.samples.to_pylist()}
        for s in shard.samples.to_pylist():
            want = view[s["rollout_id"]]
            if estimator == "batch":  # the baseline is the shard's own mean reward (per run)
                same_run = [r for run, r in rewards.values() if run == s["run"]]
                expected = want["reward"] - sum(same_run) / len(same_run)
            else:
                expected = want[estimator]
            assert s["advantage"] == pytest.approx(expected, rel=1e-9, abs=1e-12), (budget, s["rollout_id"])
            assert s["reward"] == want["reward"]


def test_live_and_sealed_shards_are_identical(store: trajstore.Store) -> None:
    fill(store, scenario_calls(), "live")
    calls = [dict(policy_version=10, max_staleness=2, estimator="grpo"),
             dict(policy_version=10, max_staleness=2, estimator="batch"),
             dict(policy_version=10, max_staleness=5, max_rollouts=3, estimator="rloo", exclude=["c1"])]
    live = [store.shard(**c).samples for c in calls]
    with store.writer("shard-w") as writer:
        writer.seal()
    assert not trajstore.wal.list_segments(store.location.wal_root / "shard-w")
    sealed = [store.shard(**c).samples for c in calls]
    for a, b in zip(live, sealed):
        assert a.to_pylist() == b.to_pylist()


def test_a_shard_of_one_run_never_takes_another_runs_group_of_the_same_id(tmp_path: Any) -> None:
    """Issue 12.1: runs "a" and "b" reuse group id "g"; a shard of run "a" holds run a's rollouts
    with advantages computed within run a's group, and a shard over all runs holds both groups."""
    store = trajstore.open_store(tmp_path / "s")
    fill(store, [rollout_events("g", "a1", 5, 1.0, "completed", size=2, t=1, run="a")
                 + rollout_events("g", "a2", 5, 0.0, "completed", size=2, t=2, run="a"),
                 rollout_events("g", "b1", 5, 10.0, "completed", size=2, t=3, run="b"),
                 rollout_events("g", "b2", 5, 30.0, "completed", size=2, t=4, run="b")], "many")
    shard = store.shard(policy_version=5, max_staleness=0, run="a", estimator="dr_grpo")
    assert (shard.group_ids, shard.rollout_ids) == (("g",), ("a1", "a2"))
    assert shard.samples.column("advantage").to_pylist() == [0.5, -0.5]
    both = store.shard(policy_version=5, max_staleness=0, estimator="dr_grpo")
    assert (both.group_ids, both.rollout_ids) == (("g", "g"), ("a1", "a2", "b1", "b2"))
    assert both.samples.column("advantage").to_pylist() == [0.5, -0.5, -10.0, 10.0]
    # a budget of one group takes the oldest (run a's) whole, never a mix of the two
    one = store.shard(policy_version=5, max_staleness=0, max_groups=1)
    assert one.rollout_ids == ("a1", "a2")


def test_invalid_shard_requests_are_refused(store: trajstore.Store) -> None:
    for bad in (dict(estimator="ppo"), dict(max_rollouts=0), dict(max_staleness=-1)):
        with pytest.raises(ValueError):
            store.shard(**{"policy_version": 1, "max_staleness": 1, **bad})
    empty = store.shard(policy_version=1, max_staleness=1)
    assert (len(empty), empty.rollout_ids, empty.group_ids, empty.num_tokens) == (0, (), (), 0)


# ------------------------------------------------------------------ against an oracle


def random_store_calls(seed: int) -> tuple[list[list[Any]], list[str], list[str]]:
    """Groups spread over many append calls (turns, rewards and statuses of one group in
    different calls), stale turns, incomplete groups, failures and consumed rollouts."""
    rnd = random.Random(seed)
    groups = [trajstore.new_id("g-") for _ in range(14)]
    pending: list[list[Any]] = [[] for _ in range(6)]
    consumed: list[str] = []
    for k, group in enumerate(groups):
        size = rnd.randint(2, 4)
        run = "exp" if k != 3 else "other"
        for j in range(size if k % 4 else size - 1):  # every 4th group misses a rollout: incomplete
            rollout = f"{group}-r{j}"
            versions = [rnd.randint(6, 10) for _ in range(rnd.randint(1, 3))]
            state = rnd.choice(["completed", "completed", "completed", "truncated", "failed", None])
            reward = None if rnd.random() < 0.1 else round(rnd.uniform(-1, 2), 3)
            events = rollout_events(group, rollout, versions, reward, state, size=size, t=k * 10 + j, run=run)
            turns = [e for e in events if isinstance(e, Turn)]
            rest = [e for e in events if not isinstance(e, Turn)]
            first = rnd.randrange(len(pending) - 1)
            pending[first] += turns
            pending[rnd.randrange(first, len(pending))] += rest
        if k == 5:
            consumed.append(f"{group}-r0")
    pending[-1].append(Checkpoint(run="exp", policy_version=10, step=1, consumed=consumed, time=at(500)))
    return [call for call in pending if call], consumed, groups


def oracle(store: trajstore.Store, *, policy_version: int, max_staleness: int, max_rollouts: int,
           exclude: list[str], estimator: str, run: str | None = None) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """What a shard must hold, straight from the views over the whole store."""
    lo = policy_version - max_staleness
    with store.snapshot() as snap:
        snap.register("_exclude", pa.table({"rollout_id": pa.array(exclude, pa.string())}))
        groups = snap.query(
            """
            WITH gone AS (SELECT rollout_id FROM consumed UNION ALL SELECT rollout_id FROM _exclude),
                 gone_groups AS (SELECT DISTINCT group_id FROM rollouts JOIN gone USING (rollout_id))
            SELECT group_id, trainable FROM groups
            WHERE complete AND trainable > 0 AND min_version >= $lo AND ($run IS NULL OR run = $run)
              AND group_id NOT IN (SELECT group_id FROM gone_groups)
            ORDER BY started, group_id
            """, {"lo": lo, "run": run}).to_pylist()
        chosen: list[str] = []
        total = 0
        for g in groups:
            total += g["trainable"]
            if total > max_rollouts and chosen:
                break
            chosen.append(g["group_id"])
        # "batch": the baseline is the mean reward of the shard's own trainable rollouts, per run
        advantage = "reward - avg(reward) OVER (PARTITION BY run)" if estimator == "batch" else estimator
        samples = snap.query(
            f"""
            WITH a AS (SELECT *, {advantage} AS adv FROM advantages WHERE list_contains($chosen, group_id))
            SELECT s.rollout_id, s.segment_id, s.tokens, s.loss_mask, s.logprobs, a.adv AS advantage
            FROM samples s JOIN a USING (rollout_id)
            WHERE list_contains($chosen, s.group_id)
            ORDER BY s.rollout_id, s.segment_id
            """, {"chosen": chosen}).to_pylist()
    return tuple(chosen), [tuple(r.values()) for r in samples]


@pytest.mark.parametrize("seed", [1])
def test_shards_across_many_sealed_files_match_the_oracle(store: trajstore.Store, seed: int) -> None:
    calls, consumed, groups = random_store_calls(seed)
    half = len(calls) // 2
    fill(store, calls[:half], "many")  # one sealed file per call...
    with store.writer("late-w", seal_on_close=False, seal_kinds=()) as writer:  # ...and the rest still live
        for call in calls[half:]:
            writer.append(call)
    assert len(store.table.snapshot().files) == half
    assert store.query("SELECT count(*) FROM _live").column(0)[0].as_py() > 0

    requests = [
        dict(policy_version=10, max_staleness=3, max_rollouts=512, exclude=[f"{groups[6]}-r1"], estimator="rloo"),
        dict(policy_version=10, max_staleness=4, max_rollouts=5, exclude=[], estimator="batch"),
        dict(policy_version=11, max_staleness=4, max_rollouts=512, exclude=[], estimator="dr_grpo", run="exp"),
    ]
    nonempty = 0
    for request in requests:
        chosen, samples = oracle(store, **request)
        exclude = request.pop("exclude")
        shard = store.shard(**request, exclude=exclude)
        assert shard.group_ids == chosen, request
        got = sorted((r["rollout_id"], r["segment_id"], r["tokens"], r["loss_mask"], r["logprobs"], r["advantage"])
                     for r in shard.samples.to_pylist())
        assert [g[:5] for g in got] == [s[:5] for s in samples], request
        assert [g[5] for g in got] == pytest.approx([s[5] for s in samples], rel=1e-9, abs=1e-12), request
        assert not set(consumed) & set(shard.rollout_ids)
        nonempty += bool(shard.group_ids)
    assert nonempty >= 2  # the seeds make real shards, not only empty ones
