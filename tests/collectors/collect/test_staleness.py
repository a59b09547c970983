"""Staleness-bounded admission and hot reload: the rule as a pure function, then a live run against a
simulated learner that consumes groups and publishes checkpoints while `collect` runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from collectors.collect.admission import LocalGroup, StoreGroup, admissible, count_pending, room, share
from collectors.collect.reload import Reloader, read_head
from collectors.collect.runner import collect
from collectors.collect.settings import CollectSettings
from collectors.embedded.app import RunningServer
from collectors.policy import EmbeddedClient
from tests.collectors.agents_for_tests import rollout_rows, write_tasks
from trajstore import Checkpoint, Store, open_store
from trajstore.announcement import Announcement

A = "tests.collectors.agents_for_tests"


@pytest.mark.parametrize(("latest", "served", "pending", "g", "k", "ok"), [
    (0, 0, 0, 2, 0, True),  # the first group of a fresh run
    (0, 0, 1, 2, 0, True),  # still trained by version 0
    (0, 0, 2, 2, 0, False),  # would be trained by version 1 but sampled by 0: staleness 1 > 0
    (0, 0, 3, 2, 1, True),
    (0, 0, 4, 2, 1, False),
    (3, 1, 0, 4, 2, True),  # the server lags the learner by 2 versions
    (3, 1, 0, 4, 1, False),
    (3, 3, 7, 4, 1, True),
    (5, 6, 2, 1, 0, False),  # a server ahead of the learner still waits for the backlog
])
def test_admission_rule(latest: int, served: int, pending: int, g: int, k: int, ok: bool) -> None:
    assert admissible(latest, served, pending, g, k) is ok
    assert (room(latest, served, pending, g, k) > 0) is ok  # the room left is the rule, counted


def test_collectors_share_the_room() -> None:
    assert share(4, ["me"], "me") == 4  # alone: the whole room
    assert share(4, ["a", "me"], "me") == 2
    assert share(4, ["a", "b"], "me") == 1  # not yet visible to the others: one at a time
    assert share(0, ["me"], "me") == share(-3, ["me"], "me") == 0
    everyone = ["a", "b", "c"]
    for free in range(7):
        for turn in range(4):  # together they take the room once, the remainder moving with the turn
            assert sum(share(free, everyone, c, turn) for c in everyone) == free
    assert [share(2, everyone, c, 0) for c in everyone] == [1, 1, 0]
    assert [share(2, everyone, c, 1) for c in everyone] == [0, 1, 1]


def group(gid: str, *, consumed: bool = False, running: int = 0, trainable: int = 0, planned: int = 2,
          oldest: int | None = 4) -> StoreGroup:
    return StoreGroup(gid, consumed, running, trainable, planned, oldest)


def test_pending_counts_neither_consumed_nor_dead_groups() -> None:
    stored = [group("consumed", consumed=True, trainable=2), group("complete", trainable=2),
              group("running", running=1, trainable=1), group("dead", trainable=1),  # finished, one short
              group("stale", trainable=2, oldest=1), group("mine-done", trainable=2),
              group("no-turns-yet", running=2, oldest=None)]
    local = {"mine-new": LocalGroup(admitted_version=5), "mine-done": LocalGroup(5, done=True, complete=False),
             "mine-stale": LocalGroup(admitted_version=2)}
    # learner at 5, K=2: a group whose oldest tokens are older than version 3 will never be trained.
    # Pending: complete, running, no-turns-yet, mine-new. Not: consumed, dead, stale, mine-stale, and
    # mine-done (this process saw it finish one short, whatever the last store poll said)
    assert count_pending(stored, local, latest=5, max_staleness=2) == 4
    assert count_pending(stored, local, latest=5, max_staleness=2, exclude="complete") == 3
    # no learner yet: nothing is stale
    assert count_pending(stored, local, latest=None, max_staleness=0) == 6
    assert count_pending(stored, {}, latest=None, max_staleness=0) == 5  # mine-done is complete in the store


def test_a_failed_reload_is_reported_and_retried(server: RunningServer, tiny_model_v2: Path, tmp_path: Path) -> None:
    async def main() -> None:
        client = EmbeddedClient(server.url)
        reloader = Reloader(client, served=server.engine.policy_version)
        start = reloader.served
        assert not await reloader.sync(Announcement(run="r", version=start + 1, step=1, path=str(tmp_path / "nothing-here")))
        assert reloader.failures == 1 and "nothing-here" in (reloader.last_error or "")
        assert reloader.served == start == server.engine.policy_version  # still serving the old weights
        assert not await reloader.sync(Announcement(run="r", version=start + 1, step=1, path=str(tiny_model_v2)))  # backing off
        reloader._retry_at = 0.0  # as if the pause had passed
        assert await reloader.sync(Announcement(run="r", version=start + 1, step=1, path=str(tiny_model_v2)))
        assert reloader.served == server.engine.policy_version == start + 1 and reloader.last_error is None
        await client.aclose()

    asyncio.run(main())


G, K, GROUPS = 2, 1, 6
COMPLETE_UNCONSUMED = """
    SELECT group_id, min(started) AS first FROM rollouts WHERE run = ? GROUP BY group_id
    HAVING count(*) FILTER (WHERE trainable) >= 2 AND count(*) FILTER (WHERE status = 'started') = 0
       AND group_id NOT IN (SELECT r.group_id FROM rollouts r JOIN consumed c USING (rollout_id))
    ORDER BY first
