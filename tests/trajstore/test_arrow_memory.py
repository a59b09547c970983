"""The store's Arrow allocator (`trajstore.arrow_memory`): jemalloc unless the user named one.

Each case runs in a fresh interpreter: pyarrow reads `ARROW_DEFAULT_MEMORY_POOL` once, when it loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, pyarrow as pa
before = pa.default_memory_pool().backend_name
from trajstore import Turn, open_store
import sys
with open_store(sys.argv[1]).writer("w") as w:
    w.append([Turn(group_id="g", rollout_id="r", segment_id="s", turn_index=0, policy_version=0, prompt_ids=[1, 2],
                   output_ids=[3], output_logprobs=[-0.5], request={"messages": []})])
print(json.dumps([before, pa.default_memory_pool().backend_name]))
"""


def allocators(tmp_path: Path, chosen: str | None) -> list[str]:
    """pyarrow's default allocator before the store was imported, and after it appended."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "store")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out)


def test_the_store_replaces_pyarrows_default_allocator_with_jemalloc(tmp_path: Path) -> None:
    before, after = allocators(tmp_path, None)
    assert before == "mimalloc"  # pyarrow's own default: what the store replaces (see the module docstring)
    assert after == "jemalloc"


@pytest.mark.parametrize("chosen", ["mimalloc", "system"])
def test_an_allocator_the_user_names_is_kept(tmp_path: Path, chosen: str) -> None:
    assert allocators(tmp_path, chosen) == [chosen, chosen]
