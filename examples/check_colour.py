"""A reward command for `trajstore collect --reward-cmd`: exit 0 (reward 1.0) when the answer is right.

`collect` runs it in the rollout's directory after the agent, with TRAJSTORE_TASK_FILE (the
task as JSON) and TRAJSTORE_RESULT_FILE (the agent's result: an agent command's stdout, or the
built-in agent's final reply). Any exit status other than 0 scores 0.0; what it prints is kept
in the rollout's status. A test suite works the same way (`--reward-cmd "pytest -q"`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, wherever this runs from
from fruit_env import named_colours  # noqa: E402

task = json.loads(Path(os.environ["TRAJSTORE_TASK_FILE"]).read_text())
answer = Path(os.environ["TRAJSTORE_RESULT_FILE"]).read_text()
if named_colours(answer) == {task["answer"]}:
    print(f"right: {task['answer']}")
    sys.exit(0)
print(f"wrong: wanted {task['answer']}, got {answer.strip()[:80]!r}")
sys.exit(1)
