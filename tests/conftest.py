"""Shared fixtures: the real local Kafka broker and a fresh run (topic prefix) per test."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def bootstrap() -> str:
    """The broker's address: $RLSTREAM_BOOTSTRAP, else the project's own broker (started if needed)."""
    if os.environ.get("RLSTREAM_BOOTSTRAP"):
        return os.environ["RLSTREAM_BOOTSTRAP"]
    from rlstream.infra import broker
    return broker.up()


@pytest.fixture
def run_name(bootstrap) -> str:
    """A fresh run whose topics exist, so tests never see each other's records."""
    from rlstream.kafka.topics import create_topics
    name = "t" + uuid.uuid4().hex[:10]
    create_topics({"bootstrap.servers": bootstrap}, name, partitions=2)
    return name
