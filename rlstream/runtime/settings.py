"""Knobs of the shared stage runtime (every stage process and replay reads them from flags and the environment)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlstream.config import knob
from rlstream.kafka.topics import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class RuntimeSettings:
    """Knobs of the shared stage runtime."""

    ROLE: ClassVar[str] = ""

    batch_size: int = knob(256, "Most records consumed and committed in one transaction")
    poll_timeout_s: float = knob(0.2, "How long one poll waits for records")
    handler_timeout_s: float = knob(30.0, "A record whose handler runs longer goes to dead-letters")
    concurrency: int = knob(64, "Records handled at once (threads for sync handlers)")
    instance: str = knob("", "Stable worker id: a restarted worker with the same id fences its zombie and takes "
                             "its partitions back at once (default: a random id, whose open transaction the broker "
                             "aborts on timeout and whose partitions move after the session timeout)")
    session_timeout_ms: int = knob(10000, "Consumer-group session: how long a dead worker without a stable "
                                          "--instance holds its partitions")
    standby: bool = knob(False, "Warm standby: load, then wait while a live worker holds this --instance, and take "
                                "its partitions and transactional id (fencing it) once its group membership lapses: "
                                "a crash costs --session-timeout-ms, not a process start and a model load. Give the "
                                "worker and its standby the same --instance, --standby and a short "
                                "--session-timeout-ms (e.g. 1500; the broker's group.min.session.timeout.ms must "
                                "allow it)")
    transaction_timeout_ms: int = knob(30000, "Broker-side timeout of an open transaction")
    stop_timeout_s: float = knob(60.0, "After SIGTERM/SIGINT, how long the process may take to finish what is open "
                                       "(a step, a batch, handlers in flight) before it exits with code 124 (what "
                                       "was not committed is read again); a second signal stops it at once; 0: no "
                                       "limit")
    metrics_port: int = knob(0, "Prometheus /metrics port (0 picks a free port)")
    metrics_addr: str = knob("127.0.0.1", "Address /metrics listens on (0.0.0.0 in containers, for Prometheus)")
    max_record_bytes: int = knob(MAX_MESSAGE_BYTES, "Outputs larger than this are dead-lettered as oversized")
    pipeline: bool = knob(True, "Per-record stages keep records in flight across polls and commit each as it "
                                "finishes, in any order (no record waits for a slower one); --no-pipeline "
                                "handles and commits one batch at a time")
    commit_interval_s: float = knob(0.1, "Pipelined stages: longest a finished record waits for its transaction")
    max_in_flight: int = knob(1024, "Pipelined stages: most records consumed and not yet committed past (at least "
                                    "--concurrency, at most ~8000: the done-ahead map must fit the offset "
                                    "metadata); bounds memory, while --concurrency bounds running handlers")
