"""Run untrusted Python snippets (tool calls, model-written code) with limits and without network.

Two backends. ``docker`` (when an engine answers): a throw-away container with
networking disabled and memory, CPU and pid limits. ``subprocess`` (the default
here): a child Python process with

- a wall-clock timeout that SIGKILLs the whole process group, and with
  namespaces the whole pid namespace (children that ``setsid()`` die too);
- ``setrlimit`` in ``preexec_fn``: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE
  (not RLIMIT_NPROC: it counts every process of the uid system-wide, and root ignores it);
- a fresh temp dir as cwd, HOME and TMPDIR, removed afterwards (or the caller's ``workdir``, kept: an
  episode's workspace), and a minimal environment;
- no network: ``unshare -rnpfm`` (user, net, pid and mount namespaces) where it works, so
  the child has no interface at all, not even loopback; an audit hook blocks sockets too;
- files: an audit hook (installed through ``sitecustomize`` in every Python process of the
  sandbox) refuses ``open`` outside the temp dir and read-only Python library folders, and
  refuses starting programs other than Python, ``ctypes`` and gc introspection. With
  namespaces, HOME and the project folder are also covered by an empty tmpfs.

Audit hooks are not a security boundary against code written to escape them (PEP 578); the
namespaces and limits are. For adversarial code use the docker backend.
"""
from __future__ import annotations

import contextlib
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
import threading
import time
from dataclasses import dataclass

from rlstream.schemas.records import ToolResult

log = logging.getLogger(__name__)

FAILURE_CLASSES = (None, "timeout", "memory", "cpu", "crash", "sandbox_error")
#: Exit status the sandbox's excepthook uses for an uncaught MemoryError (RLIMIT_AS reached).
MEMORY_EXIT = 86
_UNSHARE = ("unshare", "-r", "-n", "-p", "-f", "-m", "--kill-child")


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


# The hook every sandboxed Python process loads as sitecustomize; _CONFIG is prepended per run.
_HOOK = r'''
def _install(cfg):
    import os, shutil, sys
    work, hookdir, exe, programs = cfg["work"], cfg["hookdir"], cfg["exe"], frozenset(cfg["programs"])
    readable, exact = tuple(cfg["read"]), frozenset(cfg["exact"])
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_modules = ("ctypes", "_ctypes", "cffi", "_cffi_backend")  # raw syscalls would bypass every check

    def inside(p, roots):
        return any(p == r or p.startswith(r + sep) for r in roots)

    def deny(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(path, writing):
        if path is None or isinstance(path, int):
            return
        p = realpath(fsdecode(path))  # resolves symlinks planted in the work dir
        if inside(p, (work,)) or p in exact or (not writing and inside(p, readable)):
            return
        deny(("writing " if writing else "reading ") + p)

    def check_address(addr):
        if isinstance(addr, (str, bytes)):
            a = fsdecode(addr)
            if a and not a.startswith("\0") and inside(realpath(a), (work,)):
                return  # a unix socket of the snippet's own
        deny(f"network access to {addr!r}")

    def check_exec(path, args, env):
        args = [fsdecode(a) for a in (args or ())]
        prog = fsdecode(path if path is not None else (args[0] if args else ""))
        if sep not in prog:
            prog = shutil.which(prog) or prog
        if realpath(prog) in programs:
            return  # a program the caller allowed (the shell tool's /bin/sh); it runs without these hooks
        if realpath(prog) != exe:
            deny(f"running {prog}")
        pp = next((fsdecode(v) for k, v in (os.environ if env is None else env).items()
                   if fsdecode(k) == "PYTHONPATH"), "")
        if pp.split(os.pathsep)[0] != hookdir:
            deny("starting Python without the sandbox hooks")
        for a in args[1:]:
            if not a.startswith("-") or a.startswith(("--", "-W", "-X")):
                continue  # option values, long options and -W/-X settings hold no mode letters
            if set(a[1:]) & set("IES"):
                deny(f"python flag {a}")
            if set(a[1:]) & set("cm"):
                break

    def hook(event, args):
        if event == "open":
            flags = args[2] if isinstance(args[2], int) else 0
            mode = args[1] if isinstance(args[1], str) else ""
            check_path(args[0], bool(flags & writes) or any(c in mode for c in "wax+"))
        elif event in ("os.listdir", "os.scandir"):
            check_path(args[0], False)
        elif event == "socket.__new__":
            if args[1] != 1:  # only AF_UNIX: asyncio's self-pipe needs socketpair()
                deny("opening a network socket")
        elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            check_address(args[1])
        elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                       "socket.getnameinfo"):
            deny("name resolution")
        elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn"):
            check_exec(args[0], args[1], args[2] if len(args) > 2 else None)
        elif event in ("os.system", "gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            deny(event)
        elif event == "import" and str(args[0]).rpartition(".")[2] in blocked_modules:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")

    previous = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)
        if issubclass(kind, MemoryError):
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(cfg["memory_exit"])

    sys.excepthook = excepthook
    sys.addaudithook(hook)


_install(_CONFIG)
del _install, _CONFIG
'''

