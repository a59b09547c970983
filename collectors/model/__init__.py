"""`trajstore init-model`: a small random Qwen2, a BPE tokenizer trained on the spot, a tool-calling chat template.

The directory it writes is a Hugging Face checkpoint that transformers and vLLM load offline.
The model's text format lives here too: `families` names the chat formats a model can be built
with (hermes, llama3, harmony) and their templates (`chat_template`, `family_templates`),
`toolcalls` parses replies in each format (harmony through `openai-harmony`: `harmony`), and
`replies` reads a reply's text and calls back from a stored response.
"""

from collectors.model.build import InitModelResult, ModelSize, init_model
from collectors.model.chat_template import CHAT_TEMPLATE

__all__ = ["CHAT_TEMPLATE", "InitModelResult", "ModelSize", "init_model"]
