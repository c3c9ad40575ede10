"""ClickHouse views over the archive that answer the loop's standard questions in plain SQL.

Every view lives in database ``rlstream``, spans every run (filter on ``run``), and reads
the archive tables without FINAL: the archive sink never inserts a row twice.
"""
from __future__ import annotations

from typing import Any, Callable

from rlstream.archive.query import DATABASE

D = DATABASE


def _ms(x: str) -> str:
    return f"toUnixTimestamp64Milli({x})"


#: View name -> its SELECT. Order matters: later views read earlier ones.
VIEWS: dict[str, str] = {
    # Mean reward per (policy version, reward version): the learning curve, side by side across reward versions.
    # policy_version is the header: the oldest policy version that produced any token of the sample.
    "reward_by_version": f"""
SELECT run, header_policy_version AS policy_version, reward_version, split,
       count() AS samples, avg(reward_total) AS reward_mean, stddevPop(reward_total) AS reward_std,
       min(reward_total) AS reward_min, max(reward_total) AS reward_max, avg(n_tokens) AS tokens_mean
FROM {D}.rewards
GROUP BY run, policy_version, reward_version, split""",

    # The eval lane (records.is_eval): held-out and evaluation results, which only the eval-rewards topic carries,
    # per policy version (the oldest that produced any of the sample's tokens) and task.
    "eval_reward_by_version": f"""
SELECT run, header_policy_version AS policy_version, reward_version, task_name,
       count() AS samples, avg(reward_total) AS reward_mean, stddevPop(reward_total) AS reward_std,
       countIf(status != 'ok') AS not_ok
FROM {D}.rewards WHERE topic = 'eval-rewards'
GROUP BY run, policy_version, reward_version, task_name""",

    # One row per trajectory: every reward version's total, so any two compare as rewards['v1'] - rewards['v2'].
    "trajectory_rewards": f"""
SELECT run, trajectory_id, any(group_id) AS group_id, any(header_policy_version) AS policy_version,
       CAST((groupArray(reward_version), groupArray(reward_total)), 'Map(String, Float64)') AS rewards
FROM {D}.rewards
GROUP BY run, trajectory_id""",

    # Parameterized: SELECT * FROM rlstream.reward_disagreement(run='R', a='v1', b='v2'), one row per trajectory
    # scored under both. The run is a parameter so it prunes the table before grouping, and the grouping key is one
    # 64-bit hash of the id: (run, string id) keys made it 3-4x slower at 1M trajectories (collisions ~1e-8).
    "reward_disagreement": f"""
SELECT {{run:String}} AS run, any(id) AS trajectory_id, any(header_policy_version) AS policy_version,
       anyIf(reward_total, reward_version = {{a:String}}) AS reward_a,
       anyIf(reward_total, reward_version = {{b:String}}) AS reward_b,
       reward_b - reward_a AS delta, abs(delta) > 1e-9 AS disagree
FROM (SELECT trajectory_id AS id, header_policy_version, reward_total, reward_version FROM {D}.rewards
      WHERE run = {{run:String}} AND reward_version IN ({{a:String}}, {{b:String}}))
GROUP BY cityHash64(id)
HAVING countIf(reward_version = {{a:String}}) > 0 AND countIf(reward_version = {{b:String}}) > 0""",

    # Per published version: accepted / stale / evicted samples of that step, from the trainer's PolicyVersion
    # metrics. Staleness is decided by the trainer (its version when it read the sample), so headers alone cannot
    # give it. *_step counts are exact; older records carry only process-cumulative counts, differenced here
    # (a drop means the trainer restarted and its counter began again).
    "staleness_by_version": f"""
SELECT run, policy, version, published_at, samples_trained,
       if(mapContains(metrics, 'accepted_step'), metrics['accepted_step'],
          if(acc_total >= acc_prev, acc_total - acc_prev, acc_total)) AS accepted,
       if(mapContains(metrics, 'stale_step'), metrics['stale_step'],
          if(stale_total >= stale_prev, stale_total - stale_prev, stale_total)) AS stale,
       if(ev_total >= ev_prev, ev_total - ev_prev, ev_total) AS evicted,
       stale / nullIf(accepted + stale, 0) AS stale_ratio,
       -- tokens masked out as older than η in samples kept (--stale-rule token)
       if(mapContains(metrics, 'stale_tokens_step'), metrics['stale_tokens_step'], 0.) AS stale_tokens,
       metrics['step_seconds'] AS step_seconds, metrics['reward_mean'] AS reward_mean, metrics['loss'] AS loss
FROM (
    SELECT *, metrics['accepted'] AS acc_total, metrics['stale'] AS stale_total, metrics['evicted'] AS ev_total,
           lagInFrame(acc_total, 1, 0.) OVER w AS acc_prev, lagInFrame(stale_total, 1, 0.) OVER w AS stale_prev,
           lagInFrame(ev_total, 1, 0.) OVER w AS ev_prev
    FROM {D}.policy_versions
    WINDOW w AS (PARTITION BY run, policy ORDER BY version ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
)""",

    "stale_ratio": f"""
SELECT run, policy, count() AS versions, sum(accepted) AS accepted_samples, sum(stale) AS stale_samples,
       sum(evicted) AS evicted_samples, stale_samples / nullIf(accepted_samples + stale_samples, 0) AS stale_ratio,
       sum(stale_tokens) AS stale_tokens
FROM {D}.staleness_by_version
GROUP BY run, policy""",

    # Long format, one row per (trajectory, stage), from the derived columns below (DERIVED).
    "stage_latency": f"""
SELECT run, trajectory_id, 'rollout' AS stage, lat_rollout_ms AS latency_ms, queue_rollout_ms AS queue_ms
FROM {D}.trajectories WHERE isNotNull(lat_rollout_ms)
UNION ALL
SELECT run, trajectory_id, 'env', lat_env_ms, CAST(NULL, 'Nullable(Float64)') FROM {D}.trajectories WHERE isNotNull(lat_env_ms)
UNION ALL
SELECT run, trajectory_id, 'archive', CAST(NULL, 'Nullable(Float64)'), queue_archive_ms
FROM {D}.trajectories WHERE isNotNull(queue_archive_ms)
UNION ALL
SELECT run, trajectory_id, if(replayed, 'replay', 'reward'), reward_latency_ms, queue_reward_ms
FROM {D}.rewards WHERE isNotNull(queue_reward_ms)
UNION ALL
SELECT run, trajectory_id, 'end_to_end', lat_end_to_end_ms, CAST(NULL, 'Nullable(Float64)')
FROM {D}.rewards WHERE isNotNull(lat_end_to_end_ms)""",

    # The same figures aggregated per stage straight from the tables (not through the long view: 3x faster).
    "stage_latency_quantiles": " UNION ALL ".join(f"""
SELECT run, {stage} AS stage, count() AS samples,
       quantilesExact(0.5, 0.95, 0.99)({lat}) AS lq, quantilesExact(0.5, 0.95, 0.99)({queue}) AS qq,
       -- NULL, not 0, where a stage has no such figure
       if({has_lat}, lq[1], NULL) AS latency_p50_ms, if({has_lat}, lq[2], NULL) AS latency_p95_ms,
       if({has_lat}, lq[3], NULL) AS latency_p99_ms, if({has_queue}, qq[1], NULL) AS queue_p50_ms,
       if({has_queue}, qq[2], NULL) AS queue_p95_ms, if({has_queue}, qq[3], NULL) AS queue_p99_ms
FROM {D}.{table} WHERE isNotNull({where}) GROUP BY {group}""" for stage, lat, queue, has_lat, has_queue, table, where, group in (
        ("'rollout'", "lat_rollout_ms", "queue_rollout_ms", "1", "count(queue_rollout_ms) > 0", "trajectories",
         "lat_rollout_ms", "run"),
        ("'env'", "lat_env_ms", "lat_env_ms", "1", "0", "trajectories", "lat_env_ms", "run"),
        ("'archive'", "queue_archive_ms", "queue_archive_ms", "0", "1", "trajectories", "queue_archive_ms", "run"),
        ("if(replayed, 'replay', 'reward')", "reward_latency_ms", "queue_reward_ms", "1", "1", "rewards",
         "queue_reward_ms", "run, replayed"),
        ("'end_to_end'", "lat_end_to_end_ms", "lat_end_to_end_ms", "1", "0", "rewards", "lat_end_to_end_ms", "run"))),

    # Failures by class, as a share of the run's trajectories: the env's (status failed), tool calls', and
    # records dead-lettered by any stage (handler_timeout, handler_error, invalid, ...). is_timeout flags timeouts.
    "failure_rates": f"""
SELECT f.run AS run, f.source AS source, f.stage AS stage, f.failure_class AS failure_class, f.failures AS failures,
       t.n AS trajectories, f.failures / nullIf(t.n, 0) AS rate,
       positionCaseInsensitive(f.failure_class, 'timeout') > 0 AS is_timeout
FROM (
    SELECT run, 'trajectory' AS source, toString(failure_stage) AS stage, toString(failure_class) AS failure_class,
           count() AS failures
    FROM {D}.trajectories WHERE status = 'failed' GROUP BY run, stage, failure_class
    UNION ALL
    SELECT run, 'tool', 'env', toString(cls), count()
    FROM {D}.trajectories ARRAY JOIN `turns.tool_failure_class` AS cls WHERE cls != '' GROUP BY run, cls
    UNION ALL
    SELECT run, 'dead_letter', toString(stage), toString(reason), count() FROM {D}.dead_letters GROUP BY run, stage, reason
) AS f
LEFT JOIN (SELECT run, count() AS n FROM {D}.trajectories GROUP BY run) AS t ON f.run = t.run""",

    # Goodput per clock hour: valid (status ok) trajectories by Kafka timestamp, accepted samples by publish time.
    "goodput_hourly": f"""
SELECT run, hour, sum(n) AS trajectories, sum(valid) AS valid_trajectories,
       sum(accepted) AS accepted_samples, sum(stale) AS stale_samples
FROM (
    SELECT run, toStartOfHour(kafka_timestamp) AS hour, count() AS n, countIf(status = 'ok') AS valid,
           toUInt64(0) AS accepted, toUInt64(0) AS stale
    FROM {D}.trajectories GROUP BY run, hour
    UNION ALL
    SELECT run, toStartOfHour(published_at), toUInt64(0), toUInt64(0), toUInt64(round(sum(accepted))),
           toUInt64(round(sum(stale)))
    FROM {D}.staleness_by_version GROUP BY run, toStartOfHour(published_at)
)
GROUP BY run, hour""",

    # The whole run's goodput as rates over its span (first to last trajectory).
    "goodput": f"""
SELECT t.run AS run, t.trajectories AS trajectories, t.valid AS valid_trajectories,
       ifNull(a.accepted, 0) AS accepted_samples, t.span_s AS span_s,
       t.valid * 3600 / nullIf(t.span_s, 0) AS valid_per_hour,
       ifNull(a.accepted, 0) * 3600 / nullIf(t.span_s, 0) AS accepted_per_hour
FROM (
    SELECT run, count() AS trajectories, countIf(status = 'ok') AS valid,
           ({_ms('max(kafka_timestamp)')} - {_ms('min(kafka_timestamp)')}) / 1000 AS span_s
    FROM {D}.trajectories GROUP BY run
) AS t
LEFT JOIN (SELECT run, sum(accepted) AS accepted FROM {D}.staleness_by_version GROUP BY run) AS a ON t.run = a.run""",

    # From a version's announcement to the first token generated with it (rollout's hot swap), plus the step time.
    "publish_latency": f"""
SELECT p.run AS run, p.policy AS policy, p.version AS version, p.published_at AS published_at,
       p.metrics['step_seconds'] AS step_seconds, u.first_used_at AS first_used_at,
       if(u.n > 0, toFloat64({_ms('u.first_used_at')} - {_ms('p.published_at')}), NULL) AS publish_latency_ms
FROM {D}.policy_versions AS p
LEFT JOIN (
    SELECT run, v AS version, min(t) AS first_used_at, count() AS n
    FROM {D}.trajectories ARRAY JOIN `turns.policy_version` AS v, `turns.started_at` AS t
    WHERE v >= 0 AND t > toDateTime64(0, 3, 'UTC') GROUP BY run, version
) AS u ON p.run = u.run AND p.version = u.version""",

    # The teacher, one row per feedback record: its mean log-prob on the student's tokens, the k1 estimate of
    # reverse KL(student at sampling || teacher), and how often the sampled token is the teacher's top-1 (top-k
    # form only). NULL where the sample went on without feedback (status not ok).
    "teacher_samples": f"""
SELECT run, teacher_version, header_policy_version AS policy_version, trajectory_id, status, teacher_top_k,
       teacher_latency_ms, reward_total, arraySum(loss_mask) AS acted,
       if(status = 'ok', arraySum(arrayMap(i -> if(loss_mask[i] = 1, teacher_logprobs[i], 0),
                                           arrayEnumerate(teacher_logprobs))) / nullIf(acted, 0), NULL)
           AS teacher_logprob,
       if(status = 'ok', arraySum(arrayMap(i -> if(loss_mask[i] = 1, behaviour_logprobs[i] - teacher_logprobs[i], 0),
                                           arrayEnumerate(teacher_logprobs))) / nullIf(acted, 0), NULL)
           AS reverse_kl,
       if(status = 'ok' AND teacher_top_k > 0,
          arraySum(arrayMap(i -> loss_mask[i] = 1 AND teacher_topk_ids[(i - 1) * teacher_top_k + 1] = token_ids[i],
                            arrayEnumerate(token_ids))) / nullIf(acted, 0), NULL) AS top1_agreement
FROM {D}.feedback""",

    # Per (teacher version, policy version): teacher latency, samples without feedback (timed out, or not aligned
    # with a teacher of another tokenizer: the alignment-error rate), KL, top-1 agreement, and
    # how often teacher and verifier disagree: the teacher finds the sample likely (geometric-mean token
    # probability >= 0.5) and the verifier gave it no reward.
    "teacher_by_version": f"""
SELECT run, teacher_version, policy_version, count() AS samples, countIf(status != 'ok') AS without_feedback,
       without_feedback / samples AS without_feedback_rate,
       countIf(status = 'alignment_failed') / samples AS alignment_error_rate,
       quantilesExact(0.5, 0.95, 0.99)(teacher_latency_ms) AS lq, lq[1] AS latency_p50_ms,
       lq[2] AS latency_p95_ms, lq[3] AS latency_p99_ms, avg(reverse_kl) AS reverse_kl_mean,
       avg(teacher_logprob) AS teacher_logprob_mean, avg(top1_agreement) AS top1_agreement_mean,
       countIf(teacher_logprob >= log(0.5) AND reward_total <= 0) AS confident_but_failed,
       confident_but_failed / nullIf(samples - without_feedback, 0) AS teacher_verifier_disagreement
FROM {D}.teacher_samples
GROUP BY run, teacher_version, policy_version""",

    # The trainer's side, per published version: the distillation terms of the step (trainer/distill.py).
    "distillation_by_version": f"""
SELECT run, policy, version, published_at, metrics['opd_kl'] AS opd_kl, metrics['kl_forward'] AS kl_forward,
       metrics['kl_reverse'] AS kl_reverse, metrics['teacher_top1_agreement'] AS teacher_top1_agreement,
       metrics['opd_coef'] AS opd_coef, metrics['loss_rl'] AS loss_rl, metrics['loss_opd'] AS loss_opd,
       metrics['opd_shaping'] AS opd_shaping, metrics['reward_mean'] AS reward_mean
FROM {D}.policy_versions WHERE mapContains(metrics, 'opd_kl')""",
}


