"""Warm standbys (``--standby``) against the real broker: a standby waits while its instance is held, takes over
once the killed primary's session lapses, and the hop still loses and duplicates nothing."""
from __future__ import annotations

import time

import pytest

from rlstream.config import KafkaSettings
from rlstream.errors import UsageError
from rlstream.kafka.group import GroupMember
from rlstream.kafka.standby import await_vacancy
from rlstream.kafka.topics import topic_name
from tests.helpers.kafka import assert_rewarded_once, make_trajectory, produce, read_all, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SESSION_MS = 1000


def since_start(proc) -> str:
    """Its log since its last start."""
    text = proc.log_tail(200_000)
    return text[text.rfind("=== start"):]


@pytest.mark.timeout(300)
def test_a_standby_takes_over_a_killed_worker_and_nothing_is_lost_or_duplicated(bootstrap, run_name, tmp_path,
                                                                                  start_stage):
    n = 600
    produce(bootstrap, run_name, "trajectories",
            [(f"g{i % 50}".encode(), make_trajectory(i, group=i % 50), None) for i in range(n)])
    args = ["--reward", "tests.reward_fns:slow", "--batch-size", "25", "--concurrency", "1", "--no-pipeline",
            "--instance", "w0", "--standby", "--session-timeout-ms", str(SESSION_MS)]
    primary = start_stage("reward", bootstrap, run_name, *args, log_path=tmp_path / "primary.log")
    wait_for(lambda: len(read_all(bootstrap, run_name, "rewards", timeout=5)) >= 25, 90, "the primary's rewards")
    assert "no live member holds it" in since_start(primary)  # alone, a --standby worker is the primary at once
    standby = start_stage("reward", bootstrap, run_name, *args, log_path=tmp_path / "standby.log")
    wait_for(lambda: "standing by" in since_start(standby), 120, "the standby to stand by")
    assert primary.alive() and "taking over" not in since_start(standby), since_start(standby)
    primary.kill()
    killed_at = time.monotonic()
    partial = len(read_all(bootstrap, run_name, "rewards", timeout=5))
    assert partial < n, "the primary finished before it was killed; raise n"
    wait_for(lambda: "taking over" in since_start(standby), 60, "the standby to take over")
    # It waited out the session the broker gives the dead member, not a fixed pause of its own.
    assert time.monotonic() - killed_at >= SESSION_MS / 1000 * 0.5
    try:
        assert_rewarded_once(bootstrap, run_name, n, context=standby.log_tail())
    finally:
        assert standby.stop() == 0, standby.log_tail()


@pytest.mark.timeout(180)
def test_only_the_first_standby_in_line_takes_over_and_only_a_free_instance(bootstrap, run_name):
    """The line (rlstream/kafka/standby.py): two standbys of one instance never both take it over."""
    kafka = KafkaSettings(bootstrap=bootstrap, run=run_name)
    group = f"{run_name}.holders"

    def gives_up_after(polls: int):
        seen = []
        return lambda: seen.append(1) or len(seen) > polls

    with pytest.raises(UsageError, match="--instance"):
        await_vacancy(kafka, group, "", SESSION_MS, stopping=lambda: False)
    first = await_vacancy(kafka, group, "w0", SESSION_MS, stopping=lambda: False)  # alone and free: at once
    assert first is not None
    # A second standby of w0 queues behind the first, though nothing holds w0 in the group itself yet.
    assert await_vacancy(kafka, group, "w0", SESSION_MS, stopping=gives_up_after(15)) is None
    other = await_vacancy(kafka, group, "w1", SESSION_MS, stopping=gives_up_after(50))  # its own line
    assert other is not None
    other.leave()
    member = GroupMember(kafka, group, [topic_name(run_name, "prompts")], instance="w0",
                         session_timeout_ms=SESSION_MS, who="holder").subscribe()
    try:
        wait_for(lambda: member.consume(10, 0.2) is not None and member.consumer.assignment(), 60, "an assignment")
        first.leave()
        # First in line now, but a live member holds w0: it waits.
        assert await_vacancy(kafka, group, "w0", SESSION_MS, stopping=gives_up_after(15)) is None
    finally:
        member.close()
    # A static member that left holds its id until its session lapses; then the instance is free.
    taken = await_vacancy(kafka, group, "w0", SESSION_MS, stopping=gives_up_after(300))
    assert taken is not None
    taken.leave()
