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


def module_graph(package: str, base: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, at any level of the file (functions included)."""
    root = base / package
    modules = {p.stem if p.stem != "__init__" else package: p for p in root.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] != package:
                    continue
                if len(parts) > 1:
                    edges.add(parts[1])
                else:  # `from trajstore import wal` names a module; `from trajstore import Store` the package
                    edges.update(a.name if a.name in modules else package for a in node.names)
            elif isinstance(node, ast.Import):
                edges.update(a.name.split(".")[1] for a in node.names
                             if a.name.startswith(package + ".") and a.name.count(".") >= 1)
        graph[name] = edges - {name}
    return graph


def test_the_store_has_no_import_cycle_and_nothing_inside_imports_the_facade() -> None:
    graph = module_graph("trajstore")
    assert [m for m, edges in graph.items() if "store" in edges and m != "trajstore"] == []
    inner = {m: e - {"trajstore"} for m, e in graph.items() if m != "trajstore"}
    assert [m for m, e in graph.items() if "trajstore" in e and m != "trajstore"] == []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join(path + [node])}"
        if node in done:
            return
        for nxt in sorted(inner.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(inner):
        visit(module, [])


def test_the_module_graph_sees_function_level_and_package_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "trajstore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from trajstore.store import Store\n")
    (pkg / "store.py").write_text("from trajstore import wal\n")
    (pkg / "wal.py").write_text("def f():\n    from trajstore.store import Store\n")
    (pkg / "shard.py").write_text("import trajstore.wal\nfrom trajstore import Store\n")
    assert module_graph("trajstore", tmp_path) == {
        "trajstore": {"store"}, "store": {"wal"}, "wal": {"store"}, "shard": {"wal", "trajstore"}}


def test_collectors_are_subsystems_and_modules_stay_small() -> None:
    flat = sorted(p.name for p in (ROOT / "collectors").glob("*.py"))
    assert len(flat) <= 10, f"collectors/ has {len(flat)} flat modules; put them in a subsystem folder: {flat}"
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if not {".venv", ".venv-vllm"} & set(p.parts) and (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, f"modules over 600 lines (split each into modules with one job): {long}"


def test_the_checkpoint_announcement_is_read_through_its_type() -> None:
    """Only trajstore reads the announcement's JSON (`trajstore.announcement`, the `checkpoints` view's typed
    columns): a package that parsed the event's meta itself would be a second, untyped copy of the contract."""
    readers = {str(p.relative_to(ROOT)) for package in ("collectors", "learner", "cli")
               for p in (ROOT / package).rglob("*.py")
               if "meta FROM checkpoints" in (text := p.read_text()) or "json_extract(meta, '$.groups_per" in text}
    assert readers == set(), f"read the checkpoints view's typed columns or trajstore.announcement instead: {readers}"
