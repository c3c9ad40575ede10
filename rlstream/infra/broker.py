"""Local Apache Kafka broker (KRaft) started from the Maven Central jars; data kept under the home dir.

Layout: HOME/kafka/cluster.json (cluster id, node count, ports) and HOME/kafka/node-N/ with
server.properties, log4j2.properties, data/, logs/ and kafka.pid for each node.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

HOST = "127.0.0.1"
DEFAULT_PORT = 9092
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
JVM_HEAP = ["-Xmx512m", "-Xms256m"]
START_TIMEOUT_S = 60.0  # per node: three JVMs starting on two cores take their turns
STOP_TIMEOUT_S = 30.0

KAFKA_DIR = Path(__file__).resolve().parents[2] / "infra" / "kafka"

# Nodes started by this process, polled so that they are reaped rather than left as zombies.
_children: dict[int, subprocess.Popen] = {}


class BrokerError(RuntimeError):
    """A broker could not be started or stopped; the message says what to do."""


# ---------------------------------------------------------------- paths and layout


def _home(home: Path | str | None) -> Path:
    return Path(home if home is not None else os.environ.get("RLSTREAM_HOME", ".rlstream")).resolve()


def _port(port: int | None, recorded: int | None = None) -> int:
    """Explicit port, else $RLSTREAM_KAFKA_PORT, else the port the cluster last ran on, else 9092."""
    if port is not None:
        return int(port)
    env = os.environ.get("RLSTREAM_KAFKA_PORT")
    return int(env) if env else (recorded or DEFAULT_PORT)


def _kafka_root(home: Path) -> Path:
    return home / "kafka"


def _node_dir(home: Path, node_id: int) -> Path:
    return _kafka_root(home) / f"node-{node_id}"


def _broker_port(port: int, node_id: int) -> int:
    return port + 2 * (node_id - 1)


def _controller_port(port: int, node_id: int) -> int:
    # The odd port next to each broker port, as in Kafka's own examples (9092 broker, 9093 controller).
    return port + 2 * (node_id - 1) + 1


def _bootstrap(layout: dict) -> str:
    return ",".join(f"{HOST}:{_broker_port(layout['port'], n)}" for n in _node_ids(layout))


def _node_ids(layout: dict) -> list[int]:
    return list(range(1, layout["brokers"] + 1))


def _read_layout(home: Path) -> dict | None:
    path = _kafka_root(home) / "cluster.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_layout(home: Path, layout: dict) -> None:
    path = _kafka_root(home) / "cluster.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(layout, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def _locked(home: Path):
    """Serialise up/down/start/kill on one home across processes."""
    root = _kafka_root(home)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _new_cluster_id() -> str:
    # Kafka's Uuid format: 16 random bytes, url-safe base64 without padding, never starting with '-'.
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


# ---------------------------------------------------------------- processes


def _pid_file(home: Path, node_id: int) -> Path:
    return _node_dir(home, node_id) / "kafka.pid"


def _pid_alive(pid: int) -> bool:
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


def _node_pid(home: Path, node_id: int) -> int | None:
    """The live pid of a node, or None (a stale pid file is removed)."""
    path = _pid_file(home, node_id)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    if _pid_alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def _port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise BrokerError(
            "java not found: the local Kafka broker needs a Java 17+ runtime "
            "(e.g. apt-get install openjdk-17-jre-headless) on PATH or in JAVA_HOME"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match:
        major = int(match.group(1)) if match.group(1) != "1" else int(match.group(2) or 0)
        if major < 17:
            raise BrokerError(f"Kafka 4 needs Java 17 or newer, found Java {major} at {java}; install a newer JDK")
    return java


def _lib_dir() -> Path:
    """The directory of Kafka jars, fetching them with infra/kafka/fetch.sh when needed."""
    env = os.environ.get("RLSTREAM_KAFKA_LIB")
    if env:
        lib = Path(env).resolve()
        if not any(lib.glob("kafka_2.13-*.jar")):
            raise BrokerError(f"RLSTREAM_KAFKA_LIB={env} holds no kafka_2.13-*.jar; point it at a directory of Kafka jars")
        return lib
    fetch = KAFKA_DIR / "fetch.sh"
    if not fetch.exists():
        raise BrokerError(
            f"no Kafka jars: {fetch} is missing (rlstream is not run from a source checkout); "
            "set RLSTREAM_KAFKA_LIB to a directory of Kafka 4 jars (e.g. the libs/ of a Kafka download)"
        )
    proc = subprocess.run(["bash", str(fetch)], capture_output=True, text=True)
    lib = KAFKA_DIR / "lib"
    if proc.returncode != 0 or not any(lib.glob("kafka_2.13-*.jar")):
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BrokerError(
            f"could not fetch the Kafka jars with {fetch} (needs Maven and access to Maven Central); "
            f"fix that and retry, or set RLSTREAM_KAFKA_LIB to a directory of Kafka jars.\n{tail}"
        )
    return lib


# ---------------------------------------------------------------- configuration


def _server_properties(home: Path, layout: dict, node_id: int) -> str:
    n = layout["brokers"]
    port = layout["port"]
    replicas = min(n, 3)
    min_isr = 2 if n >= 3 else 1
    voters = ",".join(f"{i}@{HOST}:{_controller_port(port, i)}" for i in _node_ids(layout))
    bport, cport = _broker_port(port, node_id), _controller_port(port, node_id)
    props = {
        "process.roles": "broker,controller",
        "node.id": node_id,
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{HOST}:{bport},CONTROLLER://{HOST}:{cport}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{bport}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": _node_dir(home, node_id) / "data",
        "num.partitions": 4,
        "auto.create.topics.enable": "false",
        "default.replication.factor": replicas,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": min_isr,
        # Fewer internal partitions than the default 50: the first group or transaction
        # otherwise waits for 50 partitions to be created on a small machine.
        "offsets.topic.num.partitions": 8,
        "transaction.state.log.num.partitions": 8,
        "group.initial.rebalance.delay.ms": 0,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        "replica.fetch.max.bytes": MAX_MESSAGE_BYTES,
        "replica.fetch.response.max.bytes": 4 * MAX_MESSAGE_BYTES,
        # The cleaner's default 128 MiB dedupe buffer is a quarter of the small heap.
        "log.cleaner.dedupe.buffer.size": 32 * 1024 * 1024,
        "num.network.threads": 2,
        "num.io.threads": 4,
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _log4j2_properties(log_dir: Path) -> str:
    # No log4j shutdown hook: it would close the appender before Kafka logs its own shutdown.
    return f"""\
