"""An external agent for `--agent-cmd` that speaks Anthropic Messages through the anthropic SDK."""

import json
import os
from pathlib import Path

from anthropic import Anthropic

task = json.loads(Path(os.environ["TRAJSTORE_TASK_FILE"]).read_text())
client = Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY come from the runner
reply = client.messages.create(model=os.environ["TRAJSTORE_MODEL"], max_tokens=int(os.environ["TRAJSTORE_MAX_TOKENS"]),
                               messages=[{"role": "user", "content": task["prompt"]}])
print("".join(block.text for block in reply.content if block.type == "text"))
