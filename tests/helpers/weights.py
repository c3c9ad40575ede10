"""Weights versions of a chosen size for tests of the weights log, and the trainer's publish of one (upload outside
the transaction, manifest and PolicyVersion inside it), also as a process a test can kill mid-upload:

    python -m tests.helpers.weights BOOTSTRAP RUN MB SEED VERSION TRANSACTION_TIMEOUT_MS
"""
from __future__ import annotations

import sys
import threading

import torch

from rlstream.config import KafkaSettings
from rlstream.kafka import records
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.policy.deltas import Content, content_hash
from rlstream.policy.weight_log import WeightLogWriter
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion

POLICY = "policy"


def content_of(mb: float, seed: int, tensors: int = 8) -> Content:
    """A version of ``mb`` MiB of bf16 tensors with random bits (incompressible, as trained weights are), and a
    config file."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, int(mb * 1024 * 1024) // 2 // tensors)
    content = Content(files={"config.json": b'{"model_type": "test"}'})
    for i in range(tensors):
        t = torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
        content.tensors[f"layer.{i}.weight"], content.shards[f"layer.{i}.weight"] = t, "model.safetensors"
    return content


def trainer_producer(bootstrap: str, run: str, transaction_timeout_ms: int) -> TransactionalProducer:
    """The transactional producer the trainer of ``POLICY`` uses (its transactional id: a new one fences the old)."""
    txn = TransactionalProducer(KafkaSettings(bootstrap=bootstrap, run=run), f"{run}.trainer.{POLICY}",
                                who="test-trainer", transaction_timeout_ms=transaction_timeout_ms)
    txn.start()
    return txn


def publish(txn: TransactionalProducer, writer: WeightLogWriter, content: Content, version: int) -> PolicyVersion:
    """Announce ``content`` as ``version`` as the trainer does (``TrainerService._publish``); the committed record."""
    digest, out = content_hash(content), {}

    def body():
        uri = writer.produce(txn, content, digest, version)
        out["pv"] = PolicyVersion(POLICY, version, uri, created_at=hdr.now_ms(), published_at=hdr.now_ms(),
                                  content_hash=digest)
        records.produce(txn, txn.run, "policy-versions", POLICY.encode(), out["pv"], version)
    assert txn.transact(body), f"the transaction announcing v{version} aborted"
    writer.committed()
    return out["pv"]


def start_worker(bootstrap, run, home):
    """A rollout worker in a thread with its own home (no shared store): it loads versions from the weights log."""
    # Imported here: this module also runs as the publishing process a test kills, which needs none of rollout.
    from rlstream.config import LoopSettings
    from rlstream.runtime.runner import StageRunner
    from rlstream.runtime.settings import RuntimeSettings
    from rlstream.stages.rollout import RolloutSettings, RolloutStage

    loop = LoopSettings(run=run, home=str(home), group_size=2, eta=8)
    stage = RolloutStage(RolloutSettings(backend="transformers", swap="step", wait_policy_s=120, retry_load_s=0.5),
                         loop)
    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run), RuntimeSettings(batch_size=4))
    thread = threading.Thread(target=runner.run, name=f"rollout-{home.name}", daemon=True)
    thread.start()
    return stage, runner, thread


if __name__ == "__main__":
    bootstrap, run, mb, seed, version, timeout_ms = sys.argv[1:]
    content = content_of(float(mb), int(seed))
    print("uploading", flush=True)
    publish(trainer_producer(bootstrap, run, int(timeout_ms)), WeightLogWriter(run, POLICY), content, int(version))
    print("published", flush=True)
