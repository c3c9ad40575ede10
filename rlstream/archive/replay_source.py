"""Archived trajectories of a run, rebuilt page by page for a replay (interim copy of replay's row mapping)."""
from __future__ import annotations

from rlstream.archive.query import DATABASE, open_archive
from rlstream.archive.views import quote
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Failure, SamplingParams, Task, ToolCall, ToolResult, Trajectory, Turn


def _ms(col: str) -> str:
    return f"toUnixTimestamp64Milli({col})"


_TURN_COLS = ["role", "text", "token_start", "token_end", "policy_version", "finish_reason", "tool_name",
              "tool_arguments", "tool_output", "tool_exit_code", "tool_duration_ms", "tool_truncated",
              "tool_failure_class"]
_ROW_SQL = (["partition", "offset", "kafka_key", "header_policy_version", "traceparent", _ms("produced_at"),
             "trajectory_id", "group_id", "sample_index", "task_id", "task_name", "env_name", "env_version", "prompt",
             "prompt_token_ids", "answer", "task_metadata", "group_size", "split", "max_turns",
             _ms("task_created_at"), "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "response",
             "token_ids", "loss_mask", "behaviour_logprobs"] + [f"`turns.{c}`" for c in _TURN_COLS]
            + [f"arrayMap(x -> {_ms('x')}, `turns.started_at`)", f"arrayMap(x -> {_ms('x')}, `turns.finished_at`)",
               "min_policy_version", "max_policy_version", "status", "failure_class", "failure_message",
               "failure_stage", "stage_times", "trace_id"])


def trajectory_from_row(row: list) -> tuple[int, int, bytes, list, Trajectory]:
    """(partition, offset, key, headers, Trajectory) from one archived row selected with _ROW_SQL."""
    (partition, offset, key, pv, traceparent, produced, tid, gid, sample, task_id, task_name, env_name, env_version,
     prompt, prompt_ids, answer, metadata, group_size, split, max_turns, created, temperature, top_p, top_k,
     max_tokens, seed, stop, response, token_ids, loss_mask, logprobs, *rest) = row
    turn_cols, rest = rest[:len(_TURN_COLS) + 2], rest[len(_TURN_COLS) + 2:]
    min_pv, max_pv, status, f_class, f_message, f_stage, stage_times, trace_id = rest
    turns = []
    for (role, text, t0, t1, tpv, finish, tool, args, out, code, dur, trunc, t_fail, started, finished) in \
            zip(*turn_cols):
        result = None
        if out or code or dur or trunc or t_fail:
            result = ToolResult(out, code, dur, bool(trunc), t_fail or None)
        turns.append(Turn(role, text, t0, t1, tpv, finish, ToolCall(tool, args) if tool else None, result,
                          started, finished))
    task = Task(task_id=task_id, group_id=gid, task_name=task_name, env_name=env_name, env_version=env_version,
                prompt=prompt, sampling=SamplingParams(temperature, top_p, top_k, max_tokens, seed, list(stop)),
                created_at=created, prompt_token_ids=prompt_ids, answer=answer, metadata=dict(metadata),
                group_size=group_size, split=split, max_turns=max_turns, trace_id=trace_id)
    traj = Trajectory(trajectory_id=tid, group_id=gid, sample_index=sample, task=task, response=response,
                      min_policy_version=min_pv, max_policy_version=max_pv, token_ids=token_ids, loss_mask=loss_mask,
                      behaviour_logprobs=logprobs, turns=turns, status=status,
                      failure=Failure(f_class, f_message, f_stage) if f_class else None,
                      stage_times={k: int(v) for k, v in stage_times.items()}, trace_id=trace_id)
    headers = hdr.build(pv, traceparent or hdr.new_traceparent(), produced_at=produced)
    return partition, offset, (key or "").encode("utf-8"), headers, traj



class ArchivedTrajectories:
    """Trajectories of one run rebuilt from the archive, in (partition, offset) order, page by page."""

    def __init__(self, archive_url: str, run: str, *, since_ms: int | None = None, from_offset: int = -1,
                 versions: tuple[int | None, int | None] = (None, None), resume: dict[int, int] | None = None):
        self.run = run
        self._archive = open_archive(archive_url)
        where = [f"run = {quote(run)}"]
        if since_ms is not None:
            where.append(f"kafka_timestamp >= fromUnixTimestamp64Milli({since_ms}, 'UTC')")
        if from_offset >= 0:
            where.append(f"offset >= {int(from_offset)}")
        lo, hi = versions
        if lo is not None:
            where.append(f"header_policy_version >= {lo}")
        if hi is not None:
            where.append(f"header_policy_version <= {hi}")
        self._base = where
        self._where = " AND ".join(where)
        self.resume(resume or {})

    def resume(self, done: dict[int, int]) -> None:
        """Exclude, per partition, the offsets before ``done[partition]`` (what the replay group committed)."""
        where = list(self._base)
        if done:
            keys, values = zip(*sorted(done.items()))
            where.append(f"offset >= mapFromArrays({list(keys)}::Array(Int32), {list(values)}::Array(Int64))[partition]")
        self._where = " AND ".join(where)

    def partitions(self) -> list[int]:
        _, rows = self._archive.query(f"SELECT DISTINCT partition FROM {DATABASE}.trajectories "
                                      f"WHERE run = {quote(self.run)}")
        return sorted(int(r[0]) for r in rows)

    def count(self) -> int:
        return int(self._archive.query(f"SELECT count() FROM {DATABASE}.trajectories WHERE {self._where}")[1][0][0])

    def page(self, after: tuple[int, int], limit: int) -> list[tuple[int, int, bytes, list, Trajectory]]:
        _, rows = self._archive.query(
            f"SELECT {', '.join(_ROW_SQL)} FROM {DATABASE}.trajectories WHERE {self._where} "
            f"AND (partition, offset) > ({after[0]}, {after[1]}) ORDER BY partition, offset LIMIT {int(limit)}")
        return [trajectory_from_row(row) for row in rows]

    def close(self) -> None:
        self._archive.close()

    def __enter__(self) -> "ArchivedTrajectories":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
