"""The weight store on S3 (``--weights s3://bucket/run``), through s3fs, against a real S3-compatible server on the
loopback: moto's, started as a process of its own on a free port (the only S3 server the project can install from the
registries it reaches; nothing here has run against AWS S3 or MinIO).

s3fs finds the server through ``AWS_ENDPOINT_URL``, as it would a MinIO or any other S3-compatible store, so what runs
here is what a user's trainer and workers run, with only the endpoint changed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import uuid

import pytest

from rlstream.config import KafkaSettings, LoopSettings
from rlstream.policy.deltas import folder_hash
from rlstream.policy.weights import COMPLETE, PolicyWeights, WeightStore
from rlstream.runtime.settings import RuntimeSettings
from rlstream.trainer.service import TrainerService, TrainerSettings
from tests.helpers.kafka import read_all, wait_for
from tests.helpers.servers import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def s3_bucket(tmp_path_factory):
    """A bucket on a moto S3 server of the module's own; the AWS variables s3fs reads point at it meanwhile.

    The server runs in a process of its own: moto's server is a Flask app, and Flask's proxies (``flask.g``,
    ``current_app``) raise RuntimeError, not AttributeError, on ``hasattr`` outside an app context. In-process vLLM
    walks every loaded module's attributes with ``hasattr`` as it starts, so a Flask imported here broke the next
    in-process vLLM test on the same pytest worker."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"  # a file, not a pipe: it logs every request
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)

    def listening():
        assert server.poll() is None, f"moto's server exited: {log.read_text()[-2000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(listening, 60, "moto's S3 server listening")
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # one made before the variables were set would miss the server
    bucket = f"rlstream-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    try:
        yield bucket
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.terminate()
        server.wait(30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_store_on_s3_puts_lists_prunes_and_a_second_reader_sees_new_versions(s3_bucket, tmp_path):
    from rlstream.policy.deltas import Content, write_folder
    import torch

    def writer(version):
        return lambda folder: write_folder(Content({"w": torch.full((3,), float(version))}, {"w": "model.safetensors"},
                                                   {"config.json": b"{}"}), folder)

    store = WeightStore(f"s3://{s3_bucket}/store")
    reader = WeightStore(f"s3://{s3_bucket}/store")
    reader.fs = type(store.fs)(skip_instance_cache=True)  # its own client and listing cache, as on another host
    store.put("p", 0, writer(0))
    assert reader.versions("p") == [0]  # the reader has listed the policy's folder...
    for v in range(1, 5):
        store.put("p", v, writer(v))
    assert reader.versions("p") == [0, 1, 2, 3, 4]  # ...and still sees what came after
    assert store.prune("p", keep_from=3, keep={0}) == [1, 2]
    assert reader.versions("p") == [0, 3, 4]
    fetched = reader.fetch("p", 4, tmp_path / "cache")
    assert (fetched / COMPLETE).exists() and folder_hash(fetched) == folder_hash(store.fetch("p", 4, tmp_path / "c2"))
    store.fs.rm_file(f"{store._remote('p', 4)}/{COMPLETE}")  # an upload that stopped before its marker
    assert reader.versions("p") == [0, 3]


def _trainer(bootstrap, run, uri):
    # --checkpoint-every 1: every version holds its training state, written to S3 through DCP's fsspec writer.
    trainer = TrainerService(TrainerSettings(weights=uri, warmup_steps=0, window_groups=4, checkpoint_every=1),
                             LoopSettings(groups_per_step=2, eta=1))
    thread = threading.Thread(target=trainer.serve, args=(KafkaSettings(bootstrap=bootstrap, run=run),
                                                          RuntimeSettings(poll_timeout_s=0.1)), daemon=True)
    thread.start()
    return trainer, thread


@pytest.mark.timeout(600)
def test_trainer_publishes_to_s3_a_worker_loads_it_checked_and_a_restart_resumes_from_it(s3_bucket, bootstrap,
                                                                                         run_name, tmp_path):
    from tests.helpers.trainer import produce_groups  # the scored groups the trainer tests train on

    uri = f"s3://{s3_bucket}/{run_name}"
    trainer, thread = _trainer(bootstrap, run_name, uri)
    wait_for(lambda: trainer.version >= 0, 240, "the trainer's v0")
    produce_groups(bootstrap, run_name, [1, 2], version=0)
    wait_for(lambda: trainer.version >= 1, 240, "the trainer's v1")
    trainer.stop()
    thread.join(60)
    assert not thread.is_alive()

    announced = [r.record for r in read_all(bootstrap, run_name, "policy-versions")]
    assert [pv.version for pv in announced] == [0, 1]
    assert all(pv.weights_uri.startswith(f"{uri}/") for pv in announced), [pv.weights_uri for pv in announced]
    # A worker on another host: a cache of its own, the folder copied from S3 and checked against the record's hash.
    folder = PolicyWeights(tmp_path / "worker-cache").folder(announced[-1])
    assert folder_hash(folder) == announced[-1].content_hash
    assert (folder / "config.json").exists()

    # A trainer restarted with nothing local resumes v1 from S3 and goes on to v2.
    trainer2, thread2 = _trainer(bootstrap, run_name, uri)
    wait_for(lambda: trainer2.version >= 1, 240, "the restarted trainer's resume")
    assert trainer2.version == 1
    assert trainer2.engine.steps == 1, "the restart did not resume Adam from v1's training state on S3"
    produce_groups(bootstrap, run_name, [3, 4], version=1)
    wait_for(lambda: trainer2.version >= 2, 240, "the restarted trainer's v2")
    trainer2.stop()
    thread2.join(60)
    assert [r.record.version for r in read_all(bootstrap, run_name, "policy-versions")] == [0, 1, 2]
    assert WeightStore(uri).versions("policy") == [0, 1, 2]
