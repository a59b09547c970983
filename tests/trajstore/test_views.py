"""The SQL projections, checked against values worked out by hand.

One small experiment (run "exp") is appended with explicit event times, so "latest" is
unambiguous, and deliberately out of order:

group g1 (group_size 3, complete: 3 slots, D a failed attempt beside them):
  A  completed  reward 2.0 = correct 1.0 (latest of 0.0, 1.0 and an older -5.0) + format 1.0
     segments: A0 (session main, 2 turns), A1 (session main, a fork after compaction),
               A2 (session sub, a sub-agent, 2 turns, segment reward 0.25)
  B  completed  reward 0.0
  C  truncated  reward 1.0
  D  failed     reward 100.0 (not trainable: failed), error "timeout"
  trainable rewards 2, 0, 1: mean 1, sample std 1
g2 (group_size 2, incomplete: F has only started):   E completed 5.0, F started
g3 (group_size 3, incomplete: 2 of 3 rollouts):      G completed 1.0, H completed 3.0
g4 (no group_size, complete: all finished, one trainable): I completed 2.0, J aborted (no reward)
g5 (no group_size, incomplete: K has no status yet): K reward 4.0
run "other", group o1: O completed 10.0

Run mean of "exp" over its trainable rollouts (A B C E G H I): (2+0+1+5+1+3+2)/7 = 2.
"""

from __future__ import annotations

import math
import random
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trajstore
from trajstore import Reward, Status, Turn

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
EPS = 1e-6


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def turn(rollout: str, segment: str, index: int, version: int, prompt: list[int], output: list[int],
         logprobs: list[float], mask: list[bool] | None = None, *, group: str, session: str | None = None,
         t: float, run: str = "exp") -> Turn:
    return Turn(run=run, group_id=group, rollout_id=rollout, segment_id=segment, turn_index=index,
                policy_version=version, prompt_ids=prompt, output_ids=output, output_logprobs=logprobs,
                output_mask=mask, session_id=session, time=at(t))


def reward(rollout: str, value: float, *, group: str, t: float, name: str = "correct",
           segment: str | None = None, run: str = "exp") -> Reward:
    return Reward(run=run, group_id=group, rollout_id=rollout, reward=value, reward_name=name,
                  segment_id=segment, time=at(t))


def status(rollout: str, value: str, *, group: str, t: float, size: int | None = None,
           error: str | None = None, run: str = "exp") -> Status:
    return Status(run=run, group_id=group, rollout_id=rollout, status=value, group_size=size,
                  error=error, time=at(t))


def single(rollout: str, group: str, version: int, value: float | None, state: str | None, *,
           size: int | None = None, t: float, run: str = "exp") -> list[Any]:
    """A one-turn rollout with one reward and one status (either may be left out)."""
    events: list[Any] = [turn(rollout, f"{rollout}0", 0, version, [4], [31, 32], [-0.5, -0.5],
                              group=group, t=t, run=run)]
    if value is not None:
        events.append(reward(rollout, value, group=group, t=t + 1, run=run))
    if state is not None:
        events.append(status(rollout, state, group=group, t=t + 2, size=size, run=run))
    return events


