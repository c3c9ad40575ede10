"""The stateless built-in environments, chosen by ``task.env_name``.

An ``Environment`` here is stateless between records: the Episode carries the whole
conversation, so any env worker can take any turn. (Stateful environments are plugins:
``rlstream.envs.api``.) Built-ins:

- ``single``: one action and done (the reward stage judges it);
- ``calculator``: an action containing ``calc(<arithmetic>)`` is evaluated in the sandbox
  and answered with ``=<result>\\n``; an action without a call ends the episode;
- ``python``: the action's fenced code block runs in the sandbox; its output is the observation.

Tool timeouts, limits and crashes end the episode as a failed Trajectory with a failure class.
"""
from __future__ import annotations

import re
from typing import Callable

from rlstream.envs.api import StepResult
from rlstream.sandbox import Sandbox, SandboxResult
from rlstream.schemas.records import Episode, Failure, Task, ToolCall, ToolResult, Trajectory, Turn


class Environment:
    """An environment: ``reset`` checks a task at an episode's first action, ``step`` answers an action."""

    name = "base"
    version = "1"
    #: Whether ``step`` returns at once, running nothing (no sandbox, no server): such an env's episodes may be
    #: stepped one after another on one thread (the env stage's ``handle_batch``) without one waiting on another.
    instant = False

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


def turn_budget_used(episode: Episode) -> bool:
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
    instant = True

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
        if turn_budget_used(episode):
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
        if turn_budget_used(episode):
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
