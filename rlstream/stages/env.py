"""The env stage: model actions in; the next observation, or the finished trajectory, out.

Which env answers an episode: a plugin given by ``--env [NAME=]module:factory`` or a remote env server given by
``--env-url [NAME=]URL`` (with ``NAME=``: tasks whose ``env_name`` is NAME; without: every other task), else
the built-in of ``task.env_name``: ``tools`` (shell and file tools in a per-episode workspace) or the stateless
``single``, ``calculator`` and ``python`` (``rlstream.envs.builtin``). Plugin and remote envs keep state per
episode (``rlstream.envs.live``); built-ins see the whole episode each turn.

Every record of an episode is keyed by its task id (``episode_key``), so its turns come back to the same
rollout worker. Tool timeouts, env hangs, crashes and unreachable servers end the episode as a failed
Trajectory with a failure class on that turn; the stage never stops for them. A task whose env server could not
be reached is also sent back to ``prompts`` as a new task, up to ``--env-task-retries`` times
(``rlstream.envs.remote.retried_task``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, ClassVar

from rlstream import metrics
from rlstream.config import knob
from rlstream.envs import tools
from rlstream.envs.api import Env, StepResult, load_factory
from rlstream.envs.builtin import (ENVIRONMENTS, Calculator, Environment, PythonExec, SingleTurn,  # noqa: F401
                                   action_turns, register_environment, tool_calls, turn_budget_used)
from rlstream.envs.live import LiveEnvs
from rlstream.envs.remote import RemoteEnvs, TaskRetries
from rlstream.runtime.stage import Incoming, InvalidRecord, Output, Stage, each_alone
from rlstream.sandbox import Sandbox, SandboxLimits
from rlstream.schemas.headers import now_ms
from rlstream.schemas.records import Episode, Failure, Task, Trajectory, Turn, episode_key

log = logging.getLogger(__name__)

#: Built-in per-episode envs (plugin interface) by env_name.
PLUGINS: dict[str, Callable[..., Env]] = {"tools": tools.make}


@dataclass(frozen=True)
class EnvSettings:
    """The env stage's knobs."""

    ROLE: ClassVar[str] = "ENV"

    env: tuple[str, ...] = knob((), "Env plugin: [NAME=]module:factory, a factory make(task, workspace) -> Env "
                                    "(rlstream.envs.api); with NAME= for tasks whose env_name is NAME, without for "
                                    "every other task; repeat for several")
    env_url: tuple[str, ...] = knob((), "Remote env server (rlstream env-server, or any server of its HTTP "
                                        "protocol): [NAME=]URL, as --env; repeat for several")
    env_timeout_s: float = knob(30.0, "Remote env: most seconds one call (reset, step, close) may take")
    env_retries: int = knob(3, "Remote env: times a call that found no server is tried again (backoff "
                               "0.5 s doubling) before the episode fails as env_unreachable")
    env_task_retries: int = knob(2, "Remote env: times a task whose episode failed as env_unreachable is sent "
                                    "back to prompts as a new task (<task>.retryN, a group of its own); 0: never")
    step_timeout_s: float = knob(30.0, "Plugin and remote envs: most seconds one reset/step/close may take before "
                                       "the episode fails as env_timeout; keep it below --handler-timeout-s")
    max_live_envs: int = knob(1024, "Plugin and remote envs: most episodes whose env this process keeps; the "
                                    "least recently stepped is closed, and rebuilt by replay if it comes back")
    workspace_root: str = knob("", "Folder for per-episode workspaces (default: the system temp dir)")
    tool_timeout_s: float = knob(5.0, "Wall-clock limit of one tool call; keep it below --handler-timeout-s")
    tool_memory_mb: int = knob(512, "Address-space limit of one tool call (MiB)")
    tool_cpu_s: float = knob(5.0, "CPU-time limit of one tool call (s)")
    max_output_bytes: int = knob(4096, "Tool output beyond this is cut (and marked truncated)")
    sandbox: str = knob("auto", "Tool sandbox: docker where an engine answers, else subprocess",
                        choices=("auto", "subprocess", "docker"))
    docker_image: str = knob("python:3.11-slim", "Image of the docker sandbox")


