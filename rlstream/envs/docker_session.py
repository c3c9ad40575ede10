"""An episode's persistent sandbox under docker: one container per episode, every tool call exec'd into it, so
files and processes a step leaves behind are there at the next step; the container is removed when the episode ends.

The container is started at the episode's first call with the options of every sandbox container
(``rlstream.sandbox.containers.container_options``: no network, memory/CPU/pid limits, read-only root, no
capabilities) and the workspace mounted at /work. Its one program is ``sleep`` under docker's init: the init reaps
what calls leave behind, and the sleep bounds the container's life to ``LIFETIME_S`` even when the host dies without
removing it (the container is started with auto-remove, so it is then gone too).

A call runs through a small wrapper shell: the command (``/bin/sh -c`` or the image's ``python -c``) runs under
``timeout``, in its own process group, with its output sent to a file in the container's /tmp rather than to the
exec's stream; so a background child that keeps running never holds the call open, and the wrapper prints the
first bytes of that file and exits with the command's status. A call past its timeout has its group killed and fails
as ``timeout``; a container that is gone (killed, or past its lifetime) is started again at the next call (its
files remain in the workspace, its processes do not).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import time

from rlstream.envs.session import Session
from rlstream.sandbox import Sandbox, SandboxResult, classify
from rlstream.sandbox.containers import WORKDIR, container_options

log = logging.getLogger(__name__)

#: Longest life of an episode's container: what bounds it when the host dies without removing it.
LIFETIME_S = 3600
#: The status GNU timeout exits with when the command timed out (137 when its KILL reached timeout itself).
TIMEOUT_EXITS = (124, 128 + signal.SIGKILL)

# $1: timeout seconds, $2: most output bytes to print; the rest: the command. Its output goes to a file, so the
# exec's stream is the wrapper's alone.
_WRAP = r'''t=$1; n=$2; shift 2
out=$(mktemp /tmp/.rlstream-call.XXXXXX) || exit 125
timeout -s KILL "$t" "$@" >"$out" 2>&1 </dev/null
rc=$?
head -c "$n" "$out"
rm -f "$out"
exit $rc'''


class DockerSession(Session):
    """One episode's container with its workspace as cwd; thread-safe. ``run`` never raises."""

    what = "docker sandbox session"

    def __init__(self, sandbox: Sandbox, workdir: str, episode_id: str = ""):
        if sandbox.backend != "docker":
            raise ValueError("a docker session needs the docker sandbox backend")
        super().__init__()
        self.sandbox, self.workdir, self.episode_id = sandbox, workdir, episode_id
        self._container = None

    @property
    def container_id(self) -> str | None:
        return self._container.id if self._container is not None else None

    @property
    def alive(self) -> bool:
        if self._container is None:
            return False
        try:
            self._container.reload()
        except Exception:  # docker.errors.NotFound: removed (its lifetime ended, or someone removed it)
            return False
        return self._container.status == "running"

    def _client(self):
        import docker  # optional dependency, only imported where an engine answered

        # The socket's timeout covers an engine that stops answering; the call's own is enforced inside.
        return docker.from_env(timeout=int(self.sandbox.limits.timeout_s) + 30)

    def _start(self) -> None:
        self._stop()
        self._container = self._client().containers.run(
            self.sandbox.docker_image, ["sleep", str(LIFETIME_S)], detach=True, init=True, auto_remove=True,
            labels={"rlstream.sandbox": "episode", "rlstream.episode": self.episode_id[:200]},
            **container_options(self.sandbox.limits, self.workdir))

    def _call(self, kind: str, code: str, started: float) -> SandboxResult:
        lim = self.sandbox.limits
        argv = ["/bin/sh", "-c", code] if kind == "shell" else ["python", "-B", "-c", code]
        exit_code, out = self._container.exec_run(
            ["/bin/sh", "-c", _WRAP, "rlstream-call", f"{lim.timeout_s:g}", str(lim.max_output_bytes + 1), *argv],
            workdir=WORKDIR, stdout=True, stderr=True)
        duration = (time.monotonic() - started) * 1000
        out = out or b""
        cut = len(out) > lim.max_output_bytes
        text = out[:lim.max_output_bytes].decode("utf-8", "replace")
        if exit_code in TIMEOUT_EXITS and duration >= lim.timeout_s * 1000:
            return SandboxResult(text, -signal.SIGKILL, duration, cut, "timeout")
        if kind == "shell":  # the shell's convention, as the subprocess session's: 128 + signal number
            return SandboxResult(text, exit_code, duration, cut)
        status = 128 - exit_code if exit_code > 128 else exit_code  # back to -signal for the classifier
        return SandboxResult(text, status, duration, cut, classify(status, 0.0, lim.cpu_s))

    def _stop(self) -> None:
        if self._container is not None:
            with contextlib.suppress(Exception):  # already gone (auto-removed once stopped)
                self._container.remove(force=True)
        self._container = None
