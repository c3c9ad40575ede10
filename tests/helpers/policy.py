"""A policy version announced as the trainer announces it, for tests of its followers (rollout, the gateway)
without a trainer."""
from __future__ import annotations

import shutil
from pathlib import Path

from rlstream.policy.weights import WeightStore
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion
from tests.helpers.kafka import produce


def publish_version(bootstrap: str, run: str, folder: Path, root: Path, version: int = 0) -> PolicyVersion:
    """Put the model ``folder`` in a weight store under ``root`` as ``version`` and announce it."""
    uri = WeightStore(str(root)).put("policy", version, lambda out: shutil.copytree(folder, out, dirs_exist_ok=True))
    now = hdr.now_ms()
    pv = PolicyVersion("policy", version, uri, created_at=now, published_at=now)
    produce(bootstrap, run, "policy-versions", [(b"policy", pv, hdr.build(version, hdr.new_traceparent()))])
    return pv
