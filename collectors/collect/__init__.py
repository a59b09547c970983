"""The collect runner (`trajstore collect`, `trajstore reward`): task files in, groups of rewarded rollouts out.

`runner.collect` runs the whole job: tasks (`tasks`), groups and retries (`scheduler`,
`rollout`), external agent commands (`agent_cmd`), rewards and re-scoring (`rewards`),
staleness admission (`admission`), resume (`resume`), checkpoint hot reload (`reload`) and
the live display (`progress`), every model call through the capture proxy.
"""

from collectors.collect.progress import CollectSummary
from collectors.collect.rewards import RescoreSummary, load_reward, rescore
from collectors.collect.runner import collect, run_collect
from collectors.collect.settings import CollectSettings
from collectors.collect.tasks import TaskFileError, load_tasks

__all__ = ["CollectSettings", "CollectSummary", "RescoreSummary", "TaskFileError", "collect", "load_reward",
           "load_tasks", "rescore", "run_collect"]
