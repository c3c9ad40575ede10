"""An episode's workspace: one directory inside the sandbox that lives from the episode's first action to its end.

Every tool call of the episode runs in the sandbox with the workspace as its cwd, HOME and TMPDIR, so files
written by one step are there for the next. With the subprocess sandbox, processes persist too: the episode's calls
run in one sandbox session (``rlstream.envs.session``), so a process a step starts in the background is running at
the next step, until the episode ends and the session's pid namespace goes with every process in it. With the
docker sandbox the episode has a container of its own (``rlstream.envs.docker_session``), every call exec'd into
it, so processes persist there too until the container is removed. The directory and the session are removed when
the episode ends (or its env is evicted, or the stage shuts down).

The built-in tools: ``shell`` (``/bin/sh -c``; the shell and what it starts run without the sandbox's Python
audit hooks, so files are guarded by the namespaces and limits alone — the docker sandbox for adversarial
code), ``python``, and ``read_file`` / ``write_file`` (run by the env process itself, confined to the workspace by
real path: one that leaves it, by ``..``, an absolute path or a symlink, is refused with exit code 2).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from rlstream.envs.docker_session import DockerSession
from rlstream.envs.session import SandboxSession
from rlstream.sandbox import Sandbox
from rlstream.schemas.records import ToolResult

#: Most bytes a file tool reads or writes at once (the observation would be cut anyway).
MAX_FILE_BYTES = 1 << 20


class Workspace:
    """The directory of one episode (``path``) and the tools that run in it."""

    def __init__(self, sandbox: Sandbox, episode_id: str, root: str | None = None):
        self.sandbox, self.episode_id, self.root = sandbox, episode_id, root
        self._path: str | None = None
        self._session: SandboxSession | DockerSession | None = None
        self.closed = False

    @property
    def path(self) -> str:
        """The directory, made on first use (an env that never touches files, or a remote one, costs nothing)."""
        if self._path is None:
            if self.closed:
                raise RuntimeError(f"the workspace of {self.episode_id} is closed")
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.episode_id)[:80]
            # Under the system temp dir by default: the sandbox covers HOME and the project folder with a tmpfs.
            self._path = os.path.realpath(tempfile.mkdtemp(prefix=f"rlstream-ws-{safe}-", dir=self.root))
        return self._path

    @property
    def session(self) -> SandboxSession | DockerSession:
        """The episode's persistent sandbox (a process, or a container with docker), started by its first call."""
        if self._session is None:
            self._session = DockerSession(self.sandbox, self.path, self.episode_id) \
                if self.sandbox.backend == "docker" else SandboxSession(self.sandbox, self.path)
        return self._session

    def shell(self, command: str) -> ToolResult:
        """Run ``command`` with /bin/sh in the workspace; output and exit code as the tool result."""
        return self.session.run("shell", command).to_tool_result()

    def python(self, code: str) -> ToolResult:
        """Run Python ``code`` in the workspace."""
        return self.session.run("python", code).to_tool_result()

    def read_file(self, path: str) -> ToolResult:
        """A file of the workspace, as text (errors replaced); exit code 1 and why when it cannot be read."""
        started = time.monotonic()
        full = self._inside(path)
        if full is None:
            return _refused(path, started)
        try:
            with open(full, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            return ToolResult(f"error: {exc.strerror}: {path}", 1, _ms(started))
        return ToolResult(data[:MAX_FILE_BYTES].decode("utf-8", "replace"), 0, _ms(started),
                          truncated=len(data) > MAX_FILE_BYTES)

    def write_file(self, path: str, content: str) -> ToolResult:
        """Write ``content`` to a file of the workspace (folders made as needed)."""
        started = time.monotonic()
        full = self._inside(path)
        data = content.encode("utf-8", "replace")
        if full is None:
            return _refused(path, started)
        if len(data) > MAX_FILE_BYTES:
            return ToolResult(f"error: {len(data)} bytes is more than {MAX_FILE_BYTES}", 2, _ms(started))
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        except OSError as exc:
            return ToolResult(f"error: {exc.strerror}: {path}", 1, _ms(started))
        return ToolResult(f"wrote {len(data)} bytes to {path}", 0, _ms(started))

    def _inside(self, path: str) -> str | None:
        """The real path of ``path`` in the workspace, None if it resolves outside (``..``, absolute, symlinks)."""
        full = os.path.realpath(os.path.join(self.path, path))
        return full if full.startswith(self.path + os.sep) else None

    def close(self) -> None:
        """End the episode's processes and remove the workspace (idempotent)."""
        self.closed = True
        if self._session is not None:
            self._session.close()
        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000


def _refused(path: str, started: float) -> ToolResult:
    return ToolResult(f"error: {path!r} is outside the workspace", 2, _ms(started))