# The trusted first process inside the sandbox: hides folders, applies the limits to the
# snippet's process in preexec_fn (single-threaded here, so that is safe), waits, reports.
_INIT = r'''
import json, os, resource, subprocess, sys
cfg, status = json.loads(sys.argv[1]), int(sys.argv[2])
def report(**kw):
    os.write(status, (json.dumps(kw) + "\n").encode())
report(pid=int(os.readlink("/proc/self")))  # the host pid: /proc is still the host's
def mount(src, dst, fs, flags, data):
    if libc.mount(src.encode(), dst.encode(), fs and fs.encode(), flags, data and data.encode()):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {dst}: {os.strerror(err)}")
def limits():
    for name, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
try:
    if cfg["hide"]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for i, (path, keeps) in enumerate(cfg["hide"]):
            staged = []
            for j, keep in enumerate(keeps):  # park the Python install, cover its parent, put it back
                park = os.path.join(cfg["park"], f"{i}-{j}")
                os.mkdir(park)
                mount(keep, park, None, 4096 | 16384, None)  # MS_BIND | MS_REC
                staged.append((park, keep))
            mount("tmpfs", path, "tmpfs", 2 | 4, "size=64k,mode=755")  # MS_NOSUID | MS_NODEV
            for park, keep in staged:
                os.makedirs(keep, exist_ok=True)
                mount(park, keep, None, 4096 | 16384, None)
                libc.umount2(park.encode(), 2)  # MNT_DETACH
    child = subprocess.Popen(cfg["argv"], cwd=cfg["cwd"], env=cfg["env"], stdin=subprocess.DEVNULL,
                             preexec_fn=limits)
except Exception as exc:
    report(error=f"{type(exc).__name__}: {exc}")
    sys.exit(1)
_, st, ru = os.wait4(child.pid, 0)
child.returncode = code = os.waitstatus_to_exitcode(st)
report(exit=code, cpu_s=ru.ru_utime + ru.ru_stime)
'''


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


_probe_lock, _probes = threading.Lock(), {}


def namespaces_available() -> bool:
    """Whether ``unshare -rnpfm`` runs here (cached): root, or unprivileged user namespaces."""
    with _probe_lock:
        if "unshare" not in _probes:
            ok = shutil.which("unshare") is not None
            if ok:
                try:
                    ok = subprocess.run([*_UNSHARE, sys.executable, "-I", "-c", "pass"], capture_output=True,
                                        timeout=10).returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    ok = False
            _probes["unshare"] = ok
        return _probes["unshare"]


def docker_available() -> bool:
    """Whether the docker SDK is importable and an engine answers a ping (cached)."""
    with _probe_lock:
        if "docker" not in _probes:
            try:
                import docker  # optional dependency
                _probes["docker"] = bool(docker.from_env(timeout=5).ping())
            except Exception:
                _probes["docker"] = False
        return _probes["docker"]


