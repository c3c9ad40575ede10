"""Env step logic without Kafka: single-turn, calculator tool use, failures and invalid episodes."""
from __future__ import annotations

import pytest

from rlstream import rewards
from rlstream.runtime.stage import Incoming, InvalidRecord
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import Episode, Failure, SamplingParams, Task, Trajectory, Turn
from rlstream.sources import tool_tasks
from rlstream.stages.env import (ENVIRONMENTS, Calculator, Environment, EnvSettings, EnvStage, SingleTurn, StepResult,
                                 tool_calls)


def make_task(env: str = "single", max_turns: int = 1, answer: str = "46") -> Task:
    return Task(task_id="t1", group_id="g1", task_name=env, env_name=env, env_version="1",
                prompt="what is 12+34? use calc", sampling=SamplingParams(), created_at=hdr.now_ms(),
                answer=answer, max_turns=max_turns)


def make_episode(env: str = "single", actions: tuple[str, ...] = ("cba",), max_turns: int = 1,
                 versions: tuple[int, ...] | None = None, observations: tuple[str, ...] = ()) -> Episode:
    """An episode as rollout writes it: actions interleaved with tokenized observations, 2 tokens a turn."""
    ep = Episode(episode_id="g1:0", group_id="g1", sample_index=0, task=make_task(env, max_turns),
                 stage_times={"rollout.end": 1}, trace_id="trace")
    versions = versions or tuple(range(len(actions)))
    for i, text in enumerate(actions):
        if i:
            start = len(ep.token_ids)
            ep.turns.append(Turn("observation", observations[i - 1] if observations else "=46\n", start, start + 2))
            ep.token_ids += [7, 7]
            ep.loss_mask += [0, 0]
            ep.behaviour_logprobs += [0.0, 0.0]
        start = len(ep.token_ids)
        ep.token_ids += [1, 2]
        ep.loss_mask += [1, 1]
        ep.behaviour_logprobs += [-0.5, -0.5]
        ep.turns.append(Turn("action", text, start, start + 2, policy_version=versions[i], finish_reason="stop"))
    return ep


def incoming(ep: Episode, version: int = 0) -> Incoming:
    return Incoming("actions", 0, 0, ep.episode_id.encode(), {}, version, ep)


@pytest.fixture(scope="module")
def stage() -> EnvStage:
    return EnvStage(EnvSettings(tool_timeout_s=1.5, sandbox="subprocess"))


def test_single_turn_becomes_a_trajectory(stage):
    [out] = stage.handle(incoming(make_episode("single", ("cba",))))
    traj: Trajectory = out.record
    assert out.topic == "trajectories" and out.key == "g1" and out.policy_version == 0
    assert traj.status == "ok" and traj.failure is None and traj.response == "cba"
    assert traj.trajectory_id == "g1:0" and traj.token_ids == [1, 2] and traj.loss_mask == [1, 1]
    assert "env.end" in traj.stage_times and traj.stage_times["rollout.end"] == 1 and traj.trace_id == "trace"
    assert SingleTurn().step(make_episode()).done


def test_single_turn_cut_by_length_is_truncated(stage):
    ep = make_episode("single", ("cb",))
    ep.turns[-1].finish_reason = "length"
    assert stage.handle(incoming(ep))[0].record.status == "truncated"


@pytest.mark.parametrize("text, expr", [("calc(12+34)", "12+34"), ("so calc((1+2)*3) then", "(1+2)*3"),
                                        ("no call here", None), ("calc(1+", "")])
def test_find_call(text, expr):
    assert Calculator.find_call(text) == expr


def test_calculator_tool_call_becomes_an_observation(stage):
    ep = make_episode("calculator", ("calc(12+34)",), max_turns=4)
    [out] = stage.handle(incoming(ep))
    assert out.topic == "observations" and out.key == "t1" and out.policy_version is None  # the task id: episode_key
    obs = out.record.turns[-1]
    assert obs.role == "observation" and obs.text == "=46\n"
    assert obs.token_start == obs.token_end == len(out.record.token_ids) == 2, "rollout tokenizes and fills the span"
    action = out.record.turns[0]
    assert action.tool_call.name == "calc" and action.tool_call.arguments == "12+34"
    assert action.tool_result.output == "46\n" and action.tool_result.failure_class is None
    assert not out.record.done


