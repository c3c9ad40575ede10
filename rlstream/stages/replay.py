"""``rlstream replay``: score past trajectories again under a new reward version.

A replay is the reward stage under its own consumer group (``<run>.replay.<version>``)
over a bounded range of ``trajectories``: the topic's offsets as they stand when it
starts, from an offset or a time, optionally only some policy versions. Outputs and
input offsets commit in one Kafka transaction, so a killed replay resumes where it
stopped and never writes a reward twice. Once the topic's retention has dropped the
records, ``--source archive`` rebuilds them from the archive and goes through the
same runtime, committing the archived offsets in the same group.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import logging
import re
import sys
import time
from dataclasses import dataclass

from confluent_kafka import OFFSET_INVALID, KafkaException, TopicPartition

from rlstream.config import KafkaSettings, add_arguments, knob
from rlstream.archive.query import DATABASE, DEFAULT_ARCHIVE, ArchiveError, open_archive
from rlstream.archive.views import quote
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Failure, SamplingParams, Task, ToolCall, ToolResult, Trajectory, Turn
from rlstream.stages.reward import RewardSettings, RewardStage
from rlstream.runtime.runner import Incoming, Output, RuntimeSettings, Stage, StageRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplaySettings:
    """What to replay and how to score it."""

    reward: str = knob("rlstream.stages.reward:exact_match", "Reward function as a dotted path (module:function)")
    reward_version: str = knob("", "Version written on every replayed reward (required; a new one per replay)")
    since: str = knob("", "Only trajectories produced at or after TIME: ISO 8601 (UTC unless it says), "
                          "epoch milliseconds, or an age such as 90m, 6h, 2d")
    from_offset: int = knob(-1, "Start at this offset of every partition (-1: the earliest)")
    policy_version: str = knob("", "Only trajectories whose policy_version header is in A..B (also A.., ..B, A)")
    source: str = knob("topic", "topic: read the trajectories topic; archive: rebuild trajectories from the "
                                "archive (once the topic's retention has dropped them)", choices=("topic", "archive"))
    archive: str = knob(DEFAULT_ARCHIVE, "Archive URL for --source archive (chdb://PATH or http(s)://HOST:PORT)")
    progress: bool = knob(True, "Show a progress bar with an ETA")


# -- arguments -------------------------------------------------------------------------------------------------

def parse_since(text: str, now: float | None = None) -> int | None:
    """Milliseconds since the epoch for --since ('' = no bound)."""
    text = text.strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    age = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text)
    if age:
        seconds = float(age.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[age.group(2)]
        return int(((now if now is not None else time.time()) - seconds) * 1000)
    try:
        when = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: expected ISO 8601, epoch milliseconds, or an age like 6h") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return int(when.timestamp() * 1000)


def parse_versions(text: str) -> tuple[int | None, int | None]:
    """(lowest, highest) policy version for --policy-version A..B; None is open."""
    text = text.strip()
    if not text:
        return None, None
    lo, sep, hi = text.partition("..")
    try:
        if not sep:
            return int(lo), int(lo)
        return (int(lo) if lo.strip() else None), (int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"--policy-version {text!r}: expected A..B, A.., ..B or A (integers)") from None


# -- the stage ---------------------------------------------------------------------------------------------------

class ReplayStage(Stage):
    """The reward stage under a replay's own name, group and policy-version range."""

    inputs = ("trajectories",)

    def __init__(self, settings: ReplaySettings):
        if not settings.reward_version:
            raise ValueError("--reward-version is required: replayed rewards need a version of their own")
        self.name = f"replay.{settings.reward_version}"
        self.versions = parse_versions(settings.policy_version)
        # The reward logic is the reward stage's own, not a copy of it.
        self.reward = RewardStage(RewardSettings(reward=settings.reward, reward_version=settings.reward_version))
        self.scored = self.skipped = 0
        self.on_poll = None

    def wanted(self, policy_version: int) -> bool:
        lo, hi = self.versions
        return (lo is None or policy_version >= lo) and (hi is None or policy_version <= hi)

    async def handle(self, item: Incoming) -> list[Output]:
        if not self.wanted(item.policy_version):
            self.skipped += 1
            return []  # outside the range: consumed (its offset commits), not scored
        item.record.stage_times["replay.start"] = now_ms()
        out = await self.reward.handle(item)
        self.scored += 1
        return out

    def before_poll(self, ctx) -> None:
        if self.on_poll is not None:
            self.on_poll()

    def close(self) -> None:
        self.reward.close()


