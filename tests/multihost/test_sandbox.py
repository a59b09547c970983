"""The rehearsal's hosts are what they claim: separate hostnames, disks and pids, one bridge, no way out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.multihost.sandbox import available, enter, passed_through

REPO = Path(__file__).resolve().parents[2]
WHY = available()


@pytest.mark.skipif(WHY is not None, reason=f"no sandbox here: {WHY}")
def test_hosts_are_isolated_reach_only_each_other_and_die_with_their_plug() -> None:
    done = enter([sys.executable, "-m", "tests.multihost.smoke"], cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert (r["c1"]["hostname"], r["c2"]["hostname"], r["store"]["hostname"]) == ("collector", "collector", "store")
    assert r["c1"]["pid"] == r["c2"]["pid"] < 10  # own PID namespaces: the same pid on two hosts, as in containers
    # each /tmp is its own, fresh disk, where the checkout is bound through when it lives under /tmp
    through = sorted({p.relative_to("/tmp").parts[0] for p in passed_through()})
    assert r["c1"]["tmp"] == r["c2"]["tmp"] == r["store"]["tmp"] == through
    assert all(r[h]["store"] in ("refused", "connected") for h in ("c1", "c2", "store"))  # the bridge carries
    assert all("unreachable" in r[h]["outside"].lower() for h in ("c1", "c2", "store")), r  # nothing leaves
    assert r["c1_unplugged"] != "refused" and r["c1_replugged"] == "refused"
    assert r["c2_killed"]


def test_hosts_are_refused_outside_a_sandbox() -> None:
    from tests.multihost.sandbox import Sandbox

    with pytest.raises(RuntimeError, match="route off the machine"):
        Sandbox()
