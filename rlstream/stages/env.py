"""The env stage: model actions in; the next observation, or the finished trajectory, out.

An ``Environment`` is stateless between records: the Episode carries the whole
conversation, so any env worker can take any turn. Built-ins, by ``task.env_name``:

- ``single``: one action and done (the reward stage judges it);
- ``calculator``: an action containing ``calc(<arithmetic>)`` is evaluated in the sandbox
  and answered with ``=<result>\\n``; an action without a call ends the episode;
- ``python``: the action's fenced code block runs in the sandbox; its output is the observation.

Tool timeouts, limits and crashes end the episode as a failed Trajectory with a failure class.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, ClassVar

from rlstream import metrics
from rlstream.config import knob
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage
from rlstream.sandbox import Sandbox, SandboxLimits, SandboxResult
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Episode, Failure, Task, ToolCall, ToolResult, Trajectory, Turn

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one env step decided: go on with ``observation``, or ``done`` (possibly with a failure)."""

    done: bool
    observation: str | None = None
    tool_call: ToolCall | None = None
    tool_result: ToolResult | None = None
    failure: Failure | None = None
    truncated: bool = False  # ended by task.max_turns, not by the model


class Environment:
    """An environment: ``reset`` checks a task at an episode's first action, ``step`` answers an action."""

    name = "base"
    version = "1"

    def reset(self, task: Task) -> dict:
        """Initial state of an episode of ``task`` (raise InvalidRecord for a task this env cannot run)."""
        return {}

    def step(self, episode: Episode) -> StepResult:
        """React to the episode's last turn, an action."""
        raise NotImplementedError


def action_turns(episode: Episode | Trajectory) -> list[Turn]:
    return [t for t in episode.turns if t.role == "action"]


def tool_calls(record: Episode | Trajectory, name: str | None = None) -> list[ToolCall]:
    """The tool calls made in an episode or trajectory (for rewards that demand tool use)."""
    return [t.tool_call for t in record.turns if t.tool_call is not None and (name is None or t.tool_call.name == name)]


def _last_turn(episode: Episode) -> bool:
    """Whether the episode has used its task's turn budget."""
    return len(action_turns(episode)) >= max(1, episode.task.max_turns)


def _tool_failure(result: SandboxResult, what: str) -> Failure:
    detail = result.output.strip().splitlines()[-1:] if result.output.strip() else []
    return Failure(result.failure_class or "crash",
                   f"{what} ended with {result.failure_class} after {result.duration_ms:.0f} ms"
                   + (f": {detail[0][:300]}" if detail else ""), "env")


class SingleTurn(Environment):
    """One action, then done: the reward stage judges the response."""

    name = "single"

    def step(self, episode: Episode) -> StepResult:
        return StepResult(done=True)


class Calculator(Environment):
    """Multi-turn tool use: ``calc(<expr>)`` in an action is evaluated in the sandbox."""

    name = "calculator"
    _CALL = re.compile(r"calc\(")
    _ALLOWED = re.compile(r"[0-9+\-*/%().\s]*")
    MAX_EXPRESSION = 200

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    @classmethod
    def find_call(cls, text: str) -> str | None:
        """The argument of the first ``calc(...)`` in ``text`` (parentheses balanced), '' if unclosed, else None."""
        m = cls._CALL.search(text)
        if m is None:
            return None
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.end():i]
        return ""

    def step(self, episode: Episode) -> StepResult:
        expr = self.find_call(episode.turns[-1].text)
        if expr is None:
            return StepResult(done=True)  # a final answer: the reward stage judges it
        call = ToolCall("calc", expr)
        if _last_turn(episode):
            return StepResult(done=True, tool_call=call, truncated=True)
        if not expr.strip() or not self._ALLOWED.fullmatch(expr) or len(expr) > self.MAX_EXPRESSION:
            # The model's mistake, answered like any tool error: it is the model's to learn from.
            msg = "error: calc takes numbers and + - * / // % ** ( )"
            return StepResult(done=False, observation=f"={msg}\n", tool_call=call,
                              tool_result=ToolResult(msg, exit_code=2))
        # The expression goes in as a string literal, never as code.
        code = (f"try:\n    r = eval(compile({expr!r}, 'calc', 'eval'), {{'__builtins__': {{}}}})\n"
                "except Exception as e:\n    print('error:', type(e).__name__ + (f': {e}' if str(e) else ''))\n"
                "else:\n    print(r)\n")
        result = self.sandbox.run_python(code)
        tool_result = result.to_tool_result()
        if result.failure_class is not None:
            return StepResult(done=True, tool_call=call, tool_result=tool_result,
                              failure=_tool_failure(result, f"calc({expr[:50]})"))
        return StepResult(done=False, observation=f"={result.output.strip()}\n", tool_call=call,
                          tool_result=tool_result)


