"""``rlstream run monitor``: live per-version figures of a run, served as JSON over HTTP.

A faust-streaming app keeps tables of reward mean and sample counts per (policy version,
reward version), in total and in tumbling windows, and the trainer's accepted/stale
counts per published version; its web server answers ``GET /versions/``. It only reads
(committed records) and is never on the exactly-once path.

Where faust-streaming is not installed, the same figures come from a small confluent-kafka
consumer thread with the same HTTP answer (``--monitor-backend plain``). faust-streaming
0.15.3 pins click<8.4, while huggingface-hub (transformers 5.19) needs click>=8.4.2, so pip
cannot install both from pyproject.toml; faust itself runs fine with click 8.5
(``pip install --no-deps faust-streaming==0.15.3`` plus its other requirements).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from rlstream.config import KafkaSettings, knob
from rlstream.errors import INSTALL_COMMANDS, UserError
from rlstream.kafka.tail import Seen, TopicTail
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.codec import default_codec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MonitorSettings:
    """The live monitor's knobs."""

    ROLE: ClassVar[str] = "MONITOR"

    monitor_port: int = knob(6066, "HTTP port of GET /versions/ (JSON per-version figures)")
    monitor_host: str = knob("127.0.0.1", "Address the HTTP server listens on (0.0.0.0 in a container)")
    monitor_window_s: float = knob(60.0, "Tumbling window of the windowed figures, in seconds")
    monitor_expires_s: float = knob(3600.0, "How long a window is kept")
    monitor_backend: str = knob("auto", "faust, plain (confluent-kafka thread), or auto (faust when installed)",
                                choices=("auto", "faust", "plain"))
    monitor_data: str = knob(".rlstream/monitor", "faust's data folder")


# -- the figures (shared by both backends) -------------------------------------------------------------------

def reward_key(headers: dict[str, bytes], reward_version: str) -> str:
    """'<policy version>|<reward version>' of one ScoredTrajectory record."""
    try:
        version = hdr.policy_version(headers)
    except hdr.HeaderError:
        version = -1
    return f"{version}|{reward_version}"


def policy_entry(value: dict) -> tuple[str, dict]:
    """(version, what the monitor keeps of it) for one PolicyVersion record."""
    return str(value["version"]), {"policy": value["policy"], "published_at": value["published_at"],
                                   "metrics": dict(value["metrics"])}


def figures(run: str, backend: str, window_s: float, totals: dict[str, list], window: dict[str, list],
            policies: dict[str, dict]) -> dict[str, Any]:
    """The JSON document both backends serve (per-step staleness as the archive's staleness_by_version)."""
    rewards = []
    for key, (n, total) in sorted(totals.items(), key=lambda kv: (int(kv[0].split("|")[0]), kv[0])):
        version, reward_version = key.split("|", 1)
        wn, wsum = window.get(key, (0, 0.0))
        rewards.append({"policy_version": int(version), "reward_version": reward_version, "samples": int(n),
                        "reward_mean": total / n if n else None, "window_samples": int(wn),
                        "window_reward_mean": wsum / wn if wn else None})
    versions, prev = [], {}
    for version, entry in sorted(policies.items(), key=lambda kv: int(kv[0])):
        m, row = entry["metrics"], {"version": int(version), "policy": entry["policy"],
                                    "published_at": entry["published_at"]}
        for k in ("accepted", "stale", "evicted"):
            cumulative, before = m.get(k, 0.0), prev.get((entry["policy"], k), 0.0)
            # A drop in a cumulative count means the trainer restarted; *_step counts are exact.
            row[k] = m.get(f"{k}_step", cumulative - before if cumulative >= before else cumulative)
            prev[(entry["policy"], k)] = cumulative
        seen = row["accepted"] + row["stale"]
        row["stale_ratio"] = row["stale"] / seen if seen else None
        versions.append(row)
    n = sum(r["samples"] for r in rewards)
    accepted, stale = sum(v["accepted"] for v in versions), sum(v["stale"] for v in versions)
    now = time.time()
    return {"run": run, "backend": backend, "window_s": window_s, "window_start": now - now % window_s,
            "rewards": rewards, "policies": versions,
            "totals": {"samples": n, "reward_mean": sum(t for _, t in totals.values()) / n if n else None,
                       "accepted": accepted, "stale": stale,
                       "stale_ratio": stale / (accepted + stale) if accepted + stale else None,
                       "policy_version": versions[-1]["version"] if versions else None}}