def _stamp(key: str) -> str:
    return f"stage_times['{key}']"


def _span(end: str, start: str) -> str:
    return (f"if(mapContains(stage_times, '{end}') AND mapContains(stage_times, '{start}'), "
            f"toFloat64({_stamp(end)} - {_stamp(start)}), NULL)")


#: Per-stage times, stored at insert (MATERIALIZED) so that latency questions over millions of rows read
#: plain columns instead of looking keys up in the stage_times map row by row (5x faster at 1M trajectories).
#: Rows archived before the columns existed compute them on read; new rows store them.
#:   rollout: latency = generation (rollout.end - rollout.start); queue = rollout.start - prompt.created
#:   env:     latency = env.end - rollout.end (the actions-topic wait and the env step: env stamps no start)
#:   archive: queue = archived_at - produced_at
#:   reward / replay: latency = the reward function's own time (reward_latency_ms);
#:            queue = reward.end - latency - env.end (or replay.start for a replay)
#:   end_to_end: latency = reward.end - prompt.created (first scoring, not replays)
DERIVED: dict[str, list[tuple[str, str, str]]] = {
    "trajectories": [
        ("lat_rollout_ms", "Nullable(Float64)", _span("rollout.end", "rollout.start")),
        ("queue_rollout_ms", "Nullable(Float64)", _span("rollout.start", "prompt.created")),
        ("lat_env_ms", "Nullable(Float64)", _span("env.end", "rollout.end")),
        ("queue_archive_ms", "Nullable(Float64)",
         f"if(produced_at > toDateTime64(0, 3, 'UTC'), "
         f"toFloat64({_ms('archived_at')} - {_ms('produced_at')}), NULL)"),
    ],
    "rewards": [
        ("replayed", "Bool", "mapContains(stage_times, 'replay.start')"),
        ("queue_reward_ms", "Nullable(Float64)",
         f"multiIf(NOT mapContains(stage_times, 'reward.end'), NULL, mapContains(stage_times, 'replay.start'), "
         f"toFloat64({_stamp('reward.end')} - {_stamp('replay.start')}) - reward_latency_ms, "
         f"mapContains(stage_times, 'env.end'), toFloat64({_stamp('reward.end')} - {_stamp('env.end')}) - "
         f"reward_latency_ms, NULL)"),
        ("lat_end_to_end_ms", "Nullable(Float64)",
         f"if(mapContains(stage_times, 'replay.start'), NULL, {_span('reward.end', 'prompt.created')})"),
    ],
}


