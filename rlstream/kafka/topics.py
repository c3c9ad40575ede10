"""The run's topics: names, partition counts, retention and compaction; waiting for the broker to answer."""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from rlstream.errors import UserError

log = logging.getLogger(__name__)

#: Large enough for a long multi-turn trajectory with per-token log-probs.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TopicSpec:
    name: str
    record: str
    partitions: int
    config: dict
    #: The archive copies its records into ClickHouse (not weights: they stay in Kafka or the store, and
    #: policy_versions names where).
    archived: bool = True


_FOREVER = {"retention.ms": "-1"}
_WEEK = {"retention.ms": str(7 * 24 * 3600 * 1000)}

#: Logical topic -> spec. Partitions bound how many consumers of a group can share the work.
TOPICS: dict[str, TopicSpec] = {t.name: t for t in (
    TopicSpec("prompts", "Task", 8, _WEEK),
    # The eval lane (records.is_eval): co-partitioned with prompts, served first by rollout; its scored results
    # on a topic of their own, which no trainer reads.
    TopicSpec("eval-prompts", "Task", 8, _WEEK),
    TopicSpec("actions", "Episode", 8, _WEEK),
    TopicSpec("observations", "Episode", 8, _WEEK),
    # The loop's data is the asset: samples are kept until the user deletes them (replay).
    TopicSpec("trajectories", "Trajectory", 8, _FOREVER),
    TopicSpec("rewards", "ScoredTrajectory", 8, _FOREVER),
    TopicSpec("feedback", "TeacherFeedback", 8, _FOREVER),
    TopicSpec("eval-rewards", "ScoredTrajectory", 8, _FOREVER),
    # Compacted: the newest version of each policy is always readable.
    TopicSpec("policy-versions", "PolicyVersion", 1, {"cleanup.policy": "compact", "retention.ms": "-1"}),
    TopicSpec("dead-letters", "DeadLetter", 4, _FOREVER),
    # Manifests in partition 0 (the ordered log of versions), chunks spread over the others, so several brokers
    # share a version's bytes (rlstream.policy.manifest). Kept until the trainer deletes the prefix before the
    # anchor its oldest needed version builds on (never by age: time retention could delete an anchor and keep the
    # deltas that need it).
    TopicSpec("weights", "WeightChunk", 4, _FOREVER, archived=False),
)}


def topic_name(run: str, logical: str) -> str:
    """The physical topic of a logical topic in a run: ``<run>.<topic>``."""
    if logical not in TOPICS:
        raise ValueError(f"unknown topic {logical!r}; known: {', '.join(TOPICS)}")
    return f"{run}.{logical}"


def logical_name(run: str, physical: str) -> str:
    """Inverse of topic_name."""
    prefix = run + "."
    if not physical.startswith(prefix):
        raise ValueError(f"topic {physical!r} is not in run {run!r}")
    return physical[len(prefix):]


#: Topics rollout reads or writes per episode: co-partitioned (the same partition count, keyed alike by task id), so
#: that the rollout group's assignor can give partition p of each to one worker, whose engine holds the episode's
#: prefix cache (DESIGN: the loop).
CO_PARTITIONED = ("prompts", "eval-prompts", "actions", "observations")


def partition_counts(partitions: int | None = None, overrides: dict[str, int] | None = None) -> dict[str, int]:
    """Each topic's partition count: its own, else ``partitions`` for all (policy-versions keeps 1: a compacted
    log of versions read in order), then ``overrides`` per logical topic. A topic's partitions bound how many
    consumers of one group share its work: Kafka's assignor gives each partition to one member, and members
    beyond the count stay idle. UserError when the co-partitioned topics would differ."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(TOPICS))
    if unknown:
        raise UserError(f"--topic-partitions: no topic {', '.join(unknown)}; topics: {', '.join(TOPICS)}")
    counts = {}
    for spec in TOPICS.values():
        count = spec.partitions if partitions is None or spec.name == "policy-versions" else partitions
        counts[spec.name] = overrides.get(spec.name, count)
    bad = {t: n for t, n in counts.items() if n < 1}
    if bad:
        raise UserError(f"partition counts must be at least 1: {bad}")
    if counts["policy-versions"] != 1:
        raise UserError("policy-versions has one partition: it is the ordered log of the run's versions")
    co = {t: counts[t] for t in CO_PARTITIONED}
    if len(set(co.values())) > 1:
        raise UserError(f"{', '.join(CO_PARTITIONED)} must have the same partition count (each episode's turns "
                        f"come back to the rollout worker that holds its prefix cache); got {co}")
    return counts


def create_topics(admin_config: dict, run: str, replication: int = 1, partitions: int | None = None,
                  timeout: float = 30.0, overrides: dict[str, int] | None = None) -> list[str]:
    """Create the run's missing topics with ``partition_counts(partitions, overrides)``; return the names created
    (existing ones are kept as they are)."""
    counts = partition_counts(partitions, overrides)
    admin = AdminClient(admin_config)
    existing = set(admin.list_topics(timeout=timeout).topics)
    new = []
    for spec in TOPICS.values():
        name = topic_name(run, spec.name)
        if name in existing:
            continue
        count = counts[spec.name]
        config = {"max.message.bytes": str(MAX_MESSAGE_BYTES), **spec.config}
        if replication > 1:
            config["min.insync.replicas"] = str(min(2, replication))
        new.append(NewTopic(name, num_partitions=count, replication_factor=replication, config=config))
    if not new:
        return []
    for name, future in admin.create_topics(new, operation_timeout=timeout).items():
        try:
            future.result()
        except Exception as exc:  # a concurrent creator is fine
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
    names = [t.topic for t in new]
    _wait_for_leaders(admin, names, timeout)
    return names


def delete_topics(admin_config: dict, run: str, timeout: float = 30.0) -> list[str]:
    """Delete the run's topics that exist (a benchmark's run, whose records are only in the way afterwards: a
    weights topic at 100 M parameters holds gigabytes); the names deleted."""
    admin = AdminClient(admin_config)
    existing = set(admin.list_topics(timeout=timeout).topics)
    names = [topic_name(run, t) for t in TOPICS if topic_name(run, t) in existing]
    for future in (admin.delete_topics(names, operation_timeout=timeout).values() if names else ()):
        future.result()
    return names


def delete_before(admin_config: dict, run: str, logical: str, partition: int, offset: int,
                  timeout: float = 30.0) -> int:
    """Delete the records of ``<run>.<logical>[partition]`` before ``offset`` (a retention policy the writer knows
    better than time or size: the weights log); return the partition's new start offset."""
    admin = AdminClient(admin_config)
    tp = TopicPartition(topic_name(run, logical), partition, offset)
    [future] = admin.delete_records([tp], request_timeout=timeout, operation_timeout=timeout).values()
    return future.result(timeout=timeout).low_watermark


