"""The control token stays off the command line (issue 20, item 5): `serve` and `collect` take it from
$TRAJSTORE_CONTROL_TOKEN or --control-token-file, and warn when it is given on argv (`ps` shows it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cli.options import CONTROL_TOKEN_ENV, control_token_option

TOKEN = "a-control-token-0123456789"


@click.command()
@control_token_option("The token.")
def show(control_token: str | None) -> None:
    click.echo(f"token={control_token}")


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(show, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_a_token_on_argv_works_with_a_warning() -> None:
    code, out, err = invoke("--control-token", TOKEN)
    assert code == 0 and out == f"token={TOKEN}\n"
    assert "visible to every user" in err and CONTROL_TOKEN_ENV in err and "--control-token-file" in err


def test_the_environment_and_a_file_are_silent(tmp_path: Path) -> None:
    assert invoke(env={CONTROL_TOKEN_ENV: TOKEN}) == (0, f"token={TOKEN}\n", "")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    assert invoke("--control-token-file", str(path)) == (0, f"token={TOKEN}\n", "")
    assert invoke() == (0, "token=None\n", "")


def test_a_bad_token_file_is_a_clear_error(tmp_path: Path) -> None:
    empty, shared = tmp_path / "empty", tmp_path / "shared"
    empty.write_text("\n")
    shared.write_text(TOKEN)
    shared.chmod(0o644)
    code, _, err = invoke("--control-token-file", str(empty))
    assert code == 2 and "is empty" in err
    code, _, err = invoke("--control-token-file", str(tmp_path / "missing"))
    assert code == 2 and "cannot read the control token" in err
    code, out, err = invoke("--control-token-file", str(shared))
    assert code == 0 and out == f"token={TOKEN}\n" and "readable by other users" in err and "chmod 600" in err
    code, _, err = invoke("--control-token-file", str(shared), "--control-token", TOKEN)
    assert code == 2 and "not both" in err


@pytest.mark.parametrize("command", ["serve", "collect"])
def test_serve_and_collect_take_a_token_file(command: str) -> None:
    shown = subprocess.run([sys.executable, "-m", "cli.main", command, "--help"], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    assert "--control-token-file" in shown and CONTROL_TOKEN_ENV in shown
