"""`trajstore view`: the viewer's aiohttp application, its pages and its JSON API.

Routes (every one takes `?v=N` to pin the table version; without it, the latest version plus
this machine's live write-ahead rows, so the pages follow a running collector):

    GET /                          runs: totals, reward by policy version, learner curves, checkpoints
    GET /rollouts                  the rollouts table (filters and order in the query string)
    GET /rollouts/{rollout_id}     one episode as the model saw it; the token view on demand
    GET /groups/{group_id}         a group's rollouts side by side, with rewards and advantages
    GET /api/runs, /api/rollouts, /api/rollouts/{id}, /api/rollouts/{id}/tokens, /api/groups/{id}
    GET /static/...                the page's CSS and JavaScript (committed files; nothing from a CDN)

Read-only: only GET and HEAD are routed, the store is opened with create=False, and every
read goes through `trajstore.read.Snapshot`. A bad parameter is a 400 page (or JSON body) that
says what to change; an unknown id is a 404; a failure inside one request is a 500 that names
it, and the server keeps serving. Each page says which table version it read, how many of the
sealed files it opened, and how long it took.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from aiohttp import web

from collectors.errors import CollectorError
from collectors.serving import BadRequest, app_in_thread, run_until_interrupted, start_app
from collectors.viewer import charts
from collectors.viewer.data import (
    STEP_CHARTS,
    NotFound,
    Source,
    episode_tokens,
    episode_view,
    group_view,
    jsonable,
)
from collectors.viewer.listing import ORDERS, STATUSES, FilterError, RolloutFilter, list_rollouts
from trajstore import Snapshot, Store
from trajstore.errors import TrajstoreError
from trajstore.schema import INT64_MAX

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCE = web.AppKey("source", Source)
TEMPLATES = web.AppKey("templates", jinja2.Environment)


@dataclass(frozen=True)
class ViewerSettings:
    """Where `trajstore view` listens and what it reads; validated whole."""

    store: str
    host: str = "127.0.0.1"
    port: int = 8200
    model: str | None = None  # a checkpoint directory whose tokenizer decodes the tokens

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.port <= 65535:
            out.append(f"--port {self.port} is not a TCP port (0-65535; 0 picks a free one)")
        if self.model is not None and not (Path(self.model) / "tokenizer_config.json").is_file():
            out.append(f"--model {self.model} has no tokenizer_config.json: give a checkpoint directory "
                       "(init-model's output or a learner checkpoint)")
        return out


# ------------------------------------------------------------------ rendering helpers


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = _num
    env.filters["dur"] = lambda s: "" if s is None else (f"{s:.2f} s" if s < 60 else f"{s / 60:.1f} min")
    # the year by hand: strftime("%Y") writes year 1 as "1" on Linux
    env.filters["when"] = lambda t: "" if t is None else f"{t.year:04d}-{t:%m-%d %H:%M:%S}"
    env.filters["short"] = lambda s, n=14: "" if s is None else (s if len(s) <= n + 1 else s[:n] + "…")
    env.filters["pretty"] = lambda v: json.dumps(v, indent=1, sort_keys=True, default=str)
    env.globals["quote"] = lambda s: quote(str(s), safe="")
    return env


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


class Page:
    """What every page template gets: the pinned version, links that keep it, and what the read cost."""

    def __init__(self, request: web.Request, version: int | None) -> None:
        self.request = request
        self.version = version
        self.started = time.perf_counter()
        self.table_version: int | None = None
        self.live_rows = 0
        self.files_read = 0
        self.files_total = 0

    def url(self, path: str, **params: Any) -> str:
        """`path` with `params` (None values left out) and the pinned version."""
        query = {k: v for k, v in params.items() if v is not None}
        if self.version is not None:
            query["v"] = self.version
        return path + (f"?{urlencode(query)}" if query else "")

    def at_version(self, version: int | None) -> str:
        """This page at another table version (None: the latest)."""
        query: dict[str, Any] = {k: v for k, v in self.request.query.items() if k != "v"}
        if version is not None:
            query["v"] = version
        return self.request.path + (f"?{urlencode(query)}" if query else "")

    def read(self, snap: Snapshot, files_read: int | None = None) -> None:
        self.table_version = snap.table_version
        self.live_rows = snap.pinned.live.num_rows
        self.files_total = len(snap.pinned.table.files)
        self.files_read += len(snap.files) if files_read is None else files_read

    @property
    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000


def _version(request: web.Request) -> int | None:
    raw = request.query.get("v", "").strip()
    if not raw:
        return None
    try:
        version = int(raw)
    except ValueError:
        raise BadRequest(f"v={raw!r} is not a table version (an integer >= 0); drop it for the latest") from None
    if not 0 <= version <= INT64_MAX:
        raise BadRequest(f"v={version} is not a table version (an integer >= 0); drop it for the latest")
    return version


def _page(request: web.Request, template: str, page: Page, **context: Any) -> web.Response:
    html = request.app[TEMPLATES].get_template(template).render(page=page, **context)
    return web.Response(text=html, content_type="text/html", headers={"Server-Timing": f"app;dur={page.elapsed_ms:.1f}"})


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(jsonable(data), status=status, dumps=lambda d: json.dumps(d, allow_nan=False))


async def _read(request: web.Request, page: Page, read: Callable[[Any, Any], Any], *, decode: bool = False,
                files: Callable[[Any, Any], int] | None = None) -> Any:
    """One page's store reads: `read(snapshot, decode)` on a pooled snapshot of the page's version (`decode`
    is the tokenizer's when asked, else None), then what it read is noted on `page` (`files(snapshot, result)`
    files, or the snapshot's own count). Store reads block (DuckDB, Parquet), so this runs off the event loop
    and one slow page stalls no other."""
    source = request.app[SOURCE]

    def run() -> Any:
        decoder = source.decode() if decode else None
        with source.snapshot(page.version) as snap:
            out = read(snap, decoder)
            if files is None:
                page.read(snap)
            else:
                page.read(snap, files(snap, out))
            return out

    return await asyncio.to_thread(run)


# ------------------------------------------------------------------ pages


async def runs_page(request: web.Request) -> web.Response:
    source = request.app[SOURCE]
    page = Page(request, _version(request))

    runs = await _read(request, page, lambda snap, _: source.runs(snap, latest=page.version is None),
                       files=lambda snap, _: len(snap.pinned.table.files))
    if request.path.startswith("/api/"):
        return _json({"table_version": page.table_version, "runs": [vars(r) for r in runs]})
    plots = {r.run: _run_charts(r) for r in runs}
    return _page(request, "runs.html", page, runs=runs, plots=plots)


def _run_charts(run: Any) -> list[str]:
    versions = [(v["version"], v["reward"]) for v in run.by_version if v["reward"] is not None]
    reward = [charts.Series("reward (sum of components)", versions)]
    reward += [charts.Series(name, sorted(points.items())) for name, points in sorted(run.components.items())
               if len(run.components) > 1 or name != "reward"]
    out = [charts.line_chart("reward by policy version", reward, x_label="policy version"),
           charts.line_chart("rollouts and failures by policy version",
                             [charts.Series("rollouts", [(v["version"], v["rollouts"]) for v in run.by_version]),
                              charts.Series("failed", [(v["version"], v["failed"]) for v in run.by_version]),
                              charts.Series("forks", [(v["version"], v["forks"]) for v in run.by_version])],
                             x_label="policy version")]
    for title, names in STEP_CHARTS:
        series = [charts.Series(n, run.steps[n]) for n in names if n in run.steps]
        if series:
            out.append(charts.line_chart(title, series, x_label="learner step"))
    return out


async def rollouts_page(request: web.Request) -> web.Response:
    page = Page(request, _version(request))
    try:
        f = RolloutFilter.from_query(request.query)
    except FilterError as exc:
        raise BadRequest(f"the rollouts table cannot use this query: {exc}") from exc

    listing = await _read(request, page, lambda snap, _: list_rollouts(snap, f),
                          files=lambda _, listing: listing.files_read)
    if request.path.startswith("/api/"):
        return _json({"table_version": page.table_version, "files_read": listing.files_read,
                      "files_total": listing.files_total, "rows": listing.rows,
                      "next": page.url("/api/rollouts", **listing.next.query()) if listing.next else None})
    return _page(request, "rollouts.html", page, f=f, listing=listing, orders=ORDERS, statuses=STATUSES)


async def episode_page(request: web.Request) -> web.Response:
    source = request.app[SOURCE]
    page = Page(request, _version(request))
    rollout_id = request.match_info["rollout_id"]

    view, decoded = await _read(request, page, lambda snap, decode: (episode_view(snap, rollout_id, decode),
                                                                    decode is not None), decode=True)
    if request.path.startswith("/api/"):
        return _json({"table_version": page.table_version, "row": view.row, "task": view.task,
                      "timeline": view.timeline, "episode": view.episode.as_json()})
    return _page(request, "episode.html", page, v=view, ep=view.episode, decoded=decoded, model=source.model)


async def tokens_api(request: web.Request) -> web.Response:
    page = Page(request, _version(request))
    rollout_id = request.match_info["rollout_id"]

    turns = await _read(request, page, lambda snap, decode: episode_tokens(snap, rollout_id, decode), decode=True)
    return _json({"table_version": page.table_version, "rollout_id": rollout_id, "turns": turns})


async def group_page(request: web.Request) -> web.Response:
    page = Page(request, _version(request))
    group_id = request.match_info["group_id"]

    view = await _read(request, page, lambda snap, decode: group_view(snap, group_id, decode), decode=True)
    if request.path.startswith("/api/"):
        return _json({"table_version": page.table_version, **view})
    return _page(request, "group.html", page, **view)


# ------------------------------------------------------------------ errors and the application


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Every failure is a page (or JSON body) that says what happened; the server keeps serving."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        if exc.status == 405:
            message += " (the viewer only reads: GET and HEAD)"
        if exc.status == 404:
            message += "; pages: /, /rollouts, /rollouts/ROLLOUT_ID, /groups/GROUP_ID (and the same under /api/)"
        return _error(request, exc.status, message)
    except NotFound as exc:
        return _error(request, 404, str(exc))
    except BadRequest as exc:
        return _error(request, exc.status, exc.message)
    except ValueError as exc:
        return _error(request, 400, str(exc))
    except TrajstoreError as exc:  # a damaged file, a query the store refused: say so, keep serving
        log.warning("store error serving %s: %s", request.path, exc)
        return _error(request, 500, f"the store could not answer: {exc}")
    except Exception as exc:  # noqa: BLE001 - a bug in one page must not stop the viewer
        log.exception("unexpected error serving %s", request.path)
        return _error(request, 500, f"internal error: {type(exc).__name__}: {exc}")


def _error(request: web.Request, status: int, message: str) -> web.Response:
    if request.path.startswith("/api/"):
        return _json({"error": {"status": status, "message": message}}, status=status)
    page = Page(request, None)
    html = request.app[TEMPLATES].get_template("error.html").render(page=page, status=status, message=message)
    return web.Response(text=html, status=status, content_type="text/html")


def make_app(store: Store, *, model: str | None = None) -> web.Application:
    """The viewer over an open store (open it with create=False)."""
    app = web.Application(middlewares=[_errors])
    app[SOURCE] = Source(store, model=model)
    app[TEMPLATES] = _environment()
    for prefix in ("", "/api"):
        app.router.add_get(f"{prefix}/" if not prefix else f"{prefix}/runs", runs_page)
        app.router.add_get(f"{prefix}/rollouts", rollouts_page)
        app.router.add_get(f"{prefix}/rollouts/{{rollout_id}}", episode_page)
        app.router.add_get(f"{prefix}/groups/{{group_id}}", group_page)
    app.router.add_get("/api/rollouts/{rollout_id}/tokens", tokens_api)
    app.router.add_static("/static/", HERE / "static", append_version=True)
    app.on_startup.append(_load_tokenizer)
    app.on_cleanup.append(_close)
    return app


async def _close(app: web.Application) -> None:
    app[SOURCE].close()


async def _load_tokenizer(app: web.Application) -> None:
    """Load the tokenizer in the background (importing transformers takes seconds): the first episode
    page then does not wait for it, or waits less. A failure shows on the first page that decodes."""
    source = app[SOURCE]

    def load() -> None:
        try:
            source.decode()
        except Exception:  # noqa: BLE001 - reported by the page that needs it
            log.warning("could not load the tokenizer of %s", source.model, exc_info=True)

    asyncio.get_running_loop().run_in_executor(None, load)


def _open(settings: ViewerSettings) -> Store:
    import trajstore

    problems = settings.problems()
    if problems:
        raise CollectorError("invalid viewer settings: " + "; ".join(problems))
    return trajstore.open_store(settings.store, create=False)


async def start_viewer(settings: ViewerSettings) -> tuple[web.AppRunner, str]:
    """Serve the viewer from the running event loop; returns (runner, base URL)."""
    store = await asyncio.to_thread(_open, settings)
    return await start_app(make_app(store, model=settings.model), settings.host, settings.port)


@contextmanager
def viewer_in_thread(settings: ViewerSettings) -> Iterator[str]:
    """The viewer on a background thread (tests, notebooks); yields its base URL."""
    with app_in_thread(lambda: start_viewer(settings), name="trajstore-view") as (_, url):
        yield url


def run(settings: ViewerSettings) -> None:
    """Serve in the foreground until interrupted (the CLI)."""
    _open(settings)  # fail before printing a URL
    run_until_interrupted(lambda: start_viewer(settings),
                          lambda _, url: f"trajstore view: {url}/ (store {settings.store}; read-only; Ctrl-C stops)")