"""


async def fake_learner(store: Store, run: str, base: int, dirs: list[Path],
                       collecting: asyncio.Task[object]) -> list[list[str]]:
    """Consume complete groups oldest first, G per step, publishing version base+1, base+2, ... as checkpoint
    events (alternating between two checkpoint dirs). Returns the groups each version consumed."""
    published: list[list[str]] = []
    with store.writer("fake-learner") as writer:
        while len(published) * G < GROUPS:
            finished = collecting.done()  # checked before the query: the query then sees all it wrote
            rows = (await asyncio.to_thread(store.query, COMPLETE_UNCONSUMED, [run])).to_pylist()
            if len(rows) < G:
                if finished:
                    break
                await asyncio.sleep(0.1)
                continue
            batch = [r["group_id"] for r in rows[:G]]
            consumed = (await asyncio.to_thread(
                store.query, "SELECT rollout_id FROM rollouts WHERE list_contains(?, group_id)", [batch]
            )).column("rollout_id").to_pylist()
            version = base + len(published) + 1
            await asyncio.to_thread(writer.append, [Checkpoint(
                run=run, policy_version=version, step=version, consumed=consumed,
                event_id=f"checkpoint:{run}:{version}",
                meta={"path": str(dirs[version % 2]), "groups_per_version": G, "max_staleness": K})])
            published.append(batch)
    return published


def test_no_group_is_admitted_beyond_the_staleness_bound(server: RunningServer, tiny_model: Path,
                                                         tiny_model_v2: Path, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    served_at_start = server.engine.policy_version  # another test of this module may have reloaded it
    dirs = [tiny_model, tiny_model_v2]
    base = served_at_start  # the learner's versions continue from what the server serves
    with store.writer("learner-start") as w:  # the learner announces itself: version `base`, G groups per step
        w.append([Checkpoint(run="stale", policy_version=base, step=0, event_id=f"checkpoint:stale:{base}",
                             meta={"path": str(tiny_model), "groups_per_version": G, "max_staleness": K})])
    tasks = [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(GROUPS)]
    settings = CollectSettings(store=str(store.location.uri), run="stale", server=server.url, model=str(tiny_model),
                               tasks=write_tasks(tmp_path / "tasks.jsonl", tasks), n=2, max_tokens=8, seed=5,
                               agent=f"{A}:chat", reward=f"{A}:score", max_staleness=K, display="off",
                               poll_interval_s=0.2, rollout_timeout=60, workdir=str(tmp_path / "work"))

    async def main() -> tuple[list[list[str]], object]:
        collecting = asyncio.create_task(collect(settings))
        learner = asyncio.create_task(fake_learner(store, "stale", base, dirs, collecting))
        summary = await collecting
        return await learner, summary

    published, summary = asyncio.run(main())
    assert summary.groups_complete == GROUPS and len(published) == GROUPS // G
    # the last version is published after collection ends; the earlier ones were loaded as they came
    assert summary.reloads >= 1 and server.engine.policy_version == summary.served_version > base

    rows = rollout_rows(store, "stale")
    admitted = {}  # group -> version served when it was admitted
    for row in rows:
        admitted[row["group_id"]] = min(admitted.get(row["group_id"], 1 << 30), row["started_meta"]["policy_version"])
    oldest = {row["group_id"]: row["min_version"] for row in rows}
    for index, batch in enumerate(published):
        trained_by = base + index  # the learner held version base+index when it trained this batch
        for gid in batch:
            assert trained_by - admitted[gid] <= K, (gid, trained_by, admitted[gid])
            assert trained_by - oldest[gid] <= K
    # turns after a reload carry the new version: never older than the version the rollout was admitted at
    turns = store.query("SELECT t.policy_version, json_extract(s.meta, '$.policy_version')::INT AS admitted "
                        "FROM turns t JOIN events s ON s.rollout_id = t.rollout_id AND s.kind = 'status' "
                        "AND s.status = 'started' WHERE t.run = 'stale'").to_pylist()
    assert all(t["policy_version"] >= t["admitted"] for t in turns)
    assert {t["policy_version"] for t in turns} > {base}  # some turns were sampled by reloaded weights
    head = read_head(store, "stale")
    assert head is not None and head.version == base + len(published)


def test_collectors_of_one_run_admit_together_what_the_bound_allows(server: RunningServer, tiny_model: Path,
                                                                   tmp_path: Path) -> None:
    """Two collectors, a learner that announced itself and consumes nothing yet: together they start the
    groups one collector may, (K + 1) * G, plus what one starts before the other sees it, not twice that."""
    store = open_store(tmp_path / "store")
    base = server.engine.policy_version  # the version the shared server serves now
    with store.writer("learner-start") as w:
        w.append([Checkpoint(run="two", policy_version=base, step=0, event_id=f"checkpoint:two:{base}",
                             meta={"path": str(tiny_model), "groups_per_version": G, "max_staleness": K})])
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(12)])

    def settings(i: int) -> CollectSettings:
        return CollectSettings(store=str(store.location.uri), run="two", server=server.url, model=str(tiny_model),
                               tasks=tasks, n=2, max_tokens=4, seed=i, agent=f"{A}:chat", reward=f"{A}:score",
                               max_staleness=K, display="off", poll_interval_s=0.2, rollout_timeout=60,
                               forever=True, workdir=str(tmp_path / f"work{i}"))

    async def main() -> None:
        stop = asyncio.Event()
        runs = [asyncio.create_task(collect(settings(i), stop=stop)) for i in range(2)]

        def complete() -> int:
            return len(store.query(COMPLETE_UNCONSUMED, ["two"]))

        deadline = asyncio.get_running_loop().time() + 90
        while await asyncio.to_thread(complete) < (K + 1) * G:  # the bound's worth, collected
            assert asyncio.get_running_loop().time() < deadline, "the collectors did not fill the bound"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # ten polls more: time for a collector beyond its share to start more
        stop.set()
        await asyncio.gather(*runs)

    asyncio.run(main())
    groups = {row["group_id"] for row in rollout_rows(store, "two")}
    # beyond the bound only what one admits while starting up, before the other can see it (one per poll)
    assert (K + 1) * G <= len(groups) <= (K + 1) * G + 2 < 2 * (K + 1) * G, len(groups)