def _named(values: tuple[str, ...], flag: str, load: Callable) -> tuple[dict, object]:
    """``{name: loaded}`` of the NAME=VALUE entries and the one bare entry's value (or None)."""
    named, default = {}, None
    for raw in values:
        name, sep, value = raw.partition("=")
        if sep and name.isidentifier() and "://" not in name:
            named[name] = load(value)
        elif default is None:
            default = load(raw)
        else:
            raise ValueError(f"{flag}: two entries without NAME= ({raw!r}); name all but one")
    return named, default


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
        for field in ("tool_timeout_s", "tool_memory_mb", "tool_cpu_s", "max_output_bytes", "env_timeout_s",
                      "step_timeout_s", "max_live_envs"):
            if getattr(settings, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive")
        if settings.env_retries < 0 or settings.env_task_retries < 0:
            raise ValueError("--env-retries and --env-task-retries must be 0 or more")
        self.retries = TaskRetries(settings.env_task_retries)
        self.settings = settings
        limits = SandboxLimits(timeout_s=settings.tool_timeout_s, memory_mb=settings.tool_memory_mb,
                               cpu_s=settings.tool_cpu_s, max_output_bytes=settings.max_output_bytes)
        self.sandbox = Sandbox(limits, backend=settings.sandbox, docker_image=settings.docker_image)
        self._envs: dict[str, Environment] = {}
        self.plugins, self.default_plugin = _named(settings.env, "--env", load_factory)
        remote = lambda url: RemoteEnvs(url, timeout_s=settings.env_timeout_s,  # noqa: E731
                                        retries=settings.env_retries)
        urls, default_url = _named(settings.env_url, "--env-url", remote)
        if self.default_plugin is not None and default_url is not None:
            raise ValueError("--env and --env-url both without NAME=: which one serves other tasks?")
        self.plugins.update(urls)
        self.default_plugin = self.default_plugin or default_url
        self.live = LiveEnvs(self.sandbox, settings.max_live_envs, settings.step_timeout_s,
                             settings.workspace_root or None)
        log.info("env sandbox: %s (%s)", self.sandbox.backend, self.sandbox.isolation)

    def plugin(self, name: str) -> Callable[..., Env] | None:
        """The per-episode env factory serving tasks of env_name ``name``, or None for a stateless built-in."""
        if name in self.plugins:
            return self.plugins[name]
        if self.default_plugin is not None:
            return self.default_plugin
        return PLUGINS.get(name)

    def environment(self, name: str) -> Environment:
        env = self._envs.get(name)
        if env is None:
            if name not in ENVIRONMENTS:
                known = sorted({*ENVIRONMENTS, *PLUGINS, *self.plugins})
                raise InvalidRecord(f"unknown env {name!r}; known: {', '.join(known)}")
            env = self._envs[name] = ENVIRONMENTS[name](self.sandbox)  # racing threads build equal ones
        return env

    @property
    def batched(self) -> bool:
        # Per record by default (pipelined: an episode's tool call never waits for another's); handle_batch serves
        # the unpipelined runs (--no-pipeline).
        return False

    def handle_batch(self, items: list[Incoming]) -> list[list[Output] | Exception] | None:
        """A whole unpipelined batch in one call on this thread when no episode of it can block: each already
        finished or failed, or of a built-in env whose step runs nothing (``Environment.instant``: single-turn).
        Such a step costs microseconds, less than the thread hop and event-loop turn per record of the per-record
        path. Any other batch takes that path (None), where tool calls and env servers overlap."""
        # Finished and failed episodes return at once whatever their env; the others' envs are looked up once each.
        envs = {item.record.task.env_name for item in items if item.record.failure is None and not item.record.done}
        return each_alone(self.handle, items) if all(self._instant(name) for name in envs) else None

    def _instant(self, env_name: str) -> bool:
        """Whether ``handle`` on an episode of this env returns at once, running no tool, plugin or server call."""
        if self.plugin(env_name) is not None:
            return False
        try:
            return self.environment(env_name).instant
        except InvalidRecord:
            return True  # handle refuses it at once (dead-lettered as invalid)

    def handle(self, item: Incoming) -> list[Output]:
        ep: Episode = item.record
        if ep.failure is not None or ep.done:
            # Rollout gave up on it (e.g. prompt too long): the trajectory still gets recorded.
            self.live.finish(ep.episode_id)
            return [self._finish(ep, "failed" if ep.failure else "ok", item)]
        _check_episode(ep)
        started = now_ms()
        factory = self.plugin(ep.task.env_name)
        if factory is not None:
            result = self.live.step(factory, ep)
            version = getattr(factory, "version", "1")
        else:
            env = self.environment(ep.task.env_name)
            result, version = self._step_builtin(env, ep), env.version
        self._note_version(ep.task, version)
        finished = now_ms()
        last = ep.turns[-1]
        # The call and its result live on the action that made the call.
        last.tool_call = result.tool_call or last.tool_call
        last.tool_result = result.tool_result or last.tool_result
        if result.failure is None and not result.done and not result.observation:
            result.failure = Failure("env_error", f"env {ep.task.env_name} went on without an observation", "env")
        if result.failure is not None:
            ep.failure = result.failure
            return [self._finish(ep, "failed", item)] + [Output("prompts", t.task_id, t)
                                                         for t in self.retries.retry(ep.task, ep.failure)]
        if result.done or turn_budget_used(ep):
            cut = result.truncated or not result.done or last.finish_reason == "length"
            return [self._finish(ep, "truncated" if cut else "ok", item)]
        n = len(ep.token_ids)
        # Rollout tokenizes the text and fills the span: the env never sees a tokenizer.
        ep.turns.append(Turn("observation", result.observation, n, n, started_at=started, finished_at=finished))
        return [Output("observations", episode_key(ep), ep)]

    def _step_builtin(self, env: Environment, ep: Episode) -> StepResult:
        if len(action_turns(ep)) == 1:
            env.reset(ep.task)
        try:
            return env.step(ep)
        except InvalidRecord:
            raise
        except Exception as exc:  # an env bug must not lose the episode
            log.exception("env %s failed on %s", env.name, ep.episode_id)
            return StepResult(done=True, failure=Failure("env_error", f"{type(exc).__name__}: {exc}", "env"))

    def _note_version(self, task: Task, version: str) -> None:
        """Record the env version that actually ran (and what the task asked for, when different)."""
        if task.env_version != version:
            if task.env_version:
                task.metadata["requested_env_version"] = task.env_version
            task.env_version = version

    def _finish(self, ep: Episode, status: str, item: Incoming) -> Output:
        self.live.finish(ep.episode_id)  # the workspace goes with the episode
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

    def close(self) -> None:
        self.live.close_all()
        for factory in {*self.plugins.values(), self.default_plugin} - {None}:
            getattr(factory, "close", lambda: None)()
