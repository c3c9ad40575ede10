"""The rollout stage on a fleet of real vLLM OpenAI-compatible servers (CPU), started by these tests.

Two servers run at a time. The tests run in file order and share them: a push of v1 to both (a batch at a time, then
across pipelined requests in flight), then one of them killed mid-request under the pipelined runner, then a server
that refuses weight pushes (no dev-mode routes) in its place.
"""
from __future__ import annotations

import threading
import time

import pytest

from rlstream.config import KafkaSettings
from rlstream.errors import UserError
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.runtime.stage import Incoming
from rlstream.schemas.records import PolicyVersion, SamplingParams, Task
from rlstream.engine.servers import http_json
from rlstream.stages.rollout import RolloutSettings, RolloutStage
from tests.helpers.engines import FakeWatcher
from tests.helpers.kafka import produce, read_all
from tests.helpers.models import chat_tokenizer, llama_folder, reference_logprobs
from tests.helpers.servers import free_port, start_vllm_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    tok = chat_tokenizer()
    # never_stop: every response runs to max_tokens, so requests are long enough to be caught in flight.
    return root, llama_folder(root / "v0", tokenizer=tok, seed=0, never_stop=True, max_positions=128), \
        llama_folder(root / "v1", tokenizer=tok, seed=1, never_stop=True, max_positions=128)


@pytest.fixture(scope="module")
def servers(models):
    root, v0, _ = models
    started = [start_vllm_server(v0, root / f"server-{i}.log") for i in range(2)]
    try:
        yield [s.wait_ready() for s in started]
    finally:
        for s in started:
            s.kill()


def policy(version: int, folder) -> PolicyVersion:
    return PolicyVersion("policy", version, folder.as_uri(), created_at=0, published_at=0)


def fleet_stage(urls, v0, **knobs) -> RolloutStage:
    """A rollout stage whose engine is a fleet of ``urls``, started on v0 as ``_ensure_started`` would."""
    stage = RolloutStage(RolloutSettings(backend="vllm-server", engine_url=tuple(urls), max_context=64, swap="step",
                                         health_interval_s=0.5, **knobs))
    stage.max_context = 64
    stage.follower.watcher = FakeWatcher(policy(0, v0))
    stage.backend = stage._make_backend(v0, 0)
    stage.tokenizer = chat_tokenizer()
    stage.follower.version = stage.backend.version
    return stage


def task(name: str, group_size: int, max_tokens: int = 6) -> Task:
    return Task(task_id=name, group_id=name, task_name="t", env_name="e", env_version="1", prompt="Reverse abc:",
                sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens), created_at=0, group_size=group_size)


def batch(name: str, group_size: int, max_tokens: int = 6) -> list[Incoming]:
    return [Incoming("prompts", 0, 0, None, {}, -1, task(name, group_size, max_tokens))]


def assert_made_by(outputs, version: int, folder) -> None:
    """Every token is stamped ``version`` and its log-prob is the one ``folder``'s model gives it."""
    for out in outputs:
        ep = out.record
        assert out.policy_version == version and [t.policy_version for t in ep.turns] == [version]
        ref = reference_logprobs(folder, ep.task.prompt_token_ids, ep.token_ids)
        assert ep.behaviour_logprobs == pytest.approx(ref, abs=1e-3), f"{ep.episode_id} not sampled by v{version}"


@pytest.mark.timeout(600)
def test_a_push_reaches_every_server_and_later_tokens_carry_the_version_they_confirmed(models, servers):
    _, v0, v1 = models
    stage = fleet_stage([s.url for s in servers], v0)
    try:
        [before] = stage.handle_batch(batch("before", 8))
        assert len(before) == 8
        assert_made_by(before, 0, v0)
        # Least-loaded routing spread the group over both servers.
        assert {stage.backend._affinity[o.record.episode_id].url for o in before} == {s.url for s in servers}
        stage.follower.watcher.announce(policy(1, v1))
        [after] = stage.handle_batch(batch("after", 8))
        assert stage.version == 1
        assert_made_by(after, 1, v1)  # fails if v1 were stamped on tokens the servers made with v0's weights
        # Each server says it holds v1 (set only after its reload returned).
        assert [http_json("GET", s.url + "/weight_info")["weight_version"] for s in servers] == ["1", "1"]
        # A second turn of an episode goes to the server that served its first (its prefix is cached there).
        first = {o.record.episode_id: stage.backend._affinity[o.record.episode_id] for o in after}
        stage.handle_batch([Incoming("observations", 0, 0, None, {}, -1, o.record) for o in after[:1]])
        assert stage.backend._affinity[after[0].record.episode_id] is first[after[0].record.episode_id]
    finally:
        stage.close()