class _Progress:
    """tqdm when it is installed, else a plain carriage-return line; silent when disabled."""

    def __init__(self, total: int, enabled: bool, unit: str):
        self.total, self.n, self.enabled, self.started = total, 0, enabled, time.monotonic()
        self._bar, self._last = None, 0.0
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit=unit, desc="replay", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        n = min(n, self.total)
        if n <= self.n:
            return
        if self._bar is not None:
            self._bar.update(n - self.n)
        self.n = n
        if self.enabled and self._bar is None and (time.monotonic() - self._last > 0.5 or n == self.total):
            self._last = time.monotonic()
            rate = n / max(1e-9, self._last - self.started)
            eta = (self.total - n) / rate if rate > 0 else float("inf")
            print(f"\rreplay {n}/{self.total} ({100 * n / max(1, self.total):.0f}%) {rate:.0f}/s ETA {eta:.0f}s",
                  end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


@dataclass
class ReplayResult:
    """What a replay did."""

    scored: int
    skipped: int
    seconds: float
    source: str

    @property
    def rate(self) -> float:
        """Trajectories scored per second."""
        return self.scored / self.seconds if self.seconds > 0 else 0.0


# -- from the topic ----------------------------------------------------------------------------------------------

class ReplayRunner(StageRunner):
    """The shared runtime over a fixed offset range of the trajectories topic."""

    def __init__(self, stage: ReplayStage, kafka: KafkaSettings, runtime: RuntimeSettings, settings: ReplaySettings):
        # One batch per transaction: a replay's bounds and its pause past the end are per batch.
        super().__init__(stage, kafka, dataclasses.replace(runtime, pipeline=False))
        self.replay_settings = settings  # self.settings is the runtime's
        self.topic = topic_name(kafka.run, "trajectories")
        self.bounds: dict[int, tuple[int, int]] = {}  # partition -> [start, end)
        self.done_to: dict[int, int] = {}
        stage.on_poll = self._check

    def plan(self) -> int:
        """Fix each partition's [start, end): end is the offset now, start the request or where the group stopped."""
        meta = self.consumer.list_topics(self.topic, timeout=30).topics.get(self.topic)
        if meta is None or meta.error is not None:
            raise ArchiveError(f"no topic {self.topic} (is --run right?)")
        parts = [TopicPartition(self.topic, p) for p in sorted(meta.partitions)]
        since = parse_since(self.replay_settings.since)
        by_time = {}
        if since is not None:
            by_time = {tp.partition: tp.offset for tp in self.consumer.offsets_for_times(
                [TopicPartition(self.topic, tp.partition, since) for tp in parts], timeout=30)}
        committed = {tp.partition: tp.offset for tp in self.consumer.committed(parts, timeout=30)}
        for tp in parts:
            low, high = self.consumer.get_watermark_offsets(tp, timeout=30)
            start = low
            if self.replay_settings.from_offset >= 0:
                start = min(max(self.replay_settings.from_offset, low), high)
            if since is not None:
                found = by_time.get(tp.partition, -1)
                start = max(start, found if found >= 0 else high)  # -1: nothing that recent
            if committed.get(tp.partition, OFFSET_INVALID) >= 0:
                start = max(start, committed[tp.partition])  # this replay's group already did the rest
            self.bounds[tp.partition] = (start, high)
            self.done_to[tp.partition] = start
        return sum(max(0, end - start) for start, end in self.bounds.values())

    def _on_assign(self, consumer, parts) -> None:
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=30)}
        except KafkaException:
            committed = {}
        for tp in parts:
            start, _ = self.bounds.get(tp.partition, (OFFSET_INVALID, 0))
            # After a rebalance, what this group already committed wins over the planned start.
            tp.offset = max(start, committed.get(tp.partition, OFFSET_INVALID))
        consumer.assign(parts)
        super()._on_assign(consumer, parts)

    def _process_batch(self, msgs) -> None:
        keep, beyond = [], set()
        for m in msgs:
            start, end = self.bounds.get(m.partition(), (0, 0))
            if start <= m.offset() < end:
                keep.append(m)
            elif m.offset() >= end:
                beyond.add(m.partition())
        if beyond:
            # Records written after the replay began are not part of it.
            self.consumer.pause([TopicPartition(self.topic, p) for p in beyond])
            for p in beyond:
                self.done_to[p] = self.bounds[p][1]
        if keep:
            super()._process_batch(keep)

    def _check(self) -> None:
        """Track positions for the progress bar, and stop once every assigned partition reached its end."""
        assigned = [tp for tp in self._assigned if tp.partition in self.bounds]
        if assigned:
            for tp in self.consumer.position(assigned):
                if tp.offset >= 0:
                    self.done_to[tp.partition] = max(self.done_to[tp.partition], min(tp.offset,
                                                                                      self.bounds[tp.partition][1]))
        self.progress.update(sum(self.done_to[p] - s for p, (s, _) in self.bounds.items()))
        finished = all(self.done_to[p] >= e for p, (_, e) in self.bounds.items())
        mine = assigned and all(self.done_to[tp.partition] >= self.bounds[tp.partition][1] for tp in assigned)
        if finished or mine:
            self.request_stop()

    def replay(self) -> ReplayResult:
        started = time.monotonic()
        total = self.plan()
        self.progress = _Progress(total, self.replay_settings.progress, "offsets")
        log.info("replaying %d offsets of %s as group %s", total, self.topic, self.group_id)
        try:
            if total:
                self.run()
            else:
                self.close()
        finally:
            self.progress.close()
        return ReplayResult(self.stage.scored, self.stage.skipped, time.monotonic() - started, "topic")