class PythonExec(Environment):
    """The action's fenced code block runs in the sandbox; an action without one ends the episode."""

    name = "python"
    _BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def step(self, episode: Episode) -> StepResult:
        m = self._BLOCK.search(episode.turns[-1].text)
        if m is None:
            return StepResult(done=True)
        call = ToolCall("python", m.group(1))
        if _last_turn(episode):
            return StepResult(done=True, tool_call=call, truncated=True)
        result = self.sandbox.run_python(m.group(1))
        tool_result = result.to_tool_result()
        if result.failure_class is not None:
            return StepResult(done=True, tool_call=call, tool_result=tool_result,
                              failure=_tool_failure(result, "python"))
        text = result.output if result.output.endswith("\n") or not result.output else result.output + "\n"
        text = (text or "(no output)\n") + ("[output truncated]\n" if result.truncated else "")
        return StepResult(done=False, observation=text, tool_call=call, tool_result=tool_result)


#: env_name -> factory taking the stage's sandbox. Register more with ``register_environment``.
ENVIRONMENTS: dict[str, Callable[[Sandbox], Environment]] = {
    "single": lambda sandbox: SingleTurn(),
    "calculator": Calculator,
    "python": PythonExec,
}


def register_environment(name: str, factory: Callable[[Sandbox], Environment]) -> None:
    """Make ``factory(sandbox)`` the environment of tasks whose env_name is ``name``."""
    ENVIRONMENTS[name] = factory


@dataclass(frozen=True)
class EnvSettings:
    """The env stage's knobs."""

    ROLE: ClassVar[str] = "ENV"

    tool_timeout_s: float = knob(5.0, "Wall-clock limit of one tool call; keep it below --handler-timeout-s")
    tool_memory_mb: int = knob(512, "Address-space limit of one tool call (MiB)")
    tool_cpu_s: float = knob(5.0, "CPU-time limit of one tool call (s)")
    max_output_bytes: int = knob(4096, "Tool output beyond this is cut (and marked truncated)")
    sandbox: str = knob("auto", "Tool sandbox: docker where an engine answers, else subprocess",
                        choices=("auto", "subprocess", "docker"))
    docker_image: str = knob("python:3.11-slim", "Image of the docker sandbox")


def _check_episode(ep: Episode) -> None:
    """Refuse episodes whose tokens and turns do not line up: the trainer could not use them."""
    n = len(ep.token_ids)
    if ep.loss_mask and len(ep.loss_mask) != n or ep.behaviour_logprobs and len(ep.behaviour_logprobs) != n:
        raise InvalidRecord(f"episode {ep.episode_id}: {n} tokens but {len(ep.loss_mask)} mask entries and "
                            f"{len(ep.behaviour_logprobs)} log-probs")
    if not ep.turns or ep.turns[-1].role != "action":
        raise InvalidRecord(f"episode {ep.episode_id}: the last turn is not an action")
    for t in ep.turns:
        if not 0 <= t.token_start <= t.token_end <= n:
            raise InvalidRecord(f"episode {ep.episode_id}: {t.role} turn span [{t.token_start}, {t.token_end}) "
                                f"outside its {n} tokens")


