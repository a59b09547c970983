"""Hosts on one machine for the multi-host rehearsal: Linux namespaces on a bridge, inside one sandbox.

Safety first. In the machine's own network namespace a private-range address such as
10.77.0.10 is routed off the machine, so nothing here ever runs there: `enter()` re-executes
the caller under `unshare --net --mount --pid --fork --kill-child --mount-proc`, and only inside
that sandbox are hosts created and addressed. The sandbox's network namespace has no
interface but its own loopback and the bridge created here, so no packet can leave; its
mount namespace holds the namespace handles (`/run` is a private tmpfs), so nothing is left
on the machine; and when the sandbox's first process exits or is killed (SIGKILL included),
the kernel kills every process in its PID namespace and drops every namespace and link.

A host is a network namespace on the bridge `br0` (address 10.77.0.N/24) plus a holder
process started in new mount, UTS and PID namespaces: its own hostname, its own private
`/tmp` (a tmpfs: the host's "disk"; nothing else on the machine is written by a host; a checkout
or interpreter that lives under the machine's /tmp is bound through, `passed_through()`), and its
own process ids (two hosts can have a process with the same pid, as containers do). Every
command of a host enters those namespaces with `nsenter`; killing the holder kills everything
on the host at once, like pulling its plug; `Sandbox.restart_host` then boots it again (same
address, hostname and disk, nothing running). `link(False)` takes the host's cable out of the
bridge (`ip link set ... down`) without stopping anything on it.

Requires root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), `unshare`, `nsenter` and iproute2's `ip`;
`available()` says why it cannot run where it cannot.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"
BRIDGE = "br0"
_MARK = "TRAJSTORE_SANDBOX"  # set inside the sandbox: host commands refuse to run anywhere else


def available() -> str | None:
    """None when sandboxes can be made here, else why not (for a stated skip)."""
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (util-linux and iproute2 make the hosts)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network, mount and PID namespaces here ({probe.stderr.strip() or probe.returncode}); " \
               "the rehearsal needs root or CAP_SYS_ADMIN + CAP_NET_ADMIN"
    return None


def enter(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
          cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` as the first process of a fresh sandbox; everything it starts dies with it."""
    cmd = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]
    return subprocess.run(cmd, env={**(env or os.environ), _MARK: "1"}, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _inside() -> None:
    """Refuse to make hosts unless this is a fresh network namespace with nothing in it but loopback."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [line.split(":")[1].strip() for line in links.splitlines() if line.strip()]
    if os.environ.get(_MARK) != "1" or names != ["lo"]:
        raise RuntimeError("hosts are created only inside a fresh sandbox (tests.multihost.sandbox.enter): in the "
                           f"machine's own network namespace (interfaces {names}) their addresses would route off "
                           "the machine")


def passed_through() -> list[Path]:
    """What every host sees of the machine's /tmp: the checkout and the interpreter, when they live there.

    A host's /tmp is its own disk, which would hide a clone under /tmp (and its virtualenv) from the
    commands the hosts run; so these directories are bound through, at the same paths."""
    tmp = Path("/tmp")
    wanted = {Path(p) for p in (REPO, sys.prefix, Path(sys.executable).parent, Path(sys.executable).resolve().parent)}
    under = sorted(p for p in wanted if p.is_absolute() and p != tmp and tmp in p.parents)
    return [p for p in under if not any(q in p.parents for q in under)]


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One host: its name, hostname, address and the holder process of its namespaces."""

    name: str
    hostname: str
    ip: str
    holder: subprocess.Popen[bytes]  # `unshare`, whose child is pid 1 of the host's PID namespace
    init: int  # that child, as the sandbox sees it: every namespace of the host is its
    disk: Path | None = None  # bind-mounted as its /tmp (None: a fresh tmpfs)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def _nsenter(self) -> list[str]:
        return ["nsenter", "-t", str(self.init), "--mount", "--uts", "--net", "--pid"]

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: str | None = None,
              cwd: str | None = None) -> subprocess.Popen[Any]:
        """Start `argv` on this host; its output goes to `log` (a path on the caller's side) or is captured."""
        out: Any = open(log, "ab") if log else subprocess.PIPE
        proc = subprocess.Popen([*self._nsenter(), "--wd=" + (cwd or "/tmp"), *argv], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to the end."""
        done = subprocess.run([*self._nsenter(), "--wd=/tmp", *argv], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed on host {self.name} ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return done

    def link(self, up: bool) -> None:
        """Plug the host's cable into the bridge, or pull it out (everything on the host keeps running)."""
        sh("ip", "link", "set", f"v-{self.name}", "up" if up else "down")

    def kill(self) -> None:
        """Pull the plug: SIGKILL the host's pid 1, which takes every process in its PID namespace with it."""
        os.kill(self.init, signal.SIGKILL)
        self.holder.wait()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Sandbox:
    """The bridge and the hosts on it. Use inside `enter()`, as a context manager."""

    def __init__(self) -> None:
        _inside()
        self.hosts: dict[str, Host] = {}
        self._next = 10
        os.makedirs("/run", exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")  # namespace handles live and die here
        os.makedirs("/run/netns")
        sh("ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")

    def add_host(self, name: str, *, hostname: str | None = None, disk: Path | None = None) -> Host:
        """A new host on the bridge, with its own network, mount, UTS and PID namespaces; `/tmp` is its disk
        (a fresh tmpfs, or `disk` bind-mounted there so the caller can look at it afterwards)."""
        ip = f"{SUBNET}.{self._next}"
        self._next += 1
        sh("ip", "netns", "add", name)
        sh("ip", "link", "add", f"v-{name}", "type", "veth", "peer", "name", f"e-{name}")
        sh("ip", "link", "set", f"e-{name}", "netns", name)
        sh("ip", "link", "set", f"v-{name}", "master", BRIDGE)
        sh("ip", "link", "set", f"v-{name}", "up")
        for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", f"e-{name}"], ["ip", "link", "set", f"e-{name}", "up"],
                    ["ip", "link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", name, *cmd)
        host = self._boot(name, hostname or name, ip, disk)
        self.hosts[name] = host
        return host

    def restart_host(self, name: str) -> Host:
        """Boot a killed host again: its network namespace, address, hostname and disk, and nothing running."""
        old = self.hosts[name]
        if old.holder.poll() is None:
            raise RuntimeError(f"host {name} is still running: kill it first")
        host = self._boot(name, old.hostname, old.ip, old.disk)
        self.hosts[name] = host
        return host

    def _boot(self, name: str, hostname: str, ip: str, disk: Path | None) -> Host:
        # the disk is made ready beside /tmp, the code it runs bound into it, then moved over /tmp in one step
        staged = f"/run/disk-{name}"
        steps = [f"hostname {hostname}", f"mkdir -p {staged}",
                 f"mount --bind {shlex.quote(str(disk))} {staged}" if disk else f"mount -t tmpfs tmpfs {staged}"]
        for path in passed_through():
            inside = shlex.quote(f"{staged}/{path.relative_to('/tmp')}")
            steps += [f"mkdir -p {inside}", f"mount --bind {shlex.quote(str(path))} {inside}"]
        script = " && ".join([*steps, f"mount --move {staged} /tmp", "echo ready", "exec sleep 2147483647"])
        holder = subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--mount", "--uts", "--pid", "--fork",
                                   "--kill-child", "--mount-proc", "sh", "-c", script], stdout=subprocess.PIPE)
        if holder.stdout is None or holder.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"host {name} did not come up (exit {holder.poll()})")
        # `ip netns exec` execs `unshare`, so the holder's pid is unshare's; its only child is the host's pid 1
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
        if len(children) != 1:
            raise RuntimeError(f"host {name}: expected one process under its unshare, found {children}")
        return Host(name, hostname, ip, holder, int(children[0]), disk)

    def close(self) -> None:
        for host in self.hosts.values():
            if host.holder.poll() is None:
                host.kill()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def python(*args: str) -> list[str]:
    """The test interpreter, for commands run on a host."""
    return [sys.executable, *args]
