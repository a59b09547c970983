"""The `sft` export: chat-format JSON lines of chosen samples, for rejection-sampling fine-tuning.

One line per exported sample (choose them with `--where`, e.g. `reward >= 1`):

    {"messages": [{"role": "system", ...}, {"role": "user", ...}, {"role": "assistant", ...}, ...],
     "tools": [...]}

`messages` is the conversation of the sample's last model call (its request's messages, then
the reply), which holds every earlier turn of the sample: a sample is one token sequence that
each turn extends. Tool calls stay in OpenAI form (assistant `tool_calls`, `role: "tool"`
results; see `trajstore.export.chat`) and the request's tool definitions go in `tools` (left
out when it had none), which is what TRL's SFT trainer and chat templates with tool support
read. A sample stored without request/response JSON has no text (the store holds token ids
and no tokenizer): it is skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from trajstore.export.chat import conversation


def write_sft(batches: Iterable[pa.RecordBatch], out: Path) -> tuple[int, int]:
    """Write the chat lines of every batch's rows to `out`; (lines written, samples skipped for want of text)."""
    written = skipped = 0
    with open(out, "w", encoding="utf-8") as f:
        for batch in batches:
            for requests, responses in zip(batch.column("turn_requests").to_pylist(),
                                           batch.column("turn_responses").to_pylist()):
                chat = conversation(requests[-1], responses[-1])
                if chat is None:
                    skipped += 1
                    continue
                messages, reply, tools = chat
                line: dict[str, object] = {"messages": [*messages, reply]}
                if tools:
                    line["tools"] = tools
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                written += 1
    return written, skipped
