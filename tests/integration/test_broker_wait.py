"""A command started before its broker answers waits for it, saying so, instead of failing at once (containers
started before the broker container); one whose broker never answers gives up with what to do."""
import subprocess
import sys
import uuid

import pytest

from tests.helpers import ROOT
from tests.helpers.kafka import wait_for
from tests.helpers.proxy import forward
from tests.helpers.servers import free_port

WAITING = "waiting for the Kafka broker at 127.0.0.1:{port} to answer"


def _topics(run: str, port: int, wait_s: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlstream.cli", "topics", "--run", run,
                             "--bootstrap", f"127.0.0.1:{port}", "--broker-wait-s", str(wait_s)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(210)  # 30 s to say it waits + 90 s to finish + start-up
def test_a_command_waits_for_its_broker_saying_so_then_goes_on(bootstrap, tmp_path):
    port, run = free_port(), "t" + uuid.uuid4().hex[:10]
    log_path = tmp_path / "topics.log"
    with open(log_path, "wb") as log:
        proc = _topics(run, port, 120, log)
    try:
        wait_for(lambda: WAITING.format(port=port) in log_path.read_text(), 30, "the line saying it waits")
        assert proc.poll() is None, log_path.read_text()  # waiting, not failed
        # The broker starts answering at that address (the shared broker, through a forwarder).
        with forward(port, bootstrap.split(",")[0]):
            assert proc.wait(90) == 0, log_path.read_text()
    finally:
        proc.kill()
    out = log_path.read_text()
    assert "the Kafka broker at 127.0.0.1:%d answers, after" % port in out
    assert f"created {run}.prompts" in out


@pytest.mark.timeout(60)
def test_a_broker_that_never_answers_is_an_error_that_says_what_to_do(tmp_path):
    port = free_port()
    log_path = tmp_path / "topics.log"
    with open(log_path, "wb") as log:
        assert _topics("never", port, 3, log).wait(40) == 1
    out = log_path.read_text()
    assert WAITING.format(port=port) in out
    assert f"no Kafka broker answered at 127.0.0.1:{port} within" in out
    assert "rlstream up" in out and "--broker-wait-s" in out
    assert "Traceback" not in out
