"""Supervised warm start: teach a fresh model a task's format on worked conversations before RL.

A randomly initialized model almost never writes a well-formed tool call, so RL from scratch
has no reward to learn from. `warm_start` runs a short supervised pass over complete
conversations (`{"messages", "tools"}`, in the chat format the capture proxy renders) and
saves a full Hugging Face checkpoint that the policy server and the learner start from.

Tokens are laid out as the proxy lays them out when the model samples: every span the model
writes (an assistant turn, from after `<|im_start|>assistant\\n` through its `<|im_end|>`) is
tokenized on its own, and so is every span between them (the prompt the proxy renders, tool
results, the template's newline after `<|im_end|>`). The loss covers the assistant spans
only: the model learns to write calls and answers, never to predict a prompt or a tool's
output. Spans are found by rendering the conversation's prefixes with the tokenizer's chat
template, so any template that renders prefixes as prefixes works.

The learner never imports the collectors (imports flow cli -> collectors, learner -> trajstore,
guarded by tests/test_layout.py): the caller passes the conversations
(e.g. `collectors.envs.arithmetic.warm_start_conversations`).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from learner.settings import WarmStartSettings

ASSISTANT_OPEN = "<|im_start|>assistant\n"
# Files of a checkpoint that training does not change: copied from the base so the output loads
# exactly as the base did (init-model writes compatibility keys into some of them).
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "special_tokens_map.json")
SETTINGS_FILE = "trajstore_warm_start.json"


@dataclass(frozen=True)
class Example:
    """One tokenized conversation: ids (T,) and a loss mask (T,) that is True on assistant-written tokens."""

    ids: list[int]
    mask: list[bool]


def load_conversations(path: str | Path) -> list[dict[str, Any]]:
    """The conversations of a JSON-lines file, one `{"messages": [...], "tools": [...] or null}` a line.

    Every bad line is reported at once, with its number and what is wrong, before any training.
    """
    path = Path(path)
    conversations: list[dict[str, Any]] = []
    problems: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg})")
            continue
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            problems.append(f"line {number}: needs \"messages\", a list of {{\"role\", \"content\"}} objects")
        elif not any(m["role"] == "assistant" for m in messages):
            problems.append(f"line {number}: has no assistant message, so there is nothing to learn from it")
        elif row.get("tools") is not None and not isinstance(row["tools"], list):
            problems.append(f"line {number}: \"tools\" must be a list of tool schemas or null")
        else:
            conversations.append(row)
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"{path}: {shown}")
    if not conversations:
        raise ValueError(f"{path} holds no conversations; write one JSON object per line: "
                         '{"messages": [...], "tools": [...]}')
    return conversations


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) character span of each assistant turn.

    A span starts after the generation prompt `<|im_start|>assistant\\n` and ends after the
    turn's end-of-turn token, i.e. it is exactly the text the model samples for that turn.
    """
    def render(prefix: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(prefix, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    text = render(messages, False)
    eos = tokenizer.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt, through = render(messages[:i], True), render(messages[:i + 1], False)
        end = through.rfind(eos) + len(eos) if eos and eos in through[len(prompt):] else len(through)
        if not (through.startswith(prompt) and prompt.endswith(ASSISTANT_OPEN) and text.startswith(through)):
            raise ValueError(f"the chat template does not render message {i} of this conversation as an extension "
                             f"of the messages before it, so the assistant's tokens cannot be found; use a "
                             f"template whose prefixes render as prefixes (e.g. the one of `trajstore init-model`)")
        spans.append((len(prompt), end))
    if not spans:
        raise ValueError("a warm-start conversation has no assistant message; there is nothing to learn from it")
    return text, spans


def tokenize_conversation(tokenizer: Any, conversation: dict[str, Any]) -> Example:
    """Tokenize span by span (see the module docstring) and mark the assistant spans trainable."""
    text, spans = assistant_spans(tokenizer, conversation["messages"], conversation.get("tools"))
    ids: list[int] = []
    mask: list[bool] = []
    cursor = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, trainable in ((text[cursor:start], False), (text[start:end], True)):
            if piece:
                piece_ids = tokenizer.encode(piece, add_special_tokens=False)
                ids.extend(piece_ids)
                mask.extend([trainable] * len(piece_ids))
        cursor = end
    return Example(ids, mask)


def _batch(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, T), attention mask (B, T) and labels (B, T) with -100 off the loss."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.ids)
        ids[r, :n] = torch.tensor(e.ids)
        attention[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(e.mask), torch.tensor(e.ids), -100)
    return ids, attention, labels


def shared_prefix(ids: torch.Tensor, attention: torch.Tensor) -> int:
    """How many leading tokens every row of a right-padded batch (B, T) has in common."""
    lengths = attention.sum(dim=1)
    same = (ids == ids[:1]).all(dim=0).long()  # (T,)
    common = int(same.cumprod(dim=0).sum())
    return min(common, int(lengths.min()) - 1)  # leave every row at least one token of its own


def hidden_states(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The last hidden states (B, T, H), computing the batch's shared prefix once.

    Conversations of one task share a long system prompt and tool list (about 250 of their
    300 tokens here). The prefix runs as a batch of one and its keys and values are expanded
    to the batch, so the work is that of one prefix plus B suffixes; `expand` sums the rows'
    gradients in the backward pass, so the result and its gradients equal the plain forward's.
    """
    from transformers import DynamicCache

    prefix = shared_prefix(ids, attention)
    if prefix < 16 or ids.shape[0] == 1:
        return model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    rows, width = ids.shape
    head = model.base_model(input_ids=ids[:1, :prefix], use_cache=True)
    layers = [(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
              for layer in head.cache.layers]
    positions = torch.arange(prefix, width).unsqueeze(0).expand(rows, -1)
    tail = model.base_model(input_ids=ids[:, prefix:], attention_mask=attention, position_ids=positions,
                            cache=DynamicCache(layers, config=model.config), use_cache=True)
    return torch.cat([head.last_hidden_state.expand(rows, -1, -1), tail.last_hidden_state], dim=1)


def token_loss(model: Any, ids: torch.Tensor, attention: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the labelled tokens of a batch (B, T); position t predicts token t + 1.

    Only the positions that predict an assistant token go through the output layer: a turn is
    a tenth of a conversation, and the vocabulary projection is most of a tiny model's work.
    """
    hidden = hidden_states(model, ids, attention)  # (B, T, H)
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])  # (N, V)
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def _lr_factor(step: int, settings: WarmStartSettings) -> float:
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def warm_start(model_dir: str | Path, out_dir: str | Path, conversations: Sequence[dict[str, Any]], *,
               steps: int, lr: float, batch_size: int, seed: int,
               on_step: Callable[[int, float], None] | None = None) -> Path:
    """Train `model_dir` for `steps` steps on `conversations` (loss on assistant tokens) and save it to `out_dir`.

    Batches are drawn in a seeded shuffled order, epoch after epoch. `on_step(step, loss)` is
    called after each step (progress display). The output is a full Hugging Face checkpoint
    plus `trajstore_warm_start.json` (the settings and the loss curve).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = WarmStartSettings(steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                                 warmup_steps=min(10, steps // 10))
    problems = settings.problems()
    if not conversations:
        problems.append("no conversations to train on; pass at least one")
    if problems:
        raise ValueError("invalid warm start: " + "; ".join(problems))
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory for the warm start")

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    examples = [tokenize_conversation(tokenizer, c) for c in conversations]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses: list[float] = []
    for step in range(steps):
        while len(order) < batch_size:
            order.extend(torch.randperm(len(examples), generator=generator).tolist())
        picked, order = order[:batch_size], order[batch_size:]
        ids, attention, labels = _batch([examples[i] for i in picked], pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr * _lr_factor(step, settings)
        loss = token_loss(model, ids, attention, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])

    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)
    record = {"base_model": str(model_dir.resolve()), "conversations": len(examples), **asdict(settings),
              "loss": [round(x, 5) for x in losses]}
    (out_dir / SETTINGS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out_dir
