"""Prometheus metrics shared by every stage process (one registry per process)."""
from __future__ import annotations

import logging
import time

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
PUBLISH_LATENCY = Histogram("rlstream_policy_publish_latency_seconds",
                            "From weights in the store to this process generating with them", buckets=_LATENCY_BUCKETS)
GENERATED_TOKENS = Counter("rlstream_generated_tokens_total", "Tokens sampled by the inference engine", ["backend"])
# -- inference servers (rollout's fleet) ---------------------------------------------------------------------------
SERVER_UP = Gauge("rlstream_inference_server_up", "1 while a server takes new work (healthy, on the current version)",
                  ["server"])
SERVER_VERSION = Gauge("rlstream_inference_server_version", "Policy version a server confirmed it holds", ["server"])
PUSH_FAILURES = Counter("rlstream_inference_push_failures_total", "Weight pushes a server did not confirm", ["server"])
REQUEST_RETRIES = Counter("rlstream_inference_retries_total", "Requests re-sent to another server after one failed",
                          ["server"])

# -- the loop's figures (DESIGN "Observability"): goodput, staleness, RL step and publish times ------------------
VALID_TRAJECTORIES = Counter("rlstream_valid_trajectories_total",
                             "Trajectories produced with status ok (goodput numerator)", ["stage"])
ACCEPTED_SAMPLES = Counter("rlstream_accepted_samples_total",
                           "Samples the trainer accepted under the staleness bound (goodput)", ["stage"])
STALE_SAMPLES = Counter("rlstream_stale_samples_total", "Samples the trainer dropped as more than eta versions old",
                        ["stage"])
STALE_TOKENS = Counter("rlstream_stale_tokens_total", "Tokens the trainer masked out as more than eta versions old "
                       "(--stale-rule token), in samples it kept", ["stage"])
EVICTED_SAMPLES = Counter("rlstream_evicted_samples_total", "Samples of incomplete head groups evicted by timeout",
                          ["stage"])
STALE_RATIO = Gauge("rlstream_stale_ratio", "stale / (stale + accepted) since this process started", ["stage"])
STEP_SECONDS = Histogram("rlstream_rl_step_seconds", "RL step wall-clock: update, checkpoint and announce",
                         ["stage"], buckets=_LATENCY_BUCKETS)
WEIGHTS_REFUSED = Counter("rlstream_weights_refused_total",
                          "Policy versions a worker refused to load (hash_mismatch, invalid, unreadable)", ["reason"])
WEIGHTS_BYTES = Counter("rlstream_weights_log_bytes_total", "Payload bytes the trainer put on the weights topic",
                        ["kind"])
PUBLISH_SECONDS = Histogram("rlstream_policy_publish_seconds",
                            "Trainer side of a publish: checkpoint write plus the announcing transaction",
                            buckets=_LATENCY_BUCKETS)


def count_output(stage: str, topic: str, record) -> None:
    """Goodput accounting for one produced record (a valid trajectory is one with status ok)."""
    if topic == "trajectories" and getattr(record, "status", None) == "ok":
        VALID_TRAJECTORIES.labels(stage).inc()


def count_staleness(stage: str, accepted: bool, ratio: float) -> None:
    """One sample through the trainer's η filter."""
    (ACCEPTED_SAMPLES if accepted else STALE_SAMPLES).labels(stage).inc()
    STALE_RATIO.labels(stage).set(ratio)


class LagProbe:
    """Consumer lag per logical topic, from cached high watermarks and local positions (no broker round trip)."""

    def __init__(self, stage: str, run: str, every_s: float = 5.0):
        self.stage, self.prefix, self.every_s = stage, run + ".", every_s
        self._next = 0.0

    def maybe_update(self, consumer, parts) -> None:
        """Refresh the lag gauges at most every ``every_s`` seconds (``parts``: list or callable); never raises."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + 0.5  # nothing measurable yet (no assignment, no fetch): look again soon
        try:
            parts = parts() if callable(parts) else parts  # e.g. consumer.assignment, only called when due
            if not parts:
                return
            lag: dict[str, int] = {}
            for tp in consumer.position(list(parts)):
                # cached=True: the high watermark librdkafka saw on its last fetch of this partition.
                _, high = consumer.get_watermark_offsets(tp, cached=True)
                if tp.offset >= 0 and high >= 0:
                    topic = tp.topic[len(self.prefix):] if tp.topic.startswith(self.prefix) else tp.topic
                    lag[topic] = lag.get(topic, 0) + max(0, high - tp.offset)
            for topic, n in lag.items():
                CONSUMER_LAG.labels(self.stage, topic).set(n)
            if lag:
                self._next = now + self.every_s
        except Exception as exc:  # metrics must never stop a stage
            log.debug("lag probe failed: %s", exc)


def start(port: int, addr: str = "127.0.0.1"):
    """Serve /metrics from a daemon thread; port 0 picks a free one. Returns the server (``shutdown()`` stops it,
    ``server_address[1]`` is its port)."""
    server, _ = start_http_server(port, addr=addr)
    log.info("metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return server


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics for the rest of the process; port 0 picks a free one. Returns the port."""
    return start(port, addr).server_address[1]

