"""The JVMs of the local Kafka cluster: formatting storage, launching nodes, waiting for them, stopping them.

A node's pid is kept in HOME/kafka/node-N/kafka.pid; a pid counts as the node only while it is a live
kafka.Kafka process, so a stale file left by a crash never names an unrelated process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from rlstream.infra.broker_config import (HOST, BrokerError, bootstrap_of, broker_port, controller_port, host_of,
                                          kafka_root, log4j2_properties, node_dir, node_ids, server_properties)
from rlstream.infra.broker_jars import java, kafka_lib

JVM_HEAP = ["-Xmx512m", "-Xms256m"]

# Nodes started by this process, polled so that they are reaped rather than left as zombies.
_children: dict[int, subprocess.Popen] = {}


def pid_file(home: Path, node_id: int) -> Path:
    """The file that holds a running node's pid."""
    return node_dir(home, node_id) / "kafka.pid"


def pid_alive(pid: int) -> bool:
    """Whether pid is a live (not zombie) Kafka node."""
    child = _children.get(pid)
    if child is not None:
        if child.poll() is None:
            return True
        del _children[pid]
        return False
    if not Path("/proc/self").exists():  # no procfs (macOS): existence is all we can check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    # The cmdline check guards against a stale pid file whose pid was reused by another process.
    # Just after exec the kernel briefly reports an empty cmdline, so an empty one is read again.
    for _ in range(20):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        if cmdline or state == "Z":
            break
        time.sleep(0.05)
    return b"kafka.Kafka" in cmdline and state != "Z"


def node_pid(home: Path, node_id: int) -> int | None:
    """The live pid of a node, or None (a stale pid file is removed)."""
    path = pid_file(home, node_id)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid_alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def port_open(port: int, timeout: float = 0.5, host: str = HOST) -> bool:
    """Whether something accepts connections on HOST:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _prepare_node(home: Path, layout: dict, node_id: int, java_exe: str, lib: Path) -> subprocess.Popen | None:
    """Write the node's config; start formatting its storage if new (returns that process)."""
    ndir = node_dir(home, node_id)
    (ndir / "logs").mkdir(parents=True, exist_ok=True)
    (ndir / "data").mkdir(parents=True, exist_ok=True)
    (ndir / "server.properties").write_text(server_properties(home, layout, node_id))
    (ndir / "log4j2.properties").write_text(log4j2_properties(ndir / "logs"))
    if (ndir / "data" / "meta.properties").exists():
        return None
    cmd = format_command(java_exe, lib, ndir / "log4j2.properties", layout["cluster_id"], ndir / "server.properties")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def format_command(java_exe: str, lib: Path | str, log4j: Path | str, cluster_id: str,
                   properties: Path | str) -> list[str]:
    """The command that formats a node's storage for the cluster (does nothing to storage already formatted)."""
    return [java_exe, *JVM_HEAP, f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{lib}/*", "kafka.tools.StorageTool",
            "format", "-t", cluster_id, "-c", str(properties), "--ignore-formatted"]


def server_command(java_exe: str, lib: Path | str, log4j: Path | str, logs: Path | str,
                   properties: Path | str) -> list[str]:
    """The command that runs a node (also the compose broker image's, see broker_image)."""
    return [
        java_exe, *JVM_HEAP,
        "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}",
        f"-Dkafka.logs.dir={logs}",
        "-cp", f"{lib}/*", "kafka.Kafka", str(properties),
    ]


def _launch(home: Path, node_id: int, java_exe: str, lib: Path) -> int:
    """Start a node's JVM in a session of its own (it outlives this process) and record its pid."""
    ndir = node_dir(home, node_id)
    cmd = server_command(java_exe, lib, ndir / "log4j2.properties", ndir / "logs", ndir / "server.properties")
    with open(ndir / "logs" / "stdout.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ndir)
    _children[proc.pid] = proc
    pid_file(home, node_id).write_text(f"{proc.pid}\n")
    return proc.pid


def start_nodes(home: Path, layout: dict, ids: list[int]) -> None:
    """Format the storage of new nodes, then launch every one of ids that is not running."""
    java_exe, lib = java(), kafka_lib()
    formats = {n: _prepare_node(home, layout, n, java_exe, lib) for n in ids}
    for n, proc in formats.items():
        if proc is None:
            continue
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise BrokerError(f"formatting Kafka storage for node {n} failed:\n{out.strip()[-2000:]}")
    for n in ids:
        if node_pid(home, n) is None:
            _launch(home, n, java_exe, lib)


def log_tail(home: Path, node_id: int, lines: int = 10) -> str:
    """The node's errors from server.log and the end of its console output, for error messages."""
    logs = node_dir(home, node_id) / "logs"
    text = []
    with contextlib.suppress(OSError):
        errors = [ln for ln in (logs / "server.log").read_text(errors="replace").splitlines()
                  if "] ERROR " in ln or "] FATAL " in ln]
        text += errors[-lines:]
    with contextlib.suppress(OSError):
        text += (logs / "stdout.log").read_text(errors="replace").splitlines()[-lines:]
    # A JVM's error line can run to kilobytes (a whole request dumped); its start says what happened.
    return "\n".join(ln if len(ln) <= 400 else ln[:400] + " ..." for ln in text)


def wait_ready(home: Path, layout: dict, ids: list[int], timeout: float) -> None:
    """Wait until the given nodes answer metadata requests and the cluster sees all of them."""
    # Here, not at the top: the image that fetches the jars imports rlstream/infra alone, without confluent_kafka.
    from rlstream.kafka.topics import broker_ids

    port = layout["port"]
    deadline = time.monotonic() + timeout
    want = set(ids)
    while True:
        for n in ids:
            if node_pid(home, n) is None:
                raise BrokerError(
                    f"Kafka node {n} exited while starting (port {broker_port(port, n)} or "
                    f"{controller_port(port, n)} in use?). Log {node_dir(home, n) / 'logs'}:\n{log_tail(home, n)}"
                )
        if all(port_open(broker_port(port, n), host=host_of(layout)) for n in ids):
            try:
                if want <= broker_ids(bootstrap_of(layout)):
                    return
            except Exception:  # KafkaException while the broker is still starting up
                pass
        if time.monotonic() > deadline:
            raise BrokerError(
                f"Kafka did not answer on {bootstrap_of(layout)} within {timeout:.0f} s; "
                f"see the logs under {kafka_root(home)}/node-*/logs"
            )
        time.sleep(0.25)


def _signal(pids: dict[int, int], sig: int) -> None:
    """Send sig to every pid; one already gone is skipped."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_exit(pids: dict[int, int], timeout: float) -> dict[int, int]:
    """Wait for the processes to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = dict(pids)
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in alive.items() if pid_alive(p)}
        if alive:
            time.sleep(0.1)
    return alive


def stop_nodes(home: Path, layout: dict, timeout: float) -> None:
    """SIGTERM every running node, SIGKILL those still alive after timeout; their pid files go."""
    pids = {n: p for n in node_ids(layout) if (p := node_pid(home, n)) is not None}
    _signal(pids, signal.SIGTERM)
    alive = wait_exit(pids, timeout)
    if alive:
        _signal(alive, signal.SIGKILL)
        wait_exit(alive, 10)
    for n in pids:
        pid_file(home, n).unlink(missing_ok=True)