status = warn
shutdownHook = disable
appender.file.type = RollingFile
appender.file.name = file
appender.file.fileName = {log_dir}/server.log
appender.file.filePattern = {log_dir}/server.log.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 50MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
# Request logging and the state-change chatter are noise for a local broker.
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def _prepare_node(home: Path, layout: dict, node_id: int, java: str, lib: Path) -> subprocess.Popen | None:
    """Write the node's config; start formatting its storage if new (returns that process)."""
    ndir = _node_dir(home, node_id)
    (ndir / "logs").mkdir(parents=True, exist_ok=True)
    (ndir / "data").mkdir(parents=True, exist_ok=True)
    (ndir / "server.properties").write_text(_server_properties(home, layout, node_id))
    (ndir / "log4j2.properties").write_text(_log4j2_properties(ndir / "logs"))
    if (ndir / "data" / "meta.properties").exists():
        return None
    cmd = [java, *JVM_HEAP, f"-Dlog4j2.configurationFile={ndir / 'log4j2.properties'}",
           "-cp", str(lib / "*"), "kafka.tools.StorageTool", "format",
           "-t", layout["cluster_id"], "-c", str(ndir / "server.properties"), "--ignore-formatted"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _launch(home: Path, node_id: int, java: str, lib: Path) -> int:
    ndir = _node_dir(home, node_id)
    cmd = [
        java, *JVM_HEAP,
        "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={ndir / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={ndir / 'logs'}",
        "-cp", str(lib / "*"), "kafka.Kafka", str(ndir / "server.properties"),
    ]
    with open(ndir / "logs" / "stdout.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ndir)
    _children[proc.pid] = proc
    _pid_file(home, node_id).write_text(f"{proc.pid}\n")
    return proc.pid


def _log_tail(home: Path, node_id: int, lines: int = 10) -> str:
    """The node's errors from server.log and the end of its console output, for error messages."""
    logs = _node_dir(home, node_id) / "logs"
    text = []
    with contextlib.suppress(OSError):
        errors = [ln for ln in (logs / "server.log").read_text(errors="replace").splitlines()
                  if "] ERROR " in ln or "] FATAL " in ln]
        text += errors[-lines:]
    with contextlib.suppress(OSError):
        text += (logs / "stdout.log").read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text)


def _wait_ready(home: Path, layout: dict, node_ids: list[int]) -> None:
    """Wait until the given nodes answer metadata requests and the cluster sees all of them."""
    from confluent_kafka.admin import AdminClient

    port = layout["port"]
    timeout = START_TIMEOUT_S * len(node_ids)
    deadline = time.monotonic() + timeout
    want = set(node_ids)
    while True:
        for n in node_ids:
            if _node_pid(home, n) is None:
                raise BrokerError(
                    f"Kafka node {n} exited while starting (port {_broker_port(port, n)} or "
                    f"{_controller_port(port, n)} in use?). Log {_node_dir(home, n) / 'logs'}:\n{_log_tail(home, n)}"
                )
        if all(_port_open(_broker_port(port, n)) for n in node_ids):
            admin = AdminClient({"bootstrap.servers": _bootstrap(layout), "log_level": 0,
                                 "logger": _quiet_logger()})
            try:
                seen = set(admin.list_topics(timeout=2).brokers)
                if want <= seen:
                    return
            except Exception:  # KafkaException while the broker is still starting up
                pass
        if time.monotonic() > deadline:
            raise BrokerError(
                f"Kafka did not answer on {_bootstrap(layout)} within {timeout:.0f} s; "
                f"see the logs under {_kafka_root(home)}/node-*/logs"
            )
        time.sleep(0.25)


def _quiet_logger():
    import logging

    logger = logging.getLogger("rlstream.infra.broker.admin")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


def _start_nodes(home: Path, layout: dict, node_ids: list[int]) -> None:
    java, lib = _java(), _lib_dir()
    formats = {n: _prepare_node(home, layout, n, java, lib) for n in node_ids}
    for n, proc in formats.items():
        if proc is None:
            continue
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise BrokerError(f"formatting Kafka storage for node {n} failed:\n{out.strip()[-2000:]}")
    for n in node_ids:
        if _node_pid(home, n) is None:
            _launch(home, n, java, lib)


def _stop_pids(pids: dict[int, int], sig: int) -> None:
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_exit(pids: dict[int, int], timeout: float) -> dict[int, int]:
    """Wait for the processes to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = dict(pids)
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in alive.items() if _pid_alive(p)}
        if alive:
            time.sleep(0.1)
    return alive


# ---------------------------------------------------------------- public API


def up(home: Path | str | None = None, brokers: int = 1, port: int | None = None) -> str:
    """Start the local Kafka cluster (idempotent) and return its bootstrap address.

    home defaults to $RLSTREAM_HOME or .rlstream, port to $RLSTREAM_KAFKA_PORT or 9092.
    """
    if brokers not in (1, 3):
        raise BrokerError(f"brokers must be 1 or 3, got {brokers}")
    home = _home(home)
    with _locked(home):
        layout = _read_layout(home)
        if layout is not None and layout["brokers"] != brokers:
            raise BrokerError(
                f"{_kafka_root(home)} holds a {layout['brokers']}-broker cluster, not {brokers}; "
                f"use another RLSTREAM_HOME or delete {_kafka_root(home)} to start over"
            )
        running = [n for n in range(1, brokers + 1) if layout and _node_pid(home, n) is not None]
        if layout is not None and running:
            # Running already: keep its ports, whatever was asked, so callers share one cluster.
            missing = [n for n in _node_ids(layout) if n not in running]
            if missing:
                _start_nodes(home, layout, missing)
            _wait_ready(home, layout, _node_ids(layout))
            return _bootstrap(layout)
        if layout is None:
            layout = {"cluster_id": _new_cluster_id(), "brokers": brokers, "port": _port(port)}
        else:
            layout["port"] = _port(port, layout["port"])
        _write_layout(home, layout)
        busy = [p for n in _node_ids(layout)
                for p in (_broker_port(layout["port"], n), _controller_port(layout["port"], n)) if _port_open(p)]
        if busy:
            raise BrokerError(
                f"port(s) {', '.join(map(str, busy))} already in use on {HOST}; stop what listens there "
                "or choose another base port with RLSTREAM_KAFKA_PORT"
            )
        _start_nodes(home, layout, _node_ids(layout))
        try:
            _wait_ready(home, layout, _node_ids(layout))
        except BrokerError:
            _stop(home, layout)
            raise
        return _bootstrap(layout)


def _stop(home: Path, layout: dict, timeout: float = STOP_TIMEOUT_S) -> None:
    pids = {n: p for n in _node_ids(layout) if (p := _node_pid(home, n)) is not None}
    _stop_pids(pids, signal.SIGTERM)
    alive = _wait_exit(pids, timeout)
    if alive:
        _stop_pids(alive, signal.SIGKILL)
        _wait_exit(alive, 10)
    for n in pids:
        _pid_file(home, n).unlink(missing_ok=True)


def down(home: Path | str | None = None) -> None:
    """Stop every node of the local cluster (SIGTERM, SIGKILL after 30 s); data is kept. Idempotent."""
    home = _home(home)
    layout = _read_layout(home)
    if layout is None:
        return
    with _locked(home):
        _stop(home, layout)


def status(home: Path | str | None = None) -> dict[int, dict]:
    """Running nodes: {node_id: {"pid", "bootstrap", "controller"}}; empty when none runs."""
    home = _home(home)
    layout = _read_layout(home)
    if layout is None:
        return {}
    out = {}
    for n in _node_ids(layout):
        pid = _node_pid(home, n)
        if pid is not None:
            out[n] = {"pid": pid, "bootstrap": f"{HOST}:{_broker_port(layout['port'], n)}",
                      "controller": f"{HOST}:{_controller_port(layout['port'], n)}"}
    return out


def bootstrap(home: Path | str | None = None) -> str | None:
    """The bootstrap address recorded under home, or None if no cluster was ever set up there."""
    layout = _read_layout(_home(home))
    return _bootstrap(layout) if layout else None


def kill_node(home: Path | str | None, node_id: int) -> None:
    """SIGKILL one node (for chaos tests); its data is kept."""
    home = _home(home)
    with _locked(home):
        pid = _node_pid(home, node_id)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait_exit({node_id: pid}, 10)
        _pid_file(home, node_id).unlink(missing_ok=True)


def start_node(home: Path | str | None, node_id: int, wait: bool = True) -> None:
    """Start one node of an existing cluster again; with wait, until it answers."""
    home = _home(home)
    layout = _read_layout(home)
    if layout is None or node_id not in _node_ids(layout):
        raise BrokerError(f"no node {node_id} under {_kafka_root(home)}; run up() first")
    with _locked(home):
        _start_nodes(home, layout, [node_id])
        if wait:
            _wait_ready(home, layout, [node_id])


def main(argv: list[str] | None = None) -> int:
    """python -m rlstream.infra.broker up|down|status [--brokers N] [--port P]."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m rlstream.infra.broker", description=main.__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--home", default=None, help="default $RLSTREAM_HOME or .rlstream")
    parser.add_argument("--brokers", type=int, default=1, choices=[1, 3])
    parser.add_argument("--port", type=int, default=None, help="default $RLSTREAM_KAFKA_PORT or 9092")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            print(up(args.home, brokers=args.brokers, port=args.port))
        elif args.action == "down":
            down(args.home)
        else:
            print(json.dumps(status(args.home), indent=2))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
