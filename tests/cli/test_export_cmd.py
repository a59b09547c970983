"""`trajstore export` and `trajstore ingest --format hf` from the command line: each format written, the hf
export read back into an equal store, and bad input answered with one line."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import trajstore
from cli.main import main
from tests.trajstore.chat_run import chat_run


def _store(path: Path) -> str:
    store = trajstore.open_store(path)
    with store.writer("w") as w:
        w.append(chat_run(groups=1))
    return str(path)


def test_export_each_format_and_ingest_the_hf_export_back(tmp_path: Path) -> None:
    store = _store(tmp_path / "s")
    runner = CliRunner()
    for fmt, out in (("hf", "ds"), ("sft", "sft.jsonl"), ("tokens", "t.parquet"), ("ng-trajectory", "ng.jsonl")):
        result = runner.invoke(main, ["export", "--store", store, "--format", fmt, "--run", "chat",
                                      "--where", "status = 'completed'", str(tmp_path / out)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert f"written to {tmp_path / out} as {fmt}" in result.output
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 4
    assert "messages" in json.loads((tmp_path / "sft.jsonl").read_text().splitlines()[0])
    result = runner.invoke(main, ["ingest", "--store", str(tmp_path / "copy"), "--format", "hf", str(tmp_path / "ds")],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    sql = "SELECT rollout_id, tokens, loss_mask, logprobs FROM samples ORDER BY rollout_id"
    assert trajstore.open_store(tmp_path / "copy").query(sql).equals(trajstore.open_store(store).query(sql))


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    store = _store(tmp_path / "s")
    runner = CliRunner()
    result = runner.invoke(main, ["export", "--store", store, "--format", "hf", "--run", "other", str(tmp_path / "d")])
    assert result.exit_code == 1 and "run 'other' has no turns" in result.output and "Traceback" not in result.output
    result = runner.invoke(main, ["ingest", "--store", store, str(tmp_path)])
    assert result.exit_code == 2 and "--format hf for an hf export" in result.output
    result = runner.invoke(main, ["export", "--store", store, "--format", "csv", "--run", "chat", "x"])
    assert result.exit_code == 2 and "'csv' is not one of" in result.output
