"""The projections of the event log, as DuckDB SQL over the relation `_raw` (sealed + live rows).

Definitions an RL researcher can rely on:

- `events`: every event once per event_id (the first written wins).
- `turns`: model calls; `output_versions` holds the policy version that sampled each output
  token (from the run-length `output_version_starts`/`output_version_values`, all
  `policy_version` when they are null: one version, as every turn stored before them).
  `request` may be a delta of an earlier turn's (`request_base`, `request_shared`, `request_kept`): the full
  request of any turn comes from `trajstore.requests.resolve`.
- `samples`: one row per segment; `tokens` concatenates each turn's prompt delta and output
  in turn order; `loss_mask` is false on every prompt / tool-observation token and follows
  `output_mask` (all true when null) on sampled tokens; `logprobs` holds the behaviour
  logprob of each sampled token and 0 on prompt tokens. The three lists always have equal
  length. `min_version` is the oldest version that sampled a token of it (a turn's
  `policy_version`: versions only go up within a call), `max_version` the newest.
  `temperature`, `top_p`, `top_k`, `min_p`: what the sample's turns were sampled with (from each
  turn's `sampling`; `sampling_varies` when its turns differ). `support_sizes` (aligned with
  `tokens`: 0 on prompt tokens and wherever no kept set was recorded) and `support_ids` (the kept
  sets concatenated) carry each sampled token's truncated support, CSR-style.
- `samples.routed_experts` (mixture-of-experts policies): the turns' routes in turn order, aligned
  with `tokens` as `[num_tokens, layers, top_k]` flattened (`routed_experts_shape`): row i holds the
  experts of the position that predicted token i, -1 where none was recorded (`trajstore.routes`).
  Null unless every turn of the sample carries routes of one `[layers, top_k]`.
- `rollouts`: reward is the sum over reward components (reward_name) of each one's latest
  value, counting rollout-level rewards only (segment rewards are in `samples`); status is
  the latest status event; a rollout is *trainable* when its status is completed or
  truncated and it has a reward. `started`/`ended`/`duration_s` measure the episode: from
  its first turn or status to its first terminal status (to its latest turn or status
  while it runs); rewards appended later (`trajstore reward`) do not move them.
- `groups`: a group is (run, group_id): two runs that reuse a group id (say "g1") are two
  groups, never one. A group is *complete* when every rollout it knows has a terminal status and at
  least `group_size` of them (the planned size carried by status events; 1 without one) are
  trainable: every slot has a usable rollout, so a failed attempt awaiting its retry, or an
  aborted one awaiting a resumed run, keeps the group out of training.
  Reward statistics are over trainable rollouts.
- `teacher_logprobs`: per sample (rollout_id, segment_id) and teacher (the name a `teacher`
  event is filed under): `teacher_logprobs` aligned with the sample's `tokens`, the teacher's
  logprob on each output token and 0 on prompt tokens (as `logprobs` has), the latest event per
  turn counting; `complete` when every turn of the sample is annotated with one value per
  output token (only then does `teacher_logprobs` line up with `tokens` throughout).
- `advantages`: per trainable rollout, with the statistics of its (run, group_id) group over
  its trainable rollouts:
  `grpo` = (r - mean) / (std + 1e-6) with the sample std (GRPO), `dr_grpo` = r - mean
  (Dr. GRPO), `rloo` = r - mean of the other rollouts = n/(n-1) (r - mean) (RLOO),
  `batch` = r - mean over the run's trainable rollouts in view (a shard takes the mean
  over its own rollouts: the training batch). Groups of one get 0 for grpo and rloo.
- `token_ledger`: every generated (sampled) token, per run and the policy version that sampled
  it (per token: a turn whose weights changed mid-call counts each span under its version), in exactly one column, so `generated = trained + waiting + stale + discarded` holds as an
  equality. A rollout's trainable tokens are *trained* once a checkpoint consumed it; else
  *stale* when the run's newest checkpoint announces a `max_staleness` its oldest tokens are
  past; else *waiting* (trainable, not consumed yet). `discarded` = `masked` (sampled tokens
  the output mask keeps out of the loss, of trained, waiting and stale rollouts) + `incomplete`
  (every token of a rollout with no terminal status: still running, or cut off by a crash)
  + `failed` (every token of a rollout that ended failed or aborted, or without a reward)
  + `rejected` (the trainable tokens of a consumed sample the learner's `--reject` test left out
  of the loss: the `rejected` view, from the step's metric event).
- `rejected`: per learner step, the samples (rollout_id, segment_id) `learn --reject` left out of
  its loss, from the `rejected` list in the step's metric event `meta`.
"""