def install_views(target: Any) -> list[str]:
    """Add the derived columns and create or update every view (idempotent).

    ``target``: an Archive, a clickhouse-connect client, or f(sql). The archive tables must exist.
    """
    if callable(target):
        execute: Callable[[str], Any] = target
        query = None
    elif hasattr(target, "command"):
        execute, query = target.command, (lambda sql: target.query(sql).result_rows)
    else:
        execute, query = target.query, (lambda sql: target.query(sql)[1])
    execute(f"CREATE DATABASE IF NOT EXISTS {D}")
    have = set()
    if query is not None:
        have = {(t, c) for t, c in query(f"SELECT table, name FROM system.columns WHERE database = '{D}'")}
    for table, columns in DERIVED.items():
        for name, kind, expr in columns:
            # Only adds what is missing: an existing column keeps its definition (rename a column to change it).
            execute(f"ALTER TABLE {D}.{table} ADD COLUMN IF NOT EXISTS `{name}` {kind} MATERIALIZED {expr}")
            if query is not None and (table, name) not in have:
                # Rows archived before: write the column out too (a background mutation), not compute it per query.
                execute(f"ALTER TABLE {D}.{table} MATERIALIZE COLUMN `{name}`")
    for name, body in VIEWS.items():
        # OR REPLACE, not IF NOT EXISTS: a newer definition replaces an older one on upgrade.
        execute(f"CREATE OR REPLACE VIEW {D}.{name} AS {body.strip()}")
    return list(VIEWS)


