"""The fleet's bookkeeping (routing, affinity, quarantine, failover), on stand-in servers: what is tested is the
fleet, never a server (real vLLM servers: tests/integration/test_inference_fleet.py)."""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.schemas.records import SamplingParams
from rlstream.engine.base import Generation
from rlstream.engine.fleet import FleetOptions, NoServerAvailable, ServerFleet
from rlstream.engine.servers import PushRejected, ServerAPI, ServerError


class Standin(ServerAPI):
    """Answers one token whose id says which server made it; ``gate`` holds replies until set (or the request is
    cancelled); ``seeds`` records the seed of every request it got, ``cancelled`` those of requests cancelled."""

    kind = "vllm-server"

    def __init__(self, name, refuse=(), dead=False):
        super().__init__(f"http://{name}")
        self.name, self.refuse, self.dead, self.loaded = name, set(refuse), dead, []
        self.gate = threading.Event()
        self.gate.set()
        self.seeds, self.cancelled = [], []

    def generate(self, prompt, params, call=None):
        self.seeds.append(params.seed)
        deadline = time.monotonic() + 5
        while not self.gate.wait(0.01) and time.monotonic() < deadline:
            if call is not None and call.cancelled:
                self.cancelled.append(params.seed)
                raise ServerError(self.url, 0, "connection reset (cancelled)")
        if self.dead:
            raise ServerError(self.url, 0, "connection refused")
        return Generation([ord(self.name)], [-1.0], "length"), None

    def push(self, folder, version):
        if version in self.refuse:
            raise PushRejected(f"{self.url} refused v{version}")
        self.loaded.append(version)

    def healthy(self):
        return not self.dead


def fleet_of(*servers, **options) -> ServerFleet:
    fleet = ServerFleet(list(servers), FleetOptions(request_timeout_s=2, workers=8, **options))
    fleet.load_weights("/w/v0", 0)
    return fleet


def made_by(gens) -> list[str]:
    return [chr(g.token_ids[0]) for g in gens]


def test_least_loaded_spreads_new_episodes_and_affinity_keeps_an_episode_on_its_server():
    a, b = Standin("a"), Standin("b")
    fleet = fleet_of(a, b)
    a.gate.clear()  # a's requests stay in flight: the next ones go to b, the least loaded
    first = threading.Thread(target=fleet.generate, args=([[1]], SamplingParams(max_tokens=1)), kwargs={"keys": ["e1"]})
    first.start()
    while fleet.servers[0].inflight == 0:
        pass
    assert made_by(fleet.generate([[1], [1]], SamplingParams(max_tokens=1), keys=["e2", "e3"])) == ["b", "b"]
    a.gate.set()
    first.join(5)
    # e1's next turn goes back to a (its prefix is cached there), though both are idle now.
    assert made_by(fleet.generate([[1, 2]], SamplingParams(max_tokens=1), keys=["e1"])) == ["a"]
    fleet.close()


def test_a_server_that_refuses_a_push_is_quarantined_until_it_confirms():
    a, b = Standin("a"), Standin("b", refuse={1})
    fleet = fleet_of(a, b, retry_push_s=0)
    fleet.load_weights("/w/v1", 1)
    assert fleet.version == 1 and fleet.servers[1].version == 0 and "refused v1" in fleet.servers[1].why
    gens = fleet.generate([[1]] * 6, SamplingParams(max_tokens=1))
    assert made_by(gens) == ["a"] * 6 and all(g.versions == [1] for g in gens)
    b.refuse.clear()
    fleet.check(fleet.servers[1])  # the health pass pushes the current version again
    assert b.loaded == [0, 1] and fleet.servers[1].version == 1
    fleet.close()


def test_no_server_confirming_keeps_the_old_version():
    fleet = fleet_of(Standin("a", refuse={1}), Standin("b", refuse={1}))
    with pytest.raises(OSError, match="no server confirmed v1"):
        fleet.load_weights("/w/v1", 1)
    assert fleet.version == 0 and made_by(fleet.generate([[1]], SamplingParams(max_tokens=1))) in (["a"], ["b"])
    fleet.close()