# -- from the archive --------------------------------------------------------------------------------------------

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


class _Archived:
    """An archived trajectory dressed as a consumed Kafka message, so the stage runtime handles it unchanged."""

    __slots__ = ("_topic", "_partition", "_offset", "_key", "_value", "_headers")

    def __init__(self, topic, partition, offset, key, value, headers):
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._headers = key, value, headers

    def topic(self): return self._topic
    def partition(self): return self._partition
    def offset(self): return self._offset
    def key(self): return self._key
    def value(self): return self._value
    def headers(self): return self._headers
    def error(self): return None
    def timestamp(self): return (1, 0)
    def __len__(self): return len(self._value)


class ArchiveReplayRunner(StageRunner):
    """Replays archived trajectories through the runtime; the archived offsets commit in the replay's group."""

    def __init__(self, stage: ReplayStage, kafka: KafkaSettings, runtime: RuntimeSettings, settings: ReplaySettings):
        super().__init__(stage, kafka, runtime)
        self.replay_settings = settings  # self.settings is the runtime's
        self.topic = topic_name(kafka.run, "trajectories")

    def _where(self, archive) -> str:
        s, run = self.replay_settings, quote(self.kafka.run)
        where = [f"run = {run}"]
        since = parse_since(s.since)
        if since is not None:
            where.append(f"kafka_timestamp >= fromUnixTimestamp64Milli({since}, 'UTC')")
        if s.from_offset >= 0:
            where.append(f"offset >= {int(s.from_offset)}")
        lo, hi = parse_versions(s.policy_version)
        if lo is not None:
            where.append(f"header_policy_version >= {lo}")
        if hi is not None:
            where.append(f"header_policy_version <= {hi}")
        _, rows = archive.query(f"SELECT DISTINCT partition FROM {DATABASE}.trajectories WHERE run = {run}")
        try:
            parts = [TopicPartition(self.topic, int(r[0])) for r in rows]
            done = {tp.partition: tp.offset for tp in self.consumer.committed(parts, timeout=30) if tp.offset >= 0}
        except KafkaException:  # the topic itself may be gone: then nothing of this group was committed for it
            done = {}
        if done:
            # Resume: what this replay's group already committed (from the topic or the archive) is done.
            keys, values = zip(*sorted(done.items()))
            where.append(f"offset >= mapFromArrays({list(keys)}::Array(Int32), {list(values)}::Array(Int64))[partition]")
        return " AND ".join(where)

    def replay(self) -> ReplayResult:
        started = time.monotonic()
        codec = default_codec()
        page = max(1, self.settings.batch_size)  # one page of the archive is one transaction
        self.producer.init_transactions(30)
        try:
            with open_archive(self.replay_settings.archive) as archive:
                where = self._where(archive)
                total = int(archive.query(f"SELECT count() FROM {DATABASE}.trajectories WHERE {where}")[1][0][0])
                progress = _Progress(total, self.replay_settings.progress, "traj")
                log.info("replaying %d archived trajectories of run %s as group %s", total, self.kafka.run,
                         self.group_id)
                last, done = (-1, -1), 0
                try:
                    while not self._stopping:
                        _, rows = archive.query(
                            f"SELECT {', '.join(_ROW_SQL)} FROM {DATABASE}.trajectories WHERE {where} "
                            f"AND (partition, offset) > ({last[0]}, {last[1]}) ORDER BY partition, offset "
                            f"LIMIT {page}")
                        if not rows:
                            break
                        msgs = []
                        for row in rows:
                            partition, offset, key, headers, traj = trajectory_from_row(row)
                            value = codec.encode("Trajectory", traj.to_dict())
                            msgs.append(_Archived(self.topic, partition, offset, key, value, headers))
                        self._process_batch(msgs)
                        last = (rows[-1][0], rows[-1][1])
                        done += len(rows)
                        progress.update(done)
                finally:
                    progress.close()
        finally:
            self.close()
        return ReplayResult(self.stage.scored, self.stage.skipped, time.monotonic() - started, "archive")


