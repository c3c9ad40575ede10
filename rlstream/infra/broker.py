"""Local Apache Kafka broker (KRaft, one or three nodes) started from the Maven Central jars.

The cluster's data is kept under the home dir (HOME/kafka/, see broker_config); the jars come from
broker_jars (fetched once into a per-user cache); the JVMs are run by broker_process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

from rlstream.infra.broker_config import (BrokerError, bootstrap_of, broker_port, controller_port, host_of, kafka_root,
                                          locked, new_cluster_id, node_ids, read_layout, resolve_host, resolve_port,
                                          write_layout)
from rlstream.infra.broker_jars import kafka_lib
from rlstream.infra.broker_process import (log_tail, node_pid, pid_file, port_open, start_nodes, stop_nodes,
                                           wait_exit, wait_ready)

START_TIMEOUT_S = 60.0  # per node: three JVMs starting on two cores take their turns
STOP_TIMEOUT_S = 30.0


def _home(home: Path | str | None) -> Path:
    """The given home, else $RLSTREAM_HOME, else .rlstream in the working directory."""
    return Path(home if home is not None else os.environ.get("RLSTREAM_HOME", ".rlstream")).resolve()


def _wait_ready(home: Path, layout: dict, ids: list[int]) -> None:
    """Wait for ids, START_TIMEOUT_S each (read at call time, so that a caller may raise it)."""
    wait_ready(home, layout, ids, START_TIMEOUT_S * len(ids))


def up(home: Path | str | None = None, brokers: int = 1, port: int | None = None, host: str | None = None) -> str:
    """Start the local Kafka cluster (idempotent) and return its bootstrap address.

    home defaults to $RLSTREAM_HOME or .rlstream, port to $RLSTREAM_KAFKA_PORT or 9092, host (the address the
    nodes listen on) to $RLSTREAM_KAFKA_HOST or 127.0.0.1.
    """
    if brokers not in (1, 3):
        raise BrokerError(f"brokers must be 1 or 3, got {brokers}")
    home = _home(home)
    with locked(home):
        layout = read_layout(home)
        if layout is not None and layout["brokers"] != brokers:
            raise BrokerError(
                f"{kafka_root(home)} holds a {layout['brokers']}-broker cluster, not {brokers}; "
                f"use another RLSTREAM_HOME or delete {kafka_root(home)} to start over"
            )
        running = [n for n in range(1, brokers + 1) if layout and node_pid(home, n) is not None]
        if layout is not None and running:
            # Running already: keep its ports, whatever was asked, so callers share one cluster.
            missing = [n for n in node_ids(layout) if n not in running]
            if missing:
                start_nodes(home, layout, missing)
            _wait_ready(home, layout, node_ids(layout))
            return bootstrap_of(layout)
        if layout is None:
            layout = {"cluster_id": new_cluster_id(), "brokers": brokers, "port": resolve_port(port),
                      "host": resolve_host(host)}
        else:
            layout["port"] = resolve_port(port, layout["port"])
            layout["host"] = resolve_host(host, layout.get("host"))
        write_layout(home, layout)
        where = host_of(layout)
        busy = [p for n in node_ids(layout)
                for p in (broker_port(layout["port"], n), controller_port(layout["port"], n))
                if port_open(p, host=where)]
        if busy:
            raise BrokerError(
                f"port(s) {', '.join(map(str, busy))} already in use on {where}; stop what listens there "
                "or choose another base port with RLSTREAM_KAFKA_PORT"
            )
        start_nodes(home, layout, node_ids(layout))
        try:
            _wait_ready(home, layout, node_ids(layout))
        except BrokerError:
            stop_nodes(home, layout, STOP_TIMEOUT_S)
            raise
        return bootstrap_of(layout)


def down(home: Path | str | None = None) -> None:
    """Stop every node of the local cluster (SIGTERM, SIGKILL after 30 s); data is kept. Idempotent."""
    home = _home(home)
    layout = read_layout(home)
    if layout is None:
        return
    with locked(home):
        stop_nodes(home, layout, STOP_TIMEOUT_S)


def status(home: Path | str | None = None) -> dict[int, dict]:
    """Running nodes: {node_id: {"pid", "bootstrap", "controller"}}; empty when none runs."""
    home = _home(home)
    layout = read_layout(home)
    if layout is None:
        return {}
    out = {}
    for n in node_ids(layout):
        pid = node_pid(home, n)
        if pid is not None:
            out[n] = {"pid": pid, "bootstrap": f"{host_of(layout)}:{broker_port(layout['port'], n)}",
                      "controller": f"{host_of(layout)}:{controller_port(layout['port'], n)}"}
    return out


def stopped(home: Path | str | None = None) -> str | None:
    """None while every node of the cluster under home runs (or none was ever set up there); else why not: the
    stopped nodes, the free disk where their data lies (a full disk is how a broker dies unseen: Kafka stops
    itself when its log directory fails) and each one's errors and last console lines."""
    home = _home(home)
    layout = read_layout(home)
    if layout is None:
        return None
    down_ = [n for n in node_ids(layout) if node_pid(home, n) is None]
    if not down_:
        return None
    free_gb = shutil.disk_usage(kafka_root(home)).free / 2**30
    tails = "\n".join(f"node {n} ({kafka_root(home)}/node-{n}/logs):\n{log_tail(home, n)}" for n in down_)
    return f"Kafka node(s) {', '.join(map(str, down_))} under {kafka_root(home)} stopped ({free_gb:.1f} GB of disk " \
           f"free there)\n{tails}"


def bootstrap(home: Path | str | None = None) -> str | None:
    """The bootstrap address recorded under home, or None if no cluster was ever set up there."""
    layout = read_layout(_home(home))
    return bootstrap_of(layout) if layout else None


def kill_node(home: Path | str | None, node_id: int) -> None:
    """SIGKILL one node (for chaos tests); its data is kept."""
    home = _home(home)
    with locked(home):
        pid = node_pid(home, node_id)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            wait_exit({node_id: pid}, 10)
        pid_file(home, node_id).unlink(missing_ok=True)


def start_node(home: Path | str | None, node_id: int, wait: bool = True) -> None:
    """Start one node of an existing cluster again; with wait, until it answers."""
    home = _home(home)
    layout = read_layout(home)
    if layout is None or node_id not in node_ids(layout):
        raise BrokerError(f"no node {node_id} under {kafka_root(home)}; run up() first")
    with locked(home):
        start_nodes(home, layout, [node_id])
        if wait:
            _wait_ready(home, layout, [node_id])


def main(argv: list[str] | None = None) -> int:
    """python -m rlstream.infra.broker up|down|status|fetch [--brokers N] [--port P]."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m rlstream.infra.broker", description=main.__doc__)
    parser.add_argument("action", choices=["up", "down", "status", "fetch"])
    parser.add_argument("--home", default=None, help="default $RLSTREAM_HOME or .rlstream")
    parser.add_argument("--brokers", type=int, default=1, choices=[1, 3])
    parser.add_argument("--port", type=int, default=None, help="default $RLSTREAM_KAFKA_PORT or 9092")
    parser.add_argument("--host", default=None,
                        help="the address the nodes listen on (default $RLSTREAM_KAFKA_HOST or 127.0.0.1)")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            print(up(args.home, brokers=args.brokers, port=args.port, host=args.host))
        elif args.action == "down":
            down(args.home)
        elif args.action == "fetch":
            print(kafka_lib())  # the jars fetched ahead of the first up, e.g. by make setup
        else:
            print(json.dumps(status(args.home), indent=2))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
