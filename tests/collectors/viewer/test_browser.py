"""The viewer in a real headless browser (Debian's chromium, driven by Playwright) over a real run.

A person's path through it: the runs page of a collected and trained run, the rollouts table
filtered from its form, an episode opened from the table, the token view toggled, the group
page, a forked episode of the sub-agent run, and time travel to an older table version. What is
on screen is checked against the store's own SQL; each page is saved as a screenshot in
test-artifacts/viewer/ (docs/viewer.md's pictures are these). The run (`demo_run.build`) is made by
`trajstore collect` and `trajstore learn` on a tiny model: about a minute on 2 cores.

Chromium comes from Debian (`make test` installs it when missing); Playwright only drives it
(`executable_path`), it never downloads a browser. Without chromium the test is skipped on a
developer's machine and fails under CI, where it must run.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trajstore
from collectors.replay import tokenizer_decode
from collectors.viewer import ViewerSettings, viewer_in_thread
from tests.collectors.viewer import demo_run

REPO = Path(__file__).resolve().parents[3]
ARTIFACTS = Path(os.environ.get("TRAJSTORE_TEST_ARTIFACTS", REPO / "test-artifacts")) / "viewer"
CHROMIUM = os.environ.get("TRAJSTORE_CHROMIUM", "/usr/bin/chromium")
# The flags that work in a container without a display, a GPU or a network.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(viewer: str) -> Iterator[Any]:
    """Started after the run is made and the viewer serves: Playwright's sync API holds an event loop
    on this thread, and the run's commands start their own."""
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        message = f"no chromium at {CHROMIUM}: `make test` installs Debian's (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:  # Playwright gives each launch a fresh user-data dir
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> demo_run.DemoRun:
    return demo_run.build(tmp_path_factory.mktemp("demo-run"))


