"""`trajstore init-model`: a small random-init Qwen2 causal LM with a real tokenizer, in HF format.

The whole stack (embedded server, capture proxy, learner) needs a real model to run on a
laptop with no downloads. This builds one: transformers' `Qwen2ForCausalLM` with random
weights (deterministic in the seed) and the byte-level BPE of `collectors.model.tokenizer`, saved
as any Hugging Face checkpoint is (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja), so that
`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)` and
`vllm serve DIR` load it offline as is.

Compatibility decisions, written down here because the files outlive the code:
- `vocab_size` of the model equals the tokenizer's length, so every id the model can sample
  decodes (Qwen pads its embedding; a random model would then sample undecodable ids).
- The defaults are servable by vLLM's CPU backend, whose attention takes only some head sizes
  (32 and up; `collectors.policy.vllm_server.CPU_HEAD_SIZES`): hidden 64 in 2 heads of 32.
  `ModelSize.vllm_problems()` names what a shape would break there; init-model warns with it.
- The input embedding and the LM head are separate matrices by default (`tie_embeddings`):
  vLLM 0.32's in-place weight reload (`/collective_rpc reload_weights`) reloads a tied
  model's embedding but puts the old LM head back, so a hot-reloaded tied model would sample
  from a mix of two versions (measured: logprobs matched neither checkpoint). Untied, every
  reload is whole; `VLLMClient` refuses full-weight reloads of tied checkpoints.
- generation_config.json holds only bos/eos/pad ids: vLLM takes default sampling parameters
  from it (`--generation-config auto`), and an RL run must sample with exactly the parameters
  it records, not a default hidden in the checkpoint.
- The tokenizer class is written as `PreTrainedTokenizerFast` (transformers 4 loads
  tokenizer.json as is with it; transformers 5 picks its `Qwen2Tokenizer` by model type,
  which builds the same pipeline), the extra special tokens go under their transformers 4
  name `additional_special_tokens`, and the chat template is also kept in
  tokenizer_config.json for loaders older than the separate `chat_template.jinja` file. config.json also carries
  `torch_dtype` and `rope_theta`, the keys transformers 4 (and vLLM pinned to it) read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from collectors.model.families import family as named_family

ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelSize:
    """Shape of the generated model; the defaults make a ~0.6M-parameter model that is fast on CPU and
    that vLLM's CPU backend serves and hot-reloads (see the module docstring)."""

    vocab_size: int = 4096
    hidden_size: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    intermediate_size: int = 192
    max_positions: int = 4096
    tie_embeddings: bool = False

    def problems(self) -> list[str]:
        """Every invalid setting at once, each with what would fix it."""
        out = [f"{name} must be >= 1 (got {value})" for name, value in asdict(self).items()
               if not isinstance(value, bool) and value < 1]
        if out:
            return out
        if self.hidden_size % self.heads:
            out.append(f"hidden_size {self.hidden_size} must be divisible by heads {self.heads}")
        elif (self.hidden_size // self.heads) % 2:
            out.append(f"head size hidden_size/heads = {self.hidden_size // self.heads} must be even (rotary embeddings)")
        if self.heads % self.kv_heads:
            out.append(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads} (grouped-query attention)")
        return out

    def vllm_problems(self) -> list[str]:
        """Why vLLM (CPU) could not serve or hot-reload this shape; the embedded server takes any valid shape."""
        from collectors.policy.vllm_server import model_problems  # not at import: it loads the HTTP client

        out = model_problems({"hidden_size": self.hidden_size, "num_attention_heads": self.heads})
        if self.tie_embeddings:
            out.append("tied embeddings: vLLM's in-place weight reload keeps a tied LM head's old weights, so "
                       "collectors could hot-reload this model into vLLM only as LoRA adapters")
        return out


@dataclass(frozen=True)
class InitModelResult:
    path: Path
    parameters: int
    vocab_size: int
    config: dict
    warnings: tuple[str, ...] = ()  # what vLLM could not do with this model (ModelSize.vllm_problems)


def init_model(path: str | Path, size: ModelSize = ModelSize(), seed: int = 0, overwrite: bool = False,
               family: str = "hermes") -> InitModelResult:
    """Build, initialize and save a random Qwen2 model and its tokenizer into `path`.

    `family` (`collectors.model.families`: hermes, llama3, harmony) picks the tokenizer's control
    tokens, chat template and stop tokens; the network is a Qwen2 whatever the family (a chat
    format is the tokenizer's and template's business, and vLLM's CPU backend serves Qwen2)."""
    # imported here: the CLI reads ModelSize's defaults, and `trajstore --help` should not load torch
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from collectors.model.tokenizer import train_tokenizer

    problems = size.problems()
    if problems:
        raise ValueError("invalid model size: " + "; ".join(problems))
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; choose a new directory (or pass overwrite=True)")
    spec = named_family(family)
    tokenizer = train_tokenizer(size.vocab_size, seed=seed, family=family)
    first = tokenizer.convert_tokens_to_ids(spec.bos or spec.pad)
    eos, pad = tokenizer.convert_tokens_to_ids(spec.eos), tokenizer.convert_tokens_to_ids(spec.pad)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.max_positions, tie_word_embeddings=size.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=first, eos_token_id=eos, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=first, pad_token_id=pad, eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in spec.stops],
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _add_compat_keys(path, spec.template)
    return InitModelResult(path=path, parameters=sum(p.numel() for p in model.parameters()),
                           vocab_size=len(tokenizer), config=json.loads((path / "config.json").read_text()),
                           warnings=tuple(size.vllm_problems()))


def _add_compat_keys(path: Path, template: str) -> None:
    """Write the keys older loaders read beside the ones transformers 5 writes (see module doc)."""
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.setdefault("torch_dtype", "float32")
    cfg.setdefault("rope_theta", ROPE_THETA)
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_file = path / "tokenizer_config.json"
    tok = json.loads(tok_file.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(tok.get("extra_special_tokens"), list):  # transformers 4 reads a list only under this name
        tok["additional_special_tokens"] = tok.pop("extra_special_tokens")
    tok["chat_template"] = template
    tok_file.write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