# -- faust -------------------------------------------------------------------------------------------------------

def _read_committed() -> None:
    """faust 0.15.3 reads read_uncommitted unless its exactly-once mode is on; the monitor wants committed only."""
    from faust.transport.drivers import aiokafka as driver
    create = driver.AIOKafkaConsumerThread._create_worker_consumer
    if getattr(create, "_rlstream", False):
        return

    def committed_only(self, transport):
        consumer = create(self, transport)
        consumer._isolation_level = "read_committed"  # read when the consumer starts, which is after this
        return consumer

    committed_only._rlstream = True
    driver.AIOKafkaConsumerThread._create_worker_consumer = committed_only


#: librdkafka settings faust_credentials() knows how to carry over to faust's aiokafka client.
_CARRIED = {"bootstrap.servers", "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username",
            "sasl.password", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
            "ssl.endpoint.identification.algorithm", "enable.ssl.certificate.verification", "client.id"}


def faust_credentials(config: dict[str, str]):
    """faust's broker credentials for the librdkafka settings of --kafka-config / RLSTREAM_KAFKA_* (None: plaintext).

    faust talks to Kafka through aiokafka, not librdkafka, so the settings are translated; one it cannot carry
    is refused with a UserError rather than silently connecting without it.
    """
    import ssl

    import faust
    protocol = config.get("security.protocol", "PLAINTEXT").upper()
    dropped = sorted(k for k in config if k not in _CARRIED)
    if dropped:
        raise UserError(f"the faust monitor cannot use the Kafka settings {', '.join(dropped)}; "
                        "run it with --monitor-backend plain (librdkafka, every setting)")
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=config.get("ssl.ca.location"))
        if config.get("ssl.certificate.location"):
            context.load_cert_chain(config["ssl.certificate.location"], config.get("ssl.key.location"),
                                    config.get("ssl.key.password"))
        if config.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
            context.check_hostname = False
        if config.get("enable.ssl.certificate.verification", "true").lower() == "false":
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        mechanism = config.get("sasl.mechanism", config.get("sasl.mechanisms", "GSSAPI")).upper()
        if mechanism not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            raise UserError(f"the faust monitor supports SASL PLAIN and SCRAM only, not {mechanism}; "
                            "run it with --monitor-backend plain")
        return faust.SASLCredentials(username=config.get("sasl.username"), password=config.get("sasl.password"),
                                     ssl_context=context, mechanism=mechanism)
    raise UserError(f"unknown security.protocol {protocol!r}: expected PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")


