"""Prometheus metrics shared by every stage process (one registry per process)."""
from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

RECORDS_IN = Counter("rlstream_records_in_total", "Records consumed", ["stage", "topic"])
RECORDS_OUT = Counter("rlstream_records_out_total", "Records produced", ["stage", "topic"])
DEAD_LETTERS = Counter("rlstream_dead_letters_total", "Records sent to dead-letters", ["stage", "reason"])
FAILURES = Counter("rlstream_failures_total", "Recorded sample failures by class", ["stage", "failure_class"])
TRANSACTIONS = Counter("rlstream_transactions_total", "Stage transactions by outcome", ["stage", "outcome"])
HANDLER_SECONDS = Histogram("rlstream_handler_seconds", "Handler latency per record", ["stage"],
                            buckets=_LATENCY_BUCKETS)
BATCH_SECONDS = Histogram("rlstream_batch_seconds", "Consume-to-commit time per batch", ["stage"],
                          buckets=_LATENCY_BUCKETS)
QUEUE_DELAY = Histogram("rlstream_queue_delay_seconds", "Time a record waited in its topic (now - produced_at)",
                        ["stage"], buckets=_LATENCY_BUCKETS)
CONSUMER_LAG = Gauge("rlstream_consumer_lag", "Records behind the partition high watermark", ["stage", "topic"])
PAUSED = Gauge("rlstream_paused_partitions", "Partitions paused for backpressure", ["stage"])
POLICY_VERSION = Gauge("rlstream_policy_version", "Newest policy version this process knows", ["stage"])


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics; port 0 picks a free one. Returns the port."""
    server, _ = start_http_server(port, addr=addr)
    actual = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", addr, actual)
    return actual
PUBLISH_LATENCY = Histogram("rlstream_policy_publish_latency_seconds",
                            "From weights in the store to this process generating with them", buckets=_LATENCY_BUCKETS)
GENERATED_TOKENS = Counter("rlstream_generated_tokens_total", "Tokens sampled by the inference engine", ["backend"])