def test_calculator_final_answer_ends_the_episode_and_records_the_tool(stage):
    first = stage.handle(incoming(make_episode("calculator", ("calc(12+34)",), max_turns=4)))[0].record
    ep = make_episode("calculator", ("calc(12+34)", "46"), max_turns=4, versions=(3, 5))
    ep.turns[0].tool_call, ep.turns[0].tool_result = first.turns[0].tool_call, first.turns[0].tool_result
    [out] = stage.handle(incoming(ep))
    traj = out.record
    assert out.topic == "trajectories" and out.key == "g1" and traj.status == "ok"
    assert (traj.min_policy_version, traj.max_policy_version, out.policy_version) == (3, 5, 3)
    assert traj.response == "calc(12+34)=46\n46"
    assert [c.arguments for c in tool_calls(traj, "calc")] == ["12+34"]
    reward = rewards.calculator_reward(traj)
    assert reward.total == 1.0 and reward.breakdown == {"correct": 1.0, "used_tool": 1.0}
    # The same answer without the tool earns nothing: the task demands the call.
    no_tool = stage.handle(incoming(make_episode("calculator", ("46",), max_turns=4)))[0].record
    assert tool_calls(no_tool) == [] and rewards.calculator_reward(no_tool).total == 0.0


def test_calculator_errors_are_observations(stage):
    for text, expected in [("calc(1/0)", "=error: ZeroDivisionError: division by zero\n"),
                           ("calc(__import__('os'))", "=error: calc takes numbers and + - * / // % ** ( )\n")]:
        [out] = stage.handle(incoming(make_episode("calculator", (text,), max_turns=4)))
        assert out.topic == "observations" and out.record.turns[-1].text == expected


def test_calculator_max_turns_truncates(stage):
    ep = make_episode("calculator", ("calc(1+1)", "calc(2+2)"), max_turns=2)
    [out] = stage.handle(incoming(ep))
    assert out.topic == "trajectories" and out.record.status == "truncated"
    assert out.record.turns[-1].tool_call.arguments == "2+2" and out.record.turns[-1].tool_result is None


def test_hanging_tool_is_a_failed_trajectory(stage):
    [out] = stage.handle(incoming(make_episode("calculator", ("calc(9**9**9)",), max_turns=4)))
    traj = out.record
    assert out.topic == "trajectories" and traj.status == "failed"
    assert traj.failure.failure_class == "timeout" and traj.failure.stage == "env"
    assert traj.turns[-1].tool_result.failure_class == "timeout"


def test_python_env(stage):
    [out] = stage.handle(incoming(make_episode("python", ("```python\nprint(6*7)\n```",), max_turns=3)))
    assert out.topic == "observations" and out.record.turns[-1].text == "42\n"
    [out] = stage.handle(incoming(make_episode("python", ("```python\nwhile True: pass\n```",), max_turns=3)))
    assert out.record.status == "failed" and out.record.failure.failure_class == "timeout"
    [out] = stage.handle(incoming(make_episode("python", ("the answer is 42",), max_turns=3)))
    assert out.topic == "trajectories" and out.record.status == "ok"


def test_episode_failed_upstream_is_still_recorded(stage):
    ep = make_episode("single", ("x",))
    ep.failure, ep.done = Failure("prompt_too_long", "no room", "rollout"), True
    [out] = stage.handle(incoming(ep))
    assert out.record.status == "failed" and out.record.failure.stage == "rollout"


def test_env_bug_fails_the_episode_not_the_stage(stage, monkeypatch):
    class Broken(Environment):
        name = "broken"

        def step(self, episode):
            raise RuntimeError("bug")

    monkeypatch.setitem(ENVIRONMENTS, "broken", lambda sandbox: Broken())
    [out] = stage.handle(incoming(make_episode("broken", ("x",))))
    assert out.record.status == "failed" and out.record.failure.failure_class == "env_error"