def experiment() -> list[list[Any]]:
    """The events above, as the append calls that write them (out of order on purpose)."""
    g1 = "g1"
    a_turns = [
        turn("A", "A0", 1, 4, [20], [12, 13, 14], [-0.3, -0.4, -0.5], [True, False, True], group=g1, session="main", t=20),
        turn("A", "A2", 1, 5, [], [18], [-0.9], group=g1, session="sub", t=40),
        turn("A", "A0", 0, 3, [1, 2, 3], [10, 11], [-0.1, -0.2], group=g1, session="main", t=10),
        turn("A", "A1", 0, 4, [1, 2, 99], [15], [-0.6], group=g1, session="main", t=30),
        turn("A", "A2", 0, 5, [7, 7], [16, 17], [-0.7, -0.8], [False, False], group=g1, session="sub", t=35),
    ]
    a_rest = [
        status("A", "started", group=g1, t=1, size=3),
        reward("A", 0.0, group=g1, t=50),
        reward("A", 1.0, group=g1, t=60),
        reward("A", 1.0, group=g1, t=55, name="format"),
        reward("A", 0.5, group=g1, t=45, name="subtask", segment="A2"),
        reward("A", 0.25, group=g1, t=46, name="subtask", segment="A2"),
        status("A", "completed", group=g1, t=70, size=3),
    ]
    stale = [reward("A", -5.0, group=g1, t=-86400)]  # appended last, but older than the others
    b = [turn("B", "B0", 0, 3, [1, 2, 3], [30], [-1.0], group=g1, t=11),
         reward("B", 0.0, group=g1, t=12), status("B", "completed", group=g1, t=13, size=3)]
    c = single("C", g1, 4, 1.0, "truncated", size=3, t=14)
    d = single("D", g1, 4, 100.0, None, t=17) + [
        status("D", "started", group=g1, t=2, size=3),
        status("D", "failed", group=g1, t=80, size=3, error="timeout")]
    g2 = single("E", "g2", 5, 5.0, "completed", size=2, t=100) + single("F", "g2", 5, None, "started", size=2, t=103)
    g3 = single("G", "g3", 5, 1.0, "completed", size=3, t=110) + single("H", "g3", 5, 3.0, "completed", size=3, t=113)
    g4 = single("I", "g4", 5, 2.0, "completed", t=120) + single("J", "g4", 5, None, "aborted", t=123)
    g5 = single("K", "g5", 5, 4.0, None, t=130)
    other = single("O", "o1", 1, 10.0, "completed", t=140, run="other")
    return [a_turns[:2], b + c, a_turns[2:], d + a_rest, g2 + g3, g4 + g5 + other, stale]


@pytest.fixture
def exp(store: trajstore.Store) -> trajstore.Store:
    with store.writer("views-w", seal_on_close=False) as writer:
        for call in experiment():
            writer.append(call)
    return store


