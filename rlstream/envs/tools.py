"""Tool calls in the model's text, and the built-in ``tools`` env that runs them in the episode's workspace.

A tool call is the Hermes / Qwen format, one per action::

    <tool_call>{"name": "shell", "arguments": {"command": "ls -l"}}</tool_call>

The result comes back as ``<tool_response>...</tool_response>`` (with ``[exit code N]`` when not 0). An action
without a call is the final answer and ends the episode. A malformed call (unclosed tag, bad JSON, unknown tool,
missing argument) is answered with ``<tool_error>...</tool_error>``, the parse error, as agent harnesses do:
it is the model's to learn from, never an error of the stage. A tool that times out or breaks a limit ends the
episode with the sandbox's failure class.
"""
from __future__ import annotations

import json
import re

from rlstream.envs.api import Env, StepResult
from rlstream.envs.workspace import Workspace
from rlstream.schemas.records import Failure, Task, ToolCall, ToolResult

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
#: Tool name -> its required arguments.
TOOLS: dict[str, tuple[str, ...]] = {
    "shell": ("command",),
    "read_file": ("path",),
    "write_file": ("path", "content"),
    "python": ("code",),
}
_WS = re.compile(r"\s+")


class ToolCallError(ValueError):
    """A tool call the model got wrong; the message is what the model is shown."""


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """``(name, arguments)`` of the first tool call in ``text``; None without one; ToolCallError if malformed."""
    start = text.find(_OPEN)
    if start < 0:
        return None
    end = text.find(_CLOSE, start)
    if end < 0:
        raise ToolCallError(f"{_OPEN} is not closed with {_CLOSE}")
    body = text[start + len(_OPEN):end].strip()
    try:
        call = json.loads(body)
    except ValueError as exc:
        raise ToolCallError(f"the tool call is not JSON: {exc}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call is {"name": ..., "arguments": {...}}')
    name, args = call["name"], call.get("arguments", {})
    if name not in TOOLS:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(args, dict):
        raise ToolCallError(f"{name}: arguments must be an object")
    missing = [a for a in TOOLS[name] if not isinstance(args.get(a), str)]
    if missing:
        raise ToolCallError(f"{name}: missing string argument(s) {', '.join(missing)}")
    return name, args


def run_tool(workspace: Workspace, name: str, args: dict) -> ToolResult:
    """Run a parsed tool call in ``workspace``."""
    if name == "shell":
        return workspace.shell(args["command"])
    if name == "read_file":
        return workspace.read_file(args["path"])
    if name == "write_file":
        return workspace.write_file(args["path"], args["content"])
    return workspace.python(args["code"])


def response_text(result: ToolResult) -> str:
    """What the model is shown of a tool's result."""
    code = f"[exit code {result.exit_code}]\n" if result.exit_code else ""
    cut = "[output truncated]\n" if result.truncated else ""
    out = result.output if not result.output or result.output.endswith("\n") else result.output + "\n"
    return f"<tool_response>\n{out}{cut}{code}</tool_response>\n"


class ToolEnv(Env):
    """Shell and file tools in the episode's workspace, for up to ``task.max_turns`` actions."""

    def __init__(self, task: Task, workspace: Workspace):
        self.task, self.workspace, self.turns = task, workspace, 0

    def call_text(self, action: str) -> str:
        """The text the tool call is parsed from (the action; a subclass may rewrite it)."""
        return action

    def step(self, action: str) -> StepResult:
        self.turns += 1
        text = self.call_text(action)
        try:
            parsed = parse_tool_call(text)
        except ToolCallError as exc:
            raw = text[text.find(_OPEN):][:500]
            return StepResult(done=self.turns >= self.task.max_turns, observation=f"<tool_error>{exc}</tool_error>\n",
                              tool_call=ToolCall("invalid", raw), tool_result=ToolResult(str(exc), exit_code=2))
        if parsed is None:
            return StepResult(done=True)  # the final answer: the reward stage judges it
        name, args = parsed
        call = ToolCall(name, json.dumps(args, sort_keys=True))
        if self.turns >= max(1, self.task.max_turns):
            return StepResult(done=True, tool_call=call, truncated=True)  # no turn left to show the result in
        result = run_tool(self.workspace, name, args)
        if result.failure_class is not None:
            why = _WS.sub(" ", result.output.strip())[-300:]
            return StepResult(done=True, tool_call=call, tool_result=result,
                              failure=Failure(result.failure_class, f"{name} ended with {result.failure_class} after "
                                              f"{result.duration_ms:.0f} ms: {why}", "env"))
        return StepResult(done=False, observation=response_text(result), tool_call=call, tool_result=result)


def make(task: Task, workspace: Workspace) -> ToolEnv:
    """The ``tools`` env (``--env rlstream.envs.tools:make``, or tasks whose env_name is ``tools``)."""
    return ToolEnv(task, workspace)
