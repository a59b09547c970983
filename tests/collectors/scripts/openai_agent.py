"""An external agent for `--agent-cmd`: reads its task, asks the model with the openai SDK, prints the reply.

Task field "fault": "garbage" prints binary junk and exits 1 on a slot's first attempt; "hang"
starts a child process, writes both pids to ./pids and sleeps on the first attempt (the runner
must kill both), and on later attempts answers at once without a model call.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

task = json.loads(Path(os.environ["TRAJSTORE_TASK_FILE"]).read_text())
first = os.environ["TRAJSTORE_ATTEMPT"] == "0"
if task.get("fault") == "garbage" and first:
    sys.stdout.buffer.write(b"\x00\xff\xfe garbage \x1b[31m" * 50 + b"\n")
    sys.stderr.write("Traceback: the agent broke\n")
    sys.exit(1)
if task.get("fault") == "hang":
    if first:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        Path("pids").write_text(f"{os.getpid()} {child.pid}")
        time.sleep(3600)
    print("recovered")
    print(f"rollout {os.environ['TRAJSTORE_ROLLOUT_ID']} done", file=sys.stderr)
    sys.exit(0)

from openai import OpenAI  # noqa: E402 - only the model-calling path pays for the import

client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the runner
reply = client.chat.completions.create(model=os.environ["TRAJSTORE_MODEL"], seed=1,
                                       max_tokens=int(os.environ["TRAJSTORE_MAX_TOKENS"]),
                                       messages=[{"role": "user", "content": task["prompt"]}])
print(reply.choices[0].message.content)
print(f"rollout {os.environ['TRAJSTORE_ROLLOUT_ID']} done", file=sys.stderr)