def docker_image_present(image: str) -> bool:
    """Whether the engine already holds ``image`` (nothing is pulled: a sandbox must not wait on a registry)."""
    try:
        import docker
        docker.from_env(timeout=5).images.get(image)
        return True
    except Exception:
        return False


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
        self._readable = sorted({_real(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                                | {"/usr/share/zoneinfo"})
        self._keep = sorted({_real(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(self._exe)),
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
            path = _real(raw)
            if not os.path.isdir(path) or _inside(base, path) or any(_inside(path, k) for k in self._keep):
                continue  # never cover the sandbox itself, "/", or a folder inside the Python install
            keeps = [k for k in self._keep if _inside(k, path)]
            keeps = [k for k in keeps if not any(o != k and _inside(k, o) for o in keeps)]
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
                    "programs": [_real(shutil.which(p) or p) for p in programs],
                    "read": [*self._readable, hookdir],
                    "exact": ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime"]}
        if self.audit_hooks:
            with open(os.path.join(hookdir, "sitecustomize.py"), "w") as f:
                f.write(f"_CONFIG = {hook_cfg!r}\n{_HOOK}")
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
        prefix = list(_UNSHARE) if self.network == "unshare" else []
        return base, prefix, cfg

    def _run_subprocess(self, code: str, started: float, workdir=None, programs=()) -> SandboxResult:
        lim = self.limits
        base, prefix, cfg = self._prepare(code, workdir, programs)
        status_r, status_w = os.pipe()
        try:
            proc = subprocess.Popen([*prefix, self._exe, "-I", "-c", _INIT, json.dumps(cfg), str(status_w)],
                                    cwd=cfg["cwd"], env={"PATH": cfg["env"]["PATH"], "LANG": "C.UTF-8"},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(status_w,), start_new_session=True)
            os.close(status_w)
            status_w = -1
            try:
                output, truncated, timed_out = self._collect(proc, started + lim.timeout_s)
            finally:
                _kill_group(proc.pid)
                proc.wait()
                reports = _read_reports(status_r)
                _wait_gone(reports.get("pid"))
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
                             _classify(exit_code, reports.get("cpu_s", 0.0), lim.cpu_s))

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool, bool]:
        """Read output up to the limit (draining the rest so the child never blocks) until exit or deadline."""
        limit, buf, truncated = self.limits.max_output_bytes, bytearray(), False
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return bytes(buf), truncated, True
                if sel.select(min(remaining, 0.05)):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break  # every writer is gone
                    room = limit - len(buf)
                    buf += chunk[:max(room, 0)]
                    truncated = truncated or len(chunk) > room
                elif proc.poll() is not None:
                    break  # the sandbox ended; a leftover descendant still holds the pipe
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return bytes(buf), truncated, True  # closed its stdout but kept running
        return bytes(buf), truncated, False

    # -- docker backend -------------------------------------------------------------

    def _run_docker(self, code: str, started: float, workdir=None, programs=()) -> SandboxResult:
        from rlstream.sandbox_docker import run_once  # its own module: the docker SDK is an optional dependency
        return run_once(self, code, started, workdir)


def _classify(exit_code: int, cpu_s: float, cpu_limit: float) -> str | None:
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


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_reports(fd: int) -> dict:
    """The init's JSON lines, merged; every writer is dead by now, so reading ends."""
    data = bytearray()
    while chunk := os.read(fd, 65536):
        data += chunk
    reports: dict = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            reports.update(json.loads(line))
        except ValueError:
            pass
    return reports


def _wait_gone(pid: int | None, timeout: float = 5.0) -> None:
    """Wait for the sandbox's init to die: with a pid namespace, its death is every descendant's."""
    if not pid:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.01)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), **kw) -> SandboxResult:
    """Shorthand: one snippet in a ``Sandbox(limits, **kw)``."""
    return Sandbox(limits, **kw).run_python(code)
