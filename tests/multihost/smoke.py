"""Inside a sandbox: three hosts, and what each can see. Prints one JSON object (tests/multihost/test_sandbox.py)."""

from __future__ import annotations

import json
import sys

from tests.multihost.sandbox import Sandbox, python

PROBE = """
import json, os, socket, sys
out = {"hostname": socket.gethostname(), "pid": os.getpid(), "tmp": sorted(os.listdir("/tmp"))}
open("/tmp/mark-" + socket.gethostname(), "w").close()
for name, addr in (("store", (sys.argv[1], 9)), ("outside", ("1.1.1.1", 53))):
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect(addr); out[name] = "connected"
    except ConnectionRefusedError:
        out[name] = "refused"  # a host answered: reachable
    except OSError as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


def main() -> None:
    report = {}
    with Sandbox() as box:
        store = box.add_host("store")
        c1 = box.add_host("c1", hostname="collector")
        c2 = box.add_host("c2", hostname="collector")
        for host in (c1, c2, store):
            report[host.name] = json.loads(host.run(python("-c", PROBE, store.ip)).stdout)
        c1.link(False)
        report["c1_unplugged"] = json.loads(c1.run(python("-c", PROBE, store.ip)).stdout)["store"]
        c1.link(True)
        report["c1_replugged"] = json.loads(c1.run(python("-c", PROBE, store.ip)).stdout)["store"]
        sleeper = c2.popen(["sleep", "60"])
        c2.kill()
        report["c2_killed"] = sleeper.wait(timeout=10) != 0 or sleeper.returncode
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
