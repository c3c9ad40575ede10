"""Replay throughput: trajectories/s re-scored under a new reward version, against the live reward stage.

Produces N trajectories to a fresh run, scores them once with the reward stage (the
baseline: the same runtime under the stage's own group), then replays them from the
topic under a new version, and (with --archive) from the archive after 'retention',
through a running archive process as a user would.

Each rate is its stage's pace once running: the records committed after its first transaction over the time from
that commit to its last (``Pace``). Its start (the live stage's group join, each producer's transactions' init, a
replay's plan) is another cost, paid once per process: at `make bench`'s 5,000 records of 16 tokens it was most
of a whole-run rate and made that rate swing 2.3x from run to run. The whole-run rates, start included, are
reported beside them (``*_whole_per_s``).

    python -m benchmarks.replay_throughput --count 20000 [--archive]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from confluent_kafka import Producer

from benchmarks.harness.record import record
from benchmarks.harness.scratch import discard_at_exit, run_name
from rlstream.archive.query import open_archive, read_endpoint
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.kafka.topics import create_topics, topic_name
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import SamplingParams, Task, Trajectory, Turn
from rlstream.stages.replay import ReplaySettings, replay
from rlstream.stages.reward import RewardSettings, RewardStage


def trajectory(i: int, tokens: int) -> Trajectory:
    task = Task(task_id=f"task-{i // 8}", group_id=f"task-{i // 8}", task_name="reverse", env_name="single",
                env_version="1", prompt="abc>", sampling=SamplingParams(), created_at=hdr.now_ms(), answer="cba",
                group_size=8)
    response = "cba" if i % 3 else "abc"
    return Trajectory(trajectory_id=f"traj-{i}", group_id=task.group_id, sample_index=i % 8, task=task,
                      response=response, min_policy_version=i // 1000, max_policy_version=i // 1000,
                      token_ids=list(range(tokens)), loss_mask=[1] * tokens, behaviour_logprobs=[-0.5] * tokens,
                      turns=[Turn("action", response, 0, tokens, policy_version=i // 1000)],
                      stage_times={"prompt.created": hdr.now_ms(), "env.end": hdr.now_ms()})


class Pace:
    """A stage's committed records per second from its first commit to its last (the runner's ``on_committed``)."""

    def __init__(self) -> None:
        self.records, self.first_n = 0, 0
        self.started, self.first, self.last = time.monotonic(), 0.0, 0.0

    def __call__(self, n: int) -> None:
        now = time.monotonic()
        if not self.records:
            self.first, self.first_n = now, n
        self.records += n
        self.last = now

    @property
    def rate(self) -> float:
        """Once running: the records after the first transaction's, over the time after it (nan with one commit)."""
        return (self.records - self.first_n) / (self.last - self.first) if self.last > self.first else float("nan")

    @property
    def whole_rate(self) -> float:
        """From the stage's start (its group join and producer init included) to its last commit."""
        return self.records / (self.last - self.started) if self.last > self.started else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--bootstrap", default=os.environ.get("RLSTREAM_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--archive", action="store_true", help="also replay from the archive (starts one)")
    args = parser.parse_args()
    run = run_name("replay")
    create_topics({"bootstrap.servers": args.bootstrap}, run)
    discard_at_exit(args.bootstrap, run)
    kafka = KafkaSettings(bootstrap=args.bootstrap, run=run)
    runtime = RuntimeSettings(batch_size=args.batch_size, poll_timeout_s=0.1)

    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 20, "compression.type": "lz4"})
    codec = default_codec()
    for i in range(args.count):
        t = trajectory(i, args.tokens)
        producer.produce(topic_name(run, "trajectories"), key=t.group_id,
                         value=codec.encode("Trajectory", t.to_dict()),
                         headers=hdr.build(t.min_policy_version, hdr.new_traceparent()))
        if i % 10000 == 0:
            producer.poll(0)
    producer.flush(60)
    print(f"run {run}: {args.count:,} trajectories of {args.tokens} tokens")

    # Timed by its commits through the runner's hook, whichever path the stage takes (a sync judge runs on the
    # pool, not through ``handle``: a subclass timing ``handle`` saw nothing and printed a negative rate).
    live = Pace()
    StageRunner(RewardStage(RewardSettings(reward_version="v1")), kafka, runtime,
                on_committed=live).run(idle_exit_s=3.0)
    if live.records != args.count:
        raise SystemExit(f"the live reward stage committed {live.records} of {args.count} trajectories")
    print(f"live reward stage (baseline):   {live.rate:8.0f} trajectories/s  ({live.whole_rate:.0f}/s from its start)")

    topic = Pace()
    result = replay(ReplaySettings(reward_version="v2", progress=sys.stderr.isatty()), kafka, runtime,
                    on_committed=topic)
    assert result.scored == args.count, result
    print(f"replay from the topic:          {topic.rate:8.0f} trajectories/s  ({topic.rate / live.rate:.2f}x baseline; "
          f"{topic.whole_rate:.0f}/s from its start)")
    figures = {"count": args.count, "live_per_s": live.rate, "topic_per_s": topic.rate,
               "topic_ratio": topic.rate / live.rate, "live_whole_per_s": live.whole_rate,
               "topic_whole_per_s": topic.whole_rate}

    if args.archive:
        path = tempfile.mkdtemp(prefix="rlstream-replaybench-")
        env = dict(os.environ, RLSTREAM_BOOTSTRAP=args.bootstrap, RLSTREAM_RUN=run)
        proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "run", "archive", "--archive", f"chdb://{path}"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                if read_endpoint(path):
                    with open_archive(f"chdb://{path}") as db:
                        if db.query("SELECT count() FROM rlstream.trajectories")[1][0][0] >= args.count:
                            break
                time.sleep(0.5)
            archived = Pace()
            result = replay(ReplaySettings(reward_version="v3", source="archive", progress=sys.stderr.isatty()),
                            kafka, runtime, LoopSettings(archive=f"chdb://{path}"), on_committed=archived)
            assert result.scored == args.count, result
            print(f"replay from the archive:        {archived.rate:8.0f} trajectories/s  "
                  f"({archived.rate / live.rate:.2f}x baseline; {archived.whole_rate:.0f}/s from its start)")
            figures.update(archive_per_s=archived.rate, archive_ratio=archived.rate / live.rate,
                           archive_whole_per_s=archived.whole_rate)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            shutil.rmtree(path, ignore_errors=True)
    record("replay_throughput", figures)


if __name__ == "__main__":
    main()
