"""`trajstore view` over real HTTP on loopback: the JSON API says what the store's views say, errors say
what to change, a pinned version shows what it held, live rows show at once, and nothing is written.

The store: a generated multi-turn run (segments, sub-agents, masks, failures) plus a learner's metric
and checkpoint events, ingested as a user would.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import trajstore
from collectors.replay import load_episode
from collectors.viewer import ViewerSettings, viewer_in_thread
from collectors.viewer.data import jsonable
from trajstore import Checkpoint, Metric
from trajstore.synth import generate_run


def get(url: str, method: str = "GET") -> tuple[int, str, Any]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = reply.read().decode()
            status, kind = reply.status, reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        body, status, kind = exc.read().decode(), exc.code, exc.headers.get("Content-Type", "")
    return status, body, json.loads(body) if "json" in kind else None


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("view")
    events = generate_run(run="walk", groups=6, group_size=4, seed=5)
    path = root / "run.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    store = trajstore.open_store(root / "store")
    store.ingest(path, writer="collector")
    ids = store.query("SELECT rollout_id FROM rollouts WHERE trainable ORDER BY rollout_id LIMIT 8").column(
        "rollout_id").to_pylist()
    with store.writer("learner") as w:
        w.append([Metric(run="walk", step=1, policy_version=0, metrics={"loss": 0.5, "reward_mean": 0.25},
                         consumed=ids),
                  Checkpoint(run="walk", policy_version=1, step=1, consumed=ids, metrics={"loss": 0.5},
                             meta={"path": str(root / "ckpt" / "v000001")})])
    return root / "store"


@pytest.fixture(scope="module")
def viewer(store_dir: Path) -> Iterator[str]:
    with viewer_in_thread(ViewerSettings(store=str(store_dir), port=0)) as url:
        yield url


def test_runs_api_says_what_the_views_say(viewer: str, store_dir: Path) -> None:
    status, _, body = get(f"{viewer}/api/runs")
    assert status == 200
    (run,) = body["runs"]
    store = trajstore.open_store(store_dir, create=False)
    want = store.query("SELECT count(*) AS n, count(*) FILTER (WHERE trainable) AS t, avg(reward) FILTER "
                       "(WHERE trainable) AS r FROM rollouts WHERE run = 'walk'").to_pylist()[0]
    assert (run["run"], run["totals"]["rollouts"], run["totals"]["trainable"]) == ("walk", want["n"], want["t"])
    assert run["totals"]["reward"] == pytest.approx(want["r"])
    by_version = store.query("SELECT min_version AS v, avg(reward) AS r FROM rollouts WHERE trainable "
                             "GROUP BY 1 ORDER BY 1").to_pylist()
    assert [(v["version"], pytest.approx(v["reward"])) for v in run["by_version"]] == [(x["v"], x["r"])
                                                                                      for x in by_version]
    assert set(run["components"]) == {"correct", "format"}
    assert run["steps"]["loss"] == [[1, 0.5]]
    assert [(c["version"], c["consumed"]) for c in run["checkpoints"]] == [(1, 8)]


def test_episode_and_tokens_api_match_replay(viewer: str, store_dir: Path) -> None:
    store = trajstore.open_store(store_dir, create=False)
    rid = store.query("SELECT rollout_id FROM rollouts WHERE segments > 1 ORDER BY rollout_id LIMIT 1"
                      ).column("rollout_id").to_pylist()[0]
    status, _, body = get(f"{viewer}/api/rollouts/{rid}")
    assert status == 200
    assert body["episode"] == jsonable(load_episode(store, rid).as_json())
    assert body["row"]["segments"] == len(body["episode"]["segments"]) > 1
    _, _, tokens = get(f"{viewer}/api/rollouts/{rid}/tokens")
    turns = store.query("SELECT segment_id, turn_index, prompt_ids, output_ids, output_logprobs, output_mask "
                        "FROM turns WHERE rollout_id = ? ORDER BY time, turn_index", [rid]).to_pylist()
    assert len(tokens["turns"]) == len(turns)
    by_key = {(t["segment_id"], t["turn_index"]): t["tokens"] for t in tokens["turns"]}
    for t in turns:
        rows = by_key[(t["segment_id"], t["turn_index"])]
        assert [r["id"] for r in rows] == t["prompt_ids"] + t["output_ids"]
        sampled = [r for r in rows if r["kind"] != "prompt"]
        assert [r["logprob"] for r in sampled] == pytest.approx(t["output_logprobs"])
        mask = t["output_mask"] or [True] * len(t["output_ids"])
        assert [r["kind"] == "sampled" for r in sampled] == mask


def test_group_api_shows_the_advantages_view(viewer: str, store_dir: Path) -> None:
    store = trajstore.open_store(store_dir, create=False)
    status, _, body = get(f"{viewer}/api/groups/walk-g002")
    assert status == 200
    want = {r["rollout_id"]: r for r in store.query("SELECT * FROM advantages WHERE group_id = 'walk-g002'").to_pylist()}
    rows = {r["rollout_id"]: r for r in body["rollouts"]}
    assert set(rows) == set(store.query("SELECT rollout_id FROM rollouts WHERE group_id = 'walk-g002'")
                            .column("rollout_id").to_pylist())
    for rid, a in want.items():
        assert (rows[rid]["grpo"], rows[rid]["rloo"]) == (pytest.approx(a["grpo"]), pytest.approx(a["rloo"]))
    assert body["group"]["size"] == len(rows)


def test_every_page_renders(viewer: str) -> None:
    _, _, listing = get(f"{viewer}/api/rollouts?limit=3")
    first = listing["rows"][0]
    for path in ("/", "/rollouts", f"/rollouts/{first['rollout_id']}", f"/groups/{first['group_id']}",
                 "/rollouts?status=failed", "/rollouts?ckpt=1&run=walk", "/?v=1"):
        status, html, _ = get(viewer + path)
        assert status == 200, (path, html[-600:])
        assert "<footer" in html and "sealed files" in html
    status, css, _ = get(f"{viewer}/static/viewer.css")
    assert status == 200 and ".tok-sampled" in css


@pytest.mark.parametrize(("path", "status", "says"), [
    ("/rollouts?status=done&vmin=x", 400, "status='done' is not one of"),
    ("/api/rollouts?order=best", 400, "order='best' is not one of newest"),
    ("/rollouts?v=abc", 400, "v='abc' is not a table version"),
    ("/?v=999", 404, "table version 999 is not in the store"),
    ("/rollouts/no-such-rollout", 404, "no rollout 'no-such-rollout'"),
    ("/api/groups/no-such-group", 404, "no group 'no-such-group'"),
    ("/nowhere", 404, "pages: /, /rollouts"),
    # values at the limits of the types behind them: each a 400 that says what to change, not a 500
    ("/rollouts?after=0001-01-01T00:00:00%2B01:00|walk-g000-r0", 400, "is not a cursor of this page"),
    ("/api/rollouts?after=9999-12-31T23:59:59-01:00|x", 400, "is not a cursor of this page"),
    ("/api/rollouts?order=reward_asc&offset=99999999999999999999999", 400, "offset=99999999999999999999999 is over"),
    ("/api/rollouts?vmin=99999999999999999999", 400, "vmin=99999999999999999999 is over"),
    ("/api/rollouts?ckpt=99999999999999999999", 400, "ckpt=99999999999999999999 is over"),
    ("/api/rollouts?rmin=1e400", 400, "rmin='1e400' is not a finite number"),
    ("/api/rollouts?rmax=nan", 400, "rmax='nan' is not a finite number"),
    ("/api/runs?v=99999999999999999999", 400, "v=99999999999999999999 is not a table version"),
])
def test_bad_requests_say_what_to_change(viewer: str, path: str, status: int, says: str) -> None:
    got, body, data = get(viewer + path)
    assert got == status
    assert says in (data["error"]["message"] if data else body.replace("&#39;", "'"))
    assert get(f"{viewer}/api/rollouts?limit=1")[0] == 200  # and the server keeps serving


def test_a_damaged_sealed_file_is_a_page_that_names_it_and_the_fix(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "store")
    with store.writer("w") as w:
        w.append(generate_run(run="t", groups=2, group_size=2, seed=1))
    (sealed,) = (tmp_path / "store" / "events").glob("*.parquet")
    data = bytearray(sealed.read_bytes())
    meta = pq.ParquetFile(sealed).metadata
    for group in range(meta.num_row_groups):  # a byte inside every column's pages; the footer stays whole
        for i in range(meta.num_columns):
            chunk = meta.row_group(group).column(i)
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            data[start + chunk.total_compressed_size // 2] ^= 0x5A
    sealed.write_bytes(bytes(data))
    with viewer_in_thread(ViewerSettings(store=str(tmp_path / "store"), port=0)) as url:
        for path in ("/", "/rollouts", "/rollouts/t-g000-r0", "/api/rollouts/t-g000-r0/tokens"):
            status, body, payload = get(url + path)
            message = payload["error"]["message"] if payload else body
            assert status == 500 and "internal error" not in message, (path, message)
            assert sealed.name in message and "trajstore verify --store" in message, (path, message)


def test_the_viewer_only_reads(viewer: str, store_dir: Path) -> None:
    status, body, _ = get(f"{viewer}/rollouts", method="POST")
    assert status == 405 and "only reads" in body
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in store_dir.rglob("*")}
    _, _, listing = get(f"{viewer}/api/rollouts?limit=2")
    for path in ("/", "/api/runs", "/rollouts?order=reward_asc", f"/rollouts/{listing['rows'][0]['rollout_id']}",
                 f"/api/rollouts/{listing['rows'][0]['rollout_id']}/tokens", "/?v=0"):
        assert get(viewer + path)[0] == 200
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in store_dir.rglob("*")} == before


def test_pinned_versions_and_live_rows(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "store")
    events = generate_run(run="t", groups=2, group_size=2, seed=1)
    with store.writer("a") as w:
        w.append(events)
    old = store.version()
    extra = generate_run(run="t2", groups=1, group_size=2, seed=2)
    live = store.writer("live", seal_on_close=False)
    live.append(extra)  # appended, not sealed: only this machine's live rows hold them
    with viewer_in_thread(ViewerSettings(store=str(tmp_path / "store"), port=0)) as url:
        latest = {r["rollout_id"] for r in get(f"{url}/api/rollouts")[2]["rows"]}
        pinned = {r["rollout_id"] for r in get(f"{url}/api/rollouts?v={old}")[2]["rows"]}
        assert pinned == set(store.query("SELECT rollout_id FROM rollouts", version=old).column("rollout_id").to_pylist())
        assert latest - pinned == {"t2-g000-r0", "t2-g000-r1"}
        runs = {r["run"] for r in get(f"{url}/api/runs")[2]["runs"]}
        assert runs == {"t", "t2"} and {r["run"] for r in get(f"{url}/api/runs?v={old}")[2]["runs"]} == {"t"}
        status, html, _ = get(f"{url}/rollouts?v={old}")
        assert status == 200 and f"pinned to table version {old}" in html
    live.close()


def test_settings_are_checked_before_serving(tmp_path: Path) -> None:
    problems = ViewerSettings(store=str(tmp_path), port=70000, model=str(tmp_path)).problems()
    assert any("--port 70000" in p for p in problems) and any("tokenizer_config.json" in p for p in problems)
    with pytest.raises(trajstore.StoreNotFoundError, match="no trajstore store"):
        with viewer_in_thread(ViewerSettings(store=str(tmp_path / "nothing"), port=0)):
            pass
    assert not (tmp_path / "nothing").exists()



def test_the_command_fails_in_one_line_before_serving(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main

    missing = CliRunner().invoke(main, ["view", "--store", str(tmp_path / "nothing"), "--port", "0"])
    assert missing.exit_code == 1 and "no trajstore store at" in missing.output
    trajstore.open_store(tmp_path / "empty")
    bad = CliRunner().invoke(main, ["view", "--store", str(tmp_path / "empty"), "--port", "70000"])
    assert bad.exit_code == 1 and "--port 70000 is not a TCP port" in bad.output
    assert "Example:" in CliRunner().invoke(main, ["view", "--help"]).output


def test_one_runs_extreme_values_do_not_break_the_runs_page(tmp_path: Path) -> None:
    """A finite reward and metric range near the float limit in one run: the runs page (every run's) was a 500."""
    events = generate_run(run="extreme", groups=1, group_size=2, seed=3)
    for event, value in zip([e for e in events if e["kind"] == "reward"], (1.7e308, -1.7e308), strict=False):
        event["reward"] = value
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [*events, *generate_run(run="plain", groups=1,
                                                                                   group_size=2, seed=4)]))
    store = trajstore.open_store(tmp_path / "store")
    store.ingest(path, writer="collector")
    with store.writer("learner") as w:
        w.append([Metric(run="extreme", step=s, policy_version=0, metrics={"loss": v}, consumed=[])
                  for s, v in ((1, 1.7e308), (2, -1.7e308), (3, 5e-324))])
    with viewer_in_thread(ViewerSettings(store=str(tmp_path / "store"), port=0)) as url:
        status, html, _ = get(url + "/")
    assert status == 200, html
    assert "plain" in html and "extreme" in html and html.count("<svg") >= 4
