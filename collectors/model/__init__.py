"""`trajstore init-model`: a small random Qwen2, a BPE tokenizer trained on the spot, a tool-calling chat template.

The directory it writes is a Hugging Face checkpoint that transformers and vLLM load offline.
The model's text format lives here too: `chat_template` renders conversations, `toolcalls`
writes and parses the `<tool_call>` / `<think>` markup it renders, and `replies` reads a
reply's text and calls back from a stored response.
"""

from collectors.model.build import InitModelResult, ModelSize, init_model
from collectors.model.chat_template import CHAT_TEMPLATE

__all__ = ["CHAT_TEMPLATE", "InitModelResult", "ModelSize", "init_model"]
