"""The environment plugin interface: one factory signature, one object per episode.

A plugin is a dotted path (``--env mypkg.envs:make``) to a factory with this signature::

    def make(task: rlstream.schemas.records.Task, workspace: rlstream.envs.workspace.Workspace) -> Env

called once per episode, at its first action. The returned object keeps the episode's state and has:

- ``reset() -> None``: set the episode up (files in the workspace, a game board...). It may raise
  ``EnvFailure`` for a task it cannot run. Nothing is shown to the model: the task's prompt is the first
  observation, and rollout has already answered it with the first action when the env hears of the episode.
- ``step(action: str) -> StepResult``: the model's latest action text; go on with an observation, or be done.
  A malformed tool call is the model's mistake: answer it with an observation that says what is wrong.
- ``close() -> None``: the episode ended (or the env is evicted); release what it holds.

``Env`` below is a base class with these defaults; a plugin need not subclass it. The ``workspace`` is the
episode's own directory inside the sandbox (shell and file tools included), removed after ``close``.

Failure classes of a step (``Failure.failure_class``, stage ``env``): ``env_timeout`` (no answer within
``--step-timeout-s``, or the remote call's timeout), ``env_unreachable`` (a remote env server did not answer
after the retries), ``env_error`` (the env raised, or its server answered with an error), ``env_lost`` (an
episode's env could not be rebuilt by replaying its actions); a tool's own ``timeout``/``memory``/``cpu``/
``crash`` when the env reports one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol

from rlstream.schemas.records import Failure, Task, ToolCall, ToolResult

#: The failure classes this package gives a step (besides the sandbox's own tool classes).
ENV_FAILURES = ("env_timeout", "env_unreachable", "env_error", "env_lost")


@dataclass
class StepResult:
    """What one env step decided: go on with ``observation``, or ``done`` (possibly with a failure)."""

    done: bool
    observation: str | None = None
    tool_call: ToolCall | None = None
    tool_result: ToolResult | None = None
    failure: Failure | None = None
    truncated: bool = False  # ended by task.max_turns, not by the model


class EnvFailure(Exception):
    """A step or reset that failed with a class (``env_timeout``, ``env_unreachable``, ``env_error``...)."""

    def __init__(self, failure_class: str, message: str):
        super().__init__(message)
        self.failure_class = failure_class

    def failure(self) -> Failure:
        return Failure(self.failure_class, str(self), "env")


class Env:
    """A per-episode environment (see the module docstring); subclass it or duck-type it."""

    def reset(self) -> None:
        """Set the episode up; raise EnvFailure for a task this env cannot run."""

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (the workspace itself is removed by the caller)."""


class EnvFactory(Protocol):
    def __call__(self, task: Task, workspace) -> Env: ...


def load_factory(path: str, flag: str = "--env") -> Callable[..., Env]:
    """The factory at ``module:attr`` (or ``module.attr``); ValueError naming ``flag`` when it does not load."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag} {path!r}: expected a dotted path such as mypkg.envs:make")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{flag} {path!r} does not load: {exc}") from None
    if not callable(factory):
        raise ValueError(f"{flag} {path!r} is not callable")
    return factory
