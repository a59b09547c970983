"""LoRA for the learner: wrap a causal LM with trainable adapters, save them as a checkpoint, resume them.

An adapter checkpoint is a directory both policy servers load as is:
- `adapter_config.json` + `adapter_model.safetensors`, peft's format, which vLLM's runtime LoRA
  (`POST /v1/load_lora_adapter {lora_name, lora_path}`, what `VLLMClient(reload="lora")` calls)
  reads directly; its `base_model_name_or_path` is the absolute path of the base model
  directory, which is how the embedded server (`collectors.embedded.engine.load_model`) finds the
  weights to merge the adapter into;
- the base model's tokenizer files, chat template and generation config, so the directory
  describes what it serves without a look at the base.

Decisions written down here:
- Only the adapter trains: peft freezes every base parameter, so the optimizer sees the LoRA
  A/B matrices only and a checkpoint is megabytes, not the whole model.
- LoRA B starts at zero (peft's default), so a fresh adapter is exactly the base policy and
  version 0's logprobs stay valid; the first step moves B only, A follows from the second.
- `dropout` defaults to 0: with dropout on, the training forward pass is not the policy that
  sampled, so the importance ratio against the recorded behaviour logprobs would be noise.
- The defaults target every linear layer of a Qwen2/Llama block (attention and MLP), which
  vLLM's LoRA kernels support; vLLM also needs `--max-lora-rank` >= `rank`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
# copied from the base so an adapter directory carries its tokenizer; those a base lacks are skipped
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                                    "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def lora_problems(rank: int, alpha: float, dropout: float, target_modules: Sequence[str] | None = None,
                  model: torch.nn.Module | None = None) -> list[str]:
    """Every invalid LoRA setting at once (for a settings object's `problems()`); `model` also checks the targets."""
    out: list[str] = []
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        out.append(f"LoRA rank must be an integer >= 1 (got {rank!r}); 8 to 64 is usual")
    if not alpha > 0:
        out.append(f"LoRA alpha must be > 0 (got {alpha!r}); the update is scaled by alpha / rank, 2 * rank is usual")
    if not 0.0 <= dropout < 1.0:
        out.append(f"LoRA dropout must be in [0, 1) (got {dropout!r}); 0 keeps the trained policy the sampled one")
    targets = DEFAULT_TARGET_MODULES if target_modules is None else tuple(target_modules)
    if not targets:
        out.append("LoRA target_modules is empty; name the linear layers to adapt, "
                   f"e.g. {list(DEFAULT_TARGET_MODULES)}")
    elif model is not None:
        linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear)}
        missing = sorted(set(targets) - linear)
        if missing:
            out.append(f"LoRA target_modules {missing} are not linear layers of this model; "
                       f"its linear layers are {sorted(linear)}")
    return out


def apply_lora(model: PreTrainedModel, *, rank: int = 8, alpha: float = 16, dropout: float = 0.0,
               target_modules: Sequence[str] | None = None) -> PeftModel:
    """Wrap `model` with fresh LoRA adapters; only the adapters' parameters require grad afterwards.

    The wrapped model computes exactly what `model` did until the first optimizer step (B = 0).
    Raises ValueError naming every bad setting.
    """
    problems = lora_problems(rank, alpha, dropout, target_modules, model)
    if problems:
        raise ValueError("invalid LoRA settings: " + "; ".join(problems))
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=list(DEFAULT_TARGET_MODULES if target_modules is None else target_modules))
    return get_peft_model(model, config)


def save_adapter(model: PeftModel, path: str | Path, base_model_dir: str | Path) -> Path:
    """Write `model`'s adapter and the base's tokenizer files into directory `path`; returns it.

    `base_model_dir` must be the local model directory the adapter was trained on; it is
    recorded as an absolute path in adapter_config.json's `base_model_name_or_path`. Writing is
    not atomic: write into a partial directory and rename it (the learner's publisher does).
    """
    base = Path(base_model_dir).resolve()
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {base} has no config.json; pass the local Hugging Face "
                                "model directory the adapter was trained on as base_model_dir")
    if not isinstance(model, PeftModel):
        raise TypeError(f"save_adapter needs the PeftModel returned by apply_lora, got {type(model).__name__}")
    path = Path(path)
    for config in model.peft_config.values():  # what the embedded server loads the adapter onto
        config.base_model_name_or_path = str(base)
    model.save_pretrained(str(path))
    # peft also writes a Hub model card template; the checkpoint's own JSON describes it instead
    (path / "README.md").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, path / name)
    return path


def adapter_base(adapter_dir: str | Path) -> str | None:
    """`base_model_name_or_path` recorded in an adapter directory, or None when it records none."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    return config.get("base_model_name_or_path")


def load_adapter_for_training(base_dir: str | Path, adapter_dir: str | Path, *,
                              dtype: torch.dtype = torch.float32) -> PeftModel:
    """Resume: the base model in `base_dir` with the adapter of `adapter_dir` on it, adapter trainable."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {ADAPTER_CONFIG}, so it is not a LoRA adapter checkpoint; "
                                "resume a full checkpoint by loading it with AutoModelForCausalLM instead")
    if not (Path(base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"base model directory {base_dir} has no config.json; pass the local Hugging Face "
                                f"model directory the adapter was trained on ({adapter_base(adapter_dir)})")
    recorded = adapter_base(adapter_dir)
    if recorded is not None and Path(recorded).resolve() != Path(base_dir).resolve():
        # a moved base directory is legitimate; a different base model is not, and only the caller knows which
        log.warning("adapter %s was trained on %s, resuming it on %s", adapter_dir, recorded, base_dir)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
