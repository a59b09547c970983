"""The capture-proxy example of docs/capture.md runs as written, with what the project installs (issue 12.20:
it imported httpx, which is not a dependency)."""

from __future__ import annotations

from tests.collectors.proxy_harness import MODEL, Harness
from tests.test_readme import block_containing


def test_the_proxy_example_runs_as_written(proxy: Harness) -> None:
    code = block_containing("import json, urllib.request")
    assert "httpx" not in code
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())
    code = code.replace("http://127.0.0.1:8100", proxy.url).replace('model="tiny-model"', f'model="{MODEL}"')
    namespace: dict = {}
    exec(compile(code, "docs/capture.md", "exec"), namespace)  # noqa: S102 - the docs' own example
    rid = namespace["r"]["rollout_id"]
    assert proxy.store.query("SELECT turns, reward, status FROM rollouts WHERE rollout_id = ?", [rid]).to_pylist() \
        == [{"turns": 1, "reward": 1.0, "status": "completed"}]
