"""An agent program for `trajstore collect --agent-cmd`: any program that talks to the OpenAI API will do.

`collect` starts it once per rollout, in the rollout's own directory, with the variables it
needs: OPENAI_BASE_URL and OPENAI_API_KEY (the capture proxy, bound to this rollout: every
call is stored token-exact), TRAJSTORE_MODEL, TRAJSTORE_MAX_TOKENS, TRAJSTORE_MAX_TURNS and
TRAJSTORE_TASK_FILE (the task as JSON). What it prints on stdout is the rollout's result: the
reward (`--reward module:fn`, or `--reward-cmd`, which finds it in TRAJSTORE_RESULT_FILE)
judges it.

    trajstore collect ... --agent-cmd "python $PWD/examples/fruit_agent.py" \\
        --reward-cmd "python $PWD/examples/check_colour.py"

It offers the model one tool, `look_up` (the fruit environment's, answered here from the task
file), runs the calls the model makes, and prints the model's final reply. It shows the model
exactly the prompt of the warm start (the same system prompt and tool schema): a small model
is only as good as its training data on what it sees.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, wherever this runs from
from fruit_env import COLOUR_OF, SYSTEM, TOOL, colour_text  # noqa: E402


def main() -> None:
    task = json.loads(Path(os.environ["TRAJSTORE_TASK_FILE"]).read_text())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from collect
    messages = [{"role": "system", "content": task.get("system", SYSTEM)}, {"role": "user", "content": task["prompt"]}]
    for _ in range(int(os.environ.get("TRAJSTORE_MAX_TURNS", "3"))):
        reply = client.chat.completions.create(model=os.environ["TRAJSTORE_MODEL"], messages=messages, tools=[TOOL],
                                               max_tokens=int(os.environ.get("TRAJSTORE_MAX_TOKENS", "48")))
        message = reply.choices[0].message
        if not message.tool_calls:
            print(message.content or "")
            return
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            known = call.function.name == "look_up"
            result = colour_text(COLOUR_OF[task["fruit"]]) if known else f"Error: no tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("")  # out of turns: no answer


if __name__ == "__main__":
    main()
