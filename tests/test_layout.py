"""The layout of the repository: imports flow cli -> collectors, learner -> trajstore (docs/architecture.md);
small modules; one home per contract; nothing cites a file outside the repository."""

from __future__ import annotations

import ast
import re
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


VIRTUALENVS = {".venv", ".venv-vllm", ".venv-envs"}  # what `make` builds beside the code (not ours to check)


def test_collectors_are_subsystems_and_modules_stay_small() -> None:
    flat = sorted(p.name for p in (ROOT / "collectors").glob("*.py"))
    assert len(flat) <= 10, f"collectors/ has {len(flat)} flat modules; put them in a subsystem folder: {flat}"
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if not VIRTUALENVS & set(p.parts) and (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, f"modules over 600 lines (split each into modules with one job): {long}"


# ------------------------------------------------------------------ one home per contract

PACKAGES = ("trajstore", "collectors", "learner", "cli")


def package_files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def code_strings(path: Path) -> list[str]:
    """The string literals of a module's code: docstrings are prose about the code, so they are left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


TEXT_FORMAT_MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def test_only_collectors_model_writes_or_parses_the_models_text_format() -> None:
    """The tool-call and reasoning markup is spelled in collectors/model only (the chat template, its
    tokenizer, and `collectors.model.toolcalls`); everything else imports the parser and its constants."""
    offenders = {str(f.relative_to(ROOT)): sorted({m for s in code_strings(f) for m in TEXT_FORMAT_MARKUP if m in s})
                 for f in package_files(*PACKAGES) if (ROOT / "collectors" / "model") not in f.parents}
    assert {k: v for k, v in offenders.items() if v} == {}, "parse or render the text format with collectors.model.toolcalls"


def test_the_markup_checker_skips_docstrings_and_sees_code(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""Replies look like `<tool_call>...`."""\nOPEN = "<tool_call>"\n')
    assert code_strings(probe) == ["<tool_call>"]


def class_bases(*packages: str) -> dict[str, list[set[str]]]:
    """Class name -> the base names of each class of that name (the last part of a dotted base)."""
    classes: dict[str, list[set[str]]] = {}
    for path in package_files(*packages):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                names = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                classes.setdefault(node.name, []).append(names)
    return classes


ROOT_ERROR = "CollectorError"


def exception_roots(classes: dict[str, list[set[str]]], name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The names `name` derives from through the classes of `classes`: those outside it, and the root error."""
    if name not in classes or name in seen or name == ROOT_ERROR:
        return {name}
    return {root for bases in classes[name] for base in bases for root in exception_roots(classes, base, seen | {name})}


def is_exception_name(name: str) -> bool:
    builtin = getattr(__builtins__ if isinstance(__builtins__, dict) else vars(__builtins__), "get")(name)
    return (isinstance(builtin, type) and issubclass(builtin, BaseException)) or name.endswith(("Error", "Exception"))


def test_every_collector_exception_derives_from_collector_error_and_has_one_name() -> None:
    classes = class_bases("collectors")
    exceptions = {name for name in classes if name != ROOT_ERROR
                  and any(is_exception_name(root) for root in exception_roots(classes, name))}
    outside = sorted(name for name in exceptions if ROOT_ERROR not in exception_roots(classes, name))
    assert outside == [], f"collector exceptions outside CollectorError (collectors/errors.py): {outside}"
    twice = sorted(name for name in exceptions if len(classes[name]) > 1)
    assert twice == [], f"exception classes defined twice in collectors (raise the one that exists): {twice}"


def test_the_exception_checker_follows_bases_across_classes() -> None:
    classes = {"CollectorError": [{"Exception"}], "A": [{"CollectorError"}], "B": [{"A", "ValueError"}],
               "C": [{"TrajstoreError"}]}
    assert exception_roots(classes, "B") == {"CollectorError", "ValueError"}
    assert "CollectorError" not in exception_roots(classes, "C") and is_exception_name("TrajstoreError")


def module_names(path: Path) -> set[str]:
    """The top-level names a module defines or imports, and the names defined in its classes' bodies."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{n.name}" for n in node.body
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
                names.update(f"{node.name}.{t.id}" for n in node.body if isinstance(n, ast.AnnAssign)
                             for t in [n.target] if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports of a lazily exporting package
            names.update((a.asname or a.name) for n in node.body if isinstance(n, ast.ImportFrom) for a in n.names)
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.glob("*.py"))
        names.update(p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file())
    return names


def stale_name(dotted: str, base: Path = ROOT) -> bool:
    """Whether `package.module.name` names a module or a name in one that does not exist in the tree."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        stem = base.joinpath(*parts[:i])
        path = stem / "__init__.py" if (stem / "__init__.py").is_file() else stem.with_suffix(".py")
        if path.is_file():
            rest = parts[i:]
            return bool(rest) and ".".join(rest[:2]) not in module_names(path) and rest[0] not in module_names(path)
    return True


DOTTED = re.compile(r"(?<![\w.])(?:collectors|learner|cli)(?:\.[A-Za-z_]\w*)+|(?<![\w.])trajstore\.(?:%s)(?:\.[A-Za-z_]\w*)*")


def test_names_in_docstrings_comments_and_help_exist() -> None:
    """Every `collectors.x`, `learner.x`, `cli.x` (and `trajstore.<module>.x`) a text names still exists: a
    renamed or removed module leaves no pointer to nowhere in a docstring, a comment or a --help."""
    modules = "|".join(sorted(p.stem for p in (ROOT / "trajstore").glob("*.py") if p.stem != "__init__"))
    pattern = re.compile(DOTTED.pattern % modules)
    stale = {f"{f.relative_to(ROOT)}:{i}": m.group(0).rstrip(".")
             for f in package_files(*PACKAGES, "benchmarks")
             for i, line in enumerate(f.read_text().splitlines(), 1) for m in pattern.finditer(line)
             if stale_name(m.group(0).rstrip("."))}
    assert stale == {}, f"names of modules or functions that do not exist: {stale}"


def test_the_stale_name_checker_tells_live_names_from_gone_ones() -> None:
    assert not stale_name("collectors.model.toolcalls.parse_output") and not stale_name("collectors.policy")
    assert not stale_name("trajstore.table.Table.write_file") and not stale_name("collectors.collect.CollectSettings")
    assert stale_name("collectors.policy.clients") and stale_name("collectors.proxy.toolcalls")
    assert stale_name("trajstore.table.write_file") and stale_name("collectors.model.toolcalls.parse_everything")


def test_no_deprecated_transformers_cache_argument() -> None:
    """transformers takes the KV cache as `cache=` and returns it as `.cache`; `past_key_values` warns on every
    forward pass and is removed in 5.40."""
    users = [str(f.relative_to(ROOT)) for f in package_files(*PACKAGES, "benchmarks")
             if "past_key_values" in f.read_text()]
    assert users == []


def test_estimator_columns_are_named_in_trajstore_views_only() -> None:
    """The advantages view's estimator columns are listed once (trajstore.views.ESTIMATORS and its titles);
    the viewer, the CLI and the learner derive theirs from it."""
    spelled = re.compile(r"\b(?:dr_grpo|rloo)\b")
    files = [f for f in [*package_files("collectors", "learner", "cli", "trajstore"),
                         *(ROOT / "collectors").rglob("*.html")] if f != ROOT / "trajstore" / "views.py"]
    assert [str(f.relative_to(ROOT)) for f in files if spelled.search(f.read_text())] == []


def test_agents_import_the_proxy_only_through_its_public_constants() -> None:
    """Agents run beside the proxy, not inside it: they use its public constants (collectors.proxy.protocol,
    re-exported by collectors.proxy) and never its internals."""
    allowed = {"collectors.proxy", "collectors.proxy.protocol"}
    offenders = {}
    for f in package_files("collectors/agents", "collectors/envs"):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("collectors.proxy") \
                    and node.module not in allowed:
                offenders[str(f.relative_to(ROOT))] = node.module
    assert offenders == {}


def settings_fields(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.parametrize("command, settings, name", [
    ("cli/learn_cmd.py", "learner/settings.py", "LearnSettings"),
    ("cli/collect_cmd.py", "collectors/collect/settings.py", "CollectSettings"),
])
def test_cli_option_defaults_are_read_from_the_settings(command: str, settings: str, name: str) -> None:
    """An option that sets a settings field takes its default from the dataclass, never a literal typed again."""
    fields = settings_fields(ROOT / settings, name)
    typed = []
    for node in ast.walk(ast.parse((ROOT / command).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "option" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--"):
            field = str(node.args[0].value)[2:].replace("-", "_")
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if field in fields | {f.removesuffix("_s") for f in fields} and isinstance(default, ast.Constant):
                typed.append(f"--{field}")
    assert typed == [], f"{command}: defaults typed again instead of read from {name}: {typed}"


def raw_fsync_calls(path: Path) -> list[int]:
    """Lines of `path` that call fsync themselves (`os.fsync(...)`, or a bare `fsync(...)` imported from os)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in ("fsync", "fdatasync") and isinstance(f.value, ast.Name)
                    and f.value.id == "os") or (isinstance(f, ast.Name) and f.id in ("fsync", "fdatasync")):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("fsync", "fdatasync") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_durable_helper_calls_fsync() -> None:
    """Durability has one implementation (trajstore/durable.py); everything else goes through it."""
    helper = ROOT / "trajstore" / "durable.py"
    files = [f for d in ("trajstore", "collectors", "learner", "cli", "benchmarks", "tests")
             for f in sorted((ROOT / d).rglob("*.py"))]
    offenders = {str(f.relative_to(ROOT)): raw_fsync_calls(f) for f in files if f != helper}
    assert not {k: v for k, v in offenders.items() if v}, "call trajstore.durable (sync_file, fsync_path) instead"
    assert raw_fsync_calls(helper), "the checker sees the helper's own calls"


def test_the_fsync_checker_sees_each_spelling(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom os import fsync\nos.fsync(1)\nfsync(2)\nos.fdatasync(3)\nfsync_path(4)\n")
    assert raw_fsync_calls(probe) == [2, 3, 4, 5]


# Citations of files that are not in the repository: design notes kept beside a checkout, a sibling
# `shared` folder, a workstation's absolute paths. A reader of the repository cannot open them.
OUTSIDE = re.compile(r"\b(?:DESIGN|STYLE)\.md\b|\.\./shared\b|/work/(?:wt|main|shared)\b")
# A fixture store's Delta log records where its table was written (commitInfo): data, not a citation.
SKIPPED_DIRS = {".git", *VIRTUALENVS, "node_modules", "test-artifacts", "__pycache__", ".pytest_cache",
                "_delta_log"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".json", ".jinja", ".html", ".css", ".js", ".cfg", ".ini", ".yml",
                 ".yaml", ".sh"}


def repository_text_files(base: Path = ROOT) -> list[Path]:
    """The repository's own text files (code, docs, settings), without virtualenvs, caches and artifacts."""
    out = []
    for path in sorted(base.rglob("*")):
        parts = set(path.relative_to(base).parts)
        if parts & SKIPPED_DIRS or any(p.endswith(".egg-info") for p in parts) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name == "Makefile":
            out.append(path)
    return out


def outside_citations(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    return [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in OUTSIDE.finditer(text)]


def test_nothing_cites_a_file_outside_the_repository() -> None:
    found = [hit for path in repository_text_files() for hit in outside_citations(path)]
    assert not found, f"these cite files outside the repository; cite docs/ or the module instead: {found}"


def test_the_citation_checker_sees_citations(tmp_path: Path) -> None:
    design, style, shared = "DESIGN" + ".md", "STYLE" + ".md", ".." + "/shared"  # spelled apart: not citations here
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f'"""As {design} says."""\n')
    (tmp_path / "notes.md").write_text(f"See {shared}/{style} and docs/architecture.md.\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.py").write_text(f"# {design}\n")
    hits = [hit for path in repository_text_files(tmp_path) for hit in outside_citations(path)]
    assert hits == [f"notes.md:1: {shared}", f"notes.md:1: {style}", f"mod.py:1: {design}"]


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_docs_names_a_file_in_the_repository() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in MARKDOWN_LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor of the same page
            resolved = (page.parent / target.split("#")[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_checkpoint_announcement_is_read_through_its_type() -> None:
    """Only trajstore reads the announcement's JSON (`trajstore.announcement`, the `checkpoints` view's typed
    columns): a package that parsed the event's meta itself would be a second, untyped copy of the contract."""
    readers = {str(p.relative_to(ROOT)) for package in ("collectors", "learner", "cli")
               for p in (ROOT / package).rglob("*.py")
               if "meta FROM checkpoints" in (text := p.read_text()) or "json_extract(meta, '$.groups_per" in text}
    assert readers == set(), f"read the checkpoints view's typed columns or trajstore.announcement instead: {readers}"
