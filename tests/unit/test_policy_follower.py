"""The one rule every engine follows the policy by (rlstream.engine.follower): the first loadable version, the retry
of a failed load, the engine's own word on what it holds. The watcher and the weights are stand-ins here (this is
about the rule, not the topic or the store: both are real in tests/integration/test_weight_log.py and the fleet's
tests), and so is the clock of the retry interval."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from rlstream.engine.follower import PolicyFollower
from rlstream.errors import UserError
from tests.helpers.engines import FakeWatcher, pv

ROOT = Path(__file__).resolve().parents[2]


class Weights:
    """Folders by version; the versions in ``broken`` raise as an unreadable or refused version does."""

    def __init__(self, broken=()):
        self.broken = set(broken)
        self.loaded: list[int] = []

    def engine_folder(self, p):
        if p.version in self.broken:
            raise OSError(f"v{p.version} is not in the weights log")
        return Path(f"/store/v{p.version}")

    folder = engine_folder

    def load(self, p, backend):
        self.engine_folder(p)
        self.loaded.append(p.version)
        backend.version = p.version


class Backend:
    follows_policy = True
    version = 0


def follower(watcher, weights, retry_s=60.0) -> PolicyFollower:
    f = PolicyFollower("rollout", "policy", weights, retry_s)
    f.watcher, f.run = watcher, "r"
    return f


def test_the_first_version_is_the_newest_that_loads_and_none_in_time_says_what_to_start():
    watcher = FakeWatcher(pv(3))
    f = follower(watcher, Weights(broken={3}))
    later = threading.Timer(0.3, watcher.announce, [pv(4)])  # announced while the follower waits past v3
    later.start()
    got, folder = f.first(30)
    later.join()
    assert (got.version, folder) == (4, Path("/store/v4"))
    f = follower(FakeWatcher(pv(3)), Weights(broken={3}))
    with pytest.raises(UserError, match=r"no loadable policy policy announced on run 'r' within 0.2s.*"
                                        r"rollout's --wait-policy-s"):
        f.first(0.2)


def test_a_failed_load_keeps_the_version_held_and_is_retried_after_the_interval_or_on_a_newer_one():
    watcher, weights, backend = FakeWatcher(pv(0)), Weights(broken={1}), Backend()
    f = follower(watcher, weights, retry_s=0.3)
    f.held(0)
    watcher.announce(pv(1))
    assert not f.swap(backend) and f.version == 0 and f.failed[0] == 1
    assert f.due() is None  # not on every engine step: inside its retry interval
    time.sleep(0.35)
    assert f.due().version == 1  # the interval passed: tried again
    weights.broken.clear()
    assert f.swap(backend) and f.version == 1
    weights.broken.add(2)
    watcher.announce(pv(2))
    assert not f.swap(backend)
    watcher.announce(pv(3))  # a newer version is tried at once
    assert f.swap(backend) and f.version == 3 and weights.loaded == [1, 3]


def test_the_version_held_is_the_engines_word_and_a_pinned_endpoint_is_never_swapped():
    watcher, weights = FakeWatcher(pv(0)), Weights()
    f = follower(watcher, weights)
    watcher.announce(pv(2))
    assert f.advance(lambda p: 1) and f.version == 1  # a fleet that confirmed only v1 holds v1
    pinned = Backend()
    pinned.follows_policy = False
    watcher.announce(pv(5))
    assert not f.swap(pinned) and weights.loaded == [] and f.version == 1


def test_only_the_engine_package_builds_backends_or_follows_the_policy():
    """Rollout, the gateway and the teacher are users of rlstream.engine: none builds a backend or watches the
    policy for an engine of its own (the prompt sources watch it only to stamp and pace prompts)."""
    built_here = re.compile(r"\b(make_backend|start_fleet|TransformersBackend|VLLMBackend|ServerFleet|"
                            r"PolicyFollower|PolicyWatcher)\(")
    outside = {str(p.relative_to(ROOT)) for p in (ROOT / "rlstream").rglob("*.py")
               if "rlstream/engine/" not in str(p) and built_here.search(p.read_text())}
    assert outside == {"rlstream/sources/prompts.py", "rlstream/stages/rollout.py", "rlstream/gateway/engine.py",
                       "rlstream/stages/teacher/stage.py"}
    for name in ("rlstream/stages/rollout.py", "rlstream/gateway/engine.py", "rlstream/stages/teacher/stage.py"):
        assert set(built_here.findall((ROOT / name).read_text())) == {"PolicyFollower"}, name
    followers = [p for p in (ROOT / "rlstream").rglob("*.py")
                 if re.search(r"^class \w*Follower\b", p.read_text(), re.M)]
    assert [str(p.relative_to(ROOT)) for p in followers] == ["rlstream/engine/follower.py"]
