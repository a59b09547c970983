"""The rollouts table reads only some sealed files, yet every page is exactly what the whole store says.

The store: two generated runs whose events two writers seal in interleaved chunks (so files
overlap in time, as concurrent collectors' do), a checkpoint that consumed some rollouts, and a
tail left unsealed (live rows). For each filter and order, paging to the end with small pages
must give exactly the rows of the `rollouts` view over the *whole* store, filtered and sorted
in Python; the first newest page must open fewer files than the store has.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import trajstore
from collectors.viewer.data import Source
from collectors.viewer.listing import ROW_SQL, FilterError, RolloutFilter, list_rollouts
from trajstore import Checkpoint
from trajstore.synth import generate_run


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> trajstore.Store:
    events = generate_run(run="a", groups=24, group_size=4, seed=1) + generate_run(run="b", groups=12, group_size=3,
                                                                                   seed=2)
    first: dict[str, dict[str, Any]] = {}
    for e in events:  # run a opens each rollout with a `started` status (no version), as the proxy does, a minute early: in another file
        if e["run"] == "a" and (e["rollout_id"] not in first or e["time"] < first[e["rollout_id"]]["time"]):
            first[e["rollout_id"]] = e
    for rid, e in first.items():
        at = datetime.fromisoformat(e["time"].replace("Z", "+00:00")) - timedelta(seconds=60)
        events.append(dict(run="a", group_id=e["group_id"], rollout_id=rid, kind="status", status="started",
                           group_size=4, time=at.isoformat().replace("+00:00", "Z")))
    events.sort(key=lambda e: e["time"])
    s = trajstore.open_store(tmp_path_factory.mktemp("listing") / "store")
    live_from = len(events) - 60
    writers = [s.writer("w0"), s.writer("w1")]
    for k, start in enumerate(range(0, live_from, 40)):  # chunk k goes to writer k % 2, sealed every other chunk
        w = writers[k % 2]
        w.append(events[start:min(start + 40, live_from)])
        if k % 4 >= 2:
            w.seal()
    for w in writers:
        w.close()
    consumed = sorted({e["rollout_id"] for e in events[:200] if e.get("run") == "a"})
    with s.writer("learner") as w:
        w.append([Checkpoint(run="a", policy_version=1, step=1, consumed=consumed)])
    tail = s.writer("tail", seal_on_close=False)
    tail.append(events[live_from:])
    tail.close()
    assert len(s.table.snapshot().files) >= 8 and s.live().by_writer
    return s


def everything(store: trajstore.Store) -> list[dict[str, Any]]:
    return store.query(ROW_SQL).to_pylist()


def expected(rows: list[dict[str, Any]], f: RolloutFilter, consumed: set[str] | None = None) -> list[str]:
    def keep(r: dict[str, Any]) -> bool:
        return ((f.run is None or r["run"] == f.run) and (f.group is None or r["group_id"] == f.group)
                and (f.status is None or r["status"] == f.status) and (f.task is None or r["task"] == f.task)
                and (f.version_min is None or (r["min_version"] is not None and r["min_version"] >= f.version_min))
                and (f.version_max is None or (r["min_version"] is not None and r["min_version"] <= f.version_max))
                and (f.reward_min is None or (r["reward"] is not None and r["reward"] >= f.reward_min))
                and (f.reward_max is None or (r["reward"] is not None and r["reward"] <= f.reward_max))
                and (not f.forked or r["forks"] > 0) and (consumed is None or r["rollout_id"] in consumed))

    kept = [r for r in rows if keep(r)]
    far = float("inf")
    keys = {
        "newest": lambda r: (r["started"], r["rollout_id"]), "oldest": lambda r: (r["started"], r["rollout_id"]),
        "reward_desc": lambda r: (r["reward"] is None, -(r["reward"] or 0), r["rollout_id"]),
        "reward_asc": lambda r: (r["reward"] is None, r["reward"] if r["reward"] is not None else far, r["rollout_id"]),
        "turns_desc": lambda r: (-r["turns"], r["rollout_id"]),
        "tokens_desc": lambda r: (-r["tokens"], r["rollout_id"]),
        "duration_desc": lambda r: (r["duration"] is None, -(r["duration"] or 0), r["rollout_id"]),
    }
    kept.sort(key=keys[f.order], reverse=f.order == "newest")
    return [r["rollout_id"] for r in kept]


def page_through(source: Source, f: RolloutFilter) -> tuple[list[str], list[tuple[int, int]]]:
    ids, reads = [], []
    page: RolloutFilter | None = f
    while page is not None:
        with source.snapshot(None) as snap:
            listing = list_rollouts(snap, page)
        ids += [r["rollout_id"] for r in listing.rows]
        reads.append((listing.files_read, listing.files_total))
        assert len(listing.rows) <= page.limit
        page = listing.next
        assert len(reads) < 200, "paging does not end"
    return ids, reads


CASES = [
    {}, {"order": "oldest"}, {"run": "b"}, {"status": "failed"}, {"status": "truncated", "order": "oldest"},
    {"vmin": "1", "vmax": "1"}, {"vmin": "2"}, {"vmin": "1", "vmax": "1", "order": "oldest"}, {"order": "reward_asc"}, {"order": "reward_desc", "run": "a"},
    {"forked": "1"}, {"rmin": "0.5", "order": "turns_desc"}, {"group": "a-g003"}, {"task": "task-002"},
    {"order": "tokens_desc", "vmax": "0"}, {"order": "duration_desc"}, {"ckpt": "1", "run": "a"},
    {"ckpt": "1", "order": "reward_asc"},
]


@pytest.mark.parametrize("query", CASES, ids=lambda q: "&".join(f"{k}={v}" for k, v in q.items()) or "default")
def test_every_page_agrees_with_the_whole_store(store: trajstore.Store, query: dict[str, str]) -> None:
    f = RolloutFilter.from_query({**query, "limit": "20"})
    consumed = None
    if f.consumed_by is not None:
        consumed = set(store.query("SELECT rollout_id FROM consumed WHERE version = 1").column("rollout_id").to_pylist())
        assert consumed
    want = expected(everything(store), f, consumed)
    got, _ = page_through(Source(store), f)
    assert got == want
    assert len(got) == len(set(got))


def test_the_newest_rollouts_are_the_unsealed_ones(store: trajstore.Store) -> None:
    f = RolloutFilter.from_query({"limit": "5"})
    with Source(store).snapshot(None) as snap:
        listing = list_rollouts(snap, f)
    assert [r["rollout_id"] for r in listing.rows] == expected(everything(store), f)[:5]
    live = {e for batches in store.live().by_writer.values() for b in batches for e in b.column("rollout_id").to_pylist()}
    assert live >= {r["rollout_id"] for r in listing.rows}


def test_the_first_page_opens_only_the_newest_files(tmp_path: Path) -> None:
    """Ids that grow with time (as `trajstore.ids.new_id` mints them, and as the generated run's do within a
    run) let a page of the newest rollouts open only the newest files, whatever the store's size."""
    s = trajstore.open_store(tmp_path / "store")
    events = generate_run(run="solo", groups=30, group_size=4, seed=3)
    with s.writer("w") as w:
        for start in range(0, len(events), 50):
            w.append(events[start:start + 50])
            w.seal()
    source = Source(s)
    for query in ({"limit": "5"}, {"limit": "5", "order": "oldest"}, {"vmin": "0", "vmax": "0", "order": "reward_asc"}):
        f = RolloutFilter.from_query(query)
        with source.snapshot(None) as snap:
            listing = list_rollouts(snap, f)
        assert listing.files_total >= 10 and 0 < listing.files_read <= listing.files_total // 2, query
        assert [r["rollout_id"] for r in listing.rows] == expected(everything(s), f)[:f.limit]


