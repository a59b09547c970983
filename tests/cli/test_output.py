"""What the `trajstore` commands print: every view exports in every format; tables stay readable
(issue 12, items 15 and 18).

The export matrix runs in process through click's test runner (the same command function the
console script calls); one subprocess checks that piped output is not squeezed to 80 columns.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from rich.console import Console

import trajstore
from cli.main import main
from cli.output import MAX_CELL, print_table
from tests.cli.test_cli import TRAJSTORE
from trajstore.synth import generate_run


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A walkthrough run plus a checkpoint, a metric (with a rejected sample) and a teacher's scores of one
    turn, so that every view has rows."""
    path = tmp_path_factory.mktemp("out") / "s"
    store = trajstore.open_store(path)
    events = generate_run(groups=3, group_size=2, seed=3)
    turn = next(e for e in events if e["kind"] == "turn")
    with store.writer("w") as w:
        w.append(events)
        w.append([trajstore.Teacher(run=turn["run"], group_id=turn["group_id"], rollout_id=turn["rollout_id"],
                                    segment_id=turn["segment_id"], turn_index=turn["turn_index"],
                                    policy_version=turn["policy_version"], teacher="t",
                                    teacher_logprobs=[-0.5] * len(turn["output_ids"]))])
        w.append([trajstore.Metric(run="walkthrough", step=1, metrics={"loss": 0.5}, policy_version=0,
                                   consumed=["x"], meta={"rejected": [["x", "x0"]]}),
                  trajstore.Checkpoint(run="walkthrough", policy_version=1, step=1, consumed=["x"])])
    return path


@pytest.mark.parametrize("view", trajstore.VIEW_NAMES)
def test_every_view_exports_in_every_format(store_dir: Path, tmp_path: Path, view: str) -> None:
    runner = CliRunner()
    sql = f"SELECT * FROM {view}"
    rows = trajstore.open_store(store_dir).query(sql).num_rows
    assert rows > 0, view
    for fmt in ("table", "csv", "json", "parquet"):
        out = tmp_path / f"{view}.{fmt}"
        result = runner.invoke(main, ["query", "--store", str(store_dir), sql, "--format", fmt, "--output", str(out)])
        assert result.exit_code == 0, (view, fmt, result.output, result.exception)
        if fmt == "csv":
            assert len(out.read_text().splitlines()) >= rows + 1
        elif fmt == "json":
            assert len([json.loads(line) for line in out.read_text().splitlines()]) == rows
        elif fmt == "parquet":
            assert pq.read_table(out).num_rows == rows
    # an INTERVAL (DuckDB's type for a difference of timestamps) exports too, as ISO 8601
    result = runner.invoke(main, ["query", "--store", str(store_dir), "--format", "csv",
                                  "SELECT ended - started AS d FROM rollouts ORDER BY d LIMIT 1"])
    assert result.exit_code == 0 and result.output.splitlines()[1].startswith('"P0M0DT'), result.output


def render(table: pa.Table, width: int, terminal: bool = True) -> str:
    buf = io.StringIO()
    print_table(table, Console(file=buf, width=width, force_terminal=terminal, color_system=None))
    return buf.getvalue()


def test_a_wide_result_becomes_one_block_per_row_on_a_terminal() -> None:
    wide = pa.table({f"column_{i}": [f"value {i} " * 3, "x"] for i in range(20)})
    text = render(wide, 120)
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines)
    assert "-[ row 1 ]" in text and "-[ row 2 ]" in text
    assert any(line.startswith("column_19") and "value 19" in line for line in lines)
    assert len(lines) == 2 * (1 + 20)  # a rule and one line per column, per row
    narrow = render(pa.table({"a": [1, 2], "b": ["x", "y"]}), 120)
    assert "-[ row" not in narrow and len(narrow.splitlines()) == 6  # a plain table: 3 rules, header, 2 rows


def test_long_cells_are_cut_in_tables_and_whole_in_exports() -> None:
    text = render(pa.table({"response": ["z" * 500], "n": [1]}), 200)
    assert "z" * (MAX_CELL - 1) + "…" in text and "z" * MAX_CELL not in text


def test_piped_output_keeps_rows_on_one_line(store_dir: Path) -> None:
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([TRAJSTORE, "query", "--store", str(store_dir), "SELECT * FROM rollouts LIMIT 3"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 + 1 + 3  # three rules, the header, three rows: nothing wrapped
    assert max(len(line) for line in lines) > 80
    assert proc.stderr == ""  # no library warnings or progress bars in a command's output


def test_piped_lines_are_not_wrapped_at_80_columns(tmp_path: Path) -> None:
    """A line longer than 80 columns printed into a pipe stays one line (rich wrapped it at 80)."""
    long = tmp_path / ("a-store-with-a-name-long-enough-to-push-the-line-past-eighty-columns-" * 2)
    trajstore.open_store(long)
    proc = subprocess.run([TRAJSTORE, "stats", "--store", str(long)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert str(long) in first and first.endswith(f"table version {trajstore.open_store(long).stats().table_version}")


def test_the_command_console_wraps_on_a_terminal_only() -> None:
    from cli.output import CommandConsole

    text = "word " * 40
    piped = CommandConsole(file=io.StringIO(), width=80)
    piped.print(text)
    assert piped.file.getvalue().count("\n") == 1
    piped.rule("a title " * 12)
    assert piped.file.getvalue().splitlines()[-1] == "── " + "a title " * 12 + " ──"  # whole, not cut at 80
    terminal = CommandConsole(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    terminal.print(text)
    assert terminal.file.getvalue().count("\n") > 1
