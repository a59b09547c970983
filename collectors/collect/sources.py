"""Where `trajstore collect` gets its tasks: a task file (`--tasks`) or an environment package's generator (`--env`).

    --tasks tasks.jsonl                                  JSON lines or Parquet (collectors.collect.tasks)
    --env reasoning_gym:leg_counting [--env-count 64] [--env-seed 0] [--env-config '{"max_animals": 4}']

`--env PACKAGE:NAME` generates the tasks when collect starts (seeded: the same seed gives the
same tasks, so a rerun resumes the same groups) and, unless `--reward` says otherwise, scores
them with the package's own reward. This module holds only the table of packages and the
checks on the settings: it stays light, `collect --help` imports it; a package is imported only
when its tasks are generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from collectors.errors import CollectorError


class EnvSourceError(CollectorError, ValueError):
    """`--env` names no known package, or its options are not usable."""


@dataclass(frozen=True)
class EnvSource:
    """One package `--env` takes: its task generator `tasks(name, count, seed, config)` and its reward."""

    tasks: str  # module:function
    reward: str  # a name of collectors.collect.rewards.NAMED_REWARDS
    example: str  # a NAME to show in errors


ENV_SOURCES: dict[str, EnvSource] = {
    "reasoning_gym": EnvSource("collectors.envs.reasoning_gym:tasks", "reasoning_gym", "leg_counting"),
}


def parse_env(spec: str) -> tuple[EnvSource, str]:
    """(the package's source, the generator name) of `PACKAGE:NAME`; EnvSourceError says what to write."""
    package, sep, name = spec.partition(":")
    if package not in ENV_SOURCES:
        known = ", ".join(f"{p}:NAME (e.g. {p}:{s.example})" for p, s in sorted(ENV_SOURCES.items()))
        raise EnvSourceError(f"--env {spec!r}: unknown package {package!r}; --env takes {known}")
    if not sep or not name:
        raise EnvSourceError(f"--env {spec!r} names no generator: write {package}:NAME "
                             f"(e.g. {package}:{ENV_SOURCES[package].example})")
    return ENV_SOURCES[package], name


def parse_config(text: str | None) -> dict[str, Any]:
    """`--env-config` as a dict (empty when not given)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EnvSourceError(f"--env-config is not valid JSON ({exc.msg} at column {exc.colno}): {text}") from exc
    if not isinstance(value, dict):
        raise EnvSourceError(f"--env-config must be a JSON object of the generator's options, got {text}")
    return value


def env_problems(env: str, count: int, config: str | None) -> list[str]:
    """What is wrong with the `--env` options (no import of the package: that happens when generating)."""
    out = []
    for check in (lambda: parse_env(env), lambda: parse_config(config)):
        try:
            check()
        except EnvSourceError as exc:
            out.append(str(exc))
    if count < 1:
        out.append(f"--env-count must be at least 1, got {count}")
    return out


def generate(env: str, count: int, seed: int, config: str | None) -> list[dict[str, Any]]:
    """The tasks `--env` names, generated now; the generator's own errors (an unknown NAME lists close
    matches) come back as CollectorError."""
    from collectors.agents.context import load_object

    source, name = parse_env(env)
    try:
        make = load_object(source.tasks, what="task generator")
    except ValueError as exc:  # the package is not installed
        raise EnvSourceError(f"--env {env}: {exc}; install the envs extra: pip install -e '.[envs]'") from exc
    tasks = make(name, count, seed, parse_config(config))
    if not tasks:
        raise EnvSourceError(f"--env {env} generated no tasks")
    return list(tasks)