def test_a_failed_request_goes_to_another_server_and_a_recovered_server_must_confirm_again():
    a, b = Standin("a", dead=True), Standin("b")
    fleet = fleet_of(a, b)
    gens = fleet.generate([[1]] * 4, SamplingParams(max_tokens=1), keys=["e1", "e2", "e3", "e4"])
    assert made_by(gens) == ["b"] * 4 and not fleet.servers[0].up
    a.dead = False
    fleet.check(fleet.servers[0])  # back up: re-pushed the current version before any work
    assert fleet.servers[0].up and a.loaded == [0, 0] and fleet.servers[0].version == 0
    fleet.close()


def test_when_every_server_is_down_the_request_fails_naming_them():
    fleet = fleet_of(Standin("a"))
    fleet.servers[0].api.dead = True
    with pytest.raises((NoServerAvailable, ServerError), match="http://a"):
        fleet.generate([[1]], SamplingParams(max_tokens=1))
    fleet.close()


def test_a_slow_servers_requests_are_hedged_on_an_idle_one_with_their_seeds_and_answered_once():
    a, b = Standin("a"), Standin("b")
    fleet = fleet_of(a, b, hedge=True)
    a.gate.clear()
    b.gate.clear()  # b never answers: once a is idle, b's requests are sent to a too and a's replies kept
    out = []
    call = threading.Thread(target=lambda: out.append(fleet.generate([[1]] * 6, SamplingParams(max_tokens=1))))
    call.start()
    while [s.inflight for s in fleet.servers] != [3, 3]:  # least-loaded: three each
        time.sleep(0.01)
    a.gate.set()
    call.join(10)
    gens = out[0]
    assert made_by(gens) == ["a"] * 6 and all(g.versions == [0] for g in gens)
    hedged = set(b.seeds)
    assert len(hedged) == 3 and None not in hedged  # b got half, each with a seed drawn for it
    assert len(a.seeds) == 6 and hedged <= set(a.seeds)  # a hedge samples with its request's seed
    deadline = time.monotonic() + 5
    while len(b.cancelled) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(b.cancelled) == sorted(hedged)  # and b's attempts were cancelled, not left running
    assert all(s.inflight == 0 for s in fleet.servers)
    fleet.close()


def test_without_hedging_a_request_runs_once_with_the_seed_it_was_given():
    a, b = Standin("a"), Standin("b")
    fleet = fleet_of(a, b)
    fleet.generate([[1]] * 4, SamplingParams(max_tokens=1, seed=None))
    assert a.seeds + b.seeds == [None] * 4
    fleet.close()


def test_during_a_push_the_first_server_to_confirm_takes_work_and_no_health_check_pushes_it_back():
    """Pipelined rollout pushes while requests are in flight: b confirms v1 while a still drains a v0 request."""
    a, b = Standin("a"), Standin("b")
    fleet = fleet_of(a, b)
    a.gate.clear()
    held: list = []
    request = threading.Thread(target=lambda: held.extend(fleet.generate([[1]], SamplingParams(max_tokens=1))))
    request.start()
    while fleet.servers[0].inflight == 0:
        time.sleep(0.001)
    push = threading.Thread(target=fleet.load_weights, args=("/w/v1", 1))
    push.start()
    while fleet.servers[1].version != 1:
        time.sleep(0.001)
    fleet.check(fleet.servers[1])  # a health check meanwhile: b is not behind, and must not be pushed v0 back
    gens = fleet.generate([[1]], SamplingParams(max_tokens=1))
    assert made_by(gens) == ["b"] and gens[0].versions == [1] and b.loaded == [0, 1]
    assert fleet.servers[0].loading, "a pushed under its request in flight"
    a.gate.set()
    push.join(5)
    request.join(5)
    assert made_by(held) == ["a"] and held[0].versions == [0]  # dispatched on v0, stamped v0
    assert fleet.version == 1 and a.loaded == [0, 1]
    fleet.close()
