"""`trajstore --help` and commands that need no model start without torch (issue 12.19).

Measured by what gets imported, not by time: torch alone took 1.8 s of the 2-7 s `--help` cost.
Each check runs in a fresh interpreter, so nothing the test session imported counts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "transformers", "peft", "matplotlib", "aiohttp", "openai", "anthropic")
PROBE = """
import sys
from click.testing import CliRunner
from cli.main import main
result = CliRunner().invoke(main, sys.argv[1:])
assert result.exit_code == 0, (result.output, result.exception)
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
light = sorted(m for m in ("pyarrow", "duckdb", "deltalake") if m in sys.modules)
print(heavy, light)
"""


def imported(*args: str) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    heavy, light = proc.stdout.strip().split("] [")
    return heavy + "]", "[" + light


@pytest.mark.parametrize("command", ["", "learn", "annotate", "collect", "serve", "proxy", "demo", "replay", "view",
                                     "init-model", "sft"])
def test_help_loads_neither_torch_nor_the_store(command: str) -> None:
    heavy, light = imported(*([command] if command else []), "--help")
    assert heavy == "[]" and light == "[]", (heavy, light)


def test_store_commands_load_the_store_but_not_torch(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    import trajstore

    trajstore.open_store(store)
    for args in (["query", "--store", store, "SELECT count(*) FROM rollouts"], ["stats", "--store", store],
                 ["verify", "--store", store]):
        heavy, light = imported(*args)
        assert heavy == "[]" and "pyarrow" in light, (args, heavy, light)