def faust_app(settings: MonitorSettings, kafka: KafkaSettings):
    """The faust app: agents over rewards and policy-versions, tables, and the /versions/ page."""
    import faust
    _read_committed()
    run = kafka.run
    datadir = os.path.join(settings.monitor_data, run)
    os.makedirs(datadir, exist_ok=True)
    broker = ";".join(f"kafka://{h.strip()}" for h in kafka.bootstrap.split(",") if h.strip())
    app = faust.App(f"{run}.monitor", broker=broker, store="memory://", autodiscover=False,
                    broker_credentials=faust_credentials(kafka.client_config()),
                    datadir=datadir, web_port=settings.monitor_port,
                    web_bind=settings.monitor_host, web_host=settings.monitor_host, topic_partitions=8,
                    consumer_auto_offset_reset="earliest", web_enabled=True)
    tables = dict(use_partitioner=True)  # one changelog partition per key: restores right on one worker
    totals = app.Table("reward_totals", default=lambda: [0, 0.0], **tables)
    win_n = app.Table("reward_window_n", default=int, **tables).tumbling(
        settings.monitor_window_s, expires=settings.monitor_expires_s, key_index=True)
    win_sum = app.Table("reward_window_sum", default=float, **tables).tumbling(
        settings.monitor_window_s, expires=settings.monitor_expires_s, key_index=True)
    policies = app.Table("policies", default=dict, **tables)
    codec = default_codec()
    rewards_topic = app.topic(topic_name(run, "rewards"), key_serializer="raw", value_serializer="raw")
    policy_topic = app.topic(topic_name(run, "policy-versions"), key_serializer="raw", value_serializer="raw")

    async def changelogs_known() -> None:
        """Wait until the producer has metadata for every table's changelog topic.

        With use_partitioner, faust picks a changelog record's partition with aiokafka's partitioner, which reads the
        producer's metadata without waiting for it: a changelog created a moment before is not in it yet, the agent
        crashes on its first event and that event is lost (seen on a loaded CI machine). aiokafka's public
        ``partitions_for`` waits for the metadata; faust reaches its aiokafka producer only through
        ``_ensure_producer``.
        """
        producer = app.producer._ensure_producer()
        for table in list(app.tables.values()):
            await producer.partitions_for(table.changelog_topic.get_topic_name())

    def decoded(event, record: str) -> dict | None:
        """The event's value as ``record``; None for a value that does not decode (the stages dead-letter bad
        records; the monitor only skips them)."""
        try:
            return codec.decode(event.value, expect=record)[1]
        except Exception as exc:
            log.warning("monitor: undecodable %s record: %s", record, exc)
            return None

    @app.agent(rewards_topic)
    async def on_reward(stream):
        await changelogs_known()
        async for event in stream.events():
            value = decoded(event, "ScoredTrajectory")
            if value is None:
                continue
            reward = value["reward"]
            key, total = reward_key(dict(event.headers or {}), reward["reward_version"]), reward["total"]
            n, s = totals[key]
            totals[key] = [n + 1, s + total]
            win_n[key] += 1
            win_sum[key] += total

    @app.agent(policy_topic)
    async def on_policy(stream):
        await changelogs_known()
        async for event in stream.events():
            value = decoded(event, "PolicyVersion")
            if value is None:
                continue
            version, entry = policy_entry(value)
            policies[version] = entry

    def snapshot() -> dict:
        window = {}
        for key, n in win_n.items().now():
            window[key] = [n, win_sum[key].now()]
        return figures(run, "faust", settings.monitor_window_s, dict(totals.items()), window, dict(policies.items()))

    @app.page("/versions/")
    async def versions(web, request):
        return web.json(snapshot())

    app.rlstream_snapshot = snapshot
    return app


def faust_worker(app, stopping: threading.Event):
    """A faust worker for ``app`` that stops once ``stopping`` is set; it owns its event loop, not the signals."""
    import faust

    class Worker(faust.Worker):
        def install_signal_handlers(self) -> None:
            # mode's hook for the worker's own SIGTERM/SIGINT handlers: the process lifecycle owns those
            # (runtime/lifecycle.py), and sets ``stopping``.
            asyncio.ensure_future(self._stop_when_asked(), loop=self.loop)

        async def _stop_when_asked(self) -> None:
            while not stopping.is_set():
                await asyncio.sleep(0.2)
            await self.stop()
            # What mode's own signal handler does next (Worker._stop_on_signal): the worker's start still waits on
            # its future; cancelled, execute_from_commandline shuts the loop down and exits (SystemExit 0).
            if self._starting_fut is not None:
                self._starting_fut.cancel()

    # Its logging setup stays out of ours.
    return Worker(app, loglevel="WARNING", quiet=True, override_logging=False, redirect_stdouts=False)


def faust_available() -> bool:
    """Whether faust and the aiokafka driver it runs on import (faust alone imports without the driver)."""
    try:
        import faust  # noqa: F401
        import faust.transport.drivers.aiokafka  # noqa: F401
        return True
    except ImportError:
        return False


# -- plain fallback ----------------------------------------------------------------------------------------------

