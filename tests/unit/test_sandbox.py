"""The tool sandbox: no network, no files outside its temp dir, limits enforced, whole process tree killed."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from rlstream.sandbox import Sandbox, SandboxLimits, docker_available, namespaces_available

ROOT = Path(__file__).resolve().parents[2]


def _require_namespaces() -> None:
    """Skip where ``unshare -rnpfm`` does not work; under CI=true fail instead: CI must test the namespace layer."""
    if namespaces_available():
        return
    what = "unshare -rnpfm does not work here (no unshare, or user namespaces are off)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {what}; the sandbox's namespace variant cannot be tested", pytrace=False)
    pytest.skip(what)


@pytest.fixture
def namespaces() -> None:
    """For the tests marked ``needs_namespaces``."""
    _require_namespaces()


needs_namespaces = pytest.mark.usefixtures("namespaces")


def make(network: str, **limits) -> Sandbox:
    return Sandbox(SandboxLimits(**{"timeout_s": 10.0, **limits}), backend="subprocess", network=network)


@pytest.fixture(params=["unshare", "audit"])
def network(request) -> str:
    """Each isolation the subprocess backend has: namespaces with the audit hook, and the audit hook alone."""
    if request.param == "unshare":
        _require_namespaces()
    return request.param


@pytest.fixture
def listener():
    """A TCP server on loopback that records whether anyone connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


def _accepted(srv: socket.socket) -> bool:
    try:
        conn, _ = srv.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _alive_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker`` (zombies have an empty one)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_runs_code_in_a_fresh_temp_dir_with_a_minimal_environment(network, monkeypatch):
    monkeypatch.setenv("RLSTREAM_SECRET_TOKEN", "hunter2")
    result = make(network).run_python(
        "import os\nopen('f.txt', 'w').write('kept')\nprint(os.getcwd(), os.environ['HOME'], open('f.txt').read())\n"
        "print(sorted(os.environ))")
    assert result.failure_class is None and result.exit_code == 0, result.output
    cwd, home, content = result.output.splitlines()[0].split()
    assert cwd == home and content == "kept"
    assert "RLSTREAM_SECRET_TOKEN" not in result.output and "hunter2" not in result.output
    assert not os.path.exists(cwd), "the temp dir is removed afterwards"


def test_cannot_connect_or_resolve(network, listener):
    port = listener.getsockname()[1]
    result = make(network).run_python(f"""
import socket
for name, attempt in [("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
                      ("raw", lambda: socket.socket().connect(("127.0.0.1", {port}))),
                      ("dns", lambda: socket.getaddrinfo("localhost", 80)),
                      ("dns2", lambda: socket.gethostbyname("example.com"))]:
    try:
        attempt()
        print(name, "CONNECTED")
    except OSError as exc:
        print(name, "blocked", type(exc).__name__)
""")
    assert result.failure_class is None, result.output
    assert "CONNECTED" not in result.output and result.output.count("blocked") == 4, result.output
    assert not _accepted(listener)


