"""The load probe (rlstream.policy.probe): the trainer's log-probs of a fixed token sequence travel with the version,
and every load is checked against them. On the transformers engine with real tiny Llamas built in code (tied and
untied), through PolicyWeights as the rollout and gateway load; the fleet's part on stand-in servers (what is tested
there is the fleet's bookkeeping, not a server: real servers are tests/integration/)."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlstream import metrics
from rlstream.engine import TransformersBackend
from rlstream.policy import probe
from rlstream.engine.base import Generation
from rlstream.engine.fleet import FleetOptions, ServerFleet
from rlstream.policy.probe import ProbeMismatch, trainer_probe
from rlstream.engine.servers import ServerAPI
from rlstream.policy.weights import PolicyWeights
from rlstream.schemas.records import PolicyVersion, SamplingParams
from tests.helpers.models import chat_tokenizer, llama_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, tok = tmp_path_factory.mktemp("probe"), chat_tokenizer()
    return {tied: [llama_folder(root / f"{'tied' if tied else 'untied'}-v{v}", tokenizer=tok, seed=v, tied=tied,
                                max_positions=64, init_range=0.5) for v in (0, 1)] for tied in (True, False)}


def announced(folder, version: int, probe_of=None) -> PolicyVersion:
    """The PolicyVersion a trainer publishes for ``folder``, its probe computed on ``probe_of`` (default: itself)."""
    model = AutoModelForCausalLM.from_pretrained(probe_of or folder, dtype=torch.float32)
    ids, lps = trainer_probe(model)
    return PolicyVersion(policy="p", version=version, weights_uri=folder.as_uri(), created_at=0, published_at=0,
                         probe_token_ids=ids, probe_logprobs=lps)


def refused() -> float:
    return metrics.WEIGHTS_REFUSED.labels("probe_mismatch")._value.get()


def test_probe_ids_spread_over_the_vocabulary_and_check_passes_within_tolerance():
    ids = probe.probe_token_ids(323)
    assert len(ids) == probe.PROBE_TOKENS and len(set(ids)) == len(ids) and max(ids) < 323
    probe.check(1, "engine", [-1.0, -2.0], [-1.0 - probe.TOLERANCE, -2.0])  # mean gap: half the tolerance
    probe.check(1, "engine", [-10.0, -20.0], [-10.0, -20.0 - 2 * probe.RELATIVE * 15])  # in proportion to the size
    probe.check(1, "engine", [-10.0, -20.0], [-10.0, -20.0 - probe.PRECISE], precise=True)
    with pytest.raises(ProbeMismatch, match=r"allowed 0\.0100"):  # fp32 on both sides: no room for bf16's error
        probe.check(1, "engine", [-10.0, -20.0], [-10.0, -20.0 - 2 * probe.RELATIVE * 15], precise=True)
    with pytest.raises(ProbeMismatch, match=r"trainer \[-1\.000, -2\.000\], engine \[-3\.000, -2\.000\]"):
        probe.check(1, "engine", [-1.0, -2.0], [-3.0, -2.0])
    with pytest.raises(ProbeMismatch):  # another probe's answer
        probe.check(1, "engine", [-1.0, -2.0], [-1.0])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_transformers_engine_answers_the_trainers_probe_after_folder_and_tensor_loads(folders, tied):
    v0, v1 = folders[tied]
    backend = TransformersBackend(v0)
    weights = PolicyWeights(v0.parent / "cache")
    pv0, pv1 = announced(v0, 0), announced(v1, 1)
    assert pv0.probe_logprobs != pytest.approx(pv1.probe_logprobs, abs=0.5), "the versions must differ"
    weights.verify_first(pv0, backend)
    weights.load(pv1, backend)  # from the folder
    assert backend.version == 1
    assert backend.probe_logprobs(pv1.probe_token_ids) == pytest.approx(pv1.probe_logprobs, abs=1e-5)
    backend.load_tensors(load_file(str(v0 / "model.safetensors")), 2)  # from tensors, as the weights log hands them
    weights.verify(PolicyVersion(**{**pv0.to_dict(), "version": 2}), backend)
    assert backend.probe_logprobs(pv0.probe_token_ids) == pytest.approx(pv0.probe_logprobs, abs=1e-5)


def test_a_version_whose_probe_disagrees_is_refused_and_the_last_good_one_is_served_again(folders, caplog):
    v0, v1 = folders[True]
    backend = TransformersBackend(v0)
    weights = PolicyWeights(v0.parent / "cache")
    pv0 = announced(v0, 0)
    weights.verify_first(pv0, backend)
    # v1's weights, announced with v0's log-probs: what an engine that kept the old head would answer.
    bad = announced(v1, 1, probe_of=v0)
    before = refused()
    with caplog.at_level(logging.ERROR), pytest.raises(ProbeMismatch) as exc:
        weights.load(bad, backend)
    assert exc.value.version == 1 and exc.value.gap > probe.allowed(bad.probe_logprobs, precise=True)
    assert "trainer [" in str(exc.value) and "engine [" in str(exc.value)  # both figures
    assert refused() == before + 1
    assert "still serving v0" in caplog.text
    # The engine is back on v0, by its version and by its weights.
    assert backend.version == 0
    assert backend.probe_logprobs(pv0.probe_token_ids) == pytest.approx(pv0.probe_logprobs, abs=1e-5)
    # A version published without a probe (an older trainer) loads unchecked.
    weights.load(PolicyVersion(policy="p", version=3, weights_uri=v1.as_uri(), created_at=0, published_at=0),
                 backend)
    assert backend.version == 3


def test_a_first_version_that_fails_its_probe_stops_the_worker_with_one_line(folders):
    from rlstream.errors import UserError
    v0, v1 = folders[False]
    with pytest.raises(UserError, match="v0 refused: .* nats a token"):
        PolicyWeights(v0.parent / "cache").verify_first(announced(v0, 0, probe_of=v1), TransformersBackend(v0))


class ProbedStandin(ServerAPI):
    """A stand-in server that loads any version and answers the probe with ``answers[version]``."""

    kind = "vllm-server"

    def __init__(self, name, answers):
        super().__init__(f"http://{name}")
        self.answers, self.holds = answers, -1

    def generate(self, prompt, params, call=None):
        return Generation([self.holds], [-1.0], "length"), None

    def push(self, folder, version):
        self.holds = version

    def probe_logprobs(self, token_ids):
        return self.answers[self.holds]

    def healthy(self):
        return True


def test_a_fleet_server_whose_probe_disagrees_gets_no_work_for_that_version():
    good = {0: [-1.0, -2.0], 1: [-3.0, -4.0]}
    a = ProbedStandin("a", good)
    b = ProbedStandin("b", {0: good[0], 1: good[0]})  # b's log-probs after v1 are still v0's
    fleet = ServerFleet([a, b], FleetOptions(request_timeout_s=2, workers=4))
    fleet.expect_probe(0, [5, 6, 7], good[0])
    fleet.load_weights("/w/v0", 0)
    fleet.expect_probe(1, [5, 6, 7], good[1])
    fleet.load_weights("/w/v1", 1)
    assert fleet.version == 1 and fleet.servers[0].version == 1
    assert fleet.servers[1].version == -1 and "v1 refused" in fleet.servers[1].why
    gens = fleet.generate([[1]] * 4, SamplingParams(max_tokens=1))
    assert {g.versions[0] for g in gens} == {1} and a.holds == 1
    # Every server refusing: the fleet stays on v0, and no server holding the refused weights takes work.
    a.answers = b.answers = {0: good[0], 1: good[0], 2: good[0]}
    fleet.expect_probe(2, [5, 6, 7], [-9.0, -9.0])
    with pytest.raises(OSError, match="no server confirmed v2"):
        fleet.load_weights("/w/v2", 2)
    assert fleet.version == 1 and all(s.version == -1 for s in fleet.servers)
    fleet.close()


def test_a_fleets_first_version_pushed_before_its_probe_was_known_is_probed_on_every_server(folders):
    good = [-1.0, -2.0]
    a, b = ProbedStandin("a", {0: good}), ProbedStandin("b", {0: [-5.0, -5.0]})
    fleet = ServerFleet([a, b], FleetOptions(request_timeout_s=2, workers=4))
    fleet.load_weights("/w/v0", 0)  # as start_fleet pushes it, before the rollout knows the version's probe
    pv0 = PolicyVersion(policy="p", version=0, weights_uri="/w/v0", created_at=0, published_at=0,
                        probe_token_ids=[5, 6, 7], probe_logprobs=good)
    PolicyWeights(folders[True][0].parent / "cache").verify_first(pv0, fleet)
    assert [s.version for s in fleet.servers] == [0, -1] and "v0 refused" in fleet.servers[1].why
    b.answers = {0: [-5.0, -5.0]}
    a.answers = {0: [-5.0, -5.0]}
    fleet.servers[1].version = 0
    from rlstream.errors import UserError
    with pytest.raises(UserError, match="v0 refused"):  # no server serves what the trainer published
        PolicyWeights(folders[True][0].parent / "cache").verify_first(pv0, fleet)
    fleet.close()
