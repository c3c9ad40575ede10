"""Kafka's own command-line tools (kafka-console-consumer and the rest) on the local broker's jars.

The pom (kafka/pom.xml) lists kafka-tools beside the broker, so the jars that ``rlstream up`` fetches hold them:

    python -m rlstream.infra.kafka_tools console-consumer --bootstrap-server 127.0.0.1:9092 \\
        --topic demo.rewards --from-beginning --max-messages 3 \\
        --property print.key=true --property print.headers=true --property print.value=false

runs what Kafka's ``kafka-console-consumer.sh`` runs, with the tools' logging on standard error (standard output
is what the tool prints). The compose broker image has each tool on its PATH as ``kafka-<name>`` (broker_image).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from rlstream.infra.broker_config import BrokerError, console_log4j2_properties

#: Tool name (Kafka's script name less ``kafka-`` and ``.sh``) -> its main class in Kafka 4.
TOOLS = {
    "console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "console-producer": "org.apache.kafka.tools.ConsoleProducer",
    "consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "topics": "org.apache.kafka.tools.TopicCommand",
    "get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "transactions": "org.apache.kafka.tools.TransactionsCommand",
    "broker-api-versions": "org.apache.kafka.tools.BrokerApiVersionsCommand",
}

#: The tools log warnings and errors only.
TOOLS_LOG_LEVEL = "WARN"


def main_class(tool: str) -> str:
    """The Java class of a tool, or a BrokerError that lists the tools."""
    if tool not in TOOLS:
        raise BrokerError(f"unknown Kafka tool {tool!r}; one of: {', '.join(TOOLS)}")
    return TOOLS[tool]


def command(tool: str, args: list[str], java_exe: str, lib: Path | str, log4j: Path | str) -> list[str]:
    """The java command line of ``kafka-<tool> args``."""
    return [java_exe, "-Xmx256m", f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{lib}/*", main_class(tool), *args]


def run(tool: str, args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run ``kafka-<tool> args`` on the local broker's jars (fetched first if needed); ``kw`` go to
    subprocess.run (e.g. capture_output, timeout)."""
    from rlstream.infra.broker_jars import java, kafka_lib
    main_class(tool)  # an unknown tool fetches nothing
    java_exe, lib = java(), kafka_lib()
    with tempfile.TemporaryDirectory(prefix="rlstream-kafka-tools-") as tmp:
        log4j = Path(tmp) / "log4j2.properties"
        log4j.write_text(console_log4j2_properties(TOOLS_LOG_LEVEL))
        return subprocess.run(command(tool, args, java_exe, lib, log4j), **kw)


def main(argv: list[str] | None = None) -> int:
    """python -m rlstream.infra.kafka_tools TOOL [ARGS...]: Kafka's kafka-TOOL.sh (TOOL --help for its flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m rlstream.infra.kafka_tools TOOL [ARGS...]\n\n{__doc__}\ntools: {', '.join(TOOLS)}")
        return 0 if argv else 2
    try:
        return run(argv[0], argv[1:]).returncode
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
