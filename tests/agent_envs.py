"""Env plugins for the multi-turn tests, loaded by dotted path (``--env tests.agent_envs:scripted``).

A random test model writes no tool calls, so ``scripted`` scripts them by turn and feeds the model's own text
into them: turn 1 writes action 1's text to a file of the workspace, turn 2 reads it back with the shell (the
file outlived the step), turn 3 is a malformed call (answered with the parse error), turn 4 ends the episode.
"""
from __future__ import annotations

import json
import time

from rlstream.envs.api import Env
from rlstream.envs.tools import ToolEnv

MALFORMED = '<tool_call>{"name": "shell", "arguments": {"command": </tool_call>'


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Scripted(ToolEnv):
    """The built-in tools env with scripted tool calls (see the module docstring)."""

    def call_text(self, action: str) -> str:
        if self.turns == 1:
            return call("write_file", path="notes/turn1.txt", content=action)
        if self.turns == 2:
            return call("shell", command="cat notes/turn1.txt; echo '|'; ls notes")
        if self.turns == 3:
            return MALFORMED
        return action.replace("<tool_call>", "")  # a final answer


def scripted(task, workspace) -> Scripted:
    return Scripted(task, workspace)


class Hanging(Env):
    """Its step never returns (a deadlock, a stuck call)."""

    def step(self, action):
        time.sleep(3600)


class Crashing(Env):
    """Its step raises."""

    def step(self, action):
        raise RuntimeError("environment crashed")


def hanging(task, workspace) -> Hanging:
    return Hanging()


def crashing(task, workspace) -> Crashing:
    return Crashing()