def by(table_rows: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    return {r[key]: r for r in table_rows}


def approx_list(values: list[float]) -> Any:
    return pytest.approx(values, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------------ samples


def test_samples_are_turns_concatenated_in_turn_order(exp: trajstore.Store) -> None:
    samples = by(exp.query("SELECT * FROM samples").to_pylist(), "segment_id")
    assert set(samples) == {"A0", "A1", "A2", "B0", "C0", "D0", "E0", "F0", "G0", "H0", "I0", "J0", "K0", "O0"}
    a0, a1, a2 = samples["A0"], samples["A1"], samples["A2"]

    assert a0["tokens"] == [1, 2, 3, 10, 11, 20, 12, 13, 14]
    assert a0["loss_mask"] == [False, False, False, True, True, False, True, False, True]
    assert a0["logprobs"] == approx_list([0, 0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5])
    assert (a0["prompt_tokens"], a0["num_tokens"], a0["trainable_tokens"], a0["turns"]) == (3, 9, 4, 2)
    assert (a0["min_version"], a0["max_version"], a0["session_id"]) == (3, 4, "main")
    assert (a0["first_time"], a0["last_time"]) == (at(10), at(20))

    assert a1["tokens"] == [1, 2, 99, 15]
    assert a1["loss_mask"] == [False, False, False, True]
    assert a1["logprobs"] == approx_list([0, 0, 0, -0.6])
    assert (a1["prompt_tokens"], a1["num_tokens"], a1["trainable_tokens"], a1["turns"]) == (3, 4, 1, 1)

    assert a2["tokens"] == [7, 7, 16, 17, 18]
    assert a2["loss_mask"] == [False, False, False, False, True]
    assert a2["logprobs"] == approx_list([0, 0, -0.7, -0.8, -0.9])
    assert (a2["prompt_tokens"], a2["num_tokens"], a2["trainable_tokens"], a2["turns"]) == (2, 5, 1, 2)
    assert (a2["session_id"], a2["segment_reward"]) == ("sub", 0.25)
    assert a0["segment_reward"] is None and a1["segment_reward"] is None

    for s in samples.values():
        assert len(s["tokens"]) == len(s["loss_mask"]) == len(s["logprobs"]) == s["num_tokens"]
        assert sum(s["loss_mask"]) == s["trainable_tokens"]
        assert all(m is False for m in s["loss_mask"][: s["prompt_tokens"]])
    assert samples["O0"]["run"] == "other" and samples["A0"]["group_id"] == "g1"


# ------------------------------------------------------------------ rollouts


def test_rollouts(exp: trajstore.Store) -> None:
    rollouts = by(exp.query("SELECT * FROM rollouts").to_pylist(), "rollout_id")
    a = rollouts["A"]
    assert a["reward"] == 2.0  # correct 1.0 (latest by time) + format 1.0; the segment reward is not in it
    assert a["reward_components"] == 2
    assert (a["status"], a["error"], a["trainable"]) == ("completed", None, True)
    assert (a["segments"], a["sessions"], a["turns"]) == (3, 2, 5)
    assert (a["tokens"], a["output_tokens"], a["trainable_tokens"]) == (9 + 4 + 5, 2 + 3 + 1 + 2 + 1, 4 + 1 + 1)
    assert (a["min_version"], a["max_version"], a["group_size"]) == (3, 5, 3)
    # the episode: its first status or turn to its first terminal status; rewards (the stale one at
    # t=-86400, later ones) do not move it
    assert (a["started"], a["ended"], a["duration_s"]) == (at(1), at(70), 69.0)

    d = rollouts["D"]
    assert (d["status"], d["error"], d["reward"], d["trainable"]) == ("failed", "timeout", 100.0, False)
    assert (rollouts["C"]["status"], rollouts["C"]["trainable"]) == ("truncated", True)
    assert (rollouts["F"]["status"], rollouts["F"]["reward"], rollouts["F"]["trainable"]) == ("started", None, False)
    assert (rollouts["J"]["status"], rollouts["J"]["trainable"]) == ("aborted", False)
    k = rollouts["K"]
    assert (k["status"], k["reward"]) == (None, 4.0)
    assert k["trainable"] is False  # no status yet: not trainable (false, not unknown)
    expected_reward = {"A": 2.0, "B": 0.0, "C": 1.0, "D": 100.0, "E": 5.0, "F": None, "G": 1.0, "H": 3.0,
                       "I": 2.0, "J": None, "K": 4.0, "O": 10.0}
    assert {r: row["reward"] for r, row in rollouts.items()} == expected_reward
    assert all(row["turns"] == 1 and row["segments"] == 1 for r, row in rollouts.items() if r != "A")


def test_rescoring_later_does_not_stretch_the_episode(tmp_path: Any) -> None:
    """Issue 12.6: a 0.8 s rollout scored again 96 s later (`trajstore reward`) still lasted 0.8 s;
    one that has not finished yet runs to its latest turn."""
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("w") as w:
        w.append([status("R", "started", group="g", t=0),
                  turn("R", "R0", 0, 0, [1], [2], [-0.1], group="g", t=0.3),
                  reward("R", 1.0, group="g", t=0.8), status("R", "completed", group="g", t=0.8),
                  status("R", "completed", group="g", t=50),  # a status re-sent later changes nothing
                  reward("R", 0.5, group="g", t=96.8, name="judge"),
                  status("S", "started", group="g", t=1), turn("S", "S0", 0, 0, [1], [2], [-0.1], group="g", t=4)])
    rows = by(store.query("SELECT rollout_id, started, ended, duration_s FROM rollouts").to_pylist(), "rollout_id")
    assert (rows["R"]["started"], rows["R"]["ended"]) == (at(0), at(0.8))
    assert rows["R"]["duration_s"] == pytest.approx(0.8)
    assert (rows["S"]["ended"], rows["S"]["duration_s"]) == (at(4), pytest.approx(3.0))
    group = store.query("SELECT started, ended FROM groups").to_pylist()[0]
    assert (group["started"], group["ended"]) == (at(0), at(4))


# ------------------------------------------------------------------ groups


def test_two_runs_reusing_a_group_id_are_two_groups(tmp_path: Any) -> None:
    """Issue 12.1: runs "a" and "b" both name a group "g1" (the proxy example of docs/capture.md does); each
    run's rewards are normalized within its own group, never mixed into the other's."""
    store = trajstore.open_store(tmp_path / "s")
    with store.writer("w") as w:
        for run, rewards in (("a", (1.0, 0.0)), ("b", (10.0, 20.0))):
            for i, value in enumerate(rewards):
                w.append(single(f"{run}{i}", "g1", 0, value, "completed", size=2, t=i, run=run))
    groups = {r["run"]: r for r in store.query("SELECT * FROM groups").to_pylist()}
    assert {(r["group_id"], r["size"], r["complete"], r["reward_mean"]) for r in groups.values()} == \
        {("g1", 2, True, 0.5), ("g1", 2, True, 15.0)}
    assert groups["a"]["reward_mean"] == 0.5
    adv = by(store.query("SELECT * FROM advantages").to_pylist(), "rollout_id")
    assert {r: (row["group_mean"], row["group_trainable"]) for r, row in adv.items()} == \
        {"a0": (0.5, 2), "a1": (0.5, 2), "b0": (15.0, 2), "b1": (15.0, 2)}
    assert adv["a0"]["dr_grpo"] == 0.5 and adv["b1"]["dr_grpo"] == 5.0
    assert adv["a0"]["grpo"] == pytest.approx(-adv["a1"]["grpo"]) == pytest.approx(1 / math.sqrt(2), rel=1e-5)




def test_groups(exp: trajstore.Store) -> None:
    groups = by(exp.query("SELECT * FROM groups").to_pylist(), "group_id")
    want = {  # size, planned, finished, trainable, complete, mean, std
        "g1": (4, 3, 4, 3, True, 1.0, 1.0),
        "g2": (2, 2, 1, 1, False, 5.0, 0.0),
        "g3": (2, 3, 2, 2, False, 2.0, math.sqrt(2)),
        "g4": (2, None, 2, 1, True, 2.0, 0.0),
        "g5": (1, None, 0, 0, False, None, 0.0),
        "o1": (1, None, 1, 1, True, 10.0, 0.0),
    }
    got = {g: (r["size"], r["planned_size"], r["finished"], r["trainable"], r["complete"], r["reward_mean"],
               pytest.approx(r["reward_std"])) for g, r in groups.items()}
    assert got == want
    assert (groups["g1"]["min_version"], groups["g1"]["max_version"]) == (3, 5)
    assert groups["o1"]["run"] == "other"


# ------------------------------------------------------------------ advantages


ADVANTAGE_COLUMNS = ("grpo", "dr_grpo", "rloo", "batch")
ADVANTAGES = {  # rollout: (grpo, dr_grpo, rloo, batch), worked out in the module docstring's numbers
    "A": (1 / (1 + EPS), 1.0, 1.5, 0.0),  # g1: mean 1, std 1, n 3: rloo = 3/2 (r - mean)
    "B": (-1 / (1 + EPS), -1.0, -1.5, -2.0),
    "C": (0.0, 0.0, 0.0, -1.0),
    "E": (0.0, 0.0, 0.0, 3.0),  # alone among g2's trainable rollouts
    "G": (-1 / (math.sqrt(2) + EPS), -1.0, -2.0, -1.0),  # g3: mean 2, std sqrt 2, n 2: rloo = 2 (r - mean)
    "H": (1 / (math.sqrt(2) + EPS), 1.0, 2.0, 1.0),
    "I": (0.0, 0.0, 0.0, 0.0),
    "K": None,  # not trainable: no advantage
    "O": (0.0, 0.0, 0.0, 0.0),  # run "other" has its own mean
}


def test_advantages(exp: trajstore.Store) -> None:
    rows = by(exp.query("SELECT * FROM advantages").to_pylist(), "rollout_id")
    assert set(rows) == {r for r, v in ADVANTAGES.items() if v is not None}
    for rollout, want in ADVANTAGES.items():
        if want is None:
            continue
        row = rows[rollout]
        got = (row["grpo"], row["dr_grpo"], row["rloo"], row["batch"])
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), rollout
    assert (rows["A"]["group_mean"], rows["A"]["group_std"], rows["A"]["group_trainable"]) == (1.0, 1.0, 3)
    # RLOO is the reward minus the mean of the *other* rollouts of the group
    assert rows["A"]["rloo"] == pytest.approx(2.0 - (0.0 + 1.0) / 2)


def test_every_estimator_is_a_column_with_a_title(exp: trajstore.Store) -> None:
    columns = exp.query("SELECT * FROM advantages LIMIT 0").column_names
    assert [c for c in columns if c in trajstore.ESTIMATORS] == list(trajstore.ESTIMATORS) == list(ADVANTAGE_COLUMNS)
    assert set(trajstore.ESTIMATOR_TITLES) == set(trajstore.ESTIMATORS) >= set(trajstore.GROUP_ESTIMATORS)


# ------------------------------------------------------------------ fan-out


def test_every_segment_of_a_rollout_gets_its_advantage(exp: trajstore.Store) -> None:
    view = by(exp.query("SELECT * FROM samples").to_pylist(), "segment_id")
    for column, estimator in enumerate(["grpo", "dr_grpo", "rloo", "batch"]):
        shard = exp.shard(policy_version=5, max_staleness=5, estimator=estimator)
        samples = shard.samples.to_pylist()
        assert sorted(shard.group_ids) == ["g1", "g4", "o1"]  # the complete groups
        assert sorted((s["rollout_id"], s["segment_id"]) for s in samples) == \
            [("A", "A0"), ("A", "A1"), ("A", "A2"), ("B", "B0"), ("C", "C0"), ("I", "I0"), ("O", "O0")]
        rewards = {s["rollout_id"]: (s["run"], s["reward"]) for s in samples}
        for s in samples:
            want = ADVANTAGES[s["rollout_id"]][column]
            if estimator == "batch":  # a shard's baseline is its own rollouts' mean reward, per run
                same_run = [r for run, r in rewards.values() if run == s["run"]]
                want = s["reward"] - sum(same_run) / len(same_run)
            assert s["advantage"] == pytest.approx(want, rel=1e-9, abs=1e-12), (estimator, s)
            assert s["rollout_segments"] == (3 if s["rollout_id"] == "A" else 1)
        a = [s for s in samples if s["rollout_id"] == "A"]
        assert len(a) == 3 and len({s["advantage"] for s in a}) == 1
        for s in samples:  # the shard's samples are the samples view's rows
            for name in ("tokens", "loss_mask", "logprobs", "prompt_tokens", "num_tokens", "trainable_tokens"):
                assert s[name] == view[s["segment_id"]][name], (s["segment_id"], name)


# ------------------------------------------------------------------ properties of sample assembly


token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=6)
turn_specs = st.lists(
    st.tuples(token_lists,                                   # prompt delta
              st.lists(st.integers(0, 50_000), min_size=1, max_size=6),  # output
              st.one_of(st.none(), st.lists(st.booleans(), min_size=6, max_size=6)),  # mask (cut to length)
              st.floats(-20.0, 0.0, width=32)),              # logprob of each output token
    min_size=1, max_size=5,
)
experiments = st.tuples(
    st.lists(turn_specs, min_size=1, max_size=4),               # segments of one rollout
    st.lists(st.integers(0, 10_000), min_size=15, max_size=15, unique=True),  # turn indexes to draw from
    st.randoms(use_true_random=False),                          # append order and batching
)
_counter = iter(range(10**9))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(experiments)
def test_sample_assembly_properties(store: trajstore.Store, drawn: tuple[Any, ...]) -> None:
    segment_specs, index_pool, rnd = drawn
    rollout = f"prop-{next(_counter)}"
    events: list[Any] = []
    expected: dict[str, tuple[list[int], list[bool], list[float], list[int]]] = {}
    pool = list(index_pool)
    for k, specs in enumerate(segment_specs):
        segment = f"{rollout}/s{k}"
        indexes = sorted(rnd.sample(pool, len(specs)))
        tokens: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        prompt_positions: list[int] = []
        for (prompt, output, raw_mask, lp), index in zip(specs, indexes):
            out_mask = None if raw_mask is None else raw_mask[: len(output)]
            events.append(Turn(group_id="prop", rollout_id=rollout, segment_id=segment, turn_index=index,
                               policy_version=0, prompt_ids=prompt, output_ids=output,
                               output_logprobs=[lp] * len(output), output_mask=out_mask,
                               session_id=f"sess{k % 2}"))
            prompt_positions += range(len(tokens), len(tokens) + len(prompt))
            tokens += prompt + output
            mask += [False] * len(prompt) + (out_mask if out_mask is not None else [True] * len(output))
            logprobs += [0.0] * len(prompt) + [lp] * len(output)
        expected[segment] = (tokens, mask, logprobs, prompt_positions)
    rnd.shuffle(events)
    with store.writer("prop-w", seal_on_close=False) as writer:
        while events:
            take = rnd.randint(1, len(events))
            writer.append(events[:take])
            events = events[take:]

    got = store.query("SELECT * FROM samples WHERE rollout_id = $r", {"r": rollout}).to_pylist()
    assert {s["segment_id"] for s in got} == set(expected)
    for s in got:
        tokens, mask, logprobs, prompt_positions = expected[s["segment_id"]]
        assert len(s["tokens"]) == len(s["loss_mask"]) == len(s["logprobs"]) == s["num_tokens"]
        assert s["tokens"] == tokens
        assert s["loss_mask"] == mask
        assert s["logprobs"] == logprobs  # float32 values round-trip exactly
        assert not any(s["loss_mask"][i] for i in prompt_positions)  # no prompt token is trainable
        assert all(s["logprobs"][i] == 0.0 for i in prompt_positions)
        assert sum(s["loss_mask"]) == s["trainable_tokens"]


