"""reasoning-gym's procedural tasks as `trajstore collect` tasks, scored by reasoning-gym's own verifiers.

Any of its generators (`reasoning_gym.factory.DATASETS`: leg_counting, basic_arithmetic,
countdown, ...), seeded, written to a task file:

    python -m collectors.envs.reasoning_gym leg_counting --count 64 --seed 0 --out tasks.jsonl \\
        [--config '{"min_animals": 1}'] [--no-system]
    trajstore collect ... --tasks tasks.jsonl --reward reasoning_gym

(or in Python, `tasks(name, count, seed)` / `write_tasks(path, name, count, seed)`). A task:

    {"id": "rg-leg_counting-0-3", "messages": [system, user question], "answer": "...",
     "reasoning_gym": {"dataset": name, "seed": 0, "size": 64, "index": 3, "config": {...}}}

The system message is reasoning-gym's default prompt (think, then `<answer>...</answer>`);
`--no-system` leaves it out (a tiny model's context is short). The reward rebuilds the
same dataset from `reasoning_gym` (generation is deterministic in seed and index) and calls
its `score_answer(answer, entry)` with the very entry it generated, metadata and all, so a
verifier that needs more than the answer string (countdown, sudoku, ...) scores exactly as
reasoning-gym does. Components:

    score    reasoning-gym's score of the answer: the text in the last `<answer>` tag of the
             reply, or the whole reply when it has none
    format   FORMAT_REWARD when the reply put its answer in an `<answer>` tag, else 0
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import sys
from pathlib import Path
from typing import Any

from collectors.agents.context import result_text
from collectors.errors import CollectorError

KEY = "reasoning_gym"  # the task's field with what the reward needs to regenerate its entry
FORMAT_REWARD = 0.1  # worth a tenth of a right answer, so it never outweighs one


class ReasoningGymError(CollectorError, ValueError):
    """An unknown generator, a bad configuration, or a task that is not a reasoning-gym task."""


def names() -> list[str]:
    """Every generator reasoning-gym registers."""
    import reasoning_gym.factory

    return sorted(reasoning_gym.factory.DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    import reasoning_gym

    if name not in names():
        raise ReasoningGymError(unknown(name))
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (TypeError, ValueError, AssertionError) as exc:  # its configs validate with assert
        raise ReasoningGymError(f"reasoning-gym cannot build {name!r} with {config_json}: {exc}") from exc


def dataset(name: str, seed: int, size: int, config: dict[str, Any] | None = None) -> Any:
    """reasoning-gym's dataset `name` (cached: the reward rebuilds it for every rollout)."""
    return _dataset(name, seed, size, json.dumps(config or {}, sort_keys=True))


def unknown(name: str) -> str:
    """The error for a generator reasoning-gym lacks: the closest names, and how to list them all."""
    close = difflib.get_close_matches(name, names(), n=5, cutoff=0.5)
    near = f"did you mean {', '.join(close)}? " if close else ""
    return (f"reasoning-gym has no generator {name!r}; {near}(all {len(names())}: "
            "python -m collectors.envs.reasoning_gym list)")


def system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return str(SYSTEM_PROMPTS["default"])


def tasks(name: str, count: int, seed: int = 0, config: dict[str, Any] | None = None,
          system: bool = True) -> list[dict[str, Any]]:
    """`count` tasks of generator `name`, the same for the same seed and config (see the module docstring)."""
    if count < 1:
        raise ReasoningGymError(f"count must be at least 1, got {count}")
    data = dataset(name, seed, count, config)
    opening = [{"role": "system", "content": system_prompt()}] if system else []
    out = []
    for index in range(count):
        entry = data[index]
        out.append({"id": f"rg-{name}-{seed}-{index}",
                    "messages": [*opening, {"role": "user", "content": entry["question"]}],
                    "answer": str(entry["answer"]),
                    KEY: {"dataset": name, "seed": seed, "size": count, "index": index, "config": config or {}}})
    return out


def write_tasks(path: str | Path, name: str, count: int, seed: int = 0, config: dict[str, Any] | None = None,
                system: bool = True) -> Path:
    """Write `tasks(...)` as JSON lines, the task-file format of `trajstore collect`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks(name, count, seed, config, system)))
    return path


def entry(task: dict[str, Any]) -> dict[str, Any]:
    """The entry reasoning-gym generated for `task`, regenerated (checked against the task's question)."""
    spec = task.get(KEY)
    if not isinstance(spec, dict) or not {"dataset", "seed", "size", "index"} <= set(spec):
        raise ReasoningGymError(f"the reasoning_gym reward needs tasks written by collectors.envs.reasoning_gym "
                                f"(a `{KEY}` field with dataset, seed, size and index); task {task.get('id')!r} "
                                "has none")
    found = dataset(spec["dataset"], int(spec["seed"]), int(spec["size"]), spec.get("config"))[int(spec["index"])]
    question = task["messages"][-1]["content"] if task.get("messages") else task.get("prompt")
    if found["question"] != question:
        raise ReasoningGymError(f"task {task.get('id')!r}: the installed reasoning-gym generates a different "
                                "question for its seed and index (another version?); write the task file again")
    return dict(found)


def extract(text: str) -> tuple[str, bool]:
    """(the answer, whether it came from an `<answer>` tag)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text, tag_name="answer")
    return (tagged, True) if tagged is not None else (text.strip(), False)


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """`{"score": reasoning-gym's score, "format": FORMAT_REWARD or 0}` (see the module docstring)."""
    found = entry(task)
    answer, tagged = extract(result_text(result) or "")
    spec = task[KEY]
    score = dataset(spec["dataset"], int(spec["seed"]), int(spec["size"]), spec.get("config")).score_answer(
        answer=answer, entry=found)
    return {"score": float(score), "format": FORMAT_REWARD if tagged else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectors.envs.reasoning_gym",
                                     description="Write a reasoning-gym generator's tasks as a trajstore task file.")
    parser.add_argument("name", help="the generator (e.g. leg_counting); `list` prints them all")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}", help="the generator's options as a JSON object")
    parser.add_argument("--out", type=Path, help="the task file to write (JSON lines)")
    parser.add_argument("--no-system", action="store_true", help="leave out reasoning-gym's system prompt")
    args = parser.parse_args(argv)
    if args.name == "list":
        print("\n".join(names()))
        return 0
    try:
        config = json.loads(args.config)
        if not isinstance(config, dict):
            raise ReasoningGymError(f"--config must be a JSON object, got {args.config}")
        if args.out is None:
            raise ReasoningGymError("give --out FILE, the task file to write")
        path = write_tasks(args.out, args.name, args.count, args.seed, config, system=not args.no_system)
    except (json.JSONDecodeError, ReasoningGymError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.count} {args.name} tasks to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
