"""Shared fixtures. `store_location` is where a test's store lives; store tests use it so the
same suite runs against a local directory and against an S3-compatible server.

The S3 server is moto (`tests/moto_s3.py`), one process per test session on a free
loopback port, with one bucket. While it runs, the session's environment points the AWS
clients at it (AWS_ENDPOINT_URL and dummy credentials), so child processes that tests
start reach it too; the previous environment comes back at the end of the session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import trajstore

REPO = Path(__file__).resolve().parent.parent
S3_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    def new_uri(self) -> str:
        """A fresh, empty store URI in the bucket."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex}"

    def requests(self, uri: str) -> int:
        """How many S3 requests touched the store at `uri` so far (the server counts them per prefix)."""
        return store_requests(self.endpoint, uri)

    def put(self, uri: str, data: bytes | None) -> None:
        """Write the object at `uri` (s3://bucket/key), or delete it with None: damage from outside the store."""
        from trajstore.location import directory

        fs, path = directory(uri)
        if data is None:
            fs.delete_file(path)
        else:
            with fs.open_output_stream(path) as out:
                out.write(data)


def store_requests(endpoint: str, uri: str) -> int:
    """The S3 request count of the store at `uri` (s3://bucket/prefix) on the test server at `endpoint`."""
    prefix = uri.split("://", 1)[1].split("/")[1]
    with urllib.request.urlopen(f"{endpoint}/_trajstore/requests?prefix={prefix}", timeout=10) as reply:
        return int(json.loads(reply.read())["requests"])


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return line[0].strip() if line else ""


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 on 127.0.0.1, a bucket in it, and AWS_* pointing at it for the session."""
    pytest.importorskip("moto", reason="the s3 store tests need moto[server] (pip install -e '.[test]')")
    boto3 = pytest.importorskip("boto3")
    # The server exits when its stdin closes: at teardown, or when this process dies.
    proc = subprocess.Popen([sys.executable, "-m", "tests.moto_s3", "--exit-on-eof"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        endpoint = _first_line(proc, S3_START_TIMEOUT_S)
        if not endpoint.startswith("http://"):
            raise RuntimeError(f"the moto S3 server did not start within {S3_START_TIMEOUT_S:.0f} s "
                               f"(exit code {proc.poll()}); run `python -m tests.moto_s3` to see why")
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3"):
                mp.delenv(name, raising=False)
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_REGION", "us-east-1")
            server = S3Server(endpoint, "trajstore-test")
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=server.bucket)
            yield server
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["local", "s3"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A store location: a fresh directory, or a fresh prefix on the S3 server with this
    test's own write-ahead spool (TRAJSTORE_SPOOL) under tmp_path."""
    if request.param == "local":
        return str(tmp_path / "store")
    server: S3Server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("TRAJSTORE_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("TRAJSTORE_FILE_CACHE", str(tmp_path / "file-cache"))
    return server.new_uri()


@pytest.fixture
def store(store_location: str) -> trajstore.Store:
    return trajstore.open_store(store_location)
