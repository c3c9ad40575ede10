"""Inference backends on a real tiny model: transformers, vLLM in process, and a generic OpenAI-compatible endpoint
(vLLM's server, as the serving-only ``openai`` backend with a pinned version)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

from rlstream.models.loading import load_tokenizer
from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
from rlstream.schemas.records import SamplingParams
from rlstream.engine import TransformersBackend, VLLMBackend, make_backend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer()
    save_pretrained(build_model(tok, seed=0), tok, root / "v0")
    save_pretrained(build_model(tok, seed=1), tok, root / "v1")
    return tok, root / "v0", root / "v1"


def reference_logprobs(folder, prompt, tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:].tolist()


@pytest.mark.timeout(120)
def test_transformers_backend_returns_sampled_tokens_and_their_logprobs(models):
    tok, v0, v1 = models
    backend = TransformersBackend(v0)
    prompts = [tok("abc>")["input_ids"], tok("xy>")["input_ids"]]  # different lengths: left padding
    gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=1))
    for p, g in zip(prompts, gens):
        assert 1 <= len(g.token_ids) <= 4 and len(g.logprobs) == len(g.token_ids)
        assert g.logprobs == pytest.approx(reference_logprobs(v0, p, g.token_ids), abs=1e-4)
    greedy0 = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    backend.load_weights(v1, 1)
    greedy1 = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert [g.token_ids for g in greedy0] != [g.token_ids for g in greedy1], "new weights were not loaded"
    # From tensors in memory (what the weights log hands an in-process engine): the same weights as from v0's folder.
    backend.load_tensors(load_file(str(v0 / "model.safetensors")), 2)
    again = backend.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert backend.version == 2 and [g.token_ids for g in again] == [g.token_ids for g in greedy0]
    assert [x for g in again for x in g.logprobs] == pytest.approx([x for g in greedy0 for x in g.logprobs], abs=1e-5)


@pytest.mark.timeout(300)
def test_vllm_in_process_logprobs_and_hot_swap(models):
    tok, v0, v1 = models
    backend = VLLMBackend(v0)
    prompt = tok("abc>")["input_ids"]
    gens = backend.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=4))
    for g in gens:
        assert g.logprobs == pytest.approx(reference_logprobs(v0, prompt, g.token_ids), abs=1e-3)
    backend.load_weights(v1, 1)  # no engine restart
    greedy = backend.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert greedy.logprobs == pytest.approx(reference_logprobs(v1, prompt, greedy.token_ids), abs=1e-3)
    # From tensors in memory, as the weights log hands them to an engine in this process: v0 again.
    assert backend.loads_tensors
    backend.load_tensors(load_file(str(v0 / "model.safetensors")), 2)
    greedy = backend.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert backend.version == 2
    assert greedy.logprobs == pytest.approx(reference_logprobs(v0, prompt, greedy.token_ids), abs=1e-3)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(330)
def test_openai_compatible_server_backend(models):
    tok, v0, _ = models
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(v0),
                               "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "64",
                               "--dtype", "float32", "--enforce-eager"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "vLLM server exited"
                assert time.monotonic() < deadline, "vLLM server did not start"
                time.sleep(2)
        # Serving only: nothing is pushed, every token carries the pinned version, and a new version changes nothing.
        backend = make_backend("openai", v0, urls=[f"http://127.0.0.1:{port}"], version=7,
                               tokenizer=load_tokenizer(v0, flag="policy folder"))
        backend.load_weights(v0, 9)
        assert backend.version == 7 and not backend.follows_policy
        prompts = [tok("abc>")["input_ids"], tok("xy>")["input_ids"]]
        gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4))
        for p, g in zip(prompts, gens):
            assert len(g.token_ids) == len(g.logprobs) >= 1
            assert g.logprobs == pytest.approx(reference_logprobs(v0, p, g.token_ids), abs=1e-3)
            assert g.versions == [7] * len(g.token_ids)
        backend.close()
    finally:
        os.killpg(server.pid, 9)
        server.wait(30)


@pytest.mark.timeout(300)
def test_vllm_swap_between_engine_steps_continues_under_the_new_weights(models):
    """A swap mid-generation: each token is stamped with, and its log-prob taken from, the weights that sampled it.

    The tokens after the swap must score as the new model scores them given the whole prefix, which holds only
    if the in-flight sequences' KV was recomputed by the new weights (a hybrid of old KV and new weights fails).
    """
    tok, v0, v1 = models
    backend = VLLMBackend(v0)
    backend.version = 0
    prompts = [tok("abc>")["input_ids"], tok("xyz>")["input_ids"], tok("ab>")["input_ids"]] * 2
    steps = []

    def between_steps():
        steps.append(backend.version)
        if len(steps) == 3:
            backend.load_weights(v1, 1)

    # Random weights rarely sample eos (about 1 token in 47), so most sequences are still running at the swap.
    gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=3), between_steps)
    assert len(steps) >= 3 and backend.version == 1
    spanned = 0
    for p, g in zip(prompts, gens):
        assert len(g.versions) == len(g.logprobs) == len(g.token_ids) >= 1
        assert g.versions == sorted(g.versions), "versions must never go back"
        ref = {0: reference_logprobs(v0, p, g.token_ids), 1: reference_logprobs(v1, p, g.token_ids)}
        for i, (v, lp) in enumerate(zip(g.versions, g.logprobs)):
            assert lp == pytest.approx(ref[v][i], abs=1e-3), f"token {i} of {g.token_ids}, stamped v{v}"
        if set(g.versions) == {0, 1}:
            spanned += 1
            assert set(g.version_started_at) == {0, 1} and g.version_started_at[0] <= g.version_started_at[1]
    assert spanned >= 1, "no sequence was in flight across the swap"
    # The engine is left clean: a plain call after the swap samples from v1 alone.
    after = backend.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert after.versions == [1] * len(after.token_ids)
    assert after.logprobs == pytest.approx(reference_logprobs(v1, prompts[0], after.token_ids), abs=1e-3)


@pytest.mark.timeout(300)
def test_rollout_stage_on_vllm_labels_a_turn_spanning_a_swap_with_its_oldest_version(models):
    """The rollout stage end to end on vLLM: v1 is announced while a batch generates. Each episode's header and
    turn carry v0 (the oldest weights in it); its log-probs are v0's up to the swap and v1's after it, given the
    whole prefix; episodes continued under v1 carry the rollout.swap.v1 stamp."""
    from rlstream.runtime.stage import Incoming
    from rlstream.schemas.records import PolicyVersion, Task
    from rlstream.stages.rollout import SWAP_STAMP, RolloutSettings, RolloutStage

    tok, v0, v1 = models

    class Watcher:  # announces v1 at the 4th look, i.e. after the engine's 3rd step of the batch
        reads = 0

        @property
        def latest(self):
            self.reads += 1
            version, folder = (1, v1) if self.reads >= 4 else (0, v0)
            return PolicyVersion("policy", version, folder.as_uri(), created_at=0, published_at=0)

        @property
        def version(self):
            return self.latest.version

        def close(self):
            pass

    stage = RolloutStage(RolloutSettings(swap="step", max_context=64))
    stage.follower.watcher, stage.backend, stage.follower.version = Watcher(), VLLMBackend(v0), 0
    stage.backend.version = 0
    stage.tokenizer = stage.backend.tokenizer
    task = Task(task_id="t", group_id="g", task_name="reverse", env_name="e", env_version="1", prompt="abc>",
                sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=5), created_at=0, group_size=6)
    [outputs] = stage.handle_batch([Incoming("prompts", 0, 0, None, {}, -1, task)])
    assert stage.version == 1 and len(outputs) == 6
    spanned = 0
    for out in outputs:
        ep = out.record
        prompt, tokens, lps = ep.task.prompt_token_ids, ep.token_ids, ep.behaviour_logprobs
        assert out.policy_version == 0 and [t.policy_version for t in ep.turns] == [0]
        ref0, ref1 = reference_logprobs(v0, prompt, tokens), reference_logprobs(v1, prompt, tokens)
        # The first k tokens are v0's and the rest v1's, for one k: the swap point.
        splits = [k for k in range(len(tokens) + 1)
                  if lps[:k] == pytest.approx(ref0[:k], abs=1e-3) and lps[k:] == pytest.approx(ref1[k:], abs=1e-3)]
        assert splits, f"log-probs {lps} fit no v0-then-v1 split"
        # The turn's version segments say where the swap fell: the log-probs agree.
        [turn] = ep.turns
        k = sum(n for v, n in zip(turn.segment_versions, turn.segment_tokens) if v == 0)
        assert turn.segment_versions == ([0, 1] if k < len(tokens) else [0])
        assert sum(turn.segment_tokens) == len(tokens) and k in splits
        if f"{SWAP_STAMP}1" in ep.stage_times:
            spanned += 1
            assert max(splits) < len(tokens), "stamped as continued under v1, yet no token scores as v1's"
        else:
            assert min(splits) == len(tokens), "a token scores only as v1's, yet the turn has no swap stamp"
    assert spanned >= 1, "no episode was in flight across the swap"
