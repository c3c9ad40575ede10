"""``rlstream replay``: score past trajectories again under a new reward version, or run another teacher over
past scored trajectories (``--teacher-version``, ``stages/teacher/replay.py``).

A replay is the reward stage under its own consumer group (``<run>.replay.<version>``)
over a bounded range of ``trajectories``: the topic's offsets as they stand when it
starts, from an offset or a time, optionally only some policy versions. Outputs and
input offsets commit in one Kafka transaction, so a killed replay resumes where it
stopped and never writes a reward twice. Once the topic's retention has dropped the
records, ``--source archive`` rebuilds them from the archive and goes through the
same runtime, committing the archived offsets in the same group: the archive's rows are the runner's decoded
records as they are (no Avro on the way).
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
from typing import ClassVar

from rlstream.archive.replay_source import ArchivedTrajectories
from rlstream.archive.tables import TOPIC_TABLE
from rlstream.config import KafkaSettings, LoopSettings, add_arguments, knob, load
from rlstream.errors import UsageError, UserError
from rlstream.kafka import records
from rlstream.kafka.group import GroupMember
from rlstream.kafka.sources import BoundedTopicSource
from rlstream.kafka.topics import topic_name
from rlstream.runtime.runner import Counter, StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.runtime.stage import Incoming, Output, Stage
from rlstream.stages.reward import RewardSettings, RewardStage
from rlstream.stages.teacher.replay import TeacherReplayStage
from rlstream.stages.teacher.settings import TeacherSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplaySettings:
    """What to replay and how to score it."""

    ROLE: ClassVar[str] = "REPLAY"

    reward: str = knob("rlstream.rewards:exact_match", "Reward function as a dotted path (module:function)")
    reward_version: str = knob("", "Version written on every replayed reward (required; a new one per replay)")
    since: str = knob("", "Only trajectories produced at or after TIME: ISO 8601 (UTC unless it says), "
                          "epoch milliseconds, or an age such as 90m, 6h, 2d")
    from_offset: int = knob(-1, "Start at this offset of every partition (-1: the earliest)")
    policy_version: str = knob("", "Only trajectories whose policy_version header is in A..B (also A.., ..B, A)")
    source: str = knob("topic", "topic: read the trajectories topic; archive: rebuild trajectories from the "
                                "archive (once the topic's retention has dropped them)", choices=("topic", "archive"))
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
    token_views = True  # as the reward stage's

    def __init__(self, settings: ReplaySettings):
        if not settings.reward_version:
            raise ValueError("--reward-version is required: replayed rewards need a version of their own "
                             "(or --teacher-version and --teacher to replay a teacher)")
        self.name = f"replay.{settings.reward_version}"
        self.versions = parse_versions(settings.policy_version)
        # The reward logic is the reward stage's own, not a copy of it; it stamps replay.start (so the scored
        # trajectory is still written over the bytes it arrived as: schemas.splice).
        self.reward = RewardStage(RewardSettings(reward=settings.reward, reward_version=settings.reward_version),
                                  start_stamp="replay.start")
        self.scored = self.skipped = 0

    def wanted(self, policy_version: int) -> bool:
        lo, hi = self.versions
        return (lo is None or policy_version >= lo) and (hi is None or policy_version <= hi)

    async def handle(self, item: Incoming) -> list[Output]:
        if not self.wanted(item.policy_version):
            self.skipped += 1
            return []  # outside the range: consumed (its offset commits), not scored
        out = await self.reward.handle(item)
        self.scored += 1
        return out

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception] | None:
        """A replay runs one batch per transaction: the range filter and the reward stage's batch path, in one call
        (None, per record, when the reward function is async)."""
        if not self.reward.judges_in_batches:
            return None
        results: list[list[Output] | Exception] = [[] for _ in items]  # outside the range: consumed, not scored
        keep = [i for i, item in enumerate(items) if self.wanted(item.policy_version)]
        self.skipped += len(items) - len(keep)
        for i, result in zip(keep, self.reward.handle_batch([items[i] for i in keep]) if keep else []):
            results[i] = result
            self.scored += not isinstance(result, Exception)
        return results

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

def _replay_topic(stage: ReplayStage | TeacherReplayStage, kafka: KafkaSettings, runtime: RuntimeSettings,
                  s: ReplaySettings, archive_url: str = "", on_committed: Counter | None = None) -> ReplayResult:
    """The runtime over the input topic's offsets as they stand now (trajectories for a reward, rewards for a
    teacher), from the requested start."""
    started = time.monotonic()
    group = f"{kafka.run}.{stage.name}"
    logical = stage.inputs[0]
    source = BoundedTopicSource(kafka, group, topic_name(kafka.run, logical), who=stage.name)
    since = parse_since(s.since)
    try:
        by_time = source.offsets_for_time(since) if since is not None else {}

        def start_at(partition: int, low: int, high: int) -> int:
            start = low
            if s.from_offset >= 0:
                start = min(max(s.from_offset, low), high)
            if since is not None:
                found = by_time.get(partition, -1)
                start = max(start, found if found >= 0 else high)  # -1: nothing that recent
            return start
        total = source.plan(start_at)
    except (LookupError, KeyError) as exc:
        source.close()
        raise UserError(f"no topic {topic_name(kafka.run, logical)} (is --run right?)") from exc
    progress = _Progress(total, s.progress, "offsets")
    # One batch per transaction: the range's end is checked per batch.
    def committed(n: int) -> None:
        progress.update(source.done())
        if on_committed is not None:
            on_committed(n)
    runner = StageRunner(stage, kafka, dataclasses.replace(runtime, pipeline=False), source, on_committed=committed)
    log.info("replaying %d offsets of %s as group %s", total, source.topic, group)
    try:
        if total:
            runner.run()
        else:
            runner.close()
    finally:
        progress.close()
    return ReplayResult(stage.scored, stage.skipped, time.monotonic() - started, "topic")


# -- from the archive --------------------------------------------------------------------------------------------

class ArchiveSource:
    """Archived trajectories (scored ones for a teacher replay: ``logical`` rewards), page by page in (partition,
    offset) order, as the runner's input.

    Their original offsets commit in the replay's consumer group, as a replay from the topic would: a killed
    replay resumes after the last committed page, whichever source it ran from.
    """

    def __init__(self, kafka: KafkaSettings, group_id: str, s: ReplaySettings, archive_url: str,
                 logical: str = "trajectories"):
        self.logical = logical
        self.topic = topic_name(kafka.run, logical)
        # Never subscribed: it exists for the group's metadata, which the transactions commit offsets with.
        self.member = GroupMember(kafka, group_id, [self.topic], who=group_id)
        self.rows = ArchivedTrajectories(archive_url, kafka.run, since_ms=parse_since(s.since),
                                         from_offset=s.from_offset, versions=parse_versions(s.policy_version),
                                         table=TOPIC_TABLE[logical])
        # What this replay's group already committed (from the topic or the archive) is done.
        done = self.member.committed_offsets(self.topic, self.rows.partitions())
        self.rows.resume(done)
        self._after = (-1, -1)
        self._end = False
        self._require_policy_version = True

    @property
    def consumer(self):
        return self.member.consumer

    def bind(self, on_assign, on_revoke, decoder) -> None:
        self._require_policy_version = decoder.require_policy_version  # no assignments: the archive is read whole

    def start(self) -> list[str]:
        return [self.topic]

    def consume(self, num: int, timeout: float) -> list[records.Consumed]:
        """The next page of archived rows as decoded records (their headers checked as a topic's would be)."""
        rows = self.rows.page(self._after, num)
        if not rows:
            self._end = True
            return []
        self._after = (rows[-1][0], rows[-1][1])
        return [self._consumed(*row) for row in rows]

    def _consumed(self, partition: int, offset: int, key: bytes, headers: list, record) -> records.Consumed:
        # The Avro value is built only for a dead letter, which keeps the original bytes.
        consumed = records.Consumed(self.topic, partition, offset, key, headers,
                                    lambda: records.encode(self.logical, record))
        try:
            header_map, version = records.check_headers(headers, require_policy_version=self._require_policy_version)
        except records.Rejected as rej:
            consumed.rejected = rej
            return consumed
        consumed.item = records.Incoming(self.logical, partition, offset, key, header_map, version, record)
        return consumed

    def seek(self, topic: str, partition: int, offset: int) -> None:
        # Pages run in (partition, offset) order: after an abort, read again from the earliest rewound record.
        self._after = min(self._after, (partition, offset - 1))
        self._end = False

    def pause(self, parts) -> None:
        pass

    def resume(self, parts) -> None:
        pass

    def group_metadata(self):
        return self.consumer.consumer_group_metadata()

    def exhausted(self) -> bool:
        return self._end

    def close(self) -> None:
        try:
            self.rows.close()
        finally:
            self.member.close()


def _replay_archive(stage: ReplayStage | TeacherReplayStage, kafka: KafkaSettings, runtime: RuntimeSettings,
                    s: ReplaySettings, archive_url: str, on_committed: Counter | None = None) -> ReplayResult:
    started = time.monotonic()
    group = f"{kafka.run}.{stage.name}"
    source = ArchiveSource(kafka, group, s, archive_url, stage.inputs[0])
    total = source.rows.count()
    progress = _Progress(total, s.progress, "traj")
    done = [0]

    def committed(n: int) -> None:
        done[0] += n
        progress.update(done[0])
        if on_committed is not None:
            on_committed(n)
    # One page of the archive is one transaction.
    runner = StageRunner(stage, kafka, dataclasses.replace(runtime, pipeline=False), source, on_committed=committed)
    log.info("replaying %d archived trajectories of run %s as group %s", total, kafka.run, group)
    try:
        runner.run()
    finally:
        progress.close()
    return ReplayResult(stage.scored, stage.skipped, time.monotonic() - started, "archive")


# -- entry points ------------------------------------------------------------------------------------------------

def replay(settings: ReplaySettings, kafka: KafkaSettings, runtime: RuntimeSettings = RuntimeSettings(),
           loop: LoopSettings = LoopSettings(), teacher: TeacherSettings | None = None,
           on_committed: Counter | None = None) -> ReplayResult:
    """Run one replay to the end of its range; returns what it scored. With ``teacher`` (its ``teacher_version``
    set, and no ``--reward-version``) the replay is the teacher's over the rewards topic. ``on_committed(n)``: after
    each transaction, the records it committed (the runner's hook, for a benchmark's clock)."""
    if teacher is not None and teacher.teacher_version and not settings.reward_version:
        stage = TeacherReplayStage(teacher, loop, parse_versions(settings.policy_version))
    else:
        stage = ReplayStage(settings)
    run = _replay_archive if settings.source == "archive" else _replay_topic
    return run(stage, kafka, runtime, settings, loop.archive, on_committed)


def cmd_replay(args: argparse.Namespace) -> None:
    replay_settings, loop = load(ReplaySettings, args), load(LoopSettings, args)
    kafka, runtime = load(KafkaSettings, args), load(RuntimeSettings, args)
    teacher = load(TeacherSettings, args)
    try:
        parse_since(replay_settings.since)
        parse_versions(replay_settings.policy_version)
        result = replay(replay_settings, kafka, runtime, loop, teacher)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    as_what = (f"reward version {replay_settings.reward_version}" if replay_settings.reward_version else
               f"teacher version {teacher.teacher_version}")
    print(f"replayed {result.scored} trajectories from the {result.source} as {as_what} "
          f"({result.skipped} outside --policy-version) in {result.seconds:.1f} s ({result.rate:.0f}/s)")


def add_command(subparsers) -> None:
    """``rlstream replay --run R --reward-version V --reward SPEC [--since T | --from-offset N | --policy-version A..B]``."""
    p = subparsers.add_parser("replay", help="score past trajectories again with a new reward version")
    add_arguments(p, LoopSettings)
    add_arguments(p, KafkaSettings)
    add_arguments(p, ReplaySettings)
    add_arguments(p, TeacherSettings)
    add_arguments(p, RuntimeSettings, skip=("instance", "metrics_port", "max_record_bytes", "poll_timeout_s"))
    p.set_defaults(func=cmd_replay)