def quote(value: str) -> str:
    """A ClickHouse string literal."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def standard_queries(run: str, versions: tuple[str, str] | None = None) -> dict[str, str]:
    """The report's (and the benchmark's) questions for one run, as SQL over the views."""
    r = quote(run)
    out = {
        "reward by policy and reward version":
            f"SELECT policy_version, reward_version, split, samples, reward_mean, reward_std "
            f"FROM {D}.reward_by_version WHERE run = {r} ORDER BY reward_version, split, policy_version",
        "eval reward by policy version":
            f"SELECT policy_version, reward_version, task_name, samples, reward_mean, reward_std "
            f"FROM {D}.eval_reward_by_version WHERE run = {r} ORDER BY reward_version, task_name, policy_version",
        "stale ratio":
            f"SELECT policy, versions, accepted_samples, stale_samples, evicted_samples, stale_ratio, stale_tokens "
            f"FROM {D}.stale_ratio WHERE run = {r}",
        "staleness by policy version":
            f"SELECT version, accepted, stale, evicted, stale_ratio, stale_tokens, step_seconds "
            f"FROM {D}.staleness_by_version WHERE run = {r} ORDER BY version",
        "latency and queue delay per stage (ms)":
            f"SELECT stage, samples, latency_p50_ms, latency_p95_ms, latency_p99_ms, queue_p50_ms, queue_p95_ms, "
            f"queue_p99_ms FROM {D}.stage_latency_quantiles WHERE run = {r} ORDER BY stage",
        "timeout and failure rates by class":
            f"SELECT source, stage, failure_class, failures, trajectories, rate, is_timeout FROM {D}.failure_rates "
            f"WHERE run = {r} ORDER BY failures DESC, source, stage, failure_class",
        "teacher by version":
            f"SELECT teacher_version, policy_version, samples, without_feedback_rate, alignment_error_rate, "
            f"latency_p50_ms, latency_p99_ms, reverse_kl_mean, top1_agreement_mean, teacher_verifier_disagreement "
            f"FROM {D}.teacher_by_version WHERE run = {r} ORDER BY teacher_version, policy_version",
        "distillation by version":
            f"SELECT version, opd_coef, opd_kl, kl_forward, kl_reverse, teacher_top1_agreement, loss_rl, loss_opd "
            f"FROM {D}.distillation_by_version WHERE run = {r} ORDER BY version",
        "goodput":
            f"SELECT trajectories, valid_trajectories, accepted_samples, span_s, valid_per_hour, accepted_per_hour "
            f"FROM {D}.goodput WHERE run = {r}",
        "goodput per hour":
            f"SELECT hour, trajectories, valid_trajectories, accepted_samples, stale_samples FROM {D}.goodput_hourly "
            f"WHERE run = {r} ORDER BY hour",
        "policy publish latency":
            f"SELECT policy, version, published_at, step_seconds, publish_latency_ms FROM {D}.publish_latency "
            f"WHERE run = {r} ORDER BY policy, version",
    }
    if versions:
        a, b = map(quote, versions)
        out["reward disagreement"] = (
            f"SELECT count() AS trajectories, countIf(disagree) AS disagreements, "
            f"disagreements / nullIf(trajectories, 0) AS disagreement_rate, avg(abs(delta)) AS mean_abs_delta, "
            f"avg(reward_a) AS mean_a, avg(reward_b) AS mean_b "
            f"FROM {D}.reward_disagreement(run={r}, a={a}, b={b})")
        out["most disagreeing trajectories"] = (
            f"SELECT trajectory_id, policy_version, reward_a, reward_b, delta "
            f"FROM {D}.reward_disagreement(run={r}, a={a}, b={b}) "
            f"WHERE disagree ORDER BY abs(delta) DESC, trajectory_id LIMIT 20")
    return out


def trajectory_timeline_sql(run: str, trajectory_id: str) -> str:
    """SQL for one trajectory end to end: every record of it (and of its trace) and its stage stamps, in time order."""
    r, t = quote(run), quote(trajectory_id)
    mine = f"run = {r} AND trajectory_id = {t}"
    # The runtime keeps one trace id from the prompt on (child spans), so the trace finds the prompt and dead letters.
    trace = f"(SELECT splitByChar('-', traceparent)[2] FROM {D}.trajectories WHERE {mine})"
    cols = "partition, offset, header_policy_version AS policy_version, header_reward_version AS reward_version, traceparent"
    return f"""
