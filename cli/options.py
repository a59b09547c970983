"""Option bundles and error handling shared by the `trajstore` commands."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from trajstore.errors import TrajstoreError


def store_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--store LOC, shared by every command that reads or writes a store."""
    return click.option(
        "--store", "store_loc", required=True, envvar="TRAJSTORE_STORE", show_envvar=True,
        help="Store location: a directory or s3://bucket/prefix.",
    )(func)


def domain_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's named errors into click errors at the edge."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (TrajstoreError, ValueError, OSError) as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper
