"""Shared fixtures: the real local Kafka broker, a fresh run (topic prefix) per test, and stage processes."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from rlstream.infra.supervisor import StageProc, stage_env
from tests.helpers import ROOT


def pytest_collection_modifyitems(config, items):
    """For pytest-xdist (`make test` runs two workers, --dist loadgroup): a file's tests stay on one worker, so
    its module fixtures (vLLM servers among them) are built once; and tests/e2e is one group, run test after test
    on one worker, since its tests share the project's folders (.rlstream/recipes, the TRL venv, the distillation
    teacher) and each is CPU-bound, while the integration tests beside them mostly wait (on the broker, on
    timeouts they provoke: 60 % of the cores were idle through them, one at a time)."""
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
        item.add_marker(pytest.mark.xdist_group("e2e" if parts[:2] == ("tests", "e2e") else "/".join(parts)))


@pytest.fixture(scope="session")
def bootstrap() -> str:
    """The broker's address: $RLSTREAM_BOOTSTRAP, else the project's own broker (started if needed)."""
    if os.environ.get("RLSTREAM_BOOTSTRAP"):
        return os.environ["RLSTREAM_BOOTSTRAP"]
    from rlstream.infra import broker
    return broker.up()


@pytest.fixture(autouse=True)
def _project_broker_alive(request):
    """Before each test that needs the broker: the project's broker, started once for the whole session, still
    runs. If it stopped (no test stops it: those that stop brokers start their own), every later test would fail
    on a refused connection with the cause nowhere in sight; instead the session ends here, with the broker's
    own last words and the free disk."""
    if request.node.get_closest_marker("kafka") is None or os.environ.get("RLSTREAM_BOOTSTRAP"):
        return
    request.getfixturevalue("bootstrap")
    from rlstream.infra import broker
    why = broker.stopped()
    if why:
        pytest.exit(f"the project's Kafka broker stopped during this session, before {request.node.nodeid}; "
                    f"every later test needs it, so the session ends here.\n{why}", returncode=1)


@pytest.fixture
def run_name(bootstrap) -> str:
    """A fresh run whose topics exist, so tests never see each other's records."""
    from rlstream.kafka.topics import create_topics
    name = "t" + uuid.uuid4().hex[:10]
    create_topics({"bootstrap.servers": bootstrap}, name, partitions=2)
    return name


@pytest.fixture
def start_stage(tmp_path):
    """Starts ``rlstream [options] run STAGE args...`` processes (``module``: another entry point with rlstream's
    command line, e.g. ``tests.bad_envs``), started from the repository root so that reward functions and
    environments load from ``tests.`` by dotted path. Any still running when the test ends is SIGKILLed."""
    started: list[StageProc] = []

    def start(stage: str, bootstrap: str, run: str, *args: str, log_path: Path | None = None,
              options: tuple[str, ...] = (), module: str = "rlstream.cli") -> StageProc:
        """Start one stage process (logging to ``log_path``, else a file of its own under tmp_path)."""
        log = log_path or tmp_path / f"{stage}-{len(started)}.log"
        proc = StageProc(stage, [*options, "run", stage, *args], stage_env(bootstrap, run), log, module=module,
                         cwd=ROOT)
        started.append(proc.start())
        return proc

    yield start
    for proc in started:
        proc.kill()