def _quiet_logger() -> logging.Logger:
    """A logger that drops librdkafka's connection-refused chatter while a broker starts."""
    quiet = logging.getLogger(__name__ + ".librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    return quiet


def broker_ids(bootstrap: str, timeout: float = 2.0) -> set[int]:
    """The node ids the cluster's metadata names now (a cluster starting: those up so far); KafkaException while
    none answers."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, "logger": _quiet_logger()})
    return set(admin.list_topics(timeout=timeout).brokers)


def wait_for_broker(admin_config: dict, wait_s: float, every_s: float = 10.0) -> None:
    """Return once the broker answers a metadata request. Until then, say every ``every_s`` that this process is
    waiting for it, with librdkafka's last word on why (a refused connection, a failed SASL handshake); after
    ``wait_s`` (0: one try) raise a UserError that says what to do. A SIGTERM while waiting ends the process
    cleanly: nothing has been consumed yet, so there is nothing to finish."""
    where = admin_config.get("bootstrap.servers", "?")  # never the whole config: it may hold a password
    quiet = _quiet_logger()
    why: list[str] = []  # librdkafka's errors (they name hosts and mechanisms, never credentials)
    admin = AdminClient({**admin_config, "log_level": 0, "logger": quiet, "error_cb": lambda e: why.append(e.str())})
    stopped: list = []
    previous = None
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    started = time.monotonic()
    said = None
    try:
        while True:
            waited = time.monotonic() - started
            try:
                admin.list_topics(timeout=max(0.5, min(2.0, wait_s - waited)))
                if said is not None:
                    log.info("the Kafka broker at %s answers, after %.0f s", where, time.monotonic() - started)
                return
            except KafkaException as exc:
                error = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
            admin.poll(0)  # serves error_cb
            # The newest specific reason; "N/N brokers are down" only repeats that none answered.
            error = next((w for w in reversed(why) if "brokers are down" not in w), error)
            waited = time.monotonic() - started
            if stopped:
                log.info("stopped while waiting for the Kafka broker at %s", where)
                raise SystemExit(0)
            if waited >= wait_s:
                raise UserError(f"no Kafka broker answered at {where} within {waited:.0f} s ({error}): start one "
                                "(`rlstream up` starts a local one; in docker compose, the kafka service) or point "
                                "--bootstrap / RLSTREAM_BOOTSTRAP at yours; --broker-wait-s waits longer")
            if said is None or time.monotonic() - said >= every_s:
                said = time.monotonic()
                log.warning("waiting for the Kafka broker at %s to answer (%.0f s so far, giving up after %.0f s): %s",
                            where, waited, wait_s, error)
            time.sleep(min(1.0, max(0.0, wait_s - waited)))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout: float) -> None:
    """Block until every partition of the new topics has a leader.

    Creation returns before leaders are elected; a client that asks for watermarks or
    produces in between gets NOT_LEADER_FOR_PARTITION (seen on a loaded 2-core machine).
    """
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        ready = all(
            name in topics and topics[name].error is None and topics[name].partitions
            and all(p.leader >= 0 and p.error is None for p in topics[name].partitions.values())
            for name in names)
        if ready:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {names} have partitions without a leader after {timeout}s")
        time.sleep(0.2)