def test_prompt_positions_are_never_trainable(store: trajstore.Store) -> None:
    """Prompt tokens equal to output tokens do not confuse the mask: it is positional."""
    rnd = random.Random(7)
    events = []
    for i in range(6):
        prompt = [rnd.randrange(5) for _ in range(rnd.randrange(4))]
        output = [rnd.randrange(5) for _ in range(1 + rnd.randrange(4))]
        events.append(Turn(group_id="p", rollout_id="p", segment_id="p0", turn_index=i, policy_version=0,
                           prompt_ids=prompt, output_ids=output, output_logprobs=[-1.0] * len(output)))
    with store.writer("pos-w", seal_on_close=False) as writer:
        writer.append(list(reversed(events)))
    (s,) = store.query("SELECT * FROM samples").to_pylist()
    position = 0
    for e in events:
        n_prompt, n_out = len(e.prompt_ids), len(e.output_ids)
        assert s["loss_mask"][position:position + n_prompt] == [False] * n_prompt
        assert s["loss_mask"][position + n_prompt:position + n_prompt + n_out] == [True] * n_out
        position += n_prompt + n_out
    assert position == len(s["tokens"])


def test_token_ledger_puts_every_generated_token_in_one_place(store: trajstore.Store) -> None:
    """Trained (consumed), rejected (consumed, left out of the loss by the learner), waiting, stale (past the
    newest checkpoint's max_staleness), masked, failed and incomplete tokens, per policy version; the
    equality holds on every row."""
    from tests.ledger import assert_ledger_balances

    masked = [turn("M", "M0", 0, 5, [4], [31, 32], [-0.5, -0.5], [True, False], group="gm", t=50),
              reward("M", 1.0, group="gm", t=51), status("M", "completed", group="gm", t=52)]
    with store.writer("ledger-w") as writer:
        writer.append(single("T", "gt", 5, 1.0, "completed", t=10) + single("W", "gw", 5, 1.0, "completed", t=20)
                      + single("F", "gf", 5, 1.0, "failed", t=30) + single("I", "gi", 5, None, None, t=40) + masked
                      + single("S", "gs", 1, 1.0, "completed", t=60) + single("R", "gr", 5, 1.0, "completed", t=65)
                      + [trajstore.Metric(run="exp", step=6, metrics={"loss": 0.0}, consumed=["T", "R"],
                                          meta={"rejected": [["R", "R0"]]}, time=at(69)),
                         trajstore.Checkpoint(run="exp", policy_version=6, step=6, consumed=["T", "R"],
                                              meta={"max_staleness": 2}, time=at(70))])
    ledger = {r["version"]: {k: v for k, v in r.items() if k not in ("run", "version")}
              for r in assert_ledger_balances(store)}
    assert ledger == {
        5: {"generated": 12, "trained": 2, "waiting": 3, "stale": 0, "masked": 1, "incomplete": 2, "failed": 2,
            "rejected": 2, "discarded": 7},
        1: {"generated": 2, "trained": 0, "waiting": 0, "stale": 2, "masked": 0, "incomplete": 0, "failed": 0,
            "rejected": 0, "discarded": 0},
    }
