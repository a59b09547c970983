"""A policy server reloaded by a published version's location (`/v1/load_weights` with uri + digest).

A real `trajstore serve` process with a control token, its own checkpoint cache and its own object
store (a moto server of this module, on loopback, so that the test can take it down), loaded the
way a collector on another host loads it: by the checkpoint event's `uri` and `digest`. The server
fetches and verifies the version itself; whatever it cannot verify or reach is refused with a
message, and the version it served before keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from collectors.children import spawn_child
from collectors.collect.reload import Reloader
from collectors.errors import WeightLoadError
from collectors.policy import EmbeddedClient, PublishedLoader
from tests.collectors.fake_vllm import free_port
from tests.collectors.proxy_harness import call
from tests.conftest import S3_START_TIMEOUT_S, _first_line
from trajstore import artifacts
from trajstore.announcement import Announcement, LoadRequest
from trajstore.location import directory

REPO = Path(__file__).resolve().parents[3]
TOKEN = "load-by-uri-token-0123456789"


@dataclass
class Served:
    url: str
    cache: Path  # the server's checkpoint cache
    store: subprocess.Popen[str]  # its object store (moto)
    options: dict[str, str]  # how this test reaches that store
    bucket: str = "published"


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("load-published")
    moto = subprocess.Popen([sys.executable, "-m", "tests.moto_s3", "--exit-on-eof"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    server: subprocess.Popen[str] | None = None
    try:
        endpoint = _first_line(moto, S3_START_TIMEOUT_S)
        assert endpoint.startswith("http://"), f"moto did not start (exit {moto.poll()})"
        aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=Served.bucket)
        port, cache = free_port(), root / "server-cache"
        env = {**os.environ, **aws, "PYTHONPATH": str(REPO), "HOME": str(root / "server-home"),
               "TRAJSTORE_CONTROL_TOKEN": TOKEN}  # not on argv, where `ps` shows it
        env.pop("AWS_PROFILE", None)
        server = spawn_child(
            [sys.executable, "-m", "cli.main", "serve", "--model", str(tiny_model), "--port", str(port), "--threads",
             "1", "--device", "cpu", "--checkpoint-cache", str(cache)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[0]
            time.sleep(0.2)
        yield Served(url, cache, moto, aws)
    finally:
        if server is not None:
            server.terminate()
            server.communicate(timeout=60)
        moto.stdin.close()  # type: ignore[union-attr]
        moto.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return call(url + "/health").status == 200
    except OSError:
        return False


def publish(served: Served, model: Path, local: Path, name: str) -> tuple[str, str]:
    """Publish a copy of `model` (at `local`, the "learner's" directory) as s3://BUCKET/NAME: (uri, digest)."""
    shutil.copytree(model, local)
    uri = f"s3://{served.bucket}/{name}"
    return uri, artifacts.upload(local, uri, storage_options=served.options)


def load(served: Served, body: dict[str, object], token: str | None = TOKEN) -> tuple[int, dict]:
    reply = call(served.url + "/v1/load_weights", body, key=token)
    return reply.status, reply.json()


def version(served: Served) -> int:
    """The served version, after checking the server still samples (a failed load must not break it)."""
    done = call(served.url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}).json()
    assert done["choices"][0]["finish_reason"] in ("length", "stop"), done
    return call(served.url + "/health").json()["policy_version"]


def copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.is_dir() else []


