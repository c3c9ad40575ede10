"""Stand-ins for an inference engine and a policy watcher, for tests of the rollout stage's own bookkeeping
(weight swaps, turn labels, chat turns): what they test is the stage, never an engine."""
from __future__ import annotations

import threading
from pathlib import Path

from rlstream.schemas.records import PolicyVersion
from rlstream.engine import Generation, InferenceBackend


class FakeWatcher:
    """The newest announced version, settable by the test; ``announce_on_read`` announces one mid-generation."""

    def __init__(self, pv: PolicyVersion):
        self._latest = pv
        self.pending: list[tuple[int, PolicyVersion]] = []  # (read number, version to announce at it)
        self.reads = 0
        self.changed = threading.Condition()

    @property
    def latest(self) -> PolicyVersion:
        self.reads += 1
        while self.pending and self.pending[0][0] <= self.reads:
            self.announce(self.pending.pop(0)[1])
        return self._latest

    @property
    def version(self) -> int:
        return self._latest.version

    def announce(self, pv: PolicyVersion) -> None:
        with self.changed:
            self._latest = pv
            self.changed.notify_all()

    def wait_for(self, version: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self._latest.version >= version, timeout)

    def close(self) -> None:
        pass


class FakeBackend(InferenceBackend):
    """One token per step; each token's log-prob is -(version + 1), so a test can tell which weights made it."""

    name = "fake"

    def __init__(self, mid_generation: bool, steps: int = 4, fail: set[int] = frozenset()):
        self.swaps_mid_generation = mid_generation
        self.steps = steps
        self.fail = set(fail)
        self.loads: list[int] = []
        self.version = 0

    def load_weights(self, folder: Path, version: int) -> None:
        self.loads.append(version)
        if version in self.fail:
            raise OSError(f"v{version} is gone")
        self.version = version

    def generate(self, prompts, params, between_steps=None, keys=None):
        gens = [Generation([], [], "length") for _ in prompts]
        for step in range(self.steps):
            for g in gens:
                g.version_started_at.setdefault(self.version, 1000 + step)
                g.token_ids.append(5)
                g.logprobs.append(-(self.version + 1.0))
                g.versions.append(self.version)
            if step < self.steps - 1 and between_steps is not None and self.swaps_mid_generation:
                between_steps()
        return gens


def pv(version: int) -> PolicyVersion:
    return PolicyVersion("policy", version, f"file:///weights/v{version}", created_at=0, published_at=0)