from __future__ import annotations

from typing import Literal, get_args

from trajstore.versions import NEWEST_VERSION_SQL, OUTPUT_VERSIONS_SQL

GRPO_EPS = 1e-6

# The advantage estimators: each is a column of the `advantages` view, named as the estimator,
# and a shard's `advantage`. Every other package names these columns through the names below.
Estimator = Literal["grpo", "dr_grpo", "rloo", "batch"]
ESTIMATORS: tuple[Estimator, ...] = get_args(Estimator)
# The estimators computed over the rollout's (run, group_id) group; `batch` is over the run (a shard's batch).
GROUP_ESTIMATORS: tuple[Estimator, ...] = ("grpo", "dr_grpo", "rloo")
ESTIMATOR_TITLES: dict[Estimator, str] = {"grpo": "GRPO", "dr_grpo": "Dr. GRPO", "rloo": "RLOO",
                                          "batch": "batch baseline"}
# Each column's SQL over `tr` (the trainable rollout), `g` (its group's statistics) and `b` (its run's mean).
_ESTIMATOR_SQL: dict[Estimator, str] = {
    "grpo": f"(tr.reward - g.mean) / (g.std + {GRPO_EPS})",
    "dr_grpo": "tr.reward - g.mean",
    "rloo": "CASE WHEN g.n > 1 THEN (tr.reward - g.mean) * g.n / (g.n - 1) ELSE 0 END",
    "batch": "tr.reward - b.run_mean",
}
_ESTIMATOR_COLUMNS = ",\n               ".join(f"{_ESTIMATOR_SQL[name]} AS {name}" for name in ESTIMATORS)


def _meta(key: str, json_type: str) -> str:
    """SQL: the checkpoint meta's `key` as text when its JSON type is `json_type`, else NULL (meta is free JSON)."""
    return f"CASE WHEN json_type(meta, '$.{key}') = '{json_type}' THEN json_extract_string(meta, '$.{key}') END"


def _learner_int(key: str, least: int) -> str:
    """SQL: the learner setting `key` (an integer >= `least`) of the newest announcement of the run up to this
    one that states it: an announcement written by an older learner may lack it, and each row reads whole."""
    return (f"last_value(CASE WHEN TRY_CAST({_meta(key, 'UBIGINT')} AS BIGINT) >= {least} "
            f"OR TRY_CAST({_meta(key, 'BIGINT')} AS BIGINT) >= {least} "
            f"THEN TRY_CAST(json_extract_string(meta, '$.{key}') AS BIGINT) END IGNORE NULLS) "
            "OVER (PARTITION BY run ORDER BY policy_version, time ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)")


# The typed columns of the `checkpoints` view, from each checkpoint event's meta (what
# `trajstore.announcement.Announcement` writes there; stores written before it read the same way).
# `uri` and `digest` go together: a version is published for other hosts with both or not at all.
_CHECKPOINT_COLUMNS = f"""
    {_meta('path', 'VARCHAR')} AS path,
    CASE WHEN json_type(meta, '$.digest') = 'VARCHAR' THEN {_meta('uri', 'VARCHAR')} END AS uri,
    CASE WHEN json_type(meta, '$.uri') = 'VARCHAR' THEN {_meta('digest', 'VARCHAR')} END AS digest,
    coalesce({_meta('adapter', 'BOOLEAN')}::BOOLEAN, false) AS adapter,
    {_meta('base_model', 'VARCHAR')} AS base_model,
    {_learner_int('groups_per_version', 1)} AS groups_per_version,
    {_learner_int('max_staleness', 0)} AS max_staleness,
    CASE WHEN json_type(meta, '$.settings') = 'OBJECT' THEN json_extract(meta, '$.settings')::VARCHAR END AS settings
"""