@pytest.fixture(scope="module")
def viewer(run: demo_run.DemoRun) -> Iterator[str]:
    """No --model: the viewer decodes with the tokenizer of the newest checkpoint the store announces."""
    with viewer_in_thread(ViewerSettings(store=run.store, port=0)) as url:
        yield url


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_a_researcher_reads_a_run_in_the_browser(browser: Any, viewer: str, run: demo_run.DemoRun) -> None:
    store = trajstore.open_store(run.store, create=False)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

    # runs: totals, reward by policy version (the chart's points), checkpoints
    page.goto(viewer + "/")
    arith = page.locator('section.run[data-run="arith"]')
    want = store.query("SELECT count(*) AS n FROM rollouts WHERE run = 'arith'").to_pylist()[0]["n"]
    assert arith.locator("dd.rollouts").inner_text() == str(want) == "48"
    points = arith.locator('figure[data-title="reward by policy version"] g.series').first.locator("circle")
    shown = [(float(c.get_attribute("data-x")), float(c.get_attribute("data-y"))) for c in points.all()]
    by_version = store.query("SELECT min_version AS v, avg(reward) AS r FROM rollouts WHERE run = 'arith' AND "
                             "trainable GROUP BY 1 ORDER BY 1").to_pylist()
    assert [x for x, _ in shown] == [0, 2] == [r["v"] for r in by_version]
    assert all(math.isclose(y, r["r"], rel_tol=1e-9) for (_, y), r in zip(shown, by_version))
    assert arith.locator('figure[data-title="loss"] circle').count() == 2  # the learner's two steps
    assert arith.locator("table.checkpoints tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.version)") == ["0", "1", "2"]
    shot(page, "runs")

    # the rollouts table, filtered from its form: run arith, policy version 2 and up
    page.click("header nav >> text=Rollouts")
    page.fill('form#filters input[name="run"]', "arith")
    page.fill('form#filters input[name="vmin"]', "2")
    page.click("#apply")
    page.wait_for_url("**/rollouts?*vmin=2*")
    rows = page.locator("table#rollouts tbody tr[data-rollout]")
    want_ids = store.query("SELECT rollout_id FROM rollouts WHERE run = 'arith' AND min_version >= 2 "
                           "ORDER BY started DESC, rollout_id DESC").column("rollout_id").to_pylist()
    assert rows.evaluate_all("rows => rows.map(r => r.dataset.rollout)") == want_ids and len(want_ids) == 16
    assert set(rows.locator("td.version").all_inner_texts()) == {"2"}
    shot(page, "rollouts")

    # an episode, opened from the table: what is on screen is what the store holds
    rid = store.query("SELECT rollout_id FROM rollouts WHERE run = 'arith' AND min_version >= 2 AND turns >= 2 "
                      "ORDER BY started DESC, rollout_id DESC LIMIT 1").column("rollout_id").to_pylist()[0]
    page.click(f'tr[data-rollout="{rid}"] a.rollout-link')
    page.wait_for_url(f"**/rollouts/{rid}")
    facts = store.query("SELECT status, reward FROM rollouts WHERE rollout_id = ?", [rid]).to_pylist()[0]
    assert page.inner_text("#rollout-id") == rid and page.inner_text("#status") == facts["status"]
    assert page.inner_text("#reward").startswith(f"{facts['reward']:.3g}")
    turns = store.query("SELECT segment_id, turn_index, prompt_ids, output_ids, output_logprobs FROM turns "
                        "WHERE rollout_id = ? ORDER BY time, turn_index", [rid]).to_pylist()
    decode = tokenizer_decode(run.model)
    for t in turns:
        turn = page.locator(f'article.turn[data-segment="{t["segment_id"]}"][data-turn="{t["turn_index"]}"]')
        sampled = "".join(turn.locator('.text span[data-kind^="sampled"]').all_text_contents())
        assert sampled == decode(t["output_ids"])
    assert page.locator(".tool-call").count() >= 1 and page.locator(".tool-result").count() >= 1
    shot(page, "episode")

    page.click("#toggle-tokens")
    page.wait_for_selector(".tokens .tok")
    assert page.get_attribute("#toggle-tokens", "aria-pressed") == "true"
    for t in turns:
        chips = page.locator(f'article.turn[data-segment="{t["segment_id"]}"][data-turn="{t["turn_index"]}"] .tok')
        data = chips.evaluate_all("cs => cs.map(c => [Number(c.dataset.id), c.dataset.kind, c.dataset.logprob])")
        assert [d[0] for d in data] == t["prompt_ids"] + t["output_ids"]
        assert [d[1] for d in data].count("prompt") == len(t["prompt_ids"])
        logprobs = [float(d[2]) for d in data if d[1] != "prompt"]
        assert logprobs == pytest.approx(t["output_logprobs"], abs=1e-6)
    assert page.locator("article.turn .text").first.is_hidden()
    shot(page, "episode-tokens")
    page.click("#toggle-tokens")  # and back
    assert page.locator("article.turn .text").first.is_visible()

    # its group, side by side, with the store's advantages
    page.click("#group-link")
    page.wait_for_url("**/groups/**")
    group = store.query("SELECT group_id FROM rollouts WHERE rollout_id = ?", [rid]).column("group_id")[0].as_py()
    adv = {r["rollout_id"]: r["grpo"] for r in store.query("SELECT rollout_id, grpo FROM advantages WHERE "
                                                             "group_id = ?", [group]).to_pylist()}
    cards = page.locator("article.rollout-card")
    assert cards.count() == 4
    for card in cards.all():
        shown_adv = card.locator("dd.grpo").inner_text()
        assert float(shown_adv) == pytest.approx(adv[card.get_attribute("data-rollout")], abs=5e-3)
    shot(page, "group")

    # a forked episode: the sub-agent run compacts its context, and the page says why the rollout forked
    fork = store.query("SELECT rollout_id FROM rollouts WHERE run = 'fanout' ORDER BY rollout_id LIMIT 1"
                       ).column("rollout_id")[0].as_py()
    page.goto(f"{viewer}/rollouts/{fork}")
    reasons = page.locator("p.fork").evaluate_all("ps => ps.map(p => p.dataset.reason)")
    assert reasons == ["history_rewrite"]
    assert page.locator("section.segment").count() == 3
    shot(page, "episode-fork")

    # time travel: pin the runs page to the version before the second collection
    before = store.query("SELECT max(table_version) AS v FROM checkpoints WHERE run = 'arith'").to_pylist()[0]["v"]
    page.goto(viewer + "/")
    page.fill("#pin-version", str(before))
    page.click("form.pin button")
    page.wait_for_selector("#pinned")
    then = store.query("SELECT count(*) AS n FROM rollouts WHERE run = 'arith'", version=before).to_pylist()[0]["n"]
    assert page.locator('section.run[data-run="arith"] dd.rollouts').inner_text() == str(then) == "32"
    shot(page, "runs-pinned")
    assert errors == []
