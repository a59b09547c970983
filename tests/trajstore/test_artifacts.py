"""Directories published to object storage (moto's S3 server) and fetched into a local cache:
atomic for readers, verified file by file, safe for several fetching processes on one host."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.conftest import S3Server
from trajstore import ArtifactError, artifacts
from trajstore.location import directory


@pytest.fixture
def published(s3_server: S3Server, tmp_path: Path) -> tuple[Path, str, str]:
    """A directory on the publisher's disk, its URI in the bucket, and its digest once uploaded."""
    local = tmp_path / "learner" / "v000001"
    (local / "tok").mkdir(parents=True)
    (local / "config.json").write_text('{"layers": 2}\n')
    (local / "model.safetensors").write_bytes(os.urandom(3 << 20))  # a few MB, as weights are
    (local / "tok" / "vocab.json").write_text("{}\n")
    (local / "learner_state.pt").write_bytes(b"private optimizer state")
    uri = f"{s3_server.new_uri()}/checkpoints/run/v000001"
    return local, uri, artifacts.upload(local, uri, exclude=("learner_state.pt",))


def _objects(uri: str) -> dict[str, bytes]:
    fs, root = directory(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    out = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                out[info.path[len(root) + 1:]] = f.read()
    return out


def test_upload_then_fetch_on_another_disk(published: tuple[Path, str, str], tmp_path: Path) -> None:
    local, uri, digest = published
    stored = _objects(uri)
    assert set(stored) == {"config.json", "model.safetensors", "tok/vocab.json", artifacts.MANIFEST}
    assert digest == artifacts.digest(stored[artifacts.MANIFEST])
    assert artifacts.holds(local, digest), "the publisher's own directory is recognised as the announced one"
    assert artifacts.upload(local, uri, exclude=("learner_state.pt",)) == digest, "a second upload is a no-op"

    copy = artifacts.fetch(uri, tmp_path / "other-host" / "cache", expect=digest)
    assert copy.is_relative_to(tmp_path / "other-host" / "cache")
    for rel in ("config.json", "model.safetensors", "tok/vocab.json"):
        assert (copy / rel).read_bytes() == (local / rel).read_bytes()
    assert not (copy / "learner_state.pt").exists()
    assert artifacts.fetch(uri, tmp_path / "other-host" / "cache", expect=digest) == copy  # from the cache

    (local / "config.json").write_text('{"layers": 3}\n')  # the same version published again, other bytes
    with pytest.raises(ArtifactError, match="already holds another published directory"):
        artifacts.upload(local, uri, exclude=("learner_state.pt",))


def test_an_unfinished_or_damaged_upload_is_never_used(published: tuple[Path, str, str], s3_server: S3Server,
                                                      tmp_path: Path) -> None:
    local, uri, digest = published
    cache = tmp_path / "cache"
    manifest = _objects(uri)[artifacts.MANIFEST]

    s3_server.put(f"{uri}/{artifacts.MANIFEST}", None)  # files there, manifest not yet: an upload in progress
    with pytest.raises(ArtifactError, match="has no trajstore_manifest.json: its upload has not finished"):
        artifacts.fetch(uri, cache, expect=digest)
    s3_server.put(f"{uri}/{artifacts.MANIFEST}", manifest)

    s3_server.put(f"{uri}/model.safetensors", b"torn")
    with pytest.raises(ArtifactError, match=r"is damaged: model.safetensors does not have the size its manifest says"):
        artifacts.fetch(uri, cache, expect=digest)
    s3_server.put(f"{uri}/model.safetensors", (local / "model.safetensors").read_bytes())
    s3_server.put(f"{uri}/tok/vocab.json", None)
    with pytest.raises(ArtifactError, match="tok/vocab.json, listed in its manifest, is missing"):
        artifacts.fetch(uri, cache, expect=digest)
    assert sorted(p.name for p in cache.iterdir()) == [f".lock-{artifacts._key(uri)}"], "nothing partial is kept"

    with pytest.raises(ArtifactError, match="is not the one announced"):
        artifacts.fetch(uri, cache, expect="0" * 64)
    escaping = {"format": 1, "files": {"../escape": {"size": 1, "sha256": "x"}}}
    s3_server.put(f"{uri}/{artifacts.MANIFEST}", json.dumps(escaping).encode())
    with pytest.raises(ArtifactError, match="not a manifest trajstore wrote"):
        artifacts.fetch(uri, cache)
    assert not (tmp_path / "escape").exists()


def _fetch_into(uri: str, cache: str, digest: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(str(artifacts.fetch(uri, cache, expect=digest)))


def test_processes_sharing_a_cache_get_one_verified_copy(published: tuple[Path, str, str], tmp_path: Path) -> None:
    local, uri, digest = published
    cache = tmp_path / "cache"
    cache.mkdir()
    key = artifacts._key(uri)
    (cache / f".partial-{key}-deadbeef").mkdir()  # what a fetch killed midway leaves
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_fetch_into, args=(uri, str(cache), digest, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    paths = {results.get(timeout=5) for _ in procs}
    assert paths == {str(cache / key)}
    assert sorted(p.name for p in cache.iterdir()) == sorted([key, f".lock-{key}"])
    assert (cache / key / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()


def test_prune_keeps_the_most_recently_used(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for i, name in enumerate(["a", "b", "c"]):
        (cache / name).mkdir(parents=True)
        os.utime(cache / name, (1000 + i, 1000 + i))
    assert artifacts.prune(cache, 2) == [cache / "a"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == ["b", "c"]


def test_a_directory_every_host_mounts_works_the_same(tmp_path: Path) -> None:
    local = tmp_path / "learner" / "v000001"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}\n")
    shared = tmp_path / "nfs" / "ckpts" / "v000001"
    artifacts.check_destination(str(shared.parent))
    digest = artifacts.upload(local, str(shared))
    assert sorted(p.name for p in shared.iterdir()) == ["config.json", artifacts.MANIFEST]
    copy = artifacts.fetch(str(shared), tmp_path / "cache", expect=digest)
    assert (copy / "config.json").read_text() == "{}\n"
    (tmp_path / "file").write_text("")
    with pytest.raises(ArtifactError, match="cannot publish to"):
        artifacts.check_destination(str(tmp_path / "file" / "ckpts"))


def _shared_publish(tmp_path: Path) -> tuple[Path, str]:
    """A directory published on a disk every host mounts (a path, not S3), and its digest."""
    local = tmp_path / "learner" / "v000001"
    (local / "tok").mkdir(parents=True)
    (local / "config.json").write_text("{}\n")
    (local / "tok" / "vocab.json").write_text("{}\n")
    shared = tmp_path / "nfs" / "v000001"
    return shared, artifacts.upload(local, str(shared))


@pytest.mark.parametrize("linked", ["config.json", "tok", artifacts.MANIFEST])
def test_a_symlink_in_a_published_directory_is_refused_and_nothing_of_its_target_told(
        tmp_path: Path, linked: str) -> None:
    """Someone who can write the shared directory swaps a file (or a folder) for a link to the server
    user's private file: the fetch must neither copy it nor tell its size or hash."""
    shared, digest = _shared_publish(tmp_path)
    secret = tmp_path / "home" / "private"
    secret.mkdir(parents=True)
    (secret / "vocab.json").write_text("{}\n")  # the very bytes the manifest lists: a hash match
    (secret / "config.json").write_text("{}\n")
    (secret / artifacts.MANIFEST).write_bytes((shared / artifacts.MANIFEST).read_bytes())
    target = secret if linked == "tok" else secret / linked
    victim = shared / linked
    if victim.is_dir():
        for f in victim.iterdir():
            f.unlink()
        victim.rmdir()
    else:
        victim.unlink()
    victim.symlink_to(target)
    cache = tmp_path / "cache"
    with pytest.raises(ArtifactError, match=f"{linked} is a symbolic link") as err:
        artifacts.fetch(str(shared), cache, expect=digest)
    assert "sha256 " not in str(err.value).replace("announced sha256", "") and "bytes" not in str(err.value)
    assert not [p for p in cache.iterdir() if not p.name.startswith(".lock-")], "nothing was copied into the cache"


def test_a_damaged_file_message_tells_nothing_about_what_was_read(tmp_path: Path) -> None:
    shared, digest = _shared_publish(tmp_path)
    (shared / "config.json").write_text("the server user's secret\n")
    with pytest.raises(ArtifactError, match="config.json does not have the size its manifest says") as err:
        artifacts.fetch(str(shared), tmp_path / "cache", expect=digest)
    told = str(err.value).split(" is damaged: ", 1)[1]  # after the directory's path, which may hold any digits
    assert "25" not in told and "sha256 " not in told  # the file read has 25 bytes
    (shared / "config.json").write_text("[]\n")  # same size, other bytes
    with pytest.raises(ArtifactError, match="config.json does not have the sha256 its manifest says") as err:
        artifacts.fetch(str(shared), tmp_path / "cache", expect=digest)
    actual = artifacts.digest(b"[]\n")
    assert actual[:8] not in str(err.value)
    with pytest.raises(ArtifactError, match="is not the one announced") as err:
        artifacts.fetch(str(shared), tmp_path / "cache", expect="0" * 64)
    assert artifacts.digest((shared / artifacts.MANIFEST).read_bytes())[:8] not in str(err.value)


def test_a_manifest_naming_a_file_and_a_file_inside_it_is_refused(tmp_path: Path) -> None:
    shared, _ = _shared_publish(tmp_path)
    both = {"format": 1, "files": {"config.json": {"size": 3, "sha256": "x"},
                                   "config.json/x": {"size": 3, "sha256": "x"}}}
    (shared / artifacts.MANIFEST).write_text(json.dumps(both))
    with pytest.raises(ArtifactError, match="not a manifest trajstore wrote"):
        artifacts.fetch(str(shared), tmp_path / "cache")
