"""`trajstore sft`: the supervised warm start as a command. A bad data file or output directory is one
line on stderr and exit 1, before any model is loaded; the whole path (a real warm start whose
checkpoint `collect` serves) runs in tests/test_docs_commands.py."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli.main import main


def sft(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["sft", *args])
    return result.exit_code, result.output


def test_every_bad_line_of_the_data_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"messages": [{"role": "user", "content": "x"}]}),
                               json.dumps({"prompt": "x"}), json.dumps({**good, "tools": "calculator"})]) + "\n")
    (tmp_path / "model").mkdir()
    code, output = sft("--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "out"))
    assert code == 1
    assert "line 2: not JSON" in output and "line 3: has no assistant message" in output
    assert 'line 4: needs "messages"' in output and 'line 5: "tools" must be a list' in output
    assert "Traceback" not in output and not (tmp_path / "out").exists()


def test_an_output_directory_that_holds_files_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hello"}]}) + "\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, output = sft("--model", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "out"))
    assert code == 1 and "is not empty" in output and (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_defaults_are_the_settings() -> None:
    from learner.settings import WarmStartSettings

    output = CliRunner().invoke(main, ["sft", "--help"], terminal_width=300).output
    lines = {line.split()[0]: line for line in output.splitlines() if line.strip().startswith("--")}
    defaults = WarmStartSettings()
    for option, value in (("--steps", defaults.steps), ("--lr", defaults.lr), ("--batch-size", defaults.batch_size),
                          ("--seed", defaults.seed)):
        assert f"[default: {value}" in lines[option], lines[option]