def test_a_pinned_version_lists_what_it_held(store: trajstore.Store, tmp_path: Path) -> None:
    version = store.version()
    with Source(store).snapshot(version) as snap:  # a pinned version has no live rows
        pinned = list_rollouts(snap, RolloutFilter(limit=500))
    sealed_only = store.query(ROW_SQL, version=version).to_pylist()

    def facts(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted((r["rollout_id"], r["turns"], r["status"], r["reward"]) for r in rows)

    assert facts(pinned.rows) == facts(sealed_only)
    assert facts(pinned.rows) != facts(everything(store))  # the live tail is not in the pinned version


def test_bad_queries_are_reported_all_at_once() -> None:
    with pytest.raises(FilterError) as err:
        RolloutFilter.from_query({"status": "done", "vmin": "x", "vmax": "-1", "order": "best", "limit": "9999",
                                  "after": "yesterday", "colour": "red"})
    message = str(err.value)
    for part in ("status='done' is not one of completed", "vmin='x' is not an integer", "vmax='-1' must be >= 0",
                 "order='best' is not one of newest", "limit=9999 is over 500", "after='yesterday' is not a cursor",
                 "unknown parameter 'colour'"):
        assert part in message
    with pytest.raises(FilterError, match="vmin=3 is above vmax=1"):
        RolloutFilter.from_query({"vmin": "3", "vmax": "1"})


def test_a_filter_round_trips_through_its_query_string() -> None:
    f = RolloutFilter(run="a", status="failed", version_min=1, reward_max=0.5, forked=True, order="oldest", limit=20,
                      cursor=(datetime.fromisoformat("2026-01-01T00:00:01+00:00"), "a-g001-r2"))
    assert RolloutFilter.from_query(f.query()) == f