@pytest.mark.timeout(600)
def test_pipelined_records_across_a_push_carry_the_version_their_server_confirmed(models, servers):
    """The pipelined mode: records' handlers run at once, no engine lock, while the swapper pushes v1. Requests in
    flight finish on v0 and are stamped v0; the push waits for them; later ones run on v1 and are stamped v1."""
    _, v0, v1 = models
    stage = fleet_stage([s.url for s in servers], v0, max_concurrency=2)
    assert not stage.batched
    outputs: dict[str, list] = {}
    threads = []

    def handle(name: str) -> None:
        outputs[name] = stage.handle(batch(name, 2, max_tokens=30)[0])

    def start(names) -> None:
        for name in names:
            threads.append(threading.Thread(target=handle, args=(name,), daemon=True))
            threads[-1].start()
    try:
        stage._start_swapper()  # as _ensure_started does (--swap step)
        start(f"early{i}" for i in range(4))
        deadline = time.monotonic() + 120
        while sum(s.inflight for s in stage.backend.servers) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(s.inflight for s in stage.backend.servers), "no requests in flight on both servers"
        stage.follower.watcher.announce(policy(1, v1))
        # Every server is either loading v1 (it waits for its requests in flight) or holds it, unused until all do.
        while not all(s.loading or s.version == 1 for s in stage.backend.servers) and time.monotonic() < deadline:
            time.sleep(0.001)
        start(f"late{i}" for i in range(2))  # sent while the push is under way: they wait for v1
        for t in threads:
            t.join(300)
        assert sorted(outputs) == sorted([f"early{i}" for i in range(4)] + ["late0", "late1"]), "a handler hung"
        stamped = {name: {o.policy_version for o in outs} for name, outs in outputs.items()}
        assert 0 in set().union(*stamped.values()), "no request was caught in flight across the push"
        assert stamped["late0"] == stamped["late1"] == {1}
        for outs in outputs.values():
            for out in outs:  # fails if v1 were stamped on tokens a server made with v0's weights, or the reverse
                assert_made_by([out], out.policy_version, v1 if out.policy_version == 1 else v0)
        assert stage.version == 1
    finally:
        stage.close()


@pytest.mark.timeout(600)
def test_a_server_killed_mid_request_has_its_requests_finished_by_the_other_exactly_once(models, servers, bootstrap,
                                                                                        run_name):
    """Pipelined under the real runner: the killed server's requests are retried on the other one, and every
    episode reaches ``actions`` once (the record's transaction is committed only when all its requests answered)."""
    _, v0, v1 = models
    stage = fleet_stage([s.url for s in servers], v0, max_concurrency=4)
    stage.follower.watcher.announce(policy(1, v1))
    assert stage._swap_to_latest() and stage.version == 1
    victim = stage.backend.servers[1]
    killed = threading.Event()
    committed = []

    def kill_when_busy():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if victim.inflight >= 2:
                servers[1].kill()
                killed.set()
                return
            time.sleep(0.001)

    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run_name),
                         RuntimeSettings(batch_size=4, instance=f"{run_name}-rollout"),
                         on_committed=committed.append)
    assert runner.in_flight_limit() == 8  # --max-concurrency 4 on each of 2 servers: a record per request slot
    killer = threading.Thread(target=kill_when_busy, daemon=True)
    worker = threading.Thread(target=runner.run, kwargs={"idle_exit_s": 60}, daemon=True)
    killer.start()
    worker.start()
    produce(bootstrap, run_name, "prompts", [(f"k{i}".encode(), task(f"k{i}", 2, max_tokens=40), None)
                                             for i in range(8)])
    deadline = time.monotonic() + 300
    while sum(committed) < 8 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    runner.request_stop()
    worker.join(60)
    killer.join(5)
    assert killed.is_set(), "the server was never caught with requests in flight"
    actions = [seen.record for seen in read_all(bootstrap, run_name, "actions", expect=16)]
    ids = [ep.episode_id for ep in actions]
    assert sorted(ids) == sorted(f"k{i}:{j}" for i in range(8) for j in range(2)), "an episode was lost or duplicated"
    assert all(len(ep.token_ids) == 40 for ep in actions)
    for ep in actions:
        assert [t.policy_version for t in ep.turns] == [1]
        ref = reference_logprobs(v1, ep.task.prompt_token_ids, ep.token_ids)
        assert ep.behaviour_logprobs == pytest.approx(ref, abs=1e-3), f"{ep.episode_id} not sampled by v1"
    assert read_all(bootstrap, run_name, "dead-letters", timeout=2) == []
    assert not victim.up and stage.backend.servers[0].up


@pytest.mark.timeout(600)
def test_a_server_that_refuses_a_push_is_quarantined_and_nothing_is_mislabelled(models, servers):
    root, v0, v1 = models
    refusing = start_vllm_server(v0, root / "refusing.log", dev_mode=False).wait_ready()
    try:
        # v0 is what the refusing server was started with, but it cannot confirm it: it gets no work at all.
        stage = fleet_stage([servers[0].url, refusing.url], v0)
        try:
            quarantined = stage.backend.servers[1]
            assert quarantined.version == -1 and "VLLM_SERVER_DEV_MODE" in quarantined.why
            [outputs] = stage.handle_batch(batch("q0", 4))
            assert_made_by(outputs, 0, v0)
            stage.follower.watcher.announce(policy(1, v1))
            [outputs] = stage.handle_batch(batch("q1", 8))
            assert_made_by(outputs, 1, v1)
            assert {stage.backend._affinity[o.record.episode_id].url for o in outputs} == {servers[0].url}
        finally:
            stage.close()
    finally:
        refusing.kill()


def test_an_unreachable_server_is_named_at_start(models):
    _, v0, _ = models
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=url.replace(".", r"\.")):
        fleet_stage([url], v0)


@pytest.mark.timeout(120)
def test_a_server_with_another_tokenizer_is_refused_with_both_names(models, servers, tmp_path):
    _, v0, _ = models
    other = llama_folder(tmp_path / "other", tokenizer=chat_tokenizer(vocab_size=300))
    stage = RolloutStage(RolloutSettings(backend="vllm-server", engine_url=(servers[0].url,), max_context=64))
    stage.max_context = 64
    with pytest.raises(UserError) as err:
        stage._make_backend(other, 0)
    assert servers[0].url in str(err.value) and str(v0) in str(err.value) and str(other) in str(err.value)
