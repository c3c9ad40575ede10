"""Rollout's weight swaps, on a fake engine: when versions go in, and how a turn that spans two is labelled."""
from __future__ import annotations

import time

import pytest

from rlstream.runtime.stage import Incoming
from rlstream.schemas.records import SamplingParams, Task
from rlstream.stages.rollout import SWAP_STAMP, RolloutSettings, RolloutStage
from tests.helpers.engines import FakeBackend, FakeWatcher, pv


class FakeTokenizer:
    def __call__(self, text, **_):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids, **_):
        return "x" * len(ids)


def stage_with(backend: FakeBackend, swap: str = "step") -> tuple[RolloutStage, FakeWatcher]:
    stage = RolloutStage(RolloutSettings(swap=swap, retry_load_s=60, max_context=64))
    stage.follower.watcher = FakeWatcher(pv(0))
    stage.backend, stage.tokenizer, stage.follower.version = backend, FakeTokenizer(), 0
    return stage, stage.follower.watcher


def prompt_item(group: str = "g") -> Incoming:
    task = Task(task_id=group, group_id=group, task_name="t", env_name="e", env_version="1", prompt="abc>",
                sampling=SamplingParams(temperature=1.0, max_tokens=4), created_at=0, group_size=2)
    return Incoming("prompts", 0, 0, None, {}, -1, task)


def test_a_swap_between_engine_steps_labels_the_turn_with_its_oldest_version():
    stage, watcher = stage_with(FakeBackend(mid_generation=True))
    watcher.pending = [(3, pv(1))]  # announced while the generation runs, after two engine steps
    [outputs] = stage.handle_batch([prompt_item()])
    assert stage.version == 1 and stage.backend.loads == [1]
    for out in outputs:
        ep = out.record
        assert out.policy_version == 0, "the header must be the oldest version that produced a token"
        assert [t.policy_version for t in ep.turns] == [0]
        # per token: the weights that sampled it (v0 for the first tokens, v1 after the swap)
        assert ep.behaviour_logprobs == [-1.0, -1.0, -2.0, -2.0]
        assert ep.stage_times[f"{SWAP_STAMP}1"] == 1002 and f"{SWAP_STAMP}0" not in ep.stage_times
    # The next batch starts on v1 alone: no swap stamp, header 1.
    [outputs] = stage.handle_batch([prompt_item("h")])
    assert {o.policy_version for o in outputs} == {1}
    assert all(not any(k.startswith(SWAP_STAMP) for k in o.record.stage_times) for o in outputs)


def test_swap_batch_keeps_each_generation_on_one_version():
    stage, watcher = stage_with(FakeBackend(mid_generation=True), swap="batch")
    watcher.pending = [(1, pv(1))]
    [outputs] = stage.handle_batch([prompt_item()])
    assert stage.backend.loads == [] and {o.policy_version for o in outputs} == {0}
    assert all(o.record.behaviour_logprobs == [-1.0] * 4 for o in outputs)


def test_a_version_announced_before_the_batch_is_loaded_before_generating():
    # A backend that cannot swap mid-generation (transformers, openai) still starts the batch on the newest.
    stage, watcher = stage_with(FakeBackend(mid_generation=False))
    watcher.announce(pv(2))
    [outputs] = stage.handle_batch([prompt_item()])
    assert stage.backend.loads == [2] and {o.policy_version for o in outputs} == {2}
    assert all(o.record.behaviour_logprobs == [-3.0] * 4 for o in outputs)


def test_an_unloadable_version_is_not_retried_on_every_engine_step():
    stage, watcher = stage_with(FakeBackend(mid_generation=True, steps=6, fail={1}))
    watcher.announce(pv(1))
    [outputs] = stage.handle_batch([prompt_item()])
    assert stage.backend.loads == [1], "retried within retry_load_s"
    assert stage.version == 0 and {o.policy_version for o in outputs} == {0}
    watcher.announce(pv(2))  # a newer one is tried at once
    stage.handle_batch([prompt_item("h")])
    assert stage.backend.loads == [1, 2] and stage.version == 2


def test_the_swapper_thread_loads_a_new_version_while_the_engine_is_idle():
    stage, watcher = stage_with(FakeBackend(mid_generation=True))
    stage._start_swapper()
    try:
        watcher.announce(pv(1))
        deadline = time.monotonic() + 5
        while stage.version < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stage.version == 1 and stage.backend.loads == [1]
    finally:
        stage._stop.set()
        stage._swapper.join(5)
    assert not stage._swapper.is_alive()


@pytest.mark.parametrize("swap", ["step", "batch"])
def test_swap_is_a_typed_setting(swap, monkeypatch):
    from rlstream.config import from_sources
    monkeypatch.setenv("RLSTREAM_ROLLOUT_SWAP", swap)
    assert from_sources(RolloutSettings).swap == swap
    monkeypatch.setenv("RLSTREAM_ROLLOUT_SWAP", "sometimes")
    with pytest.raises(ValueError):
        from_sources(RolloutSettings)


def test_a_generic_openai_endpoint_is_refused_as_a_training_source_without_allow_unversioned(tmp_path):
    from rlstream.errors import UserError
    stage = RolloutStage(RolloutSettings(backend="openai", engine_url=("http://127.0.0.1:9",)))
    with pytest.raises(UserError, match="--allow-unversioned"):
        stage._make_backend(tmp_path, 0)
