"""Training shards: the next complete, fresh, unconsumed groups with per-sample advantages.

The planner keeps the cost of a shard tied to the *unconsumed, fresh* part of the log, not
to the store's size, by choosing which sealed files to open from their min/max statistics
(one pinned table version throughout):

1. Fresh candidates. A group qualifies only if its oldest tokens have
   policy_version >= lo = policy_version - max_staleness, so only files whose max
   policy_version reaches lo can hold its turns. A rollout sampled at version v can only be
   consumed by a checkpoint published after it, so consumption is read from checkpoint
   events with version >= lo, which live in the same files.
2. Whole groups. A group is (run, group_id). All events of the candidate groups (older turns that disqualify a group,
   rewards, statuses) are read from the files whose group_id range covers a candidate.
   Ids minted by `trajstore.ids.new_id` are time-ordered, so those are the recent files; any
   other ids stay correct and only prune less.
3. The chosen groups' turns are assembled into samples and joined with advantages. With
   estimator "batch" the baseline is the mean reward of the shard's trainable rollouts (per
   run): the training batch, as REINFORCE-style batch baselines use it.

Each step reads only the rows of the groups it needs, through the same SQL views as
`store.query`, so a shard agrees exactly with what the views say about those groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from trajstore.read import Reader, Snapshot, rows_where
from trajstore.schema import EVENT_SCHEMA
from trajstore.table import files_covering
from trajstore.views import ESTIMATORS, Estimator

# Step 2 needs scalars only; step 3 the token lists too, never the request/response JSON (training needs none of it).
_SCALARS = [f.name for f in EVENT_SCHEMA if not isinstance(f.type, (pa.ListType, pa.MapType))
            and f.name not in ("request", "response", "sampling", "meta", "error", "request_base", "request_shared")]
_SAMPLE_COLUMNS = [*_SCALARS, "prompt_ids", "output_ids", "output_logprobs", "output_mask", "consumed",
                   "routed_experts", "routed_experts_shape",
                   "sampling", "support_sizes", "support_ids",  # how each token was sampled, and from which support
                   "output_version_values"]  # a sample's newest version (`max_version`)
_TEACHER_COLUMNS = [*_SAMPLE_COLUMNS, "teacher_logprobs"]


@dataclass(frozen=True)
class Shard:
    """One training shard. `samples` has one row per sample (segment):

    run, group_id, rollout_id, segment_id, tokens, loss_mask, logprobs (equal lengths),
    advantage (the rollout's, on every segment of it), reward, prompt_tokens, num_tokens,
    trainable_tokens, min_version, max_version, rollout_segments (segments of its rollout,
    so a loss can count the rollout once), routed_experts and routed_experts_shape (a mixture-of-experts
    policy's routes aligned with tokens, null for dense models; see `trajstore.routes`), temperature,
    top_p, top_k, min_p, sampling_varies (how its tokens were sampled), support_sizes (aligned with
    tokens) and support_ids (each sampled token's kept set, CSR-style; see the `samples` view); with a
    `teacher`, teacher_logprobs (aligned with
    tokens, as the `teacher_logprobs` view has them; null where the sample is not completely
    annotated by that teacher).
    """

    samples: pa.Table
    rollout_ids: tuple[str, ...]  # the shard's trainable rollouts, oldest first
    group_ids: tuple[str, ...]  # one per chosen group, in order (a group is (run, group_id))
    table_version: int
    policy_version: int
    max_staleness: int
    estimator: str

    @property
    def num_rollouts(self) -> int:
        return len(self.rollout_ids)

    @property
    def num_tokens(self) -> int:
        return int(pc.sum(self.samples.column("num_tokens")).as_py() or 0) if self.samples.num_rows else 0

    def __len__(self) -> int:
        return self.samples.num_rows


def make_shard(reader: Reader, *, policy_version: int, max_staleness: int, max_rollouts: int = 512,
               estimator: Estimator = "grpo", run: str | None = None,
               exclude: Iterable[str] = (), max_groups: int | None = None, teacher: str | None = None) -> Shard:
    problems = []
    if policy_version < 0 or max_staleness < 0:
        problems.append("policy_version and max_staleness must be >= 0")
    if max_rollouts < 1:
        problems.append("max_rollouts must be >= 1")
    if max_groups is not None and max_groups < 1:
        problems.append("max_groups must be >= 1 (or None for no limit)")
    if estimator not in ESTIMATORS:
        problems.append(f"estimator {estimator!r} is not one of {list(ESTIMATORS)}")
    if problems:
        raise ValueError("; ".join(problems))
    lo = policy_version - max_staleness
    pinned = reader.pin()
    table, live = pinned.table, pinned.live

    # 1. fresh candidate groups, minus those with a consumed or excluded rollout
    recent = [f for f in table.files if not f.min or (f.max.get("policy_version") is not None
                                                    and f.max["policy_version"] >= lo)]
    empty = Shard(pa.table({}), (), (), table.version, policy_version, max_staleness, estimator)
    with Snapshot(reader.table, pinned, files=recent) as snap:  # one connection for the three steps
        snap.register("_exclude", pa.table({"rollout_id": pa.array(list(exclude), pa.string())}))
        cand = snap.query(
            """
            WITH fresh AS (
                SELECT DISTINCT run, group_id, rollout_id FROM _raw
                WHERE kind = 'turn' AND policy_version >= $lo AND ($run IS NULL OR run = $run)),
            gone AS (
                SELECT unnest(consumed) AS rollout_id FROM _raw
                WHERE kind = 'checkpoint' AND policy_version >= $lo
                UNION ALL SELECT rollout_id FROM _exclude)
            SELECT DISTINCT run, group_id FROM fresh
            EXCEPT SELECT DISTINCT run, group_id FROM fresh JOIN gone USING (rollout_id)
            ORDER BY group_id, run
            """,
            {"lo": lo, "run": run},
        )
        if not cand.num_rows:
            return empty
        candidates = sorted(set(cand.column("group_id").to_pylist()))

        # 2. whole candidate groups (scalar columns only): completeness, staleness, order, budget.
        # Rows are read by group id, so another run's group of the same id comes along: the views
        # keep them apart, and `_candidates` keeps only the (run, group_id) pairs found above.
        files = files_covering(table.files, "group_id", candidates)
        snap.use_rows(rows_where(reader.table, files, live, "group_id", candidates, columns=_SCALARS))
        snap.register("_candidates", cand)
        chosen = snap.query(
            """
            WITH ok AS (
                SELECT run, group_id, trainable, started FROM groups SEMI JOIN _candidates USING (run, group_id)
                WHERE complete AND trainable > 0 AND min_version >= $lo),
            acc AS (
                SELECT run, group_id, row_number() OVER w AS k,
                       sum(trainable) OVER w AS total
                FROM ok WINDOW w AS (ORDER BY started, group_id, run ROWS UNBOUNDED PRECEDING))
            SELECT run, group_id FROM acc WHERE (total <= $budget OR k = 1) AND k <= $max_groups ORDER BY k
            """,
            {"lo": lo, "budget": max_rollouts, "max_groups": max_groups if max_groups is not None else 2**62},
        )
        if not chosen.num_rows:
            return empty

        # 3. samples of the chosen groups' trainable rollouts, with the rollout's advantage
        chosen_sorted = sorted(set(chosen.column("group_id").to_pylist()))
        chosen_files = files_covering(files, "group_id", chosen_sorted)
        # (a teacher's events carry their turn's group and version, so they are in the same files)
        snap.use_rows(rows_where(reader.table, chosen_files, live, "group_id", chosen_sorted,
                                 columns=_SAMPLE_COLUMNS if teacher is None else _TEACHER_COLUMNS))
        snap.register("_chosen", chosen)
        teacher_column, teacher_join = "", ""
        if teacher is not None:
            teacher_column = ", CASE WHEN t.complete THEN t.teacher_logprobs END AS teacher_logprobs"
            teacher_join = ("LEFT JOIN (SELECT * FROM teacher_logprobs WHERE teacher = $teacher) t "
                            "USING (rollout_id, segment_id)")
        samples = snap.query(
            f"""
            SELECT s.run, s.group_id, s.rollout_id, s.segment_id, s.tokens, s.loss_mask, s.logprobs,
                   a.{estimator} AS advantage, a.reward, s.prompt_tokens, s.num_tokens,
                   s.trainable_tokens, s.min_version, s.max_version,
                   count(*) OVER (PARTITION BY s.rollout_id) AS rollout_segments,
                   s.routed_experts, s.routed_experts_shape, s.temperature, s.top_p, s.top_k, s.min_p,
                   s.sampling_varies, s.support_sizes, s.support_ids {teacher_column}
            FROM samples s JOIN advantages a USING (rollout_id) {teacher_join}
            WHERE (s.run, s.group_id) IN (SELECT (run, group_id) FROM _chosen)
            ORDER BY s.first_time, s.rollout_id, s.segment_id
            """, {"teacher": teacher} if teacher is not None else None
        )
    rollout_ids = tuple(dict.fromkeys(samples.column("rollout_id").to_pylist()))
    return Shard(samples, rollout_ids, tuple(chosen.column("group_id").to_pylist()), table.version, policy_version,
                 max_staleness, estimator)