# Turns whose weights changed mid-call, one row per version span: its generated and trainable tokens.
_SPAN_TOKENS = """
    SELECT run, rollout_id, segment_id, output_version_values[k] AS version, hi - lo AS generated,
           CASE WHEN output_mask IS NULL THEN hi - lo
                ELSE len(list_filter(output_mask[lo + 1:hi], lambda m: m)) END AS trainable
    FROM (SELECT run, rollout_id, segment_id, output_mask, output_version_values, k, output_version_starts[k] AS lo,
                 coalesce(output_version_starts[k + 1], output_tokens) AS hi
          FROM (SELECT *, unnest(range(1, len(output_version_starts) + 1)) AS k
                FROM turns WHERE output_version_starts IS NOT NULL))
"""

VIEWS: dict[str, str] = {
    "events": """
        SELECT * FROM _raw
        QUALIFY row_number() OVER (PARTITION BY event_id ORDER BY time, writer, writer_seq) = 1
    """,
    "turns": f"""
        SELECT event_id, time, run, group_id, rollout_id, session_id, segment_id, turn_index,
               policy_version, prompt_ids, output_ids, output_logprobs, output_mask,
               prompt_tokens, output_tokens, trainable_tokens, finish_reason, sampling,
               request, response, meta, writer, writer_seq, routed_experts, routed_experts_shape,
               TRY_CAST(json_extract_string(sampling, '$.temperature') AS DOUBLE) AS temperature,
               TRY_CAST(json_extract_string(sampling, '$.top_p') AS DOUBLE) AS top_p,
               TRY_CAST(json_extract_string(sampling, '$.top_k') AS BIGINT) AS top_k,
               TRY_CAST(json_extract_string(sampling, '$.min_p') AS DOUBLE) AS min_p,
               support_sizes, support_ids, output_version_starts, output_version_values,
               {OUTPUT_VERSIONS_SQL} AS output_versions, request_base, request_shared, request_kept
        FROM events WHERE kind = 'turn'
    """,
    "samples": f"""
        WITH seg AS (
            SELECT rollout_id, segment_id,
                   any_value(run) AS run, any_value(group_id) AS group_id,
                   any_value(session_id) AS session_id,
                   flatten(list(list_concat(prompt_ids, output_ids) ORDER BY turn_index)) AS tokens,
                   flatten(list(list_concat(
                       list_transform(prompt_ids, lambda x: false),
                       coalesce(output_mask, list_transform(output_ids, lambda x: true)))
                       ORDER BY turn_index)) AS loss_mask,
                   flatten(list(list_concat(
                       list_transform(prompt_ids, lambda x: 0.0::FLOAT), output_logprobs)
                       ORDER BY turn_index)) AS logprobs,
                   arg_min(prompt_tokens, turn_index) AS prompt_tokens,
                   sum(prompt_tokens + output_tokens)::BIGINT AS num_tokens,
                   sum(trainable_tokens)::BIGINT AS trainable_tokens,
                   count(*) AS turns,
                   min(policy_version) AS min_version, max({NEWEST_VERSION_SQL}) AS max_version,
                   min(time) AS first_time, max(time) AS last_time,
                   -- routes only when every turn has them, all of one [layers, top_k] (trajstore.routes)
                   count(routed_experts) = count(*) AND count(DISTINCT routed_experts_shape[2:3]) = 1 AS routed,
                   flatten(list(routed_experts ORDER BY turn_index)) AS all_routes,
                   any_value(routed_experts_shape[2:3]) AS route_row,
                   min(temperature) AS temperature, min(top_p) AS top_p, min(top_k) AS top_k, min(min_p) AS min_p,
                   count(DISTINCT (temperature, top_p, top_k, min_p)) > 1 AS sampling_varies,
                   flatten(list(list_concat(
                       list_transform(prompt_ids, lambda x: 0),
                       coalesce(support_sizes, list_transform(output_ids, lambda x: 0)))
                       ORDER BY turn_index)) AS support_sizes,
                   flatten(list(coalesce(support_ids, []::INTEGER[]) ORDER BY turn_index)) AS support_ids
            FROM turns GROUP BY rollout_id, segment_id
        ),
        seg_reward AS (
            SELECT rollout_id, segment_id, sum(value) AS segment_reward FROM (
                SELECT rollout_id, segment_id, reward_name,
                       last(reward ORDER BY time, writer, writer_seq) AS value
                FROM events WHERE kind = 'reward' AND segment_id IS NOT NULL
                GROUP BY rollout_id, segment_id, reward_name)
            GROUP BY rollout_id, segment_id
        )
        SELECT seg.run, seg.group_id, seg.rollout_id, seg.session_id, seg.segment_id,
               seg.tokens, seg.loss_mask, seg.logprobs, seg.prompt_tokens, seg.num_tokens,
               seg.trainable_tokens, seg.turns, seg.min_version, seg.max_version,
               seg.first_time, seg.last_time, seg_reward.segment_reward,
               CASE WHEN seg.routed THEN seg.all_routes END AS routed_experts,
               CASE WHEN seg.routed THEN list_concat([seg.num_tokens::INTEGER], seg.route_row) END
                   AS routed_experts_shape,
               seg.temperature, seg.top_p, seg.top_k, seg.min_p, seg.sampling_varies,
               seg.support_sizes, seg.support_ids
        FROM seg LEFT JOIN seg_reward USING (rollout_id, segment_id)
    """,
    "rollouts": f"""
        WITH t AS (
            SELECT rollout_id, count(*) AS turns, count(DISTINCT segment_id) AS segments,
                   count(DISTINCT coalesce(session_id, '')) AS sessions,
                   sum(prompt_tokens + output_tokens)::BIGINT AS tokens,
                   sum(output_tokens)::BIGINT AS output_tokens,
                   sum(trainable_tokens)::BIGINT AS trainable_tokens,
                   min(policy_version) AS min_version, max({NEWEST_VERSION_SQL}) AS max_version
            FROM turns GROUP BY rollout_id
        ),
        r AS (
            SELECT rollout_id, sum(value) AS reward, count(*) AS reward_components FROM (
                SELECT rollout_id, reward_name,
                       last(reward ORDER BY time, writer, writer_seq) AS value
                FROM events WHERE kind = 'reward' AND segment_id IS NULL
                GROUP BY rollout_id, reward_name)
            GROUP BY rollout_id
        ),
        s AS (
            SELECT rollout_id, last(status ORDER BY time, writer, writer_seq) AS status,
                   last(error ORDER BY time, writer, writer_seq) AS error,
                   max(group_size) AS group_size
            FROM events WHERE kind = 'status' GROUP BY rollout_id
        ),
        e AS (
            SELECT rollout_id, any_value(run) AS run, any_value(group_id) AS group_id,
                   min(time) FILTER (WHERE kind <> 'reward') AS started,
                   coalesce(min(time) FILTER (WHERE kind = 'status'
                                                AND status IN ('completed', 'truncated', 'aborted', 'failed')),
                            max(time) FILTER (WHERE kind <> 'reward')) AS ended
            FROM events WHERE kind IN ('turn', 'reward', 'status') GROUP BY rollout_id
        )
        SELECT e.run, e.group_id, e.rollout_id, r.reward, s.status, s.error,
               coalesce(s.status IN ('completed', 'truncated') AND r.reward IS NOT NULL, false) AS trainable,
               coalesce(t.segments, 0) AS segments, coalesce(t.sessions, 0) AS sessions,
               coalesce(t.turns, 0) AS turns, coalesce(t.tokens, 0) AS tokens,
               coalesce(t.output_tokens, 0) AS output_tokens,
               coalesce(t.trainable_tokens, 0) AS trainable_tokens,
               t.min_version, t.max_version, coalesce(r.reward_components, 0) AS reward_components,
               s.group_size, e.started, e.ended,
               (epoch_us(e.ended) - epoch_us(e.started)) / 1e6 AS duration_s
        FROM e LEFT JOIN t USING (rollout_id) LEFT JOIN r USING (rollout_id) LEFT JOIN s USING (rollout_id)
    """,
    "groups": """
        SELECT run, group_id, count(*) AS size, max(group_size) AS planned_size,
               count(*) FILTER (WHERE status IN ('completed', 'truncated', 'aborted', 'failed')) AS finished,
               count(*) FILTER (WHERE trainable) AS trainable,
               (count(*) FILTER (WHERE status IN ('completed', 'truncated', 'aborted', 'failed')) = count(*)
                AND count(*) FILTER (WHERE trainable) >= coalesce(max(group_size), 1)) AS complete,
               avg(reward) FILTER (WHERE trainable) AS reward_mean,
               coalesce(stddev_samp(reward) FILTER (WHERE trainable), 0) AS reward_std,
               min(min_version) AS min_version, max(max_version) AS max_version,
               min(started) AS started, max(ended) AS ended
        FROM rollouts GROUP BY run, group_id
    """,
    "advantages": f"""
        WITH tr AS (SELECT run, group_id, rollout_id, reward FROM rollouts WHERE trainable),
        g AS (SELECT run, group_id, count(*) AS n, avg(reward) AS mean,
                     coalesce(stddev_samp(reward), 0) AS std
              FROM tr GROUP BY run, group_id),
        b AS (SELECT run, avg(reward) AS run_mean FROM tr GROUP BY run)
        SELECT tr.run, tr.group_id, tr.rollout_id, tr.reward, g.n AS group_trainable,
               g.mean AS group_mean, g.std AS group_std,
               {_ESTIMATOR_COLUMNS}
        FROM tr JOIN g USING (run, group_id) JOIN b USING (run)
    """,
    "teacher_logprobs": """
        WITH a AS (
            SELECT rollout_id, segment_id, turn_index, teacher,
                   last(teacher_logprobs ORDER BY time, writer, writer_seq) AS lp
            FROM events WHERE kind = 'teacher' GROUP BY rollout_id, segment_id, turn_index, teacher),
        n AS (SELECT rollout_id, segment_id, count(*) AS turns FROM turns GROUP BY rollout_id, segment_id),
        t AS (
            SELECT turns.run, turns.group_id, turns.rollout_id, turns.segment_id, turns.turn_index, a.teacher,
                   list_concat(list_transform(turns.prompt_ids, lambda x: 0.0::FLOAT), a.lp) AS lp,
                   len(a.lp) = len(turns.output_ids) AS aligned
            FROM turns JOIN a USING (rollout_id, segment_id, turn_index))
        SELECT t.run, any_value(t.group_id) AS group_id, t.rollout_id, t.segment_id, t.teacher,
               flatten(list(t.lp ORDER BY t.turn_index)) AS teacher_logprobs,
               count(*) AS annotated_turns, any_value(n.turns) AS turns,
               count(*) = any_value(n.turns) AND bool_and(t.aligned) AS complete
        FROM t JOIN n USING (rollout_id, segment_id)
        GROUP BY t.run, t.rollout_id, t.segment_id, t.teacher
    """,
    "checkpoints": f"""
        SELECT run, policy_version AS version, step, time, table_version,
               coalesce(len(consumed), 0) AS consumed_rollouts, consumed, metrics, {_CHECKPOINT_COLUMNS},
               meta, event_id
        FROM events WHERE kind = 'checkpoint'
    """,
    "consumed": """
        SELECT run, policy_version AS version, step, unnest(consumed) AS rollout_id
        FROM events WHERE kind = 'checkpoint' AND consumed IS NOT NULL
    """,
    "rejected": """
        SELECT run, step, policy_version, p[1] AS rollout_id, p[2] AS segment_id
        FROM (SELECT run, step, policy_version,
                     unnest(from_json(json_extract(meta, '$.rejected'), '[["VARCHAR"]]')) AS p
              FROM events WHERE kind = 'metric' AND meta IS NOT NULL)
    """,
    "token_ledger": f"""
        WITH head AS (
            SELECT run, max(version) AS head,
                   arg_max(TRY_CAST(json_extract_string(meta, '$.max_staleness') AS BIGINT), version)
                       AS max_staleness
            FROM checkpoints GROUP BY run),
        fate AS (
            SELECT r.run, r.rollout_id,
                   CASE WHEN c.rollout_id IS NOT NULL THEN 'trained'
                        WHEN r.status IS NULL OR r.status NOT IN ('completed', 'truncated', 'aborted', 'failed')
                            THEN 'incomplete'
                        WHEN NOT r.trainable THEN 'failed'
                        WHEN r.min_version < h.head - h.max_staleness THEN 'stale'
                        ELSE 'waiting' END AS fate
            FROM rollouts r
            LEFT JOIN (SELECT DISTINCT run, rollout_id FROM consumed) c USING (run, rollout_id)
            LEFT JOIN head h USING (run)),
        t AS (
            SELECT run, rollout_id, segment_id, version, sum(generated)::BIGINT AS generated,
                   sum(trainable)::BIGINT AS trainable
            FROM (SELECT run, rollout_id, segment_id, policy_version AS version, output_tokens AS generated,
                         trainable_tokens AS trainable
                  FROM turns WHERE output_version_starts IS NULL
                  UNION ALL {_SPAN_TOKENS})
            GROUP BY run, rollout_id, segment_id, version),
        by_fate AS (
            SELECT f.run, t.version,
                   CASE WHEN f.fate = 'trained' AND x.segment_id IS NOT NULL THEN 'rejected' ELSE f.fate END AS fate,
                   sum(t.generated) AS generated, sum(t.trainable) AS trainable
            FROM t JOIN fate f USING (run, rollout_id)
            LEFT JOIN (SELECT DISTINCT run, rollout_id, segment_id FROM rejected) x
                USING (run, rollout_id, segment_id)
            GROUP BY ALL)
        SELECT run, version, sum(generated)::BIGINT AS generated,
               coalesce(sum(trainable) FILTER (WHERE fate = 'trained'), 0)::BIGINT AS trained,
               coalesce(sum(trainable) FILTER (WHERE fate = 'waiting'), 0)::BIGINT AS waiting,
               coalesce(sum(trainable) FILTER (WHERE fate = 'stale'), 0)::BIGINT AS stale,
               coalesce(sum(generated - trainable)
                        FILTER (WHERE fate IN ('trained', 'rejected', 'waiting', 'stale')), 0)::BIGINT AS masked,
               coalesce(sum(generated) FILTER (WHERE fate = 'incomplete'), 0)::BIGINT AS incomplete,
               coalesce(sum(generated) FILTER (WHERE fate = 'failed'), 0)::BIGINT AS failed,
               coalesce(sum(trainable) FILTER (WHERE fate = 'rejected'), 0)::BIGINT AS rejected,
               (masked + incomplete + failed + rejected)::BIGINT AS discarded
        FROM by_fate GROUP BY run, version
    """,
    "metrics": """
        SELECT run, step, time, policy_version, unnest(map_keys(metrics)) AS name,
               unnest(map_values(metrics)) AS value
        FROM events WHERE kind = 'metric' AND metrics IS NOT NULL
    """,
    "step_rollouts": """
        SELECT run, step, policy_version, table_version, unnest(consumed) AS rollout_id
        FROM events WHERE kind = 'metric' AND consumed IS NOT NULL
    """,
}


VIEW_NAMES = tuple(VIEWS)


def create_views(con: object) -> None:
    """Define every view on a DuckDB connection that has `_raw` registered."""
    for name, sql in VIEWS.items():
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")  # type: ignore[attr-defined]