@needs_namespaces
def test_network_namespace_alone_has_no_route(listener):
    """With the audit hook off, the kernel still refuses: the namespace has no interface up."""
    port = listener.getsockname()[1]
    sandbox = Sandbox(SandboxLimits(timeout_s=10), backend="subprocess", network="unshare", audit_hooks=False)
    result = sandbox.run_python(f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("CONNECTED")
except OSError as exc:
    print("blocked", exc.errno)
""")
    assert result.output.startswith("blocked"), result.output
    assert not _accepted(listener)


def test_cannot_read_project_or_home_files(network, tmp_path):
    secret = tmp_path / "secret.txt"  # outside the sandbox's own temp dir, like any user file
    secret.write_text("s3cret")
    home_file = Path.home() / ".bashrc"
    targets = [ROOT / "pyproject.toml", secret, home_file if home_file.exists() else secret]
    code = f"""
import os, subprocess, sys
for path in {[str(t) for t in targets]!r}:
    try:
        print("READ", open(path).read()[:40])
    except OSError as exc:
        print("blocked", type(exc).__name__)
os.symlink({str(secret)!r}, "link")
try:
    print("READ", open("link").read())
except OSError as exc:
    print("blocked", type(exc).__name__)
for argv in (["cat", {str(secret)!r}], [sys.executable, "-I", "-c", "print(open({str(secret)!r}).read())"],
             [sys.executable, "-c", "print(open({str(secret)!r}).read())"]):
    try:
        print("READ", subprocess.run(argv, capture_output=True, text=True).stdout or "nothing")
    except OSError as exc:
        print("blocked", type(exc).__name__)
"""
    result = make(network).run_python(code)
    assert result.failure_class is None, result.output
    assert "s3cret" not in result.output and "build-system" not in result.output, result.output
    assert result.output.count("blocked") == 6 and "READ nothing" in result.output, result.output


@needs_namespaces
def test_mount_namespace_hides_folders_from_any_program(tmp_path):
    """Under namespaces the hidden folders are empty for every program, not just Python's open()."""
    (tmp_path / "secret.txt").write_text("s3cret")
    sandbox = Sandbox(SandboxLimits(timeout_s=10), backend="subprocess", network="unshare",
                      hide=(str(ROOT), str(tmp_path)), audit_hooks=False)
    result = sandbox.run_python(f"""
import os, subprocess
print(sorted(os.listdir({str(tmp_path)!r})), sorted(os.listdir({str(ROOT)!r})))
print(subprocess.run(["cat", {str(tmp_path / "secret.txt")!r}], capture_output=True, text=True).stderr)
import numpy  # the Python install itself stays visible
""")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("[] []") and "No such file" in result.output, result.output


def test_cpu_limit(network):
    result = make(network, cpu_s=1).run_python("while True:\n    pass")
    assert result.failure_class == "cpu", result  # the CPU limit (1 s) ended it, not the wall-clock timeout (10 s)


def test_memory_limit(network):
    result = make(network, memory_mb=256).run_python("x = bytearray(1 << 30)\nprint('allocated')")
    assert result.failure_class == "memory", result
    assert "allocated" not in result.output


def test_timeout_kills_the_process_and_its_children(network):
    marker = f"rlstream-sbx-test-{os.getpid()}-{time.monotonic_ns()}"
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{marker}-child"])
print("started", flush=True)
time.sleep(120)
"""
    result = make(network, timeout_s=1.5).run_python(code)
    assert result.failure_class == "timeout" and result.output.startswith("started"), result
    deadline = time.monotonic() + 3
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_with(marker) == [], "the sandbox's child outlived it"


@needs_namespaces
def test_timeout_kills_children_that_left_the_process_group():
    marker = f"rlstream-sbx-setsid-{os.getpid()}-{time.monotonic_ns()}"
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(120)", "{marker}"])
time.sleep(120)
"""
    result = make("unshare", timeout_s=1.5).run_python(code)
    assert result.failure_class == "timeout"
    assert _alive_with(marker) == [], "a setsid() child outlived the pid namespace"


def test_output_is_truncated(network):
    result = make(network, max_output_bytes=1000).run_python("print('x' * 1_000_000)\nprint('done')")
    assert result.truncated and result.failure_class is None and result.exit_code == 0
    assert result.output == "x" * 1000


def test_crash_and_plain_errors(network):
    sandbox = make(network)
    crash = sandbox.run_python("import os\nos.abort()")
    assert crash.failure_class == "crash" and crash.exit_code < 0
    error = sandbox.run_python("raise SystemExit(3)")
    assert error.failure_class is None and error.exit_code == 3  # the snippet's own error is its output
    tool = error.to_tool_result()
    assert tool.exit_code == 3 and tool.failure_class is None


def test_docker_backend_is_refused_without_an_engine(monkeypatch, tmp_path):
    """Whatever this machine runs (CI runs this beside its compose stack's engine): the SDK pointed at a socket
    nothing listens on, and the probe's cached answer set aside for the test."""
    from rlstream.sandbox import probes
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-engine.sock'}")
    monkeypatch.setattr(probes, "PROBES", {})
    assert not docker_available()
    with pytest.raises(ValueError, match="docker"):
        Sandbox(backend="docker")
    assert Sandbox(backend="auto").backend == "subprocess"


def test_docker_backend_passes_limits_and_classifies(monkeypatch):
    """The docker path against a stand-in SDK (no engine here): isolation options in, failure classes out."""
    import sys
    import types

    from rlstream.sandbox import probes

    runs = []

    class Container:
        def __init__(self, status, logs=b"", oom=False, hang=False):
            self.status, self.chunks, self.oom, self.hang = status, [logs], oom, hang
            self.killed = self.removed = False
            self.attrs = {"State": {"OOMKilled": oom}}

        def wait(self, timeout):
            if self.hang:
                raise TimeoutError("read timed out")
            return {"StatusCode": self.status}

        def kill(self):
            self.killed = True

        def logs(self, stdout, stderr, stream):
            return iter(self.chunks)

        def reload(self):
            pass

        def remove(self, force):
            self.removed = True

    queue: list[Container] = []

    def run(image, command, **kw):
        runs.append((image, command, kw))
        return queue.pop(0)

    images = {"python:3.11-slim"}

    def get(name):
        if name not in images:
            raise LookupError(name)

    client = types.SimpleNamespace(containers=types.SimpleNamespace(run=run), images=types.SimpleNamespace(get=get))
    fake = types.SimpleNamespace(from_env=lambda **kw: client, types=types.SimpleNamespace(Ulimit=dict))
    monkeypatch.setitem(sys.modules, "docker", fake)
    monkeypatch.setitem(probes.PROBES, "docker", True)
    # auto takes docker only where the engine holds the image (a pull would fail every call offline).
    assert Sandbox(backend="auto", docker_image="absent:1").backend == "subprocess"
    with pytest.raises(ValueError, match="no image 'absent:1'"):
        Sandbox(backend="docker", docker_image="absent:1")
    sandbox = Sandbox(SandboxLimits(memory_mb=256, timeout_s=2, max_output_bytes=4), backend="auto")
    assert sandbox.backend == "docker" and sandbox.isolation == "docker"
    cases = [(Container(0, b"hi\n"), None), (Container(128 + 24), "cpu"), (Container(139), "crash"),
             (Container(137, oom=True), "memory"), (Container(0, hang=True), "timeout"), (Container(1), None)]
    queue.extend(c for c, _ in cases)
    results = [sandbox.run_python("print('hi')") for _ in cases]
    assert [r.failure_class for r in results] == [expected for _, expected in cases]
    assert results[0].output == "hi\n" and not results[0].truncated
    assert all(c.removed for c, _ in cases) and cases[4][0].killed
    image, command, kw = runs[0]
    assert image == "python:3.11-slim" and command[-1] == "print('hi')"
    assert kw["network_disabled"] is True and kw["mem_limit"] == "256m" and kw["read_only"] is True
    assert kw["pids_limit"] > 0 and kw["cap_drop"] == ["ALL"]
    queue.append(Container(0, b"x" * 100))
    big = sandbox.run_python("print('x' * 100)")
    assert big.truncated and big.output == "xxxx"
