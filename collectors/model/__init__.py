"""`trajstore init-model`: a small random Qwen2, a BPE tokenizer trained on the spot, a tool-calling chat template.

The directory it writes is a Hugging Face checkpoint that transformers and vLLM load offline.
"""

from collectors.model.build import InitModelResult, ModelSize, init_model
from collectors.model.chat_template import CHAT_TEMPLATE

__all__ = ["CHAT_TEMPLATE", "InitModelResult", "ModelSize", "init_model"]
