"""What a snippet may use (``SandboxLimits``), how it ended (``SandboxResult``), and the failure class of an
exit (``classify``): shared by every backend and by the per-episode sessions of ``rlstream.envs``."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from rlstream.schemas.records import ToolResult

FAILURE_CLASSES = (None, "timeout", "memory", "cpu", "crash", "sandbox_error")
#: Exit status the sandbox's excepthook uses for an uncaught MemoryError (RLIMIT_AS reached).
MEMORY_EXIT = 86

@dataclass(frozen=True)
class SandboxLimits:
    """What one snippet may use."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    cpu_s: float = 5.0
    max_output_bytes: int = 16384
    file_size_mb: int = 16


@dataclass
class SandboxResult:
    """How a snippet ended: its output (stdout and stderr together) and a failure class or None."""

    output: str
    exit_code: int
    duration_ms: float
    truncated: bool = False
    failure_class: str | None = None

    def to_tool_result(self) -> ToolResult:
        return ToolResult(self.output, self.exit_code, self.duration_ms, self.truncated, self.failure_class)


def classify(exit_code: int, cpu_s: float, cpu_limit: float) -> str | None:
    """Failure class of a finished snippet; a non-zero exit of its own is its output, not a failure."""
    if exit_code == MEMORY_EXIT:
        return "memory"
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= cpu_limit):
        return "cpu"
    if exit_code == -signal.SIGKILL:
        return "memory"  # killed by no one we know of: the kernel's OOM killer
    if exit_code < 0:
        return "crash"
    return None
