"""The in-process backends' streaming hook (``on_step``, what the gateway streams from): after every engine step
the generations so far, growing a step at a time, ending as the returned generations; on a real tiny model,
transformers and vLLM (CPU)."""
from __future__ import annotations

import pytest

from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
from rlstream.schemas.records import SamplingParams
from rlstream.engine import TransformersBackend, VLLMBackend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = build_tokenizer()
    folder = tmp_path_factory.mktemp("models") / "v0"
    save_pretrained(build_model(tok, seed=0), tok, folder)
    return tok, folder


def check_steps(backend, tok) -> None:
    prompts = [tok("abc>")["input_ids"], tok("xy>")["input_ids"]]
    steps: list[list[list[int]]] = []
    gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=3),
                            on_step=lambda so_far: steps.append([list(g.token_ids) for g in so_far]))
    assert backend.streams
    assert len(steps) >= max(len(g.token_ids) for g in gens) >= 2, "one call per engine step, not one at the end"
    for i, g in enumerate(gens):
        seen = [s[i] for s in steps]
        assert seen[-1] == g.token_ids
        # Each step's tokens extend the last step's by at most one token: they came as they were sampled.
        assert all(b[:len(a)] == a and len(b) - len(a) <= 1 for a, b in zip(seen, seen[1:]))


@pytest.mark.timeout(120)
def test_transformers_backend_hands_over_each_steps_tokens(model):
    tok, folder = model
    check_steps(TransformersBackend(folder), tok)


@pytest.mark.timeout(300)
def test_vllm_in_process_hands_over_each_steps_tokens(model):
    tok, folder = model
    backend = VLLMBackend(folder)
    try:
        check_steps(backend, tok)
    finally:
        backend.close()
