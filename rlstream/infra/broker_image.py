"""The compose stack's broker image, written from the same settings as ``rlstream up``'s nodes.

``python -m rlstream.infra.broker_image OUT`` (run by the Dockerfile's build, with Debian's python3: this module
and what it imports need only the standard library) writes under OUT:

- ``config/server.properties``: one KRaft node, broker and controller, reached by the other containers as
  kafka:9092 and by the host as localhost:29092 (broker_config.container_properties);
- ``config/log4j2.properties`` (the broker logs to the container's log) and ``config/tools-log4j2.properties``;
- ``bin/kafka-server``: formats the storage on first start, then runs the node in the foreground;
- ``bin/kafka-<tool>`` for each of Kafka's tools (kafka_tools.TOOLS), e.g. ``kafka-console-consumer``.

The jars are the pom's, in OUT/libs (the image copies the same folder that ``rlstream up`` runs from).
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from rlstream.infra.broker_config import console_log4j2_properties, container_properties, new_cluster_id
from rlstream.infra.broker_process import format_command, server_command
from rlstream.infra.kafka_tools import TOOLS, TOOLS_LOG_LEVEL, command

#: Where the image keeps the broker's data (a volume in compose.yaml).
DATA = "/var/lib/kafka/data"
#: The container's name on the compose network, and the port published to the host.
NAME, HOST_PORT = "kafka", 29092


def _script(body: str) -> str:
    return "#!/bin/sh\nset -e\n" + body


def write(out: Path, cluster_id: str | None = None) -> None:
    """Write the image's configuration and commands under ``out`` (its jars are ``out/libs``)."""
    config, bin_dir, lib = out / "config", out / "bin", out / "libs"
    config.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    props, log4j, tools_log4j = config / "server.properties", config / "log4j2.properties", \
        config / "tools-log4j2.properties"
    props.write_text(container_properties(NAME, DATA, HOST_PORT))
    log4j.write_text(console_log4j2_properties("INFO"))
    tools_log4j.write_text(console_log4j2_properties(TOOLS_LOG_LEVEL))
    # The id is fixed at build time unless KAFKA_CLUSTER_ID says otherwise; it is kept in the data volume.
    fmt = format_command("java", lib, log4j, "@ID@", props)
    fmt_line = shlex.join(fmt).replace("@ID@", '"${KAFKA_CLUSTER_ID:-%s}"' % (cluster_id or new_cluster_id()))
    server = bin_dir / "kafka-server"
    server.write_text(_script(
        f"# The compose broker: format {DATA} on the first start, then run the node in the foreground.\n"
        f"mkdir -p {DATA}\n"
        f"[ -f {DATA}/meta.properties ] || {fmt_line} >&2\n"
        f"exec {shlex.join(server_command('java', lib, log4j, out / 'logs', props))}\n"))
    server.chmod(0o755)
    for tool in TOOLS:
        path = bin_dir / f"kafka-{tool}"
        path.write_text(_script(f'exec {shlex.join(command(tool, [], "java", lib, tools_log4j))} "$@"\n'))
        path.chmod(0o755)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlstream.infra.broker_image", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the image's Kafka folder (e.g. /opt/kafka)")
    write(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
