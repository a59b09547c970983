"""Shared fixtures. `store_location` is where a test's store lives; store tests use it so the
same suite runs against a local directory and against an S3-compatible server."""

from __future__ import annotations

import pytest

import trajstore


@pytest.fixture(params=["local"])
def store_location(request: pytest.FixtureRequest, tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(store_location: str) -> trajstore.Store:
    return trajstore.open_store(store_location)
