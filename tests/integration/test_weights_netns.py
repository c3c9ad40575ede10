"""A rollout worker in a network namespace of its own (``ip netns`` and a veth pair, Debian's iproute2): its one way
out is the veth to a broker listening on the host side of it. The trainer writes its store under its own home; the
worker, with another home, reaches nothing of the trainer but that broker, so every version it generates with came
to it through the weights topic, hash-checked."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlstream.engine.follower import serving_line
from rlstream.infra import broker
from rlstream.kafka.topics import create_topics
from rlstream.policy.weight_log import parse_uri
from rlstream.schemas import headers as hdr
from tests.helpers.kafka import free_base_port, make_task, produce, read_all, wait_for
from tests.helpers.policy import scored_group, start_log_trainer

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespace():
    """(namespace, host-side address): a network namespace joined to this one by a veth pair and nothing else."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "network namespaces need root and iproute2's ip"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    name, outside, inside = f"rls-{tag}", f"rv{tag}h", f"rv{tag}w"
    net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{net}.1/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{net}.2/30", "dev", inside)
        _ip("netns", "exec", name, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, f"{net}.1"
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _reaches(namespace: str, address: str) -> bool:
    """Whether a TCP connection from inside the namespace to ``host:port`` is accepted."""
    host, port = address.rsplit(":", 1)
    probe = f"import socket; s = socket.socket(); s.settimeout(2); print(s.connect_ex(({host!r}, {port})))"
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", probe], capture_output=True,
                         text=True, check=True).stdout.strip()
    return out == "0"


@pytest.mark.timeout(420)
def test_a_worker_in_its_own_network_namespace_loads_versions_through_the_broker_alone(
        bootstrap, namespace, tmp_path, start_stage):
    ns, address = namespace
    kafka_home = tmp_path / "broker"
    here = broker.up(kafka_home, port=free_base_port(), host=address)
    try:
        assert not _reaches(ns, bootstrap), "the worker's namespace reaches the host's own broker"
        assert _reaches(ns, here), "the worker's namespace does not reach the broker on the veth"
        run = "netns" + uuid.uuid4().hex[:8]
        create_topics({"bootstrap.servers": here}, run, partitions=2)
        trainer_home = tmp_path / "trainer-host"
        trainer = start_log_trainer(start_stage, here, run, trainer_home)
        worker_home, log = tmp_path / "worker-host", tmp_path / "worker.log"
        env = dict(os.environ, RLSTREAM_BOOTSTRAP=here, RLSTREAM_RUN=run)
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "rlstream.cli", "run", "rollout", "--home",
                 str(worker_home), "--backend", "transformers", "--swap", "step", "--group-size", "2", "--eta", "8",
                 "--wait-policy-s", "120"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            wait_for(lambda: serving_line("rollout", "policy", 0) in log.read_text(), 180,
                     f"the worker to start on v0\n{trainer.log_tail(2000)}")
            for v in range(3):  # v1 a delta, v2 an anchor, v3 a delta: the worker takes each as it comes
                produce(here, run, "rewards", scored_group(v + 1, v))
                wait_for(lambda: f"weights policy v{v + 1} rebuilt from the log" in log.read_text(), 120,
                         f"the worker to rebuild v{v + 1}\n{trainer.log_tail(2000)}\n{log.read_text()[-2000:]}")
            assert trainer.wait(60) == 0, trainer.log_tail(3000)
            versions = [s.record for s in read_all(here, run, "policy-versions", expect=4)]
            assert [parse_uri(pv.weights_uri).version for pv in versions] == [0, 1, 2, 3]

            # Prompts until the worker answers with the newest version: a token is stamped only with weights held.
            asked = itertools.count(100)

            def answered_with_v3():
                i = next(asked)
                produce(here, run, "prompts", [(f"task-{i}".encode(), make_task(i), None)])
                actions = read_all(here, run, "actions", timeout=5)
                return any(hdr.policy_version(s.headers) == 3 for s in actions)
            wait_for(answered_with_v3, 180, f"actions stamped v3\n{log.read_text()[-3000:]}", interval=2)
            assert worker.poll() is None, log.read_text()[-3000:]
            text = log.read_text()
            # Every delta applied to the version the worker held, every version checked against its hash.
            assert "rebuilding from anchor" not in text and "refusing" not in text, text[-3000:]
            assert not any(trainer_home in p.parents for p in worker_home.rglob("*"))
        finally:
            os.killpg(worker.pid, 9)
            worker.wait(30)
    finally:
        broker.down(kafka_home)