def test_invalid_episodes_are_rejected(stage):
    unknown = make_episode("nosuchenv", ("x",))
    not_action = make_episode("calculator", ("calc(1+1)",), max_turns=4)
    not_action.turns.append(Turn("observation", "=2\n", 2, 2))
    misaligned = make_episode("single", ("x",))
    misaligned.loss_mask.append(1)
    out_of_range = make_episode("single", ("x",))
    out_of_range.turns[-1].token_end = 9
    for ep in (unknown, not_action, misaligned, out_of_range):
        with pytest.raises(InvalidRecord):
            stage.handle(incoming(ep))


def test_an_unpipelined_batch_of_single_turn_episodes_is_one_call_with_what_each_record_gives_alone(stage):
    """EnvStage.handle_batch (--no-pipeline): episodes that cannot block are stepped on the calling thread, each
    with the outputs ``handle`` gives it, a bad one refused alone; pipelined stays the default."""
    failed = make_episode("single", ("x",))
    failed.failure, failed.done = Failure("prompt_too_long", "no room", "rollout"), True
    finished_tool = make_episode("calculator", ("calc(1+1)",), max_turns=3)
    finished_tool.done = True  # a tool env's finished episode runs no tool
    misaligned = make_episode("single", ("x",))
    misaligned.loss_mask.append(1)
    episodes = [make_episode("single", ("cba",)), failed, finished_tool, make_episode("nosuchenv", ("x",)),
                misaligned]
    out = stage.handle_batch([incoming(ep) for ep in episodes])
    assert stage.batched is False
    assert len(out) == 5 and all(isinstance(o, list) for o in out[:3])
    alone = [stage.handle(incoming(ep)) for ep in episodes[:3]]
    for got, want in zip(out[:3], alone):
        assert [(o.topic, o.key, o.policy_version, o.record.status, o.record.response) for o in got] == \
               [(o.topic, o.key, o.policy_version, o.record.status, o.record.response) for o in want]
    assert [o.record.status for o, in out[:3]] == ["ok", "failed", "ok"]
    assert isinstance(out[3], InvalidRecord) and "unknown env" in str(out[3])
    assert isinstance(out[4], InvalidRecord)


@pytest.mark.parametrize("episode", [make_episode("calculator", ("calc(1+1)",), max_turns=3),
                                     make_episode("python", ("```python\nprint(1)\n```",), max_turns=3),
                                     make_episode("tools", ("x",), max_turns=3)],
                         ids=["calculator", "python", "tools-plugin"])
def test_a_batch_with_an_episode_that_may_run_a_tool_keeps_the_per_record_path(stage, episode):
    """One episode whose step may run a sandbox or plugin sends the whole batch per record (None), where steps
    overlap rather than queue behind one thread."""
    assert stage.handle_batch([incoming(make_episode("single", ("cba",))), incoming(episode)]) is None


def test_env_version_recorded(monkeypatch):
    class V2(Environment):
        name, version = "v2env", "2"

        def step(self, episode):
            return StepResult(done=True)

    monkeypatch.setitem(ENVIRONMENTS, "v2env", lambda sandbox: V2())
    stage = EnvStage(EnvSettings(sandbox="subprocess"))
    [out] = stage.handle(incoming(make_episode("v2env", ("x",))))
    assert out.record.task.env_version == "2" and out.record.task.metadata["requested_env_version"] == "1"


def test_settings_are_validated():
    with pytest.raises(ValueError):
        EnvStage(EnvSettings(tool_timeout_s=0))


def test_calculator_tasks_have_exact_answers_and_a_fixed_split():
    train = list(tool_tasks.generate("calculator", seed=1, count=50))
    held = list(tool_tasks.generate("calculator", split="heldout"))
    assert len(train) == 50 and len(held) == 256
    assert {p for _, p, _, _ in train}.isdisjoint({p for _, p, _, _ in held})
    for task_id, prompt, answer, split in train[:10] + held[:10]:
        a, b = prompt.removeprefix("what is ").removesuffix("? use calc").split("*")
        assert prompt.endswith("? use calc") and answer == str(int(a) * int(b))
    assert train == list(tool_tasks.generate("calculator", seed=1, count=50))
    task = tool_tasks.get_task("calculator")
    assert task.env_name == "calculator" and task.max_turns > 1 and task.max_new_tokens >= len("calc(99*99)")
