"""The faust monitor carries SASL/SSL settings over from librdkafka's names, or refuses clearly."""
from __future__ import annotations

import ssl

import pytest

from rlstream.config import KafkaSettings
from rlstream.errors import UserError
from rlstream.monitoring.monitor import Monitor, MonitorSettings, faust_credentials


def _faust():
    """faust-streaming, or a skip where it is not installed; under CI=true (which installs it) a failure instead,
    also when faust imports but the aiokafka driver it talks through does not (a missing side-installed dep)."""
    import os
    if os.environ.get("CI") != "true":
        return pytest.importorskip("faust")
    try:
        import faust
        import faust.transport.drivers.aiokafka  # noqa: F401 (imports aiokafka and mode, and their requirements)
    except ImportError as exc:
        pytest.fail(f"CI=true: faust-streaming does not import: {exc!r} (make setup installs it)", pytrace=False)
    return faust


faust = _faust()


def test_plaintext_needs_no_credentials():
    assert faust_credentials({"bootstrap.servers": "b:9092"}) is None


def test_sasl_scram_over_tls_becomes_faust_sasl_credentials_with_a_tls_context():
    creds = faust_credentials({"bootstrap.servers": "b:9093", "security.protocol": "SASL_SSL",
                               "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice", "sasl.password": "s3cret"})
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.username, creds.password, creds.mechanism.value) == ("alice", "s3cret", "SCRAM-SHA-512")
    assert isinstance(creds.ssl_context, ssl.SSLContext) and creds.protocol.value == "SASL_SSL"
    assert "s3cret" not in repr(creds)


def test_tls_without_verification_when_asked():
    creds = faust_credentials({"security.protocol": "SSL", "enable.ssl.certificate.verification": "false"})
    assert isinstance(creds, faust.SSLCredentials)
    assert creds.context.verify_mode == ssl.CERT_NONE and not creds.context.check_hostname


@pytest.mark.parametrize("config, says", [
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}, "PLAIN and SCRAM"),
    ({"security.protocol": "SASL_PLAINTEXT", "sasl.kerberos.service.name": "kafka"}, "sasl.kerberos.service.name"),
    ({"security.protocol": "TLS"}, "security.protocol"),
])
def test_settings_faust_cannot_carry_are_refused_with_what_to_do(config, says):
    with pytest.raises(UserError, match=says) as err:
        faust_credentials(config)
    assert "--monitor-backend plain" in str(err.value) or "expected PLAINTEXT" in str(err.value)


def test_auto_backend_falls_back_to_plain_rather_than_connecting_without_the_settings(monkeypatch):
    monitor = Monitor(MonitorSettings(monitor_backend="auto"))
    assert monitor.backend == "faust"
    started = []
    monkeypatch.setattr("rlstream.monitoring.monitor.PlainMonitor.consume", lambda self: started.append("consume"))

    class Server:
        def shutdown(self):
            started.append("shutdown")
    monkeypatch.setattr("rlstream.monitoring.monitor.PlainMonitor.serve_http", lambda self: Server())
    monitor.serve(KafkaSettings(kafka_config="security.protocol=SASL_SSL,sasl.mechanism=GSSAPI"))
    assert monitor.backend == "plain" and started == ["consume", "shutdown"]
