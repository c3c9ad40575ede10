"""Standard analytics over 1,000,000 archived trajectories in embedded chDB, against a 1 s goal per query.

Generates the rows inside ClickHouse (INSERT ... SELECT FROM numbers()) into the
archive's own tables (the sink's DDL): N trajectories, each scored under two
reward versions (2N reward rows), a policy version per 10,000 samples, and some
dead letters; then installs the views and times every query the report asks.

    python -m benchmarks.analytics_queries --rows 1000000
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from benchmarks.harness.record import Goal, record
from rlstream.archive.sink import ArchiveSettings, ArchiveSink
from rlstream.archive.tables import TABLES
from rlstream.archive.views import install_views, standard_queries, trajectory_timeline_sql
from rlstream.config import LoopSettings

GOAL_S = 1.0
RUN = "bench"
HOUR_MS = 3_600_000


def _trajectory_exprs(base_ms: int, span_ms: int, rows: int) -> dict[str, str]:
    """Column -> SQL over numbers() for a plausible single-turn trajectory (sample n)."""
    ts = f"({base_ms} + intDiv(number * {span_ms}, {rows}))"
    pv = "toInt32(intDiv(number, 10000))"
    failed, truncated = "number % 53 = 0", "number % 41 = 0"
    return {
        "run": f"'{RUN}'", "topic": "'trajectories'", "partition": "toInt32(number % 8)",
        "offset": "toInt64(intDiv(number, 8))", "kafka_key": "concat('task-', toString(intDiv(number, 8)))",
        "kafka_timestamp": f"fromUnixTimestamp64Milli(toInt64({ts}), 'UTC')", "header_policy_version": pv,
        "header_reward_version": "''",
        "traceparent": "concat('00-', lower(hex(cityHash64(number))), lower(hex(cityHash64(number + 1))), '-', "
                       "lower(hex(cityHash64(number + 2))), '-01')",
        "produced_at": f"fromUnixTimestamp64Milli(toInt64({ts}), 'UTC')",
        "trajectory_id": "concat('traj-', toString(number))", "group_id": "concat('task-', toString(intDiv(number, 8)))",
        "sample_index": "toInt32(number % 8)", "task_id": "concat('task-', toString(intDiv(number, 8)))",
        "task_name": "'reverse'", "env_name": "'single'", "env_version": "'1'", "prompt": "'abc>'",
        "prompt_token_ids": "[1, 2, 3, 40]", "answer": "'cba'", "task_metadata": "map()", "group_size": "8",
        "split": "if(number % 50 = 0, 'heldout', 'train')", "max_turns": "1",
        "task_created_at": f"fromUnixTimestamp64Milli(toInt64({ts} - 900), 'UTC')", "temperature": "1.0",
        "top_p": "1.0", "top_k": "-1", "max_tokens": "8", "seed": "NULL", "stop": "[]",
        "response": "['cba', 'abc', 'cab', 'cbb'][number % 4 + 1]",
        "token_ids": "arrayMap(i -> toInt32((number + i) % 47), range(8))", "loss_mask": "arrayResize([1], 8, 1)",
        "behaviour_logprobs": "arrayResize([-0.5], 8, -0.5)", "n_tokens": "8",
        "turns.role": "['action']", "turns.text": "['cba']", "turns.token_start": "[0]", "turns.token_end": "[8]",
        "turns.policy_version": f"[{pv}]", "turns.finish_reason": "['stop']", "turns.tool_name": "['']",
        "turns.tool_arguments": "['']", "turns.tool_output": "['']", "turns.tool_exit_code": "[0]",
        "turns.tool_duration_ms": "[0.]", "turns.tool_truncated": "[false]",
        "turns.tool_failure_class": "[if(number % 97 = 0, 'tool_timeout', '')]",
        "turns.started_at": f"[fromUnixTimestamp64Milli(toInt64({ts} - 800 + number % 200), 'UTC')]",
        "turns.finished_at": f"[fromUnixTimestamp64Milli(toInt64({ts} - 100), 'UTC')]",
        "turns.segment_versions": f"[[{pv}]]", "turns.segment_tokens": "[[8]]",
        "min_policy_version": pv, "max_policy_version": pv,
        "status": f"multiIf({failed}, 'failed', {truncated}, 'truncated', 'ok')",
        "failure_class": f"if({failed}, ['env_error', 'sandbox_timeout'][number % 2 + 1], '')",
        "failure_message": f"if({failed}, 'boom', '')", "failure_stage": f"if({failed}, 'env', '')",
        "stage_times": f"map('prompt.created', toInt64({ts} - 900), 'rollout.start', toInt64({ts} - 800 + number % 200),"
                       f" 'rollout.end', toInt64({ts} - 100), 'env.end', toInt64({ts}))",
        "trace_id": "''",
    }


def generate(sink: ArchiveSink, rows: int) -> None:
    now = int(time.time() * 1000)
    span = 10 * HOUR_MS
    base = now - span
    traj = _trajectory_exprs(base, span, rows)
    names = TABLES["trajectories"].names
    cols = ", ".join(f"`{n}`" for n in names)

    def timed(what, sql):
        started = time.perf_counter()
        sink.client.command(sql)
        print(f"  {what}: {time.perf_counter() - started:.1f} s", flush=True)

    timed(f"{rows:,} trajectories",
          f"INSERT INTO rlstream.trajectories ({cols}) SELECT {', '.join(traj[n] for n in names)} "
          f"FROM numbers({rows})")
    reward_names = TABLES["rewards"].names
    for k, (version, total) in enumerate((("v1", "if(response = 'cba', 1.0, 0.0)"),
                                          ("v2", "arraySum(arrayMap((a, b) -> a = b, splitByString('', response), "
                                                 "['c', 'b', 'a'])) / 3"))):
        # Scored a little after the env produced it; v2 is a replay, much later.
        delay = 40 if k == 0 else 5 * HOUR_MS
        at = "toInt64(toUnixTimestamp64Milli(produced_at))"
        stamps = f"'reward.end', {at} + {delay}" + (f", 'replay.start', {at} + {delay - 30}" if k else "")
        exprs = {n: f"`{n}`" for n in reward_names}
        exprs.update({
            "topic": "'rewards'", "offset": f"offset + {k} * {rows}",
            "header_reward_version": f"'{version}'", "reward_version": f"'{version}'",
            "produced_at": f"produced_at + toIntervalMillisecond({delay})",
            "kafka_timestamp": f"kafka_timestamp + toIntervalMillisecond({delay})",
            "reward_total": total, "reward_breakdown": f"map('exact', {total})", "violations": "[]",
            "turn_scores": "[]",
            "verifier_version": "'exact_match/1'", "judge_version": "''", "reward_latency_ms": "5 + number_ % 20",
            "reward_failure_class": "if(status = 'failed', failure_class, '')",
            "scored_at": f"produced_at + toIntervalMillisecond({delay})",
            "stage_times": f"mapUpdate(stage_times, map({stamps}))",
        })
        timed(f"{rows:,} rewards {version}",
              f"INSERT INTO rlstream.rewards ({', '.join(f'`{n}`' for n in reward_names)}) "
              f"SELECT {', '.join(exprs[n] for n in reward_names)} FROM "
              f"(SELECT *, rowNumberInAllBlocks() AS number_ FROM rlstream.trajectories WHERE run = '{RUN}')")
    versions = rows // 10000 + 1
    timed(f"{versions} policy versions",
          f"INSERT INTO rlstream.policy_versions (run, topic, partition, offset, policy, version, weights_uri, step, "
          f"published_at, created_at, metrics) SELECT '{RUN}', 'policy-versions', 0, number, 'policy', number, '', "
          f"number, fromUnixTimestamp64Milli(toInt64({base} + number * {span // versions}), 'UTC'), "
          f"fromUnixTimestamp64Milli(toInt64({base} + number * {span // versions}), 'UTC'), "
          f"map('accepted', toFloat64(number * 9000), 'stale', toFloat64(number * 1000), 'accepted_step', 9000., "
          f"'stale_step', 1000., 'step_seconds', 2.5) FROM numbers({versions})")
    timed("1,000 dead letters",
          f"INSERT INTO rlstream.dead_letters (run, topic, partition, offset, stage, reason, error, failed_at) "
          f"SELECT '{RUN}', 'dead-letters', 0, number, ['reward', 'env'][number % 2 + 1], "
          f"['handler_timeout', 'handler_error', 'invalid'][number % 3 + 1], 'x', now64(3) FROM numbers(1000)")
    sink.client.command("OPTIMIZE TABLE rlstream.rewards FINAL")  # as after the sink's merges settle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="archived trajectories")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each query (the best and median are shown)")
    parser.add_argument("--path", default=None, help="chDB data path (default: a temporary folder, removed)")
    args = parser.parse_args()
    path = args.path or tempfile.mkdtemp(prefix="rlstream-analytics-")
    sink = ArchiveSink(ArchiveSettings(), LoopSettings(archive=f"chdb://{path}"))
    sink.open()
    try:
        # As the archive does at start: derived columns first, so inserted rows store them.
        install_views(sink.client)
        have = sink.client.query(f"SELECT count() FROM rlstream.trajectories WHERE run = '{RUN}'").result_rows[0][0]
        if have and have != args.rows:
            raise SystemExit(f"{path} holds {have:,} benchmark trajectories, not {args.rows:,}: use another --path")
        if not have:
            print(f"generating {args.rows:,} archived trajectories in {path}:")
            generate(sink, args.rows)
        install_views(sink.client)
        queries = standard_queries(RUN, ("v1", "v2"))
        queries["one trajectory end to end"] = trajectory_timeline_sql(RUN, f"traj-{args.rows // 2}")
        print(f"\n{'query':<42} {'best s':>7} {'median s':>9} {'rows':>6}  within {GOAL_S:.0f} s")
        slow, medians = 0, []
        for name, sql in queries.items():
            times, n = [], 0
            for _ in range(args.repeat):
                started = time.perf_counter()
                n = len(sink.client.query(sql).result_rows)
                times.append(time.perf_counter() - started)
            medians.append(statistics.median(times))
            ok = medians[-1] < GOAL_S  # judged on the median: a best-of-N hides a slow first read
            slow += not ok
            print(f"{name:<42} {min(times):7.3f} {statistics.median(times):9.3f} {n:6d}  {'yes' if ok else 'NO'}")
        counts = sink.client.query("SELECT (SELECT count() FROM rlstream.trajectories), "
                                   "(SELECT count() FROM rlstream.rewards)").result_rows[0]
        print(f"\narchive: {counts[0]:,} trajectories, {counts[1]:,} reward rows; "
              f"{len(queries) - slow}/{len(queries)} queries within {GOAL_S:.0f} s")
        record("analytics_queries", dict(trajectories=counts[0], queries=len(queries),
                                         within_goal=len(queries) - slow, slowest_median_s=max(medians)),
               [Goal("slowest_median_s", "<=", GOAL_S)])
    finally:
        sink.close()
        if args.path is None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
