"""`annotate(...)`: score a run's stored samples with a local teacher model, appending its logprobs.

The teacher's logprob of every output token of every turn goes into the store as a `Teacher`
event (one per turn, keyed by rollout, segment and turn, filed under a name), next to the turns
it scores: history is never rewritten, and the `teacher_logprobs` view lines the scores up with
each sample's tokens for `learn --loss distill`. A turn is scored in the context of its whole
sample (every earlier turn, prompt deltas included), exactly what the student conditions on.

Idempotent: samples the name already annotates completely are skipped, and each event's id
derives from (run, rollout, segment, turn, name), so a rerun after a crash appends nothing twice.
Samples are packed into micro-batches as the learner packs them (`learner.batching.pack`).
Limitation: the teacher must share the student's tokenizer (token ids are scored as stored).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM

from learner.batching import pack
from learner.losses import token_logprobs
from learner.train import check_vocabulary, forward_logits, resolve_device
from trajstore import Teacher, open_store


@dataclass(frozen=True)
class AnnotateSummary:
    run: str
    teacher: str
    samples: int  # samples scored by this call
    turns: int  # Teacher events appended
    tokens: int  # output tokens scored
    skipped: int  # samples already annotated completely under this name


def _event_id(run: str, rollout: str, segment: str, turn: int, name: str) -> str:
    key = "\x1f".join((run, rollout, segment, str(turn), name)).encode()
    return "teacher-" + hashlib.sha256(key).hexdigest()[:32]


def _sample_table(turns: pa.Table) -> tuple[pa.Table, list[list[dict]]]:
    """One row per sample (tokens, output-token mask) in the shape `pack` reads, and its turns in order."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for t in turns.to_pylist():
        rows.setdefault((t["rollout_id"], t["segment_id"]), []).append(t)
    tokens, masks, runs, rollouts = [], [], [], []
    for (rollout, _), ts in rows.items():
        tokens.append([x for t in ts for x in t["prompt_ids"] + t["output_ids"]])
        masks.append([m for t in ts for m in [False] * len(t["prompt_ids"]) + [True] * len(t["output_ids"])])
        runs.append(ts[0]["run"])
        rollouts.append(rollout)
    n = len(tokens)
    table = pa.table({"run": runs, "rollout_id": rollouts, "tokens": tokens, "loss_mask": masks,
                      "logprobs": [[0.0] * len(x) for x in tokens], "advantage": pa.array([0.0] * n),
                      "rollout_segments": pa.array([1] * n)})
    return table, list(rows.values())


def annotate(store_loc: str, run: str, teacher_model: str, name: str, *, device: str = "auto",
             temperature: float = 1.0, micro_batch_tokens: int = 4096) -> AnnotateSummary:
    """Score every turn of `run` that `name` does not annotate yet with the model at `teacher_model`."""
    store = open_store(store_loc, create=False)
    params = {"run": run, "name": name}
    turns = store.query(
        """SELECT t.run, t.group_id, t.rollout_id, t.segment_id, t.turn_index, t.policy_version,
                  t.prompt_ids, t.output_ids
           FROM turns t ANTI JOIN (SELECT rollout_id, segment_id FROM teacher_logprobs
                                   WHERE teacher = $name AND complete) USING (rollout_id, segment_id)
           WHERE t.run = $run ORDER BY t.rollout_id, t.segment_id, t.turn_index""", params)
    skipped = store.query("SELECT count(*) AS n FROM teacher_logprobs WHERE run = $run AND teacher = $name "
                          "AND complete", params).column("n")[0].as_py()
    if not turns.num_rows:
        return AnnotateSummary(run, name, 0, 0, 0, skipped)
    samples, sample_turns = _sample_table(turns)
    where = resolve_device(device, 0)
    model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=torch.float32).to(where).eval()
    check_vocabulary(samples, int(model.get_input_embeddings().num_embeddings))
    appended = tokens = 0
    with store.writer(store.unique_writer_name(f"annotate-{name}-"[:40])) as writer, torch.no_grad():
        for mb in pack(samples, micro_batch_tokens):
            mb = mb.to(where)
            keep = mb.mask.nonzero().squeeze(1)
            lp = token_logprobs(forward_logits(model, mb, temperature), mb.targets[keep]).cpu().numpy()
            seq = mb.seq[keep].cpu().numpy()
            events = []
            for i, row in enumerate(mb.rows):
                scores = lp[seq == i]
                ts = sample_turns[row]
                # a sample's first token is never predicted: when it is an output token, it scores 0
                missing = sum(len(t["output_ids"]) for t in ts) - len(scores)
                scores = np.concatenate([np.zeros(missing, dtype=scores.dtype), scores])
                start = 0
                for t in ts:
                    n = len(t["output_ids"])
                    events.append(Teacher(
                        run=t["run"], group_id=t["group_id"], rollout_id=t["rollout_id"], segment_id=t["segment_id"],
                        turn_index=t["turn_index"], policy_version=t["policy_version"], teacher=name,
                        teacher_logprobs=np.minimum(scores[start:start + n], 0.0).astype(np.float32),
                        event_id=_event_id(t["run"], t["rollout_id"], t["segment_id"], t["turn_index"], name)))
                    start += n
                tokens += start
            writer.append(events)
            appended += len(events)
    return AnnotateSummary(run, name, samples.num_rows, appended, tokens, skipped)
