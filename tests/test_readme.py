"""The README and the docs/ pages say what is true (issue 12.20): their synopses name real options
(required ones outside brackets), their task line is the arithmetic environment's, and their metric
names are those the learner logs and the terminal shows; the README stays one screen's worth. (The
proxy example is run in tests/collectors/proxy, the commands of docs/own-task.md and the check of
docs/models.md in tests/test_docs_commands.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest

from cli.main import main
from collectors.envs import arithmetic
from learner.metrics_log import COLUMNS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n\n".join(page.read_text() for page in PAGES)  # the README and every docs/ page, in one text
README_LINES = 300  # about one screen's worth of scrolling: the rest belongs in docs/


def fenced_block(text: str, marker: str) -> str:
    """The fenced code block of `text` that holds `marker`."""
    at = text.index(marker)
    start = text.rindex("```", 0, at)
    return text[text.index("\n", start) + 1:text.index("```", at)]


def block_containing(marker: str) -> str:
    """The fenced code block of the README or a docs/ page that holds `marker`."""
    return fenced_block(README, marker)


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


def test_the_readme_stays_short_and_links_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("incoming-")}
    assert pages and {p for p in pages if f"docs/{p}" not in text} == set()


def test_the_readmes_own_task_commands_are_the_docs_page_s() -> None:
    """The README shows the commands of docs/own-task.md, which tests/test_docs_commands.py runs."""
    marker = "trajstore init-model my/base"
    assert fenced_block((ROOT / "README.md").read_text(), marker) == \
        fenced_block((ROOT / "docs" / "own-task.md").read_text(), marker)


def test_the_documented_columns_of_each_view_are_the_views(tmp_path: Path) -> None:
    import trajstore
    from trajstore.views import VIEWS

    documented = dict(re.findall(r"^- `(\w+)`: (\w+(?:, \w+)*)$", (ROOT / "docs" / "architecture.md").read_text(), re.M))
    store = trajstore.open_store(tmp_path / "s")
    actual = {v: ", ".join(store.query(f"SELECT * FROM {v} LIMIT 0").column_names) for v in VIEWS if v != "events"}
    assert documented == actual