class PlainMonitor:
    """The same figures from a confluent-kafka consumer thread (reads both topics from the start, no state kept)."""

    def __init__(self, settings: MonitorSettings, kafka: KafkaSettings, stopping: threading.Event | None = None):
        self.settings, self.kafka = settings, kafka
        self.lock = threading.Lock()
        self.totals: dict[str, list] = {}
        self.windows: dict[tuple[str, int], list] = {}  # (key, window index) -> [n, sum]
        self.policies: dict[str, dict] = {}
        self.stopping = stopping or threading.Event()

    def _fold(self, seen: Seen) -> None:
        record = seen.record
        if record is None:  # the stages dead-letter bad records; the monitor only skips them
            log.warning("monitor: skipped an undecodable %s record at offset %d", seen.topic, seen.offset)
            return
        with self.lock:
            if seen.topic == "policy-versions":
                version, entry = policy_entry(record.to_dict())
                self.policies[version] = entry
                return
            key, total = reward_key(seen.headers, record.reward.reward_version), record.reward.total
            t = self.totals.setdefault(key, [0, 0.0])
            t[0], t[1] = t[0] + 1, t[1] + total
            w = self.windows.setdefault((key, int(seen.timestamp_ms / 1000 // self.settings.monitor_window_s)),
                                        [0, 0.0])
            w[0], w[1] = w[0] + 1, w[1] + total

    def consume(self) -> None:
        """Fold both topics from their start until ``stopping`` is set; expired windows are dropped meanwhile."""
        tail = TopicTail(self.kafka.client_config(), self.kafka.run, ["rewards", "policy-versions"],
                         name="monitor-plain", keep=False, on_record=self._fold)
        try:
            while not self.stopping.wait(0.5):
                self._expire()
        finally:
            tail.close()

    def _expire(self) -> None:
        oldest = int((time.time() - self.settings.monitor_expires_s) // self.settings.monitor_window_s)
        with self.lock:
            for k in [k for k in self.windows if k[1] < oldest]:
                del self.windows[k]

    def snapshot(self) -> dict:
        now = int(time.time() // self.settings.monitor_window_s)
        with self.lock:
            window = {key: list(v) for (key, w), v in self.windows.items() if w == now}
            return figures(self.kafka.run, "plain", self.settings.monitor_window_s,
                           {k: list(v) for k, v in self.totals.items()}, window, dict(self.policies))

    def serve_http(self) -> ThreadingHTTPServer:
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.rstrip("/") != "/versions":
                    self.send_error(404, "try /versions/")
                    return
                body = json.dumps(monitor.snapshot(), default=_nan_free).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                pass

        server = ThreadingHTTPServer((self.settings.monitor_host, self.settings.monitor_port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="monitor-http", daemon=True).start()
        return server


def _nan_free(x):
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


class Monitor:
    """``rlstream run monitor``: faust when installed (or asked for), else the plain consumer."""

    def __init__(self, settings: MonitorSettings = MonitorSettings()):
        self.settings = settings
        backend = settings.monitor_backend
        if backend == "faust" and not faust_available():
            raise ValueError("--monitor-backend faust: faust-streaming is not installed: install it with "
                             f"{INSTALL_COMMANDS['faust']}, or use --monitor-backend plain")
        self.backend = "faust" if backend == "faust" or (backend == "auto" and faust_available()) else "plain"
        self._stopping = threading.Event()

    def stop(self) -> None:
        """Leave ``serve`` (the process lifecycle calls it on SIGTERM/SIGINT)."""
        self._stopping.set()

    def serve(self, kafka: KafkaSettings, runtime=None) -> None:
        """Serve the figures until ``stop()``."""
        if self.backend == "faust" and self.settings.monitor_backend == "auto":
            try:
                faust_credentials(kafka.client_config())
            except UserError as exc:
                log.warning("monitor: %s; using the plain backend", exc)
                self.backend = "plain"
        log.info("monitor (%s) for run %s on http://%s:%d/versions/", self.backend, kafka.run,
                 self.settings.monitor_host, self.settings.monitor_port)
        if self.backend == "faust":
            try:
                faust_worker(faust_app(self.settings, kafka), self._stopping).execute_from_commandline()
            except SystemExit as exc:  # how a mode worker returns: 0 once stopped, 1 after a crash it has logged
                if exc.code not in (None, 0):
                    raise UserError(f"the faust monitor failed (exit {exc.code}; its log above says why); "
                                    "--monitor-backend plain runs without faust") from None
            return
        plain = PlainMonitor(self.settings, kafka, self._stopping)
        server = plain.serve_http()
        try:
            plain.consume()
        finally:
            server.shutdown()
