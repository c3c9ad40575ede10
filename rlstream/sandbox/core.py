"""``Sandbox``: runs Python snippets under limits, one process (or container) per snippet, choosing the backend
(docker where an engine holds the image, else a subprocess in namespaces where they work) and the network
isolation. What each layer does is the package docstring's (rlstream/sandbox/__init__.py)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

from rlstream.sandbox.limits import MEMORY_EXIT, SandboxLimits, SandboxResult, classify
from rlstream.sandbox.probes import UNSHARE, docker_available, docker_image_present, namespaces_available
from rlstream.sandbox.process import HOOK, INIT, inside, kill_group, read_reports, real, wait_gone

log = logging.getLogger(__name__)


class Sandbox:
    """Runs Python snippets under ``limits``; thread-safe, one process (or container) per snippet.

    ``backend``: auto | subprocess | docker. ``network`` (subprocess): auto | unshare | audit.
    ``hide``: folders covered with an empty tmpfs under namespaces (default: HOME and the cwd).
    ``audit_hooks=False`` leaves only the kernel's isolation (for tests of that layer alone).
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), backend: str = "auto", network: str = "auto",
                 docker_image: str = "python:3.11-slim", hide: tuple[str, ...] | None = None,
                 audit_hooks: bool = True):
        if backend not in ("auto", "subprocess", "docker"):
            raise ValueError(f"sandbox backend must be auto, subprocess or docker, not {backend!r}")
        if network not in ("auto", "unshare", "audit"):
            raise ValueError(f"sandbox network must be auto, unshare or audit, not {network!r}")
        if backend == "auto":
            # An engine alone is not enough: without the image every call would fail (sandbox_error) on a pull.
            backend = "docker" if docker_available() and docker_image_present(docker_image) else "subprocess"
        elif backend == "docker" and not docker_available():
            raise ValueError("sandbox backend docker: the docker SDK is missing or no engine answers")
        elif backend == "docker" and not docker_image_present(docker_image):
            raise ValueError(f"sandbox backend docker: the engine has no image {docker_image!r}: `docker pull "
                             f"{docker_image}`, or give --docker-image an image with python3 that it has")
        if network == "auto":
            network = "unshare" if backend == "subprocess" and namespaces_available() else "audit"
        elif network == "unshare" and not namespaces_available():
            raise ValueError("sandbox network unshare: `unshare -rnpfm` does not work here")
        self.limits, self.backend, self.network, self.docker_image = limits, backend, network, docker_image
        self.audit_hooks = audit_hooks
        self.hide = (os.path.expanduser("~"), os.getcwd()) if hide is None else tuple(hide)
        # The interpreter as invoked, not its real path: a venv's python finds the venv's packages through the
        # pyvenv.cfg beside it, and the real binary under -I would see only the base install's.
        self._exe = sys.executable
        paths = sysconfig.get_paths()
        self._readable = sorted({real(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                                | {"/usr/share/zoneinfo"})
        self._keep = sorted({real(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(self._exe)),
                                                *self._readable)})

    @property
    def isolation(self) -> str:
        """How network and files are isolated: docker, namespaces+audit, namespaces, or audit."""
        if self.backend == "docker":
            return "docker"
        layers = (["namespaces"] if self.network == "unshare" else []) + (["audit"] if self.audit_hooks else [])
        return "+".join(layers) or "none"

    def run_python(self, code: str, workdir: str | None = None, programs: tuple[str, ...] = ()) -> SandboxResult:
        """Run ``code`` as a script (never raises for what it does); ``programs``: others it may start (a shell)."""
        started = time.monotonic()
        try:
            run = self._run_docker if self.backend == "docker" else self._run_subprocess
            return run(code, started, workdir, programs)
        except Exception as exc:  # the sandbox itself broke; say so rather than blame the snippet
            log.exception("sandbox error")
            return SandboxResult(f"sandbox error: {type(exc).__name__}: {exc}", -1,
                                 (time.monotonic() - started) * 1000, failure_class="sandbox_error")

    # -- subprocess backend ---------------------------------------------------------

    def _hide_plan(self, base: str) -> list[tuple[str, list[str]]]:
        """Folders to cover, each with the Python folders inside it to put back."""
        plan = []
        for raw in self.hide:
            path = real(raw)
            if not os.path.isdir(path) or inside(base, path) or any(inside(path, k) for k in self._keep):
                continue  # never cover the sandbox itself, "/", or a folder inside the Python install
            keeps = [k for k in self._keep if inside(k, path)]
            keeps = [k for k in keeps if not any(o != k and inside(k, o) for o in keeps)]
            plan.append((path, keeps))
        return plan

    def _prepare(self, code: str, workdir: str | None, programs: tuple[str, ...]) -> tuple[str, list[str], dict]:
        lim = self.limits
        base = os.path.realpath(tempfile.mkdtemp(prefix="rlstream-sbx-"))
        work, hookdir, park = (os.path.join(base, d) for d in ("work", "hook", "park"))
        for d in (work, hookdir, park):
            os.mkdir(d, 0o700)
        work = os.path.realpath(workdir) if workdir else work
        hook_cfg = {"work": work, "hookdir": hookdir, "exe": os.path.realpath(self._exe), "memory_exit": MEMORY_EXIT,
                    "programs": [real(shutil.which(p) or p) for p in programs],
                    "read": [*self._readable, hookdir],
                    "exact": ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime"]}
        if self.audit_hooks:
            with open(os.path.join(hookdir, "sitecustomize.py"), "w") as f:
                f.write(f"_CONFIG = {hook_cfg!r}\n{HOOK}")
        with open(os.path.join(hookdir, "main.py"), "w") as f:  # not in work: a workspace holds only the episode's
            f.write(code)
        # Nothing of ours is inherited: no secrets, no proxies, no RLSTREAM_* settings.
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "PYTHONPATH": hookdir, "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               # glibc reserves 64 MiB of address space per thread arena, which RLIMIT_AS counts.
               "MALLOC_ARENA_MAX": "2"}
        cpu = max(1, int(round(lim.cpu_s)))
        cfg = {"argv": [self._exe, "-B", os.path.join(hookdir, "main.py")], "cwd": work, "env": env, "park": park,
               "hide": self._hide_plan(base) if self.network == "unshare" else [],
               "limits": [["RLIMIT_CPU", cpu, cpu + 1],  # SIGXCPU first, SIGKILL a second later
                          ["RLIMIT_AS", lim.memory_mb << 20, lim.memory_mb << 20],
                          ["RLIMIT_FSIZE", lim.file_size_mb << 20, lim.file_size_mb << 20],
                          ["RLIMIT_CORE", 0, 0]]}
        prefix = list(UNSHARE) if self.network == "unshare" else []
        return base, prefix, cfg

    def _run_subprocess(self, code: str, started: float, workdir=None, programs=()) -> SandboxResult:
        lim = self.limits
        base, prefix, cfg = self._prepare(code, workdir, programs)
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen([*prefix, self._exe, "-I", "-c", INIT, json.dumps(cfg), str(status_w)],
                                    cwd=cfg["cwd"], env={"PATH": cfg["env"]["PATH"], "LANG": "C.UTF-8"},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(status_w,), start_new_session=True)
            os.close(status_w)
            status_w = -1
            try:
                output, truncated, timed_out = self._collect(proc, started + lim.timeout_s)
            finally:
                kill_group(proc.pid)
                proc.wait()
                reports = read_reports(status_r)
                wait_gone(reports.get("pid"))
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(base, ignore_errors=True)
        duration = (time.monotonic() - started) * 1000
        text = output.decode("utf-8", "replace")
        if timed_out:
            return SandboxResult(text, -signal.SIGKILL, duration, truncated, "timeout")
        if "exit" not in reports:
            why = reports.get("error", f"sandbox exited with {proc.returncode}")
            return SandboxResult(f"{text}sandbox error: {why}", -1, duration, truncated, "sandbox_error")
        exit_code = reports["exit"]
        return SandboxResult(text, exit_code, duration, truncated,
                             classify(exit_code, reports.get("cpu_s", 0.0), lim.cpu_s))

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool, bool]:
        """Read output up to the limit (draining the rest so the child never blocks) until exit or deadline."""
        limit, buf, truncated = self.limits.max_output_bytes, bytearray(), False
        fd, after_exit = proc.stdout.fileno(), None
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return bytes(buf), truncated, True
                # Once it has exited, what it wrote is all in the pipe (one pipe's capacity at most): read that
                # much, or until the pipe is empty, before giving up on a descendant that still holds it open.
                if after_exit is None and proc.poll() is not None:
                    after_exit = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
                if after_exit is not None and after_exit <= 0:
                    break
                if sel.select(0 if after_exit is not None else min(remaining, 0.05)):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break  # every writer is gone
                    if after_exit is not None:
                        after_exit -= len(chunk)
                    room = limit - len(buf)
                    buf += chunk[:max(room, 0)]
                    truncated = truncated or len(chunk) > room
                elif after_exit is not None:
                    break  # the sandbox ended; a leftover descendant still holds the pipe
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return bytes(buf), truncated, True  # closed its stdout but kept running
        return bytes(buf), truncated, False

    # -- docker backend -------------------------------------------------------------

    def _run_docker(self, code: str, started: float, workdir=None, programs=()) -> SandboxResult:
        from rlstream.sandbox.containers import run_once  # the docker SDK is an optional dependency
        return run_once(self, code, started, workdir)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), **kw) -> SandboxResult:
    """Shorthand: one snippet in a ``Sandbox(limits, **kw)``."""
    return Sandbox(limits, **kw).run_python(code)
