"""Option bundles and the one place where errors become messages, shared by the `trajstore` commands."""

from __future__ import annotations

import dataclasses
import os
import signal
import warnings
from collections.abc import Callable
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
