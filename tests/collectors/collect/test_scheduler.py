"""The scheduler's concurrency: `concurrency` slots run at once, never more, across group boundaries.

The agent (this module's `crowd`) makes no model call: the first `concurrency` rollouts each wait
until that many run at the same time, so the run only completes without timeouts when the
scheduler fills every slot; later ones pass straight through.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from collectors.agents.context import AgentContext, RolloutInfo
from collectors.collect.runner import collect
from collectors.collect.settings import CollectSettings
from collectors.embedded.app import RunningServer
from tests.collectors.agents_for_tests import rollout_rows, write_tasks
from trajstore import open_store

CROWD: dict[str, Any] = {}


async def crowd(task: dict[str, Any], ctx: AgentContext) -> str:
    CROWD["running"] += 1
    CROWD["most"] = max(CROWD["most"], CROWD["running"])
    try:
        if CROWD["running"] == CROWD["concurrency"]:
            CROWD["full"].set()
        await asyncio.wait_for(CROWD["full"].wait(), 30)
        await asyncio.sleep(0)
        return "ok"
    finally:
        CROWD["running"] -= 1


def one(task: dict[str, Any], result: Any, rollout: RolloutInfo) -> float:
    return 1.0


def test_every_slot_fills_and_never_more(server: RunningServer, tiny_model: Path, tmp_path: Path) -> None:
    concurrency = 5  # not a multiple of n: slots of one group start beside slots of the next
    settings = CollectSettings(store=str(tmp_path / "store"), run="crowd", server=server.url, model=str(tiny_model),
                               tasks=write_tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "prompt": "p"}
                                                                           for i in range(6)]),
                               n=2, concurrency=concurrency, retries=0, rollout_timeout=60,
                               workdir=str(tmp_path / "work"), display="off", agent=f"{__name__}:crowd",
                               reward=f"{__name__}:one")

    async def main() -> Any:
        CROWD.update(running=0, most=0, concurrency=concurrency, full=asyncio.Event())
        return await collect(settings)

    summary = asyncio.run(main())
    assert CROWD["most"] == concurrency and CROWD["running"] == 0
    assert summary.rollouts == {"completed": 12} and summary.groups_complete == 6 and summary.retries == 0
    rows = rollout_rows(open_store(settings.store), "crowd")
    assert len(rows) == 12 and all(r["status"] == "completed" and r["turns"] == 0 for r in rows)
