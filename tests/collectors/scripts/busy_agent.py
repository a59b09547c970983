"""An external agent for `--agent-cmd` that keeps the model and a child process busy until it is killed.

It starts a child (`sleep`), writes its own pid and the child's to ./pids, then asks the model
(stdlib HTTP, no SDK import: many of these start at once) again and again with the run's
max_tokens. The collector must kill it, its child and its model call when it stops.
"""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

child = subprocess.Popen(["sleep", "600"])
Path("pids").write_text(f"{os.getpid()} {child.pid}")
request = {"model": os.environ["TRAJSTORE_MODEL"], "max_tokens": int(os.environ["TRAJSTORE_MAX_TOKENS"]),
           "messages": [{"role": "user", "content": "Tell me everything."}]}
for _ in range(100):
    call = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
                                  data=json.dumps(request).encode(), method="POST",
                                  headers={"Content-Type": "application/json",
                                           "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(call, timeout=600) as reply:
        json.load(reply)
print("done", file=sys.stderr)
child.wait()
