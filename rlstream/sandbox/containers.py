"""The docker backend of ``rlstream.sandbox``: what every sandbox container is started with, and the one-snippet
run (a throw-away container per snippet). The per-episode container is ``rlstream.envs.docker_session``.

The docker SDK is an optional dependency: this module imports it only when a container is started.
"""
from __future__ import annotations

import os
import signal
import time

from rlstream.sandbox.limits import MEMORY_EXIT, SandboxLimits, SandboxResult, classify

#: Where the episode's workspace is mounted in a container (its cwd).
WORKDIR = "/work"
#: The user of a container without a workspace: nobody.
NOBODY = "65534:65534"


def container_options(limits: SandboxLimits, workdir: str | None = None) -> dict:
    """``containers.run`` keyword arguments every sandbox container gets: no network, memory, CPU and pid limits,
    a read-only root with a small /tmp, no capabilities, no privilege gain; ``workdir`` mounted at /work.

    With a workspace the container runs as the host's own uid and gid (without capabilities, root there cannot
    override file permissions): the workspace is the host's folder (made 0700 by mkdtemp), and the host's file
    tools and the container's commands must be able to write each other's files. Without one it runs as nobody.
    """
    import docker  # optional dependency
    cpu = max(1, int(round(limits.cpu_s)))
    return dict(
        network_disabled=True, mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
        nano_cpus=10**9, pids_limit=64, read_only=True, tmpfs={"/tmp": f"size={limits.file_size_mb}m"},
        working_dir=WORKDIR if workdir else "/tmp",
        volumes={os.path.realpath(workdir): {"bind": WORKDIR, "mode": "rw"}} if workdir else None,
        environment={"HOME": WORKDIR if workdir else "/tmp", "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1"},
        user=f"{os.getuid()}:{os.getgid()}" if workdir else NOBODY, cap_drop=["ALL"],
        security_opt=["no-new-privileges"], ulimits=[docker.types.Ulimit(name="cpu", soft=cpu, hard=cpu + 1)])


def run_once(sandbox, code: str, started: float, workdir: str | None = None) -> SandboxResult:
    """Run ``code`` in a container of its own, removed afterwards (``Sandbox.run_python`` with docker)."""
    import docker  # optional dependency, only imported where an engine answered
    lim: SandboxLimits = sandbox.limits
    boot = ("import os,sys\nh=sys.excepthook\ndef e(t,v,b):\n h(t,v,b)\n if issubclass(t,MemoryError):"
            f" os._exit({MEMORY_EXIT})\nsys.excepthook=e\nexec(compile(sys.argv[1],'main.py','exec'))")
    container = docker.from_env().containers.run(sandbox.docker_image, ["python", "-c", boot, code], detach=True,
                                                 **container_options(lim, workdir))
    try:
        timed_out = False
        try:
            exit_code = int(container.wait(timeout=lim.timeout_s).get("StatusCode", -1))
        except Exception:  # requests' ReadTimeout / ConnectionError: the deadline passed
            timed_out, exit_code = True, -signal.SIGKILL
            container.kill()
        buf = bytearray()
        for chunk in container.logs(stdout=True, stderr=True, stream=True):
            buf += chunk
            if len(buf) > lim.max_output_bytes:
                break
        container.reload()
        oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
    finally:
        container.remove(force=True)
    truncated = len(buf) > lim.max_output_bytes
    text = bytes(buf[:lim.max_output_bytes]).decode("utf-8", "replace")
    duration = (time.monotonic() - started) * 1000
    if timed_out:
        failure = "timeout"
    elif oom:
        failure = "memory"
    else:  # the shell's convention: 128 + signal number
        failure = classify(128 - exit_code if exit_code > 128 else exit_code, 0.0, lim.cpu_s)
    return SandboxResult(text, exit_code, duration, truncated, failure)
