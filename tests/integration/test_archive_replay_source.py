"""ArchivedTrajectories against the real broker and embedded chDB: archived trajectories come back as they were sent."""
from __future__ import annotations

import dataclasses

import pytest
from confluent_kafka import Producer

from rlstream.archive.query import read_endpoint
from rlstream.archive.replay_source import ArchivedTrajectories
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import Failure, SamplingParams, ToolCall, ToolResult, Trajectory, Turn
from tests.helpers.kafka import make_task
from tests.helpers.kafka import wait_for as _wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

T0 = 1_700_000_000_000  # Kafka timestamps: T0 + i seconds


def _trajectory(i: int) -> Trajectory:
    """A trajectory whose every field the archive keeps differs from its default in some of them."""
    task = dataclasses.replace(
        make_task(i, answer=None if i % 3 == 0 else "cba"), group_id=f"g{i % 2}", trace_id=f"{i:032x}",
        metadata={"source": f"s{i}"} if i % 2 else {}, prompt_token_ids=[5, 6, i], max_turns=2,
        sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=i, max_tokens=32, seed=i if i % 2 else None,
                                stop=["\n"] * (i % 2)))
    turns = [Turn("action", "calc(1+1)", 0, 3, policy_version=i, finish_reason="tool",
                  tool_call=ToolCall("calc", "1+1"), started_at=T0 + 1, finished_at=T0 + 9,
                  segment_versions=[i // 2, i], segment_tokens=[1, 2],
                  tool_result=ToolResult("2", exit_code=i % 2, duration_ms=2.5, truncated=i % 3 == 1,
                                         failure_class="oom" if i % 2 else None)),
             Turn("observation", "2", 3, 4, policy_version=i, started_at=T0 + 10, finished_at=T0 + 11)][:i % 3]
    return Trajectory(trajectory_id=f"traj-{i}", group_id=task.group_id, sample_index=i, task=task,
                      response=f"answer {i}", min_policy_version=i // 2, max_policy_version=i,
                      token_ids=list(range(i + 1)), loss_mask=[i % 2] * (i + 1),
                      behaviour_logprobs=[-0.25 * k for k in range(i + 1)],  # exact in float32, as archived
                      turns=turns, status="failed" if i % 4 == 3 else "ok",
                      failure=Failure("env_error", f"boom {i}", "env") if i % 4 == 3 else None,
                      stage_times={"rollout.start": T0 + i, "rollout.end": T0 + 2 * i}, trace_id=task.trace_id)


@pytest.mark.timeout(300)
def test_archived_trajectories_page_back_as_they_were_sent(bootstrap, run_name, tmp_path, start_stage):
    """Pages in (partition, offset) order rebuild every record, key and header; each filter and resume cuts rows."""
    sent = {}  # (partition, offset) -> (key, policy_version, traceparent, produced_at, timestamp, trajectory)
    producer = Producer({"bootstrap.servers": bootstrap})
    codec = default_codec()
    for i in range(10):
        partition, offset = i % 2, i // 2  # the run's topics are new: offsets start at 0
        traceparent, produced = hdr.new_traceparent(), T0 + 100 + i
        traj = _trajectory(i)
        producer.produce(topic_name(run_name, "trajectories"), value=codec.encode("Trajectory", traj.to_dict()),
                         key=f"k{i}".encode(), partition=partition, timestamp=T0 + 1000 * i,
                         headers=hdr.build(i % 4, traceparent, produced_at=produced))
        sent[(partition, offset)] = (f"k{i}".encode(), i % 4, traceparent, produced, T0 + 1000 * i, traj)
    producer.flush(30)

    path = tmp_path / "archive"
    url = f"chdb://{path}"
    log = tmp_path / "archive.log"
    proc = start_stage("archive", bootstrap, run_name, "--archive", url, "--archive-flush-s", "0.3", log_path=log)
    try:
        _wait_for(lambda: read_endpoint(str(path)) or not proc.alive(), 60, "the SQL endpoint")
        assert proc.alive(), log.read_text()[-3000:]
        with ArchivedTrajectories(url, run_name) as source:
            _wait_for(lambda: source.count() == len(sent), 90, f"{len(sent)} archived trajectories")
            assert source.partitions() == [0, 1]
            got, after = [], (-1, -1)
            while page := source.page(after, 3):
                assert len(page) <= 3
                got += page
                after = page[-1][:2]
        assert [(p, o) for p, o, *_ in got] == sorted(sent)
        for partition, offset, key, headers, traj in got:
            want_key, pv, traceparent, produced, _, want = sent[(partition, offset)]
            assert key == want_key
            assert hdr.as_dict(headers) == {hdr.POLICY_VERSION: str(pv).encode(), hdr.TRACEPARENT: traceparent.encode(),
                                            hdr.PRODUCED_AT: str(produced).encode()}
            for field in dataclasses.fields(Trajectory):
                assert getattr(traj, field.name) == getattr(want, field.name), (partition, offset, field.name)

        def selected(**filters) -> list[tuple[int, int]]:
            with ArchivedTrajectories(url, run_name, **filters) as source:
                rows = [(p, o) for p, o, *_ in source.page((-1, -1), 100)]
                assert source.count() == len(rows)
                return rows

        assert selected(versions=(1, 2)) == sorted(k for k, v in sent.items() if 1 <= v[1] <= 2)
        assert selected(versions=(None, 1)) == sorted(k for k, v in sent.items() if v[1] <= 1)
        assert selected(versions=(3, None)) == sorted(k for k, v in sent.items() if v[1] >= 3)
        assert selected(from_offset=3) == sorted(k for k in sent if k[1] >= 3)
        assert selected(since_ms=T0 + 6000) == sorted(k for k, v in sent.items() if v[4] >= T0 + 6000)
        assert selected(resume={0: 2, 1: 4}) == sorted(k for k in sent if k[1] >= (2, 4)[k[0]])
        assert selected(resume={1: 4}, from_offset=1) == sorted(k for k in sent if k[1] >= (1, 4)[k[0]])
        assert selected(versions=(9, None)) == []
    finally:
        assert proc.stop() == 0, log.read_text()[-3000:]
