"""The README says what is true (issue 12.20): its synopses name real options (required ones outside
brackets), its task line is the arithmetic environment's, and its metric names are those the
learner logs and the terminal shows. (Its proxy example is run in tests/collectors/proxy.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest

from cli.main import main
from collectors.envs import arithmetic
from learner.metrics_log import COLUMNS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def block_containing(marker: str) -> str:
    """The fenced code block of the README that holds `marker`."""
    at = README.index(marker)
    start = README.rindex("```", 0, at)
    return README[README.index("\n", start) + 1:README.index("```", at)]


@pytest.mark.parametrize("command", ["collect", "learn"])
def test_synopses_name_real_options_and_bracket_only_the_optional_ones(command: str) -> None:
    synopsis = block_containing(f"trajstore {command} --store S --run exp")
    synopsis = synopsis[synopsis.index(f"trajstore {command}"):]
    cmd = main.commands[command]
    options = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
    required = {p.opts[0] for p in cmd.params if isinstance(p, click.Option) and p.required}
    text = re.sub(r"#.*", "", synopsis)
    named = set(re.findall(r"(--[a-z][a-z-]*)", text))
    assert named <= options, named - options
    plain = re.sub(r"\([^()]*\)", "", re.sub(r"\[[^\]]*\]", "", text))  # without [optional] and (a | b) groups
    unbracketed = set(re.findall(r"(--[a-z][a-z-]*)", plain))
    assert unbracketed == required, (unbracketed, required)  # a flag shown plain is one that must be given


def test_the_arithmetic_task_line_is_the_environments() -> None:
    comment = re.search(r"#   one task per line: (\{.*?\n#\s+.*?\})", README, re.S)
    assert comment is not None
    task = json.loads(re.sub(r"\n#\s+", " ", comment.group(1)))
    assert task == arithmetic.tasks(1, seed=0)[0]


def test_the_metric_names_are_what_the_terminal_shows_and_the_store_holds() -> None:
    rows = re.findall(r"^  \| `([^`]+)` \| `([^`]+)` \|", README, re.M)
    assert len(rows) >= 10
    shown = {label: name for name, label, _ in COLUMNS}
    for label, name in rows:
        assert shown.get(label) == name, (label, name)
