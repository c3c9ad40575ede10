"""The local Kafka cluster's layout on disk, its ports and the configuration files written for each node.

Layout: HOME/kafka/cluster.json (cluster id, node count, base port) and HOME/kafka/node-N/ with
server.properties, log4j2.properties, data/, logs/ and kafka.pid for each node.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import uuid
from pathlib import Path

from rlstream.errors import UserError

HOST = "127.0.0.1"
# rlstream.kafka.topics.MAX_MESSAGE_BYTES again: the image that fetches the jars runs rlstream/infra alone, on a bare
# Python without confluent_kafka, so nothing here imports rlstream.kafka at module level.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_PORT = 9092


class BrokerError(UserError, RuntimeError):
    """A broker could not be started or stopped; the message says what to do."""


# ---------------------------------------------------------------- ports


def resolve_host(host: str | None, recorded: str | None = None) -> str:
    """The address the nodes listen on: explicit, else $RLSTREAM_KAFKA_HOST, else the one the cluster last ran on,
    else 127.0.0.1. Another address of this machine (a veth's, a bridge's) lets clients in other network
    namespaces or containers reach the broker with nothing else of the host's network in reach."""
    return host or os.environ.get("RLSTREAM_KAFKA_HOST") or recorded or HOST


def host_of(layout: dict) -> str:
    """The address a cluster's nodes listen on (clusters set up before it was recorded: 127.0.0.1)."""
    return layout.get("host", HOST)


def resolve_port(port: int | None, recorded: int | None = None) -> int:
    """Explicit port, else $RLSTREAM_KAFKA_PORT, else the port the cluster last ran on, else 9092."""
    if port is not None:
        return int(port)
    env = os.environ.get("RLSTREAM_KAFKA_PORT")
    return int(env) if env else (recorded or DEFAULT_PORT)


def broker_port(port: int, node_id: int) -> int:
    """The client port of a node, two ports apart from the next node's."""
    return port + 2 * (node_id - 1)


def controller_port(port: int, node_id: int) -> int:
    """The KRaft controller port of a node."""
    # The odd port next to each broker port, as in Kafka's own examples (9092 broker, 9093 controller).
    return port + 2 * (node_id - 1) + 1


def node_ids(layout: dict) -> list[int]:
    """The ids of the cluster's nodes, 1 .. brokers."""
    return list(range(1, layout["brokers"] + 1))


def bootstrap_of(layout: dict) -> str:
    """The bootstrap address that names every node of the cluster."""
    return ",".join(f"{host_of(layout)}:{broker_port(layout['port'], n)}" for n in node_ids(layout))


# ---------------------------------------------------------------- layout on disk


def kafka_root(home: Path) -> Path:
    """The directory of the cluster under a home."""
    return home / "kafka"


def node_dir(home: Path, node_id: int) -> Path:
    """The directory of one node: its configuration, data and logs."""
    return kafka_root(home) / f"node-{node_id}"


def read_layout(home: Path) -> dict | None:
    """The recorded cluster (cluster_id, brokers, port), or None if none was set up under home."""
    path = kafka_root(home) / "cluster.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_layout(home: Path, layout: dict) -> None:
    """Record the cluster, replacing the file whole so that a reader never sees half of it."""
    path = kafka_root(home) / "cluster.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(layout, indent=2) + "\n")
    tmp.replace(path)


@contextlib.contextmanager
def locked(home: Path):
    """Serialise up/down/start/kill on one home across processes."""
    root = kafka_root(home)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def new_cluster_id() -> str:
    """A fresh KRaft cluster id."""
    # Kafka's Uuid format: 16 random bytes, url-safe base64 without padding, never starting with '-'.
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


# ---------------------------------------------------------------- configuration files


def cluster_properties(brokers: int) -> dict:
    """The settings every node of a cluster of ``brokers`` nodes shares, wherever it runs (rlstream up, or the
    compose stack's broker image, see broker_image): replication sized to the cluster, message size, threads."""
    replicas = min(brokers, 3)
    min_isr = 2 if brokers >= 3 else 1
    return {
        "process.roles": "broker,controller",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
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
        # A warm standby (--standby) takes over when its primary's session lapses; Kafka's 6 s floor on sessions
        # would make that the floor of every recovery.
        "group.min.session.timeout.ms": 1000,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        "replica.fetch.max.bytes": MAX_MESSAGE_BYTES,
        "replica.fetch.response.max.bytes": 4 * MAX_MESSAGE_BYTES,
        # The cleaner's default 128 MiB dedupe buffer is a quarter of the small heap.
        "log.cleaner.dedupe.buffer.size": 32 * 1024 * 1024,
        "num.network.threads": 2,
        "num.io.threads": 4,
    }


def render(props: dict) -> str:
    """A .properties file of ``props``, in their order."""
    return "".join(f"{k}={v}\n" for k, v in props.items())


def server_properties(home: Path, layout: dict, node_id: int) -> str:
    """server.properties of one local node: combined broker and controller, on the layout's host only."""
    port, host = layout["port"], host_of(layout)
    voters = ",".join(f"{i}@{host}:{controller_port(port, i)}" for i in node_ids(layout))
    bport, cport = broker_port(port, node_id), controller_port(port, node_id)
    return render({
        "node.id": node_id,
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{host}:{bport},CONTROLLER://{host}:{cport}",
        "advertised.listeners": f"PLAINTEXT://{host}:{bport}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": node_dir(home, node_id) / "data",
        **cluster_properties(layout["brokers"]),
    })


def container_properties(name: str, data_dir: str, host_port: int) -> str:
    """server.properties of a one-node broker in a container named ``name``: other containers reach it as
    name:9092, the host (through a published port) as localhost:host_port; the controller stays inside."""
    return render({
        "node.id": 1,
        "controller.quorum.voters": "1@127.0.0.1:9093",
        "listeners": f"PLAINTEXT://0.0.0.0:9092,CONTROLLER://127.0.0.1:9093,HOST://0.0.0.0:{host_port}",
        "advertised.listeners": f"PLAINTEXT://{name}:9092,HOST://localhost:{host_port}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,HOST:PLAINTEXT",
        "log.dirs": data_dir,
        **cluster_properties(1),
    })


def log4j2_properties(log_dir: Path) -> str:
    """log4j2.properties of one node: a rolling server.log under log_dir."""
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


def console_log4j2_properties(level: str) -> str:
    """log4j2.properties that log at ``level`` to standard error: the compose broker (its container's log) and the
    Kafka command-line tools (whose standard output is the records they print)."""
    return f"""\
status = warn
shutdownHook = disable
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.console.ref = console
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""