# -- entry points ------------------------------------------------------------------------------------------------

def replay(settings: ReplaySettings, kafka: KafkaSettings, runtime: RuntimeSettings = RuntimeSettings()) -> ReplayResult:
    """Run one replay to the end of its range; returns what it scored."""
    stage = ReplayStage(settings)
    cls = ArchiveReplayRunner if settings.source == "archive" else ReplayRunner
    return cls(stage, kafka, runtime, settings).replay()


def cmd_replay(args: argparse.Namespace) -> None:
    from rlstream.cli import UsageError, settings as load
    replay_settings = load(ReplaySettings, args)
    kafka, runtime = load(KafkaSettings, args), load(RuntimeSettings, args)
    try:
        parse_since(replay_settings.since)
        parse_versions(replay_settings.policy_version)
        result = replay(replay_settings, kafka, runtime)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"replayed {result.scored} trajectories from the {result.source} as reward version "
          f"{replay_settings.reward_version} ({result.skipped} outside --policy-version) in {result.seconds:.1f} s "
          f"({result.rate:.0f}/s)")


def add_command(subparsers) -> None:
    """``rlstream replay --run R --reward-version V --reward SPEC [--since T | --from-offset N | --policy-version A..B]``."""
    p = subparsers.add_parser("replay", help="score past trajectories again with a new reward version")
    add_arguments(p, KafkaSettings)
    add_arguments(p, ReplaySettings)
    add_arguments(p, RuntimeSettings, skip=("instance", "metrics_port", "max_record_bytes", "poll_timeout_s"))
    p.set_defaults(func=cmd_replay)
