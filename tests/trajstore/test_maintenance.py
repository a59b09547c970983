"""`vacuum` (issue 12.10): disk is reclaimed, and nothing a read or a writer needs is deleted.

Compaction leaves the files it replaced (a crash run left 569 Parquet files on disk for 1 in
the table), and a crash between writing a file and committing it leaves an unreferenced one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from deltalake import DeltaTable

import trajstore
import trajstore.maintenance
from cli.main import main
from trajstore import Reward


def parquet_files(path: Path) -> set[str]:
    return {p.name for p in (path / "events").glob("*.parquet")}


def test_vacuum_deletes_replaced_and_leftover_files_once_they_are_old(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    store = trajstore.open_store(path)

    def seal_four(tag: str) -> None:
        for i in range(4):
            with store.writer(f"{tag}{i}") as w:
                w.append([Reward(run="r", group_id="g", rollout_id=f"{tag}{i}", reward=float(i))])

    seal_four("old")
    two_hours_ago = time.time() - 7200

    class Clock:  # this compaction happened two hours ago
        @staticmethod
        def time() -> float:
            return two_hours_ago

    monkeypatch.setattr(trajstore.maintenance, "time", Clock)
    store.compact()
    monkeypatch.undo()
    replaced_long_ago = parquet_files(path) - {f.path for f in store.table.snapshot().files}
    seal_four("new")
    store.compact(target_bytes=1 << 30)  # replaces the four new seals and the first compaction's file, just now
    leftover = path / "events" / "seal-crashed-0-f00000000c00000000.zstd.parquet"  # written, never committed
    leftover.write_bytes(b"PAR1 a seal that died before its commit")
    live = {f.path for f in store.table.snapshot().files}
    assert len(live) == 1 and len(parquet_files(path)) == 11 and len(replaced_long_ago) == 4

    # replaced two hours ago: deleted; replaced just now, or written just now: kept (a read pinned a
    # moment ago may still need it, a writer may be about to commit it)
    assert set(store.vacuum(retention_hours=1, dry_run=True).files) == replaced_long_ago
    os.utime(leftover, (two_hours_ago, two_hours_ago))  # the crash was two hours ago
    result = CliRunner().invoke(main, ["vacuum", "--store", str(path), "--retention-hours", "1"])
    assert result.exit_code == 0 and "deleted 5 unreferenced file(s)" in result.output, result.output
    assert not leftover.exists() and not replaced_long_ago & parquet_files(path)
    assert len(parquet_files(path)) == 1 + 5  # the live file, and the five replaced just now
    assert store.query("SELECT sum(reward) AS s FROM rollouts").to_pylist() == [{"s": 12.0}]
    assert store.verify().ok
    # what the log lists is what external readers read: every event once
    assert DeltaTable(str(path / "events")).to_pyarrow_table().num_rows == 8


def test_a_retention_below_an_hour_is_refused(tmp_path: Path) -> None:
    store = trajstore.open_store(tmp_path / "s")
    with pytest.raises(ValueError, match="at least 1"):
        store.vacuum(retention_hours=0.1)
    result = CliRunner().invoke(main, ["vacuum", "--store", str(tmp_path / "s"), "--retention-hours", "0"])
    assert result.exit_code == 2 and "0<=" not in result.output and "1<=x<=876000" in result.output


@pytest.mark.parametrize("hours", ["inf", "1e308", "1e15", "nan"])
def test_a_retention_no_clock_can_hold_is_a_usage_error_not_a_traceback(tmp_path: Path, hours: str) -> None:
    store = trajstore.open_store(tmp_path / "s")
    with pytest.raises(ValueError, match="retention_hours must be"):
        store.vacuum(retention_hours=float(hours))
    result = CliRunner().invoke(main, ["vacuum", "--store", str(tmp_path / "s"), "--retention-hours", hours])
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
    assert "--retention-hours" in result.output or "retention_hours must be" in result.output, result.output
    assert CliRunner().invoke(main, ["vacuum", "--store", str(tmp_path / "s"), "--retention-hours", "876000",
                                     "--dry-run"]).exit_code == 0
