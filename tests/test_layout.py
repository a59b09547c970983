"""The dependency direction of DESIGN.md: cli -> collectors, learner -> trajstore."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "trajstore": {"collectors", "learner", "cli"},
    "collectors": {"learner", "cli"},
    "learner": {"collectors", "cli"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package]) for f in files
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"imports against cli -> collectors, learner -> trajstore: {offenders}"


def test_the_checker_sees_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import collectors.embedded.app\nfrom learner import loop\nfrom . import sibling\n")
    assert imported_packages(probe) == {"collectors", "learner"}
