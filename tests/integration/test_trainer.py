"""The trainer against the real broker: staleness bound, resume after restart, dead letters."""
from __future__ import annotations

import pytest

from rlstream.config import KafkaSettings
from rlstream.schemas import headers as hdr
from rlstream.trainer.shards import holds_state
from tests.helpers.kafka import produce, read_all, wait_for
from tests.helpers.trainer import G, produce_groups, scored_group, start, wait_version

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(1350)
def test_stale_samples_are_never_trained_on_and_restart_resumes(bootstrap, run_name, tmp_path):
    trainer, thread = start(bootstrap, run_name, tmp_path)
    wait_version(trainer, 0)
    # v0 -> v1 -> v2 on fresh samples.
    produce_groups(bootstrap, run_name, [1, 2], version=0)
    wait_version(trainer, 1)
    produce_groups(bootstrap, run_name, [3, 4], version=1)
    wait_version(trainer, 2)
    # At v2 with eta=1, samples of v0 are stale; v1 and v2 are fine. Interleave them.
    produce_groups(bootstrap, run_name, [50], version=0)
    produce_groups(bootstrap, run_name, [5], version=1)
    produce_groups(bootstrap, run_name, [51], version=0)
    produce_groups(bootstrap, run_name, [6], version=2)
    wait_version(trainer, 3)
    # A record that is not a ScoredTrajectory is dead-lettered in the next step's transaction.
    produce(bootstrap, run_name, "rewards", [(b"junk", b"\x00junk", hdr.build(2, hdr.new_traceparent()))])
    produce_groups(bootstrap, run_name, [7, 8], version=3)
    wait_version(trainer, 4)
    trainer.stop()
    thread.join(60)
    assert not thread.is_alive()

    trained = {gid for _, groups in trainer.trained for gid in groups}
    assert trained == {f"task-{g}" for g in (1, 2, 3, 4, 5, 6, 7, 8)}
    assert not trained & {"task-50", "task-51"}, "a sample older than eta versions reached a batch"
    assert trainer.counter.stale == 2 * G

    # Restart: the new trainer resumes from the last announced version and continues with the next one.
    trainer2, thread2 = start(bootstrap, run_name, tmp_path)
    wait_version(trainer2, 4)
    assert trainer2.version == 4
    produce_groups(bootstrap, run_name, [9, 10], version=4)
    wait_version(trainer2, 5)
    trainer2.stop()
    thread2.join(60)
    assert trainer2.trained == [(4, ["task-9", "task-10"])], "restarted trainer retrained or skipped samples"

    versions = [r.record for r in read_all(bootstrap, run_name, "policy-versions")]
    assert [v.version for v in versions] == [0, 1, 2, 3, 4, 5]
    assert versions[-1].parent_version == 4 and versions[-1].samples_trained == 2 * G
    letters = read_all(bootstrap, run_name, "dead-letters")
    assert [(l.key, l.record.reason, l.record.stage) for l in letters] == [(b"junk", "malformed", "trainer")]


@pytest.mark.timeout(690)
def test_groups_trained_past_a_held_head_are_not_trained_again_after_a_restart(bootstrap, run_name, tmp_path):
    """The window trains complete groups out of log order; a restart reads again from the committed offsets
    (the incomplete head) and must skip what was already trained past it."""
    head = scored_group(0)
    produce(bootstrap, run_name, "rewards", [(b"task-0", s, hdr.build(0, hdr.new_traceparent(), "v1"))
                                             for s in head[:G - 1]])
    produce_groups(bootstrap, run_name, [1, 2], version=0)
    trainer, thread = start(bootstrap, run_name, tmp_path)
    wait_version(trainer, 1)
    trainer.stop()
    thread.join(60)
    assert trainer.trained == [(0, ["task-1", "task-2"])]

    trainer2, thread2 = start(bootstrap, run_name, tmp_path)
    wait_version(trainer2, 1)
    produce_groups(bootstrap, run_name, [3], version=1)  # one complete group: not enough for a step of two
    wait_for(lambda: "task-3" in trainer2.window.window_group_ids() and trainer2.window.pending_samples >= G, 60,
             "trainer 2 to read group 3")
    trainer2.settled()  # it would have trained by now, had it taken groups 1 and 2 for new
    assert trainer2.trained == [], "groups 1 and 2 were trained a second time after the restart"
    produce(bootstrap, run_name, "rewards", [(b"task-0", head[G - 1], hdr.build(0, hdr.new_traceparent(), "v1"))])
    wait_version(trainer2, 2)
    trainer2.stop()
    thread2.join(60)
    assert trainer2.trained == [(1, ["task-0", "task-3"])]


