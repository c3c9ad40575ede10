"""Secrets: Kafka SASL/SSL settings pass through from --kafka-config and RLSTREAM_KAFKA_* variables, ClickHouse
credentials come from the environment, and no secret shows up in logs, metrics or the archive."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from rlstream import cli, config
from rlstream.archive import query
from rlstream.config import KafkaSettings, from_sources
from rlstream.schemas import headers as hdr
from tests.helpers import ROOT
from tests.helpers.kafka import make_trajectory, produce, read_all

SECRET_CONFIG = "kc-Secret-7f3a9d"  # passed in --kafka-config (the process listing shows it; logs must not)
SECRET_ENV = "env-Secret-2b8e1c"  # passed in RLSTREAM_KAFKA_SASL_PASSWORD
SECRET_CH = "ch-Secret-91d0aa"  # passed in RLSTREAM_CLICKHOUSE_PASSWORD
SECRETS = (SECRET_CONFIG, SECRET_ENV, SECRET_CH)
KAFKA_ENV = ("RLSTREAM_KAFKA_CONFIG", "RLSTREAM_KAFKA_SASL_USERNAME", "RLSTREAM_KAFKA_SASL_PASSWORD",
             "RLSTREAM_KAFKA_SECURITY_PROTOCOL", "RLSTREAM_KAFKA_SASL_MECHANISM", "RLSTREAM_KAFKA_SSL_CA_LOCATION")


@pytest.fixture
def clean_env(monkeypatch):
    for name in KAFKA_ENV + ("RLSTREAM_CLICKHOUSE_USER", "RLSTREAM_CLICKHOUSE_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- Kafka settings pass through -------------------------------------------------------------------------------


def test_kafka_config_passes_sasl_and_ssl_through(clean_env):
    kafka = KafkaSettings(bootstrap="b1:9093,b2:9093", kafka_config=(
        "security.protocol=SASL_SSL, sasl.mechanism=SCRAM-SHA-512,sasl.username=alice,"
        "sasl.password=pa=ss,ssl.ca.location=/etc/ssl/ca.pem,ssl.endpoint.identification.algorithm=https"))
    assert kafka.client_config() == {
        "bootstrap.servers": "b1:9093,b2:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "alice", "sasl.password": "pa=ss", "ssl.ca.location": "/etc/ssl/ca.pem",
        "ssl.endpoint.identification.algorithm": "https"}


def test_kafka_secrets_from_the_environment_win_and_may_hold_commas(clean_env):
    clean_env.setenv("RLSTREAM_KAFKA_CONFIG", "security.protocol=SASL_PLAINTEXT,sasl.password=from-config")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_USERNAME", "bob")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", "p,a=s s")
    clean_env.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    clean_env.setenv("RLSTREAM_KAFKA_SSL_CA_LOCATION", "/ca.pem")
    conf = from_sources(KafkaSettings, {}).client_config()  # what every stage process builds
    assert {k: conf[k] for k in ("security.protocol", "sasl.mechanism", "sasl.username", "sasl.password",
                                 "ssl.ca.location")} == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "bob",
        "sasl.password": "p,a=s s", "ssl.ca.location": "/ca.pem"}


def test_the_command_line_reaches_the_kafka_settings(clean_env):
    args = cli.build_parser("reward").parse_args(
        ["run", "reward", "--bootstrap", "k:9093", "--kafka-config", "security.protocol=SSL,ssl.key.password=x"])
    conf = config.load(KafkaSettings, args).client_config()
    assert conf["security.protocol"] == "SSL" and conf["ssl.key.password"] == "x" and conf["bootstrap.servers"] == "k:9093"


def test_a_malformed_kafka_config_never_echoes_its_items(clean_env):
    # A password with a comma splits into a fragment without '=': the error must not print the fragment.
    kafka = KafkaSettings(kafka_config=f"sasl.username=u,sasl.password=ab,{SECRET_CONFIG}")
    with pytest.raises(ValueError) as exc:
        kafka.client_config()
    assert SECRET_CONFIG not in str(exc.value) and "item 3" in str(exc.value)


# -- ClickHouse credentials ------------------------------------------------------------------------------------


def test_clickhouse_credentials_come_from_the_environment(clean_env):
    import clickhouse_connect
    seen = {}
    clean_env.setattr(clickhouse_connect, "get_client", lambda **kw: seen.update(kw) or object())
    clean_env.setenv("RLSTREAM_CLICKHOUSE_USER", "archiver")
    clean_env.setenv("RLSTREAM_CLICKHOUSE_PASSWORD", SECRET_CH)
    query.connect("https://ch.example:8443")
    assert (seen["host"], seen["port"], seen["secure"]) == ("ch.example", 8443, True)
    assert (seen["username"], seen["password"]) == ("archiver", SECRET_CH)
    clean_env.delenv("RLSTREAM_CLICKHOUSE_USER")
    clean_env.delenv("RLSTREAM_CLICKHOUSE_PASSWORD")
    query.connect("http://ch.example")
    assert (seen["username"], seen["password"], seen["port"]) == ("default", "", 8123)


def test_credentials_in_the_archive_url_are_refused_without_repeating_them(clean_env):
    with pytest.raises(ValueError) as exc:
        query.resolve(f"http://archiver:{SECRET_CH}@ch.example:8123")
    assert "RLSTREAM_CLICKHOUSE_PASSWORD" in str(exc.value) and SECRET_CH not in str(exc.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_an_unreachable_clickhouse_server_error_shows_no_password(clean_env, tmp_path):
    env = dict(os.environ, RLSTREAM_CLICKHOUSE_USER="archiver", RLSTREAM_CLICKHOUSE_PASSWORD=SECRET_CH,
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "-v", "sql", "--archive",
                          f"http://127.0.0.1:{_closed_port()}", "SELECT 1"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    assert "cannot open the archive" in out.stderr, out.stderr[-2000:]
    assert SECRET_CH not in out.stdout + out.stderr


# -- nothing leaks ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_secret_in_logs_metrics_or_the_archive(bootstrap, run_name, tmp_path, clean_env, start_stage):
    """Stages run with SASL secrets in --kafka-config and in the environment (the local broker is PLAINTEXT,
    so librdkafka carries them unused), with debug logging; logs, /metrics and every archived string are
    searched for them."""
    clean_env.setenv("RLSTREAM_KAFKA_SASL_USERNAME", "rlstream-user")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", SECRET_ENV)
    clean_env.setenv("RLSTREAM_CLICKHOUSE_PASSWORD", SECRET_CH)
    kafka_config = f"sasl.username=rlstream-user,sasl.password={SECRET_CONFIG},client.rack=r1"
    good = [make_trajectory(i) for i in range(5)]
    produce(bootstrap, run_name, "trajectories", [(b"g", t, None) for t in good]
            + [(b"bad", b"\x00garbage", hdr.build(0, hdr.new_traceparent()))])
    port = _free_port()
    archive = f"chdb://{tmp_path / 'archive'}"
    logs = {"reward": tmp_path / "reward.log", "archive": tmp_path / "archive.log"}
    env_args = ["--kafka-config", kafka_config]
    # ``rlstream -v run STAGE``: debug logging, the secrets in this process's environment.
    reward = start_stage("reward", bootstrap, run_name, *env_args, "--metrics-port", str(port),
                         log_path=logs["reward"], options=("-v",))
    arch = start_stage("archive", bootstrap, run_name, *env_args, "--archive", archive, log_path=logs["archive"],
                       options=("-v",))
    try:
        assert len(read_all(bootstrap, run_name, "rewards", expect=len(good), timeout=120)) == len(good)
        assert len(read_all(bootstrap, run_name, "dead-letters", expect=1, timeout=60)) == 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            metrics_text = resp.read().decode()
        assert "rlstream_records_out_total" in metrics_text
        rows = _archived_rows(archive, run_name, expect=len(good) * 2 + 2, log=logs["archive"])
    finally:
        codes = {name: p.stop(timeout=60) for name, p in (("reward", reward), ("archive", arch))}
    assert codes == {"reward": 0, "archive": 0}, {n: p.read_text()[-2000:] for n, p in logs.items()}
    texts = {"metrics": metrics_text, "archive": "\n".join(rows),
             **{f"{name} log": path.read_text(errors="replace") for name, path in logs.items()}}
    assert "DEBUG" in texts["reward log"]  # the most talkative logging there is
    for what, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} found in the {what}"


def _archived_rows(archive: str, run: str, expect: int, log, timeout: float = 120) -> list[str]:
    """Every archived row of the run, every column as text (strings, maps, arrays, raw bytes), read through the
    archive process's SQL endpoint only: before it announces one, opening the path here would take chDB's lock
    from the archive that is still starting (CI once read 0 rows for 120 s on a slow machine)."""
    from rlstream.archive.tables import TABLES
    deadline = time.monotonic() + timeout
    path = archive.removeprefix("chdb://")
    while True:
        rows = []
        if query.read_endpoint(path) is not None:
            try:
                with query.open_archive(archive) as db:
                    for table in TABLES:
                        rows += [repr(r) for r in db.query(f"SELECT * FROM rlstream.{table} WHERE run = '{run}'")[1]]
            except query.ArchiveError:
                pass  # the endpoint is announced before its first query is served
        if len(rows) >= expect or time.monotonic() > deadline:
            assert len(rows) >= expect, (f"{len(rows)} archived rows, expected {expect}; the archive's log:\n"
                                         + log.read_text(errors="replace")[-3000:])
            return rows
        time.sleep(1)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sasl_settings_from_the_environment_reach_the_kafka_clients(bootstrap, run_name, tmp_path, clean_env,
                                                                    start_stage):
    """A stage told by its environment to speak SASL to the PLAINTEXT local broker tries SASL (so the settings
    reached librdkafka), waits for the broker instead of crashing, logs no password, and stops on SIGTERM."""
    clean_env.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_USERNAME", "rlstream-user")
    clean_env.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", SECRET_ENV)
    log = tmp_path / "reward.log"
    proc = start_stage("reward", bootstrap, run_name, "--instance", "sasl", log_path=log, options=("-v",))
    try:
        deadline = time.monotonic() + 120
        while "SASL PLAIN mechanism handshake failed" not in log.read_text(errors="replace"):
            assert proc.alive(), log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        code = proc.stop(timeout=90)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert SECRET_ENV not in text
