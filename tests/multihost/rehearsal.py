"""The multi-host rehearsal: an object store, two collector hosts, a policy-server host, a learner host; faults.

Run only inside a sandbox (`tests/multihost/test_rehearsal.py` starts it with
`sandbox.enter`; hosts refuse to be made anywhere else). Each host has its own disk (a
directory under --work, mounted as its /tmp, so the test can read it afterwards), hostname,
process ids and network namespace; the collector hosts share one hostname, as two containers
can. Across hosts, the collectors reach the policy server; everything else meets only in the
object store (moto with atomic conditional writes, `tests/moto_s3.py`, which also drops the
reply to every Nth Delta commit after performing it). One JSON report comes out at the end.

1. Visibility: c1 appends (metrics, then statuses), c2 watches as another machine, and
   the report gives the append-to-visible latency per kind with `--seal-interval 1`.
2. Store faults: c1 and c2 append at once (same hostname: the default writer names still
   differ); c1's link is cut mid-append and restored; c2 is killed mid-append, restarted on
   its own disk, and appends again (sealing what the dead writer acknowledged); the learner
   host watches throughout (snapshots only grow). Every acknowledged event must be there once.
3. The closed loop. While phase 2 runs, the learner host makes the initial model and
   the policy host starts `trajstore serve --control-token` on its copy. Its control route is
   checked from c2 (refused without the token; with it, a version named by a location nothing
   was published at is refused and version 0 keeps serving). Then `trajstore learn` on the
   learner host and `trajstore collect --follow --server POLICY` on each collector host, which
   reload the shared server by each version's published URI, until the learner has published
   --versions versions; meanwhile the learner host is killed mid-publish and restarted, c2 is
   killed and restarted, and c1's link is cut and restored. Then `probe check` reports the
   invariants.

Where the time goes: `cpu_seconds_by_command` in the report samples every process of the
sandbox. The object store (moto, in Python) takes the most: every reader's poll lists the
Delta log and reads the sealed files, so the loop polls once a second (learner and collectors)
and its groups are of 2 rollouts, enough for a group advantage.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.multihost.sandbox import Host, Sandbox, python

REPO = Path(__file__).resolve().parents[2]
BUCKET = "rehearsal"
RUN = "loop"
K = 1  # max staleness
DROP_EVERY = 7  # the store drops its reply to every 7th Delta commit
TOKEN = "rehearsal-control-token-0123"  # the policy server's control token


class Failed(RuntimeError):
    pass


def wait_for(what: str, ok: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    """Poll `ok()` until truthy; a clear failure after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(poll)
    raise Failed(f"gave up after {timeout:.0f} s waiting for {what}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def acks(path: Path) -> list[dict[str, Any]]:
    """The acknowledged events an `append` probe logged (a line cut by a kill was not yet logged whole)."""
    out = []
    for line in read(path).splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


class Rehearsal:
    def __init__(self, box: Sandbox, work: Path, versions: int) -> None:
        self.box, self.work, self.versions = box, work, versions
        self.report: dict[str, Any] = {"faults": []}
        self.store = box.add_host("store", disk=self.disk("store"))
        self.c1 = box.add_host("c1", hostname="collector", disk=self.disk("c1"))
        self.c2 = box.add_host("c2", hostname="collector", disk=self.disk("c2"))
        self.learner = box.add_host("learner", disk=self.disk("learner"))
        self.policy = box.add_host("policy", disk=self.disk("policy"))
        self.policy_url = f"http://{self.policy.ip}:8000"
        self.uri = f"s3://{BUCKET}/store"
        endpoint = f"http://{self.store.ip}:9000"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": "/tmp/home", "TRAJSTORE_SPOOL": "/tmp/spool",
                    "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "rehearsal", "AWS_SECRET_ACCESS_KEY": "rehearsal",
                    "AWS_REGION": "us-east-1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "TOKENIZERS_PARALLELISM": "false"}
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "TRAJSTORE_CHECKPOINT_CACHE",
                     "TRAJSTORE_STORE", "TRAJSTORE_SEAL_INTERVAL"):
            self.env.pop(name, None)

    def disk(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def on(self, host: Host, argv: list[str], log: str) -> subprocess.Popen[Any]:
        return host.popen(argv, env=self.env, log=str(self.work / host.name / log))

    def restart(self, host: Host) -> Host:
        """The host comes back after a kill: same name, address, hostname and disk; nothing running."""
        fresh = self.box.restart_host(host.name)
        for attr in ("c1", "c2", "learner"):
            if getattr(self, attr) is host:
                setattr(self, attr, fresh)
        return fresh

    # ------------------------------------------------------------------ the object store

    def start_store(self) -> None:
        log = self.work / "store" / "moto.log"
        self.on(self.store, python("-m", "tests.moto_s3", "--host", self.store.ip, "--port", "9000",
                                   "--drop-commit-replies", str(DROP_EVERY)), "moto.log")
        wait_for("the object store (moto) to serve", lambda: "http://" in read(log), 60)
        make = f"import boto3; boto3.client('s3').create_bucket(Bucket={BUCKET!r})"
        self.c1.run(python("-c", make), env=self.env)

    # ------------------------------------------------------------------ 1. visibility

    def visibility(self) -> None:
        n = 40
        watch = self.on(self.c2, python("-m", "tests.multihost.probe", "watch", "--store", self.uri, "--prefix", "vis",
                                        "--expect", str(n), "--out", "/tmp/vis-seen.json", "--timeout", "90"),
                        "vis-watch.log")
        # the watcher needs the store: create it from c1 first (open_store creates), then append
        app = self.on(self.c1, python("-m", "tests.multihost.probe", "append", "--store", self.uri, "--prefix", "vis",
                                      "--count", str(n), "--every", "0.1", "--seal-interval", "1",
                                      "--ack", "/tmp/vis-acks.jsonl"), "vis-append.log")
        self.finish(app, "the visibility appender on c1", 90)
        self.finish(watch, "the visibility watcher on c2", 120)
        seen = json.loads(read(self.work / "c2" / "vis-seen.json"))
        lat: dict[str, list[float]] = {}
        for a in acks(self.work / "c1" / "vis-acks.jsonl"):
            if a["id"] not in seen["seen"]:
                raise Failed(f"event {a['id']} was acknowledged on c1 but never became visible on c2")
            lat.setdefault(a["kind"], []).append(seen["seen"][a["id"]] - a["t"])
        self.report["visibility_s"] = {kind: {"n": len(v), "p50": sorted(v)[len(v) // 2], "max": max(v)}
                                       for kind, v in lat.items()}
        self.report["visibility_shrank"] = seen["shrank"]

    def finish(self, proc: subprocess.Popen[Any], what: str, timeout: float) -> None:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise Failed(f"{what} did not finish within {timeout:.0f} s") from None
        if code != 0:
            raise Failed(f"{what} failed with exit code {code} (its log is under {self.work})")

    # ------------------------------------------------------------------ 2. store faults

    def store_faults(self) -> None:
        stop = self.work / "learner" / "stop-watch"
        watch = self.on(self.learner, python("-m", "tests.multihost.probe", "watch", "--store", self.uri, "--prefix",
                                             "f", "--expect", "100000", "--out", "/tmp/faults-seen.json",
                                             "--timeout", "120", "--stop", "/tmp/stop-watch"), "faults-watch.log")
        probe = ["-m", "tests.multihost.probe", "append", "--store", self.uri, "--count", "60", "--every", "0.05",
                 "--seal-interval", "1"]
        a1 = self.on(self.c1, python(*probe, "--prefix", "f1", "--ack", "/tmp/f1.jsonl"), "f1.log")
        self.on(self.c2, python(*probe, "--prefix", "f2", "--ack", "/tmp/f2.jsonl"), "f2.log")
        wait_for("c1's first acknowledged appends", lambda: len(acks(self.work / "c1" / "f1.jsonl")) >= 10, 60)
        self.c1.link(False)
        self.report["faults"].append("store: c1's link cut mid-append for 3 s")
        wait_for("c2's first acknowledged appends", lambda: len(acks(self.work / "c2" / "f2.jsonl")) >= 15, 60)
        self.c2.kill()
        self.report["faults"].append("store: c2 killed mid-append, restarted on its disk")
        time.sleep(max(0.0, 3.0))
        self.c1.link(True)
        c2 = self.restart(self.c2)
        again = self.on(c2, python(*probe[:-4], "--count", "8", "--every", "0.05", "--seal-interval", "1",
                                   "--prefix", "f2b", "--ack", "/tmp/f2b.jsonl"), "f2b.log")
        self.finish(a1, "the appender on c1 (link cut and restored)", 120)
        self.finish(again, "the appender on c2 after its restart", 120)
        acked = [a["id"] for name, host in (("f1", "c1"), ("f2", "c2"), ("f2b", "c2"))
                 for a in acks(self.work / host / f"{name}.jsonl")]
        check = ("import json, sys, trajstore; s = trajstore.open_store(sys.argv[1], create=False); "
                 "print(json.dumps(s.query(\"SELECT event_id, count(*) AS n FROM _raw WHERE regexp_matches(event_id, "
                 "'^f[0-9]') GROUP BY event_id\").to_pylist()))")

        def stored() -> dict[str, int] | None:
            rows = json.loads(self.learner.run(python("-c", check, self.uri), env=self.env).stdout)
            got = {r["event_id"]: r["n"] for r in rows}
            return got if set(acked) <= set(got) else None

        got = wait_for("every acknowledged event to be visible on the learner host", stored, 60, poll=0.5)
        stop.touch()
        self.finish(watch, "the watcher on the learner host", 60)
        seen = json.loads(read(self.work / "learner" / "faults-seen.json"))
        self.report["store_faults"] = {
            "acknowledged": len(acked), "stored": len(got), "twice": sorted(e for e, n in got.items() if n > 1),
            "lost": sorted(set(acked) - set(got)), "shrank": seen["shrank"],
            "unacknowledged_but_stored": len(set(got) - set(acked)),  # appended when the kill cut the ack log
            "writers": sorted({a["writer"] for name, host in (("f1", "c1"), ("f2", "c2"))
                               for a in acks(self.work / host / f"{name}.jsonl")}),
            "dropped_commit_replies": read(self.work / "store" / "moto.log").count("dropped the reply"),
        }

    # ------------------------------------------------------------------ 3. the closed loop

    def prepare_loop(self) -> None:
        """Ready the closed loop's hosts: the initial model (made on the learner host, copied to every other host's
        disk), the task files, and the policy server on its host. Runs in the background during phase 2."""
        t = time.monotonic()
        self.learner.run(python("-m", "cli.main", "init-model", "/tmp/model", "--layers", "1", "--hidden-size", "32",
                                "--heads", "1", "--kv-heads", "1", "--intermediate-size", "64", "--vocab-size", "512"),
                         env=self.env, timeout=180)
        for name in ("c1", "c2", "policy"):  # each host its own copy of the initial model (collectors: its tokenizer)
            shutil.copytree(self.work / "learner" / "model", self.work / name / "model")
        for name in ("c1", "c2"):
            tasks = [{"id": f"{name}-t{i}", "prompt": f"Count to {i} on {name}."} for i in range(400)]
            (self.work / name / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
        self.server = self.with_pid(self.policy, python("-m", "cli.main", "serve", "--model", "/tmp/model", "--host",
                                                        self.policy.ip, "--port", "8000", "--device", "cpu",
                                                        "--threads", "1", "--control-token", TOKEN), "serve")
        wait_for("the policy server on its host", lambda: "serving" in read(self.work / "policy" / "serve.log")
                 or self.server.poll() is not None, 120, poll=0.2)
        if self.server.poll() is not None:
            raise Failed(f"the policy server exited ({self.server.returncode}): {read(self.work / 'policy' / 'serve.log')}")
        self.report["prepare_loop_seconds"] = round(time.monotonic() - t, 1)

    def prepare_in_background(self) -> None:
        def run() -> None:
            try:
                self.prepare_loop()
            except BaseException as exc:  # noqa: BLE001 - reported when the closed loop needs it
                self.prepared_error = exc

        self.prepared_error: BaseException | None = None
        self.preparing = threading.Thread(target=run, daemon=True)
        self.preparing.start()

    def closed_loop(self) -> None:
        if not hasattr(self, "preparing"):
            self.prepare_in_background()
        self.preparing.join()
        if self.prepared_error is not None:
            raise self.prepared_error
        server = self.server
        self.control_route()
        started = time.monotonic()
        marks = self.report["loop_timeline_s"] = {}

        def mark(what: str) -> None:
            marks[what] = round(time.monotonic() - started, 1)

        # a reader on the store's host takes snapshots throughout: they must only grow
        watch = self.on(self.store, python("-m", "tests.multihost.probe", "watch", "--store", self.uri, "--prefix",
                                           "none", "--expect", "1", "--timeout", "600", "--poll", "2", "--out",
                                           "/tmp/loop-seen.json", "--stop", "/tmp/stop-loop-watch"), "loop-watch.log")
        self.start_learner()
        for host in (self.c1, self.c2):
            self.start_collector(host)
        seen_versions = self.versions_seen

        # the learner host is killed mid-publish (a partial checkpoint directory on its disk), then restarted
        ckpts = self.work / "learner" / "ckpts"
        wait_for("version 2", lambda: seen_versions() >= 2, 120, poll=0.5)
        mark("version 2")
        try:  # a version being written: a `.partial-*` directory (each lasts milliseconds: poll fast)
            wait_for("the learner to start publishing a version", lambda: any(
                p.name.startswith(".partial-") for p in ckpts.iterdir()), 30, poll=0.005)
            when = "mid-publish, a partial checkpoint directory on its disk"
        except Failed:  # never caught in the act: kill it as soon as the next version is out, mid-announcement
            wait_for("version 3", lambda: seen_versions() >= 3, 60, poll=0.005)
            when = "right after publishing version 3"
        self.learner.kill()
        mark("learner killed")
        self.report["faults"].append(f"loop: learner host killed {when}, restarted on its disk")
        self.restart(self.learner)
        self.start_learner()

        # a collector host is killed and restarted; the other's link is cut and restored
        wait_for("version 4", lambda: seen_versions() >= 4, 120, poll=0.5)
        mark("version 4")
        self.c2.kill()
        self.report["faults"].append("loop: collector host c2 killed and restarted")
        self.start_collector(self.restart(self.c2))
        self.c1.link(False)
        time.sleep(3)
        self.c1.link(True)
        self.report["faults"].append("loop: c1's link cut for 3 s and restored")

        wait_for(f"version {self.versions}", lambda: seen_versions() >= self.versions, 240, poll=0.5)
        mark(f"version {self.versions}")
        self.finish(self.learner_proc, "the learner (reaching --steps)", 60)
        health = ("import json, sys, urllib.request\n"
                  "print(json.load(urllib.request.urlopen(sys.argv[1] + '/health'))['policy_version'])\n")
        served = lambda: int(self.c1.run(python("-c", health, self.policy_url), env=self.env).stdout)
        wait_for(f"the collectors to reload version {self.versions} into the policy server",
                 lambda: served() >= self.versions, 30, poll=0.5)
        for host in (self.c1, self.c2):
            self.stop(host, self.collectors[host.name], "collect")
        self.stop(self.policy, server, "serve")
        (self.work / "store" / "stop-loop-watch").touch()
        self.finish(watch, "the reader on the store's host", 60)
        seen = json.loads(read(self.work / "store" / "loop-seen.json"))
        check = self.learner.run(python("-m", "tests.multihost.probe", "check", "--store", self.uri, "--run", RUN,
                                        "--max-staleness", str(K)), env=self.env)
        self.report["loop"] = json.loads(check.stdout.strip().splitlines()[-1])
        self.report["loop"]["reader"] = {"snapshots": seen["snapshots"], "shrank": seen["shrank"]}
        self.report["loop"]["fetched_checkpoints"] = {  # the policy host fetched them; its collectors did not
            name: sorted(p.parent.name for p in (self.work / name / "home").rglob("trajstore_manifest.json"))
            for name in ("policy", "c1", "c2")}
        self.report["dropped_commit_replies"] = read(self.work / "store" / "moto.log").count("dropped the reply")
        self.report["loop"]["unsealed_segments"] = {
            name: [str(p.relative_to(self.work)) for p in (self.work / name / "spool").rglob("*.arrows")]
            for name in ("c1", "c2", "learner")}

    def control_route(self) -> None:
        """The policy host's control route, from collector host c2: refused without the token; with it, a version
        named by a location nothing was published at is refused too, and the server keeps serving version 0."""
        probe = ("import asyncio, json, sys\n"
                 "from collectors.policy import EmbeddedClient\n"
                 "from trajstore.announcement import LoadRequest\n"
                 "async def load(token):\n"
                 "    async with EmbeddedClient(sys.argv[1], control_token=token) as c:\n"
                 "        try:\n"
                 "            await c.load_published(LoadRequest(version=1, uri=sys.argv[3], digest='0' * 64))\n"
                 "            return 'loaded'\n"
                 "        except Exception as exc:\n"
                 "            return f'{type(exc).__name__}: {exc}'\n"
                 "print(json.dumps([asyncio.run(load(None)), asyncio.run(load(sys.argv[2]))]))\n")
        nowhere = f"s3://{BUCKET}/nothing-published-here"
        answers = json.loads(self.c2.run(python("-c", probe, self.policy_url, TOKEN, nowhere),
                                         env=self.env).stdout.strip().splitlines()[-1])
        self.report["control_route"] = {"without_token": answers[0], "with_token_unpublished": answers[1]}

    def with_pid(self, host: Host, argv: list[str], name: str) -> subprocess.Popen[Any]:
        """Start `argv` on `host`, its pid (as the host sees it) in /tmp/NAME.pid, its output in NAME.log."""
        return self.on(host, ["sh", "-c", f"echo $$ > /tmp/{name}.pid && exec {shlex.join(argv)}"], f"{name}.log")

    def stop(self, host: Host, proc: subprocess.Popen[Any], name: str, timeout: float = 60) -> None:
        """SIGTERM what `with_pid` started (by its pid on its host), and wait for it to end."""
        host.run(["sh", "-c", f"kill -TERM $(cat /tmp/{name}.pid)"], env=self.env)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failed(f"{name} on {host.name} did not stop within {timeout:.0f} s of SIGTERM") from None

    def running(self) -> None:
        """Fail at once, with its log's tail, when the learner or a collector exited on its own."""
        procs = [("learner", self.learner_proc, self.learner_log)]
        procs += [(name, p, self.work / name / "collect.log") for name, p in self.collectors.items()]
        for name, proc, log in procs:
            if proc.poll() not in (None, 0):
                raise Failed(f"the {'learner' if name == 'learner' else 'collector on ' + name} exited with code "
                             f"{proc.returncode}; the end of {log}:\n{read(log)[-3000:]}")

    def versions_seen(self) -> int:
        """The newest version published on the learner's disk (renamed into place whole)."""
        self.running()
        ckpts = self.work / "learner" / "ckpts"
        found = [int(p.name[1:]) for p in ckpts.glob("v[0-9]*")] if ckpts.is_dir() else []
        return max(found, default=0)

    def start_learner(self) -> None:
        n = sum(1 for p in (self.work / "learner").glob("learn*.log"))
        self.learner_proc = self.on(self.learner, python(
            "-m", "cli.main", "learn", "--store", self.uri, "--run", RUN, "--model", "/tmp/model", "--checkpoints",
            "/tmp/ckpts", "--groups-per-step", "2", "--steps", str(self.versions), "--max-staleness", str(K),
            "--seal-interval", "1", "--poll-interval", "1", "--lr", "1e-3", "--device", "cpu", "--create-store"),
            f"learn-{n}.log")
        self.learner_log = self.work / "learner" / f"learn-{n}.log"

    def start_collector(self, host: Host) -> None:
        self.collectors = getattr(self, "collectors", {})
        cmd = python("-m", "cli.main", "collect", "--store", self.uri, "--run", RUN, "--tasks",
               "/tmp/tasks.jsonl", "--n", "2", "--server", self.policy_url, "--control-token", TOKEN, "--model",
               "/tmp/model", "--reward", "tests.collectors.agents_for_tests:score", "--max-tokens", "8",
               "--max-turns", "1", "--concurrency", "4", "--follow", "--plain", "--max-staleness", str(K),
               "--seal-interval", "1", "--poll-interval", "1", "--seed", "1")
        self.collectors[host.name] = self.with_pid(host, cmd, "collect")


def cpu_by_command(stop: threading.Event, out: dict[str, float], every: float = 0.5) -> None:
    """Sample every process of the sandbox (all hosts) until `stop`: CPU seconds per command, e.g.
    `cli.main learn` or `tests.moto_s3` (what a process spends after its last sample is missed)."""
    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[str, str], tuple[str, float]] = {}
    while not stop.wait(every):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            # after the command's name: utime and stime are fields 14 and 15 of stat, starttime 22
            key, cpu = (pid, stat[19]), (int(stat[11]) + int(stat[12])) / tick
            if "-m" in argv:
                label = " ".join(argv[argv.index("-m") + 1:argv.index("-m") + 3])
            else:
                label = Path(argv[0]).name + (" -c" if "-c" in argv else "")
            seen[key] = (seen[key][0] if key in seen and not argv[0] else label, cpu)  # an exited one has no argv
    for label, cpu in seen.values():
        out[label] = round(out.get(label, 0.0) + cpu, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--phases", default="visibility,store_faults,closed_loop")
    a = ap.parse_args()
    started = time.monotonic()
    stop, cpu = threading.Event(), dict[str, float]()
    sampler = threading.Thread(target=cpu_by_command, args=(stop, cpu), daemon=True)
    sampler.start()
    with Sandbox() as box:
        r = Rehearsal(box, a.work, a.versions)
        r.start_store()
        for phase in a.phases.split(","):
            if phase != "visibility" and "closed_loop" in a.phases and not hasattr(r, "preparing"):
                r.prepare_in_background()  # during the store faults, not while latencies are measured
            t = time.monotonic()
            getattr(r, phase)()
            r.report[f"{phase}_seconds"] = round(time.monotonic() - t, 1)
    stop.set()
    sampler.join()
    r.report["cpu_seconds_by_command"] = dict(sorted(cpu.items(), key=lambda kv: -kv[1]))
    r.report["seconds"] = round(time.monotonic() - started, 1)
    r.report["load"] = os.getloadavg()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # every host process was waited for by its nsenter
    r.report["cpu_seconds"] = round(used.ru_utime + used.ru_stime, 1)  # what the rehearsal costs, whatever the load
    (a.work / "report.json").write_text(json.dumps(r.report, indent=1, default=str))
    print(json.dumps(r.report, default=str))


if __name__ == "__main__":
    sys.exit(main())
