"""A loopback S3-compatible server for the tests: moto, with atomic conditional writes.

Run as `python -m tests.moto_s3 [--host ADDR] [--port N]`; it binds ADDR (127.0.0.1 by default;
the multi-host rehearsal binds the object-store host's address inside its sandbox) on port N (a free
one by default) and prints `http://ADDR:PORT` as its first line once it serves. With `--exit-on-eof` it also
exits when its stdin closes, so a test session that dies (even by SIGKILL) takes its
server with it: the parent holds the other end of the pipe.

It runs in its own process, not in a thread of the test process, because delta-rs calls
block while holding the GIL: an in-process server thread could not answer them.

moto answers `PUT` with `If-None-Match: *` by looking the key up and then writing it, with
no lock in between, so two concurrent creates of one key can both succeed (seen here: 12
of 300 keys raced by 8 threads under a short GIL switch interval). Real S3 makes the
check-and-write atomic, and Delta commits depend on that (the commit file `N.json` is
created with `If-None-Match: *`; the loser retries at N+1). So conditional writes are
serialized here; everything else stays concurrent.

With `--drop-commit-replies N` (the multi-host rehearsal's fault), every Nth conditional write
of a Delta commit file (`_delta_log/*.json`) is performed and its reply never sent: the
connection is cut, as when a network drops the answer, so the writer cannot know whether its
commit landed.

Every request is counted per store prefix (the first path component after the bucket, or the
`prefix` of a listing): `GET /_trajstore/requests?prefix=P` answers how many requests touched
prefix P so far (not counted itself), so tests and benchmarks can assert what a read costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def atomic_conditional_writes(app: WSGIApp) -> WSGIApp:
    """Serialize writes that carry a precondition, so check-and-write cannot interleave."""
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conditional = environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH")
        if conditional and environ.get("REQUEST_METHOD") in ("PUT", "POST"):  # POST: multipart completion
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wrapped


def drop_commit_replies(app: WSGIApp, every: int) -> WSGIApp:
    """Perform every `every`th conditional write of a Delta commit, then cut the connection instead of replying."""
    seen = 0
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        nonlocal seen
        commit = (environ.get("REQUEST_METHOD") == "PUT" and environ.get("HTTP_IF_NONE_MATCH")
                  and "/_delta_log/" in environ.get("PATH_INFO", "") and environ["PATH_INFO"].endswith(".json"))
        if not commit:
            return app(environ, start_response)
        with lock:
            seen += 1
            drop = seen % every == 0
        if not drop:
            return app(environ, start_response)
        list(app(environ, lambda *a, **k: None))  # the write happens; its reply is thrown away
        sock = environ.get("werkzeug.socket")
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        print(f"dropped the reply to {environ['PATH_INFO']}", file=sys.stderr, flush=True)
        start_response("500 Internal Server Error", [("Content-Length", "0")])  # never reaches the client
        return []

    return wrapped


COUNT_PATH = "/_trajstore/requests"


def _store_prefix(environ: dict[str, Any]) -> str:
    """The first key component after the bucket (path-style URLs), or a listing's `prefix`'s."""
    parts = environ.get("PATH_INFO", "").lstrip("/").split("/")
    if len(parts) > 1 and parts[1]:
        return parts[1]
    listed = parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [""])[0]
    return listed.split("/")[0]


def count_requests(app: WSGIApp) -> WSGIApp:
    """Count requests per store prefix; `GET /_trajstore/requests?prefix=P` answers the count for P."""
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNT_PATH:
            prefix = parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [""])[0]
            with lock:
                body = json.dumps({"prefix": prefix, "requests": counts.get(prefix, 0)}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        prefix = _store_prefix(environ)
        with lock:
            counts[prefix] = counts.get(prefix, 0) + 1
        return app(environ, start_response)

    return wrapped


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:  # one line per request drowns test output
        pass


def _exit_on_eof() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description="moto's S3 with atomic conditional writes")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--exit-on-eof", action="store_true", help="exit when stdin closes (the parent died)")
    ap.add_argument("--drop-commit-replies", type=int, default=0, metavar="N",
                    help="perform every Nth Delta commit write but cut the connection instead of replying")
    args = ap.parse_args()
    backend: WSGIApp = DomainDispatcherApplication(create_backend_app)
    if args.drop_commit_replies > 0:
        backend = drop_commit_replies(backend, args.drop_commit_replies)
    app = count_requests(atomic_conditional_writes(backend))
    server = make_server(args.host, args.port, app, threaded=True, request_handler=_QuietHandler)
    if args.exit_on_eof:
        threading.Thread(target=_exit_on_eof, daemon=True).start()
    print(f"http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
