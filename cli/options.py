"""Option bundles and the one place where errors become messages, shared by the `trajstore` commands."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click

from collectors.errors import CollectorError
from learner.errors import LearnerError
from trajstore.errors import TrajstoreError

# What a command may fail with on purpose: each package's root, and the operating system's and
# bad values' errors (a port in use, a directory that exists, a name that is not allowed).
DOMAIN_ERRORS = (TrajstoreError, CollectorError, LearnerError, OSError, ValueError)


class Commands(click.Group):
    """The `trajstore` group: a domain error of any command ends as one line on stderr and exit 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DOMAIN_ERRORS as exc:
            raise click.ClickException(str(exc)) from exc
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (see prepare_process): cleanup has run
            click.echo(str(exc) or "interrupted", err=True)
            ctx.exit(130)


def store_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--store LOC, shared by every command that reads or writes a store."""
    return click.option(
        "--store", "store_loc", required=True, envvar="TRAJSTORE_STORE", show_envvar=True,
        help="Store location: a directory or s3://bucket/prefix.",
    )(func)


def setting_default(settings: type[Any], name: str) -> Any:
    """The default of field `name` of the settings dataclass `settings`: a command's option defaults are
    read from the settings it builds, so that the two cannot drift apart."""
    for field in dataclasses.fields(settings):
        if field.name == name:
            if field.default is dataclasses.MISSING:
                raise TypeError(f"{settings.__name__}.{name} has no default to show as an option's default")
            return field.default
    raise TypeError(f"{settings.__name__} has no field {name!r}")


def seal_interval_option(default: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--seal-interval SECONDS, shared by the commands that append to a store (each gives its settings' default)."""
    return click.option(
        "--seal-interval", type=click.FloatRange(min=0, min_open=True), default=default, show_default=True,
        envvar="TRAJSTORE_SEAL_INTERVAL", show_envvar=True,
        help="Seconds before appended events are sealed into the table, which is when other machines see them "
             "(in an s3:// store, checkpoint and status events are sealed at once).",
    )


CONTROL_TOKEN_ENV = "TRAJSTORE_CONTROL_TOKEN"


def control_token_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--control-token TOKEN and --control-token-file FILE, resolved into the command's `control_token`
    argument. A token on the command line shows in `ps` to every user of the machine: it still works, with a
    warning naming the safe ways (the environment variable, a file only its owner reads)."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def command(*args: Any, control_token_file: str | None, **kwargs: Any) -> Any:
            kwargs["control_token"] = _control_token(kwargs.get("control_token"), control_token_file)
            return func(*args, **kwargs)

        command = click.option(
            "--control-token-file", type=click.Path(dir_okay=False), metavar="FILE",
            help="Read the control token from FILE (its first line; keep it readable by its owner only).",
        )(command)
        return click.option(
            "--control-token", envvar=CONTROL_TOKEN_ENV, show_envvar=True, metavar="TOKEN",
            help=help + f" Prefer ${CONTROL_TOKEN_ENV} or --control-token-file: a command line shows in `ps`.",
        )(command)

    return decorate


def _control_token(given: str | None, path: str | None) -> str | None:
    ctx = click.get_current_context()
    on_argv = ctx.get_parameter_source("control_token") == click.core.ParameterSource.COMMANDLINE
    if path is not None:
        if on_argv:
            raise click.UsageError("give the control token once: --control-token or --control-token-file, not both")
        return _read_token(Path(path))
    if given is not None and on_argv:
        click.echo(f"warning: --control-token on the command line is visible to every user of this machine (`ps`); "
                   f"set {CONTROL_TOKEN_ENV} or use --control-token-file FILE instead", err=True)
    return given


def _read_token(path: Path) -> str:
    try:
        lines = path.read_text().splitlines()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read the control token from {path}: {exc}",
                                 param_hint="--control-token-file") from exc
    if not lines or not lines[0].strip():
        raise click.BadParameter(f"{path} is empty; write the token on its first line "
                                 "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())' > FILE`)",
                                 param_hint="--control-token-file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        click.echo(f"warning: {path} is readable by other users (mode {stat.S_IMODE(mode):o}); `chmod 600 {path}`",
                   err=True)
    return lines[0].strip()


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def prepare_process() -> None:
    """What every command needs before it starts: `kill PID` (SIGTERM) stops it the way Ctrl-C does, so
    its cleanup runs and its store writers seal what they appended; and library progress bars and
    deprecation warnings stay out of its output (set before the libraries load, which the commands
    do lazily)."""
    signal.signal(signal.SIGTERM, _stop)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # its warning when an agent command forks
    for module in ("transformers", "torch", "peft", "huggingface_hub", "accelerate"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