def test_a_server_loads_a_version_by_its_published_uri_and_refuses_what_it_cannot_verify(
        served: Served, tiny_model: Path, tiny_model_v2: Path, tmp_path: Path) -> None:
    uri, digest = publish(served, tiny_model_v2, tmp_path / "learner" / "v1", "ckpts/v000001")
    v1 = {"uri": uri, "digest": digest, "version": 1, "path": "/learner/host/only/v000001"}

    status, body = load(served, v1, token=None)
    assert status == 401 and "control token" in body["error"]["message"]
    for bad, param, fragment in [
        ({**v1, "uri": "http://elsewhere/v1"}, "uri", "use a directory path or an s3://bucket/prefix URI"),
        ({**v1, "uri": 7}, "uri", "the checkpoint announcement's uri"),
        ({**v1, "digest": "abc"}, "digest", "64 lowercase hex digits"),
        ({"uri": uri, "version": 1}, "digest", "64 lowercase hex digits"),
        ({**v1, "digest": hashlib.sha256(b"another manifest").hexdigest()}, "uri", "is not the one announced"),
        ({**v1, "uri": f"s3://{served.bucket}/ckpts/never-published"}, "uri", "has no trajstore_manifest.json"),
        ({**v1, "uri": "s3://no-such-bucket/ckpts/v000001"}, "uri", "or nothing was published there"),
    ]:
        status, body = load(served, bad)
        error = body["error"]
        assert status in (400, 422, 502) and error["param"] == param and fragment in error["message"], (bad, body)
        assert "still serving version 0" in error["message"] or status == 400, body
        assert version(served) == 0

    # damaged in storage after it was announced: every file is checked before anything loads
    weights = (tmp_path / "learner" / "v1" / "model.safetensors").read_bytes()
    fs, key = directory(f"{uri}/model.safetensors", storage_options=served.options)
    with fs.open_output_stream(key) as out:
        out.write(weights[:-5])
    status, body = load(served, v1)
    assert status == 422 and "is damaged: model.safetensors" in body["error"]["message"], body
    with fs.open_output_stream(key) as out:
        out.write(weights)
    assert version(served) == 0 and copies(served.cache) == []

    # a manifest naming a file and a file inside it (both objects exist: S3 has no folders) is refused, a 422
    plain = b"{}\n"
    entry = {"size": len(plain), "sha256": hashlib.sha256(plain).hexdigest()}
    both = json.dumps({"format": 1, "files": {"config.json": entry, "config.json/x": entry}}).encode()
    for name, data in (("config.json", plain), ("config.json/x", plain), (artifacts.MANIFEST, both)):
        fs, key = directory(f"s3://{served.bucket}/ckpts/both/{name}", storage_options=served.options)
        with fs.open_output_stream(key) as out:
            out.write(data)
    status, body = load(served, {**v1, "uri": f"s3://{served.bucket}/ckpts/both",
                                 "digest": hashlib.sha256(both).hexdigest()})
    assert status == 422 and "not a manifest trajstore wrote" in body["error"]["message"], body
    assert version(served) == 0 and copies(served.cache) == []

    # a collector's reloader names the version by its location; the server fetches, the collector does not
    async def reload(head: Announcement, collector_cache: Path) -> Reloader:
        async with EmbeddedClient(served.url, control_token=TOKEN) as client:
            assert isinstance(client, PublishedLoader)
            reloader = Reloader(client, served=0, cache=collector_cache)
            assert await reloader.sync(head), reloader.last_error
            return reloader

    asyncio.run(reload(Announcement(run="r", version=1, step=1, path=v1["path"], uri=uri, digest=digest), tmp_path / "collector-cache"))
    assert version(served) == 1
    assert not (tmp_path / "collector-cache").exists(), "the collector fetched nothing: its server did"
    (copy,) = copies(served.cache)
    assert artifacts.holds(copy, digest) and (copy / "model.safetensors").read_bytes() == weights

    status, body = load(served, {**v1, "version": 1})  # refused before any download
    assert status == 409 and "versions only go up" in body["error"]["message"]
    # a second collector of the same server, a step behind: the conflict means the version is already served
    other = asyncio.run(reload(Announcement(run="r", version=1, step=1, path=v1["path"], uri=uri, digest=digest), tmp_path / "other-cache"))
    assert (other.served, other.failures) == (1, 0)

    # where the server's disk holds the announced directory (the learner's host), it is loaded in place
    uri2, digest2 = publish(served, tiny_model, tmp_path / "learner" / "v2", "ckpts/v000002")
    status, body = load(served, {"uri": uri2, "digest": digest2, "version": 2, "path": str(tmp_path / "learner/v2")})
    assert status == 200 and body["path"] == str(tmp_path / "learner" / "v2"), body
    assert version(served) == 2 and copies(served.cache) == [copy]

    # the object store goes down: the reload fails with the reason, the server keeps serving version 2
    uri3, digest3 = publish(served, tiny_model_v2, tmp_path / "learner" / "v3", "ckpts/v000003")
    served.store.kill()
    served.store.wait(timeout=30)

    async def unreachable() -> None:
        async with EmbeddedClient(served.url, control_token=TOKEN) as client:
            with pytest.raises(WeightLoadError, match=r"could not fetch .* still serving version 2"):
                await client.load_published(LoadRequest(version=3, uri=uri3, digest=digest3))

    asyncio.run(unreachable())
    assert version(served) == 2
