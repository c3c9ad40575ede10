"""The stage runtime against the real broker: exactly once across SIGKILL, and dead letters."""
from __future__ import annotations

import pytest

from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from tests.helpers.kafka import assert_rewarded_once, make_trajectory, produce, read_all, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.parametrize("n,mode", [
    (400, ["--reward", "tests.reward_fns:slow", "--batch-size", "25", "--concurrency", "1", "--no-pipeline"]),
    # Pipelined: 32 heavy-tailed judgements in flight across polls, finished out of order, committed in order.
    (4000, ["--reward", "tests.reward_fns:jittery", "--batch-size", "25", "--concurrency", "32",
            "--commit-interval-s", "0.05"]),
], ids=["batch", "pipelined"])
@pytest.mark.timeout(480)
def test_sigkill_mid_batch_loses_and_duplicates_nothing(bootstrap, run_name, tmp_path, start_stage, n, mode):
    """(a) Kill -9 a stage inside a transaction, restart it: every input appears exactly once downstream."""
    produce(bootstrap, run_name, "trajectories",
            [(f"g{i % 50}".encode(), make_trajectory(i, group=i % 50), None) for i in range(n)])
    args = [*mode, "--instance", "w0"]
    log = tmp_path / "stage.log"
    proc = start_stage("reward", bootstrap, run_name, *args, log_path=log)
    # Let it commit a few transactions, then kill it while a batch is being handled.
    wait_for(lambda: len(read_all(bootstrap, run_name, "rewards", timeout=5)) >= 50, 90, "first committed rewards")
    proc.kill()
    partial = len(read_all(bootstrap, run_name, "rewards", timeout=5))
    assert partial < n, "the stage finished before it could be killed; raise n"
    proc.start()  # the same --instance: its transactional id fences what the killed one left open
    try:
        assert_rewarded_once(bootstrap, run_name, n, context=proc.log_tail())
        rewards = read_all(bootstrap, run_name, "rewards")
    finally:
        assert proc.stop() == 0, proc.log_tail()
    assert all(r.headers["reward_version"] == b"v1" for r in rewards)


@pytest.mark.timeout(270)
def test_bad_records_go_to_dead_letters_and_good_ones_flow(bootstrap, run_name, tmp_path, start_stage):
    """(b) Every kind of bad input ends in dead-letters with its reason; the good records still get rewards, and a
    judge that raises or hangs gives a reward carrying its failure class."""
    codec = default_codec()
    good = [make_trajectory(i, response="cba") for i in range(10)]
    unknown_fp = b"\xc3\x01" + b"\x13" * 8 + codec.encode("Trajectory", good[0].to_dict())[10:]
    ok_headers = lambda: hdr.build(0, hdr.new_traceparent())  # noqa: E731
    bad = [
        (b"malformed", b"\x00\x01garbage", ok_headers(), "malformed"),
        (b"truncated", codec.encode("Trajectory", good[0].to_dict())[:40], ok_headers(), "malformed"),
        (b"unknown", unknown_fp, ok_headers(), "unknown_schema"),
        (b"no-version", make_trajectory(100), [("traceparent", hdr.new_traceparent().encode())], "bad_header"),
        (b"text-version", make_trajectory(101), [("policy_version", b"seven")], "bad_header"),
        (b"wrong-record", codec.encode("Task", good[0].task.to_dict()), ok_headers(), "wrong_record"),
        (b"nan", make_trajectory(104, response="nan"), None, "invalid"),
        (b"inf", make_trajectory(105, response="inf"), None, "invalid"),
        (b"wrongtype", make_trajectory(106, response="wrongtype"), None, "handler_error"),
    ]
    judge_failures = {b"raises": (make_trajectory(102, response="raise"), "judge_error"),
                      b"hangs": (make_trajectory(103, response="hang"), "judge_timeout")}
    items = [(key, t, None) for key, (t, _) in judge_failures.items()]
    for i, g in enumerate(good):
        items.append((b"good", g, None))
        if i < len(bad):
            key, value, headers, _ = bad[i]
            items.append((key, value, headers))
    items += [(k, v, h) for k, v, h, _ in bad[len(good):]]
    produce(bootstrap, run_name, "trajectories", items)
    log = tmp_path / "stage.log"
    proc = start_stage("reward", bootstrap, run_name, "--reward", "tests.reward_fns:picky",
                       "--handler-timeout-s", "2", "--judge-timeout-s", "1", "--batch-size", "8", log_path=log)
    try:
        rewards = read_all(bootstrap, run_name, "rewards", expect=len(good) + len(judge_failures), timeout=90)
        letters = read_all(bootstrap, run_name, "dead-letters", expect=len(bad), timeout=60)
    finally:
        # SIGTERM ends cleanly even with a handler thread still hung.
        assert proc.stop(timeout=20) == 0, proc.log_tail()
    judged = {r.key: r.record.reward for r in rewards if r.key in judge_failures}
    assert {k: r.failure_class for k, r in judged.items()} == {k: cls for k, (_, cls) in judge_failures.items()}
    assert all(r.total == 0.0 and r.violations[0].startswith(r.failure_class) for r in judged.values())
    scored = [r for r in rewards if r.key not in judge_failures]
    assert sorted(r.record.trajectory.trajectory_id for r in scored) == sorted(g.trajectory_id for g in good)
    assert all(r.record.reward.total == 1.0 and r.record.reward.failure_class is None for r in scored)
    by_key = {l.key: l.record for l in letters}
    assert {k: v.reason for k, v in by_key.items()} == {k: reason for k, _, _, reason in bad}
    for key, value, _, _ in bad:
        letter = by_key[key]
        assert letter.stage == "reward" and letter.topic.endswith(".trajectories")
        raw = value if isinstance(value, bytes) else codec.encode("Trajectory", value.to_dict())
        assert letter.value == raw, "the dead letter keeps the original bytes"
        assert letter.error