SELECT at, event, source, partition, offset, policy_version, reward_version, traceparent, detail FROM (
    SELECT fromUnixTimestamp64Milli(v, 'UTC') AS at, concat('stamp ', k) AS event, 'stage_times' AS source,
           {cols}, '' AS detail
    FROM {D}.trajectories ARRAY JOIN mapKeys(stage_times) AS k, mapValues(stage_times) AS v WHERE {mine}
    UNION ALL
    SELECT produced_at, 'prompt', 'tasks', {cols}, concat(task_name, ': ', prompt)
    FROM {D}.tasks WHERE run = {r} AND splitByChar('-', traceparent)[2] IN {trace}
    UNION ALL
    SELECT produced_at, concat('episode ', direction), 'episodes', {cols}, concat(toString(length(`turns.role`)), ' turns')
    FROM {D}.episodes WHERE run = {r} AND episode_id = {t}
    UNION ALL
    SELECT produced_at, concat('trajectory ', status), 'trajectories', {cols},
           concat(response, if(failure_class != '', concat(' [', failure_class, ': ', failure_message, ']'), ''))
    FROM {D}.trajectories WHERE {mine}
    UNION ALL
    SELECT produced_at, concat('reward ', reward_version), 'rewards', {cols}, toString(reward_total)
    FROM {D}.rewards WHERE {mine}
    UNION ALL
    SELECT produced_at, concat('feedback ', teacher_version), 'feedback', {cols}, toString(reward_total)
    FROM {D}.feedback WHERE {mine}
    UNION ALL
    SELECT failed_at, concat('dead letter ', reason), 'dead_letters', {cols}, concat(stage, ': ', error)
    FROM {D}.dead_letters WHERE run = {r} AND trace_id IN {trace}
) ORDER BY at, event"""


def trajectory_timeline(archive, run: str, trajectory_id: str) -> tuple[list[str], list[list]]:
    """One trajectory end to end, by id: (columns, rows) from an open Archive."""
    return archive.query(trajectory_timeline_sql(run, trajectory_id))