class EnvStage(Stage):
    """Steps each episode's environment once per action: observation out, or the trajectory."""

    name = "env"
    inputs = ("actions",)

    def __init__(self, settings: EnvSettings = EnvSettings()):
        for field in ("tool_timeout_s", "tool_memory_mb", "tool_cpu_s", "max_output_bytes"):
            if getattr(settings, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive")
        self.settings = settings
        limits = SandboxLimits(timeout_s=settings.tool_timeout_s, memory_mb=settings.tool_memory_mb,
                               cpu_s=settings.tool_cpu_s, max_output_bytes=settings.max_output_bytes)
        self.sandbox = Sandbox(limits, backend=settings.sandbox, docker_image=settings.docker_image)
        self._envs: dict[str, Environment] = {}
        log.info("env sandbox: %s (%s)", self.sandbox.backend, self.sandbox.isolation)

    def environment(self, name: str) -> Environment:
        env = self._envs.get(name)
        if env is None:
            if name not in ENVIRONMENTS:
                raise InvalidRecord(f"unknown env {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
            env = self._envs[name] = ENVIRONMENTS[name](self.sandbox)  # racing threads build equal ones
        return env

    def handle(self, item: Incoming) -> list[Output]:
        ep: Episode = item.record
        if ep.failure is not None or ep.done:
            # Rollout gave up on it (e.g. prompt too long): the trajectory still gets recorded.
            return [self._finish(ep, "failed" if ep.failure else "ok", item)]
        _check_episode(ep)
        env = self.environment(ep.task.env_name)
        self._note_version(ep.task, env)
        if len(action_turns(ep)) == 1:
            env.reset(ep.task)
        started = now_ms()
        try:
            result = env.step(ep)
        except InvalidRecord:
            raise
        except Exception as exc:  # an env bug must not lose the episode
            log.exception("env %s failed on %s", env.name, ep.episode_id)
            result = StepResult(done=True, failure=Failure("env_error", f"{type(exc).__name__}: {exc}", "env"))
        last = ep.turns[-1]
        # The call and its result live on the action that made the call.
        last.tool_call = result.tool_call or last.tool_call
        last.tool_result = result.tool_result or last.tool_result
        if result.failure is not None:
            ep.failure = result.failure
            return [self._finish(ep, "failed", item)]
        if not result.done and not result.observation:
            ep.failure = Failure("env_error", f"env {env.name} went on without an observation", "env")
            return [self._finish(ep, "failed", item)]
        if result.done or _last_turn(ep):
            cut = result.truncated or not result.done or last.finish_reason == "length"
            return [self._finish(ep, "truncated" if cut else "ok", item)]
        n = len(ep.token_ids)
        # Rollout tokenizes the text and fills the span: the env never sees a tokenizer.
        ep.turns.append(Turn("observation", result.observation, n, n, started_at=started, finished_at=now_ms()))
        return [Output("observations", ep.episode_id, ep)]

    def _note_version(self, task: Task, env: Environment) -> None:
        """Record the env version that actually ran (and what the task asked for, when different)."""
        if task.env_version != env.version:
            if task.env_version:
                task.metadata["requested_env_version"] = task.env_version
            task.env_version = env.version

    def _finish(self, ep: Episode, status: str, item: Incoming) -> Output:
        versions = [t.policy_version for t in action_turns(ep) if t.policy_version >= 0] or [item.policy_version]
        if ep.failure is not None:
            metrics.FAILURES.labels(self.name, ep.failure.failure_class).inc()
        traj = Trajectory(trajectory_id=ep.episode_id, group_id=ep.group_id, sample_index=ep.sample_index,
                          task=ep.task, response="".join(t.text for t in ep.turns),
                          min_policy_version=min(versions), max_policy_version=max(versions),
                          token_ids=ep.token_ids, loss_mask=ep.loss_mask, behaviour_logprobs=ep.behaviour_logprobs,
                          turns=ep.turns, status=status, failure=ep.failure,
                          stage_times={**ep.stage_times, "env.end": now_ms()}, trace_id=ep.trace_id)
        return Output("trajectories", ep.group_id, traj, policy_version=min(versions))
