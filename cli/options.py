"""Option bundles and the one place where errors become messages, shared by the `trajstore` commands."""

from __future__ import annotations

from collections.abc import Callable
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


def store_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--store LOC, shared by every command that reads or writes a store."""
    return click.option(
        "--store", "store_loc", required=True, envvar="TRAJSTORE_STORE", show_envvar=True,
        help="Store location: a directory or s3://bucket/prefix.",
    )(func)
