"""The collect runner (`trajstore collect`, `trajstore reward`): task files in, groups of rewarded rollouts out.

`runner.collect` runs the whole job: tasks (`tasks`), groups and retries (`scheduler`,
`rollout`), external agent commands (`agent_cmd`), rewards and re-scoring (`rewards`),
staleness admission (`admission`), resume (`resume`), checkpoint hot reload (`reload`) and
the live display (`progress`), every model call through the capture proxy.

The names below load their module on first use (PEP 562), so that the CLI reads the
defaults of `settings.CollectSettings` for `collect --help` without loading the runner,
the proxy and the policy clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajstore.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CollectSummary": "collectors.collect.progress",
    **dict.fromkeys(("RescoreSummary", "load_reward", "rescore"), "collectors.collect.rewards"),
    **dict.fromkeys(("collect", "run_collect"), "collectors.collect.runner"),
    "CollectSettings": "collectors.collect.settings",
    **dict.fromkeys(("TaskFileError", "load_tasks"), "collectors.collect.tasks"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from collectors.collect.progress import CollectSummary
    from collectors.collect.rewards import RescoreSummary, load_reward, rescore
    from collectors.collect.runner import collect, run_collect
    from collectors.collect.settings import CollectSettings
    from collectors.collect.tasks import TaskFileError, load_tasks