@pytest.mark.timeout(300)
def test_a_failed_judgement_is_not_trained_on_and_its_group_trains_without_it(bootstrap, run_name, tmp_path):
    """A reward whose judge raised or timed out (failure class judge_error / judge_timeout), or whose episode the
    infrastructure failed (env_unreachable), is no reward: its group trains with the other samples, and a failed
    episode's reward of 0 is still trained on."""
    trainer, thread = start(bootstrap, run_name, tmp_path)
    wait_version(trainer, 0)
    items = []
    for g in (1, 2):
        for i, scored in enumerate(scored_group(g)):
            if g == 1 and i == 0:
                scored.reward.failure_class = "judge_timeout"
            if g == 1 and i == 1:
                scored.reward.failure_class = "timeout"  # the episode failed: a real 0
            if g == 2 and i == 0:
                scored.reward.failure_class = "env_unreachable"  # the env server never answered: no verdict
            items.append((f"task-{g}".encode(), scored, hdr.build(0, hdr.new_traceparent(), "v1")))
    produce(bootstrap, run_name, "rewards", items)
    wait_version(trainer, 1)
    trainer.stop()
    thread.join(60)
    assert trainer.trained == [(0, ["task-1", "task-2"])]
    versions = [r.record for r in read_all(bootstrap, run_name, "policy-versions", expect=2)]
    assert versions[-1].samples_trained == 2 * G - 2


@pytest.mark.timeout(900)
def test_a_restart_resumes_adam_from_the_newest_optimizer_state_written_every_k_versions(bootstrap, run_name,
                                                                                          tmp_path):
    """--checkpoint-every 3: the optimizer state goes with v0 (a process's first) and v3 only, and stays in the store
    past η while it is the newest; a trainer killed at v4 resumes v4's weights with v3's Adam (3 steps taken)."""
    trainer, thread = start(bootstrap, run_name, tmp_path, checkpoint_every=3)
    wait_version(trainer, 0)
    for v in range(4):
        produce_groups(bootstrap, run_name, [10 * v + 1, 10 * v + 2], version=v)
        wait_version(trainer, v + 1)
    trainer.stop()
    thread.join(60)
    store = tmp_path / "weights" / "policy"
    held = {int(p.name[1:]): holds_state(p) for p in store.glob("v*") if p.name[1:].isdigit()}
    # η = 1 keeps v2..v4; v0 is always kept; v3 holds the newest optimizer state.
    assert held == {0: True, 2: False, 3: True, 4: False}

    trainer2, thread2 = start(bootstrap, run_name, tmp_path, checkpoint_every=3)
    wait_version(trainer2, 4)
    assert trainer2.engine.steps == 3, "Adam did not resume from v3's optimizer state"
    produce_groups(bootstrap, run_name, [50, 51], version=4)
    wait_version(trainer2, 5)
    trainer2.stop()
    thread2.join(60)
    assert trainer2.trained == [(4, ["task-50", "task-51"])], "restarted trainer retrained or skipped samples"
    assert holds_state(store / "v5"), "a restarted trainer's first version carries the state"


@pytest.mark.timeout(300)
def test_a_bf16_publish_resumes_the_fp32_master_bit_for_bit(bootstrap, run_name, tmp_path):
    """--publish-dtype bf16 on the fp32 tiny model: the announced folders are bf16 and match the hash their
    PolicyVersion carries; a restart resumes the fp32 weights as trained, not their bf16 rounding."""
    import torch

    from rlstream.policy.deltas import folder_hash
    from rlstream.policy.watcher import last_policy_version
    from rlstream.policy.weights import local_path
    trainer, thread = start(bootstrap, run_name, tmp_path, publish_dtype="bf16")
    wait_version(trainer, 0)
    produce_groups(bootstrap, run_name, [1, 2], version=0)
    wait_version(trainer, 1)
    trainer.stop()
    thread.join(60)
    trained = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    pv = last_policy_version(KafkaSettings(bootstrap=bootstrap, run=run_name).client_config(), run_name, "policy")
    folder = local_path(pv.weights_uri)
    assert pv.version == 1 and folder_hash(folder) == pv.content_hash
    from safetensors.torch import load_file
    assert {t.dtype for t in load_file(str(folder / "model.safetensors")).values()} == {torch.bfloat16}

    trainer2, thread2 = start(bootstrap, run_name, tmp_path, publish_dtype="bf16")
    wait_version(trainer2, 1)
    trainer2.stop()
    thread2.join(60)
    resumed = trainer2.model.state_dict()
    assert all(resumed[k].dtype == torch.float32 and torch.equal(resumed[k], v) for k, v in trained.items())
