"""A foreground server settles its heap once up (`collectors.serving.settle_heap`): what its imports made is frozen
out of every collection, and the bodies of calls in flight no longer start a collection every few calls."""

from __future__ import annotations

import subprocess
import sys

# A child process (its collector's state its own) decodes call-sized bodies, two in flight at a time as
# concurrent calls hold them, and prints how many collections ran meanwhile and how many objects are frozen.
CALLS = """
import gc, sys, orjson
from collectors.serving import settle_heap
if sys.argv[1] == "settled":
    settle_heap()
ran = []
gc.callbacks.append(lambda phase, info: ran.append(info["generation"]) if phase == "stop" else None)
body = orjson.dumps({"messages": [{"role": "tool", "tool_call_id": f"call_{i}", "content": "x" * 40,
                                   "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]} for i in range(400)]})
in_flight = []
for call in range(20):
    in_flight.append(orjson.loads(body))
    if len(in_flight) > 2:
        in_flight.pop(0)
print(len(ran), gc.get_freeze_count())
"""


def run_calls(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", CALLS, mode], capture_output=True, text=True, check=True)
    collections, frozen = out.stdout.split()
    return int(collections), int(frozen)


def test_calls_in_flight_start_no_collection_once_the_heap_is_settled() -> None:
    default_collections, default_frozen = run_calls("default")
    settled_collections, settled_frozen = run_calls("settled")
    assert default_collections >= 10 and default_frozen == 0  # Python's threshold: a collection every call or so
    assert settled_collections == 0  # 20 calls of ~1,600 containers each, two alive at a time
    assert settled_frozen > 1000  # the imports' objects, out of every collection
