"""Writers of one `s3://` store on several machines (each machine: its own spool directory).

- a writer name belongs to one machine: a second machine opening it is refused when it opens,
  before it acknowledges anything, also when both open at once; reopening on its own machine
  costs no commit;
- default writer names differ across machines even with one hostname and one pid;
- what other machines wait on (status and checkpoint events) is sealed at once, other events
  once `seal_interval` has passed, so both become visible elsewhere without a close;
- a background seal that fails (the store unreachable) is retried until it lands.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import trajstore
from tests.conftest import S3Server
from trajstore.errors import WriterBusyError

VISIBLE_WITHIN_S = 30.0  # a generous bound on the waits below (seals take milliseconds here)


@pytest.fixture
def uri(s3_server: S3Server) -> str:
    return s3_server.new_uri()


def machine(uri: str, root: Path, name: str) -> trajstore.Store:
    return trajstore.open_store(uri, spool=root / name / "spool")


def metric(i: int) -> dict[str, Any]:
    return {"kind": "metric", "step": i, "metrics": {"x": 1.0}, "event_id": f"m{i}"}


def status(i: int) -> dict[str, Any]:
    return {"kind": "status", "run": "r", "group_id": "g", "rollout_id": f"r{i}", "status": "completed",
            "event_id": f"s{i}"}


def wait_visible(store: trajstore.Store, event_id: str) -> bool:
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while time.monotonic() < deadline:
        if store.query("SELECT count(*) AS n FROM events WHERE event_id = ?", [event_id]).column("n")[0].as_py():
            return True
        time.sleep(0.05)
    return False


def test_a_name_in_use_on_another_machine_is_refused_at_open(uri: str, tmp_path: Path) -> None:
    a, b = machine(uri, tmp_path, "a"), machine(uri, tmp_path, "b")
    with a.writer("collector", seal_kinds=()) as wa:
        wa.append([metric(0)])
        with pytest.raises(WriterBusyError, match="belongs to another machine"):
            b.writer("collector")
        assert not (b.location.wal_root / "collector").exists() or \
            not list((b.location.wal_root / "collector").glob("*.arrows")), "nothing was appended on b"
    version = a.version()
    with a.writer("collector") as again:  # its own machine reopens it, without a new claim
        assert a.version() == version
        again.append([metric(1)])
    assert a.query("SELECT event_id FROM events ORDER BY event_id").column(0).to_pylist() == ["m0", "m1"]
    with pytest.raises(WriterBusyError, match="another name"):
        b.writer("collector")


def test_two_machines_opening_one_name_at_once_one_wins(uri: str, tmp_path: Path) -> None:
    stores = [machine(uri, tmp_path, f"m{i}") for i in range(4)]
    start, outcome = threading.Barrier(len(stores)), {}

    def open_one(i: int) -> None:
        start.wait()
        try:
            stores[i].writer("same").close()
            outcome[i] = "opened"
        except WriterBusyError:
            outcome[i] = "refused"

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(outcome.values()) == ["opened"] + ["refused"] * (len(stores) - 1)


def test_default_names_differ_across_machines_with_one_hostname_and_pid(uri: str, tmp_path: Path) -> None:
    a, b = machine(uri, tmp_path, "a"), machine(uri, tmp_path, "b")
    assert a.unique_writer_name("c-") != b.unique_writer_name("c-")  # same process: same hostname and pid
    assert a.unique_writer_name("c-") == a.unique_writer_name("c-")  # the machine's id is kept
    with a.writer() as wa, b.writer() as wb:
        wa.append([metric(0)])
        wb.append([metric(1)])
    assert sorted(a.query("SELECT event_id FROM events").column(0).to_pylist()) == ["m0", "m1"]


def test_what_others_wait_on_is_sealed_at_once_the_rest_after_the_interval(uri: str, tmp_path: Path) -> None:
    here, there = machine(uri, tmp_path, "here"), machine(uri, tmp_path, "there")
    with here.writer("slow", seal_interval=3600) as slow, here.writer("timed", seal_interval=0.5) as timed:
        slow.append([status(0)])
        assert wait_visible(there, "s0"), "a status event was not sealed at once"
        timed.append([metric(1)])
        assert wait_visible(there, "m1"), "a metric was not sealed after seal_interval"
        slow.append([metric(2)])
        assert there.query("SELECT count(*) AS n FROM events WHERE event_id = 'm2'").column("n")[0].as_py() == 0
        assert here.query("SELECT count(*) AS n FROM events WHERE event_id = 'm2'").column("n")[0].as_py() == 1


def _immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i: even root cannot add files to an immutable directory (ext4 and most local filesystems)."""
    import shutil
    import subprocess

    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0


def test_a_background_seal_that_fails_is_retried_until_it_lands(tmp_path: Path) -> None:
    """The object store or the network failing under a seal (here: the Delta log refusing new files) stops
    nothing: the writer keeps acknowledging, and its sealer seals everything once the log takes files again."""
    store = trajstore.open_store(tmp_path / "s")
    log_dir = tmp_path / "s" / "events" / "_delta_log"
    with store.writer("w", seal_interval=0.2) as writer:
        writer.append([metric(0)])
        if not _immutable(log_dir, True):
            pytest.skip("chattr +i is not available here (needs root and a local filesystem that supports it)")
        try:
            time.sleep(1.0)  # several background seals fail meanwhile
            writer.append([metric(1)])  # appends are still acknowledged
            assert store.version() == 0
        finally:
            assert _immutable(log_dir, False)
        deadline = time.monotonic() + VISIBLE_WITHIN_S
        while store.table.sealed_seq("w") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.table.sealed_seq("w") == 1, "the sealer gave up after a failed seal"
    assert store.query("SELECT event_id FROM events ORDER BY event_id").column(0).to_pylist() == ["m0", "m1"]



def test_a_seal_that_failed_reads_its_segments_again_and_verifies_them(tmp_path: Path) -> None:
    """A writer seals what it wrote from memory, but not after a failed seal: it drops what it kept (memory stays
    bounded however long the log refuses files) and the next attempt reads the segments, so damage done to them
    meanwhile is reported, not sealed."""
    from trajstore import wal
    from trajstore.errors import CorruptionError

    store = trajstore.open_store(tmp_path / "s")
    log_dir = tmp_path / "s" / "events" / "_delta_log"
    with store.writer("w", seal_interval=3600, seal_on_close=False) as writer:
        writer.append([metric(0), metric(1)])
        if not _immutable(log_dir, True):
            pytest.skip("chattr +i is not available here (needs root and a local filesystem that supports it)")
        try:
            with pytest.raises(Exception):  # noqa: B017 - whatever the Delta log's refusal is called
                writer.seal()
        finally:
            assert _immutable(log_dir, False)
        (path,) = wal.list_segments(tmp_path / "s" / "wal" / "w")
        data = bytearray(path.read_bytes())
        data[data.rindex(b"m1")] ^= 0x01  # an event_id, in the batch's body
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptionError, match="fails its CRC-32"):
            writer.seal()
    assert store.table.sealed_seq("w") == -1
