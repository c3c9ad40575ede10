"""Tiny LoRA policies for tests: a tied or untied tiny Qwen2, a real Adam step of its adapter, a version published
as the trainer publishes it."""
from __future__ import annotations

import copy

import torch
from transformers import Qwen2ForCausalLM

from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.schemas.records import PolicyVersion

SEQ = [1, 5, 9, 13, 20, 7, 3, 30, 11]


def tiny(tied: bool, seed: int = 0):
    tok = build_tokenizer()
    model = build_model(tok, hidden=32, layers=1, seed=seed)
    if tied:
        config = copy.deepcopy(model.config)
        config.tie_word_embeddings = True
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model, tok


def logprobs(model, ids=SEQ) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def train_a_step(engine, seed: int) -> None:
    """A real gradient step of the adapter (a language-model loss on a random sequence)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 40, (2, 8), generator=g)
    engine.model.train()
    engine.step(engine.forward(input_ids=ids, labels=ids).loss)
    engine.model.eval()


def publish(lora, model, tok, store, version):
    """A LoRA version as the trainer publishes it: the adapter folder in the store, the PolicyVersion naming its
    base."""
    writer = lora.writer(model, tok)
    written = {}

    def write(folder):
        written["hash"] = writer.write(folder)[1]
    uri = store.put("policy", version, write)
    return PolicyVersion(policy="policy", version=version, weights_uri=uri, created_at=0, published_at=0,
                         content_hash=written["hash"], **lora.fields())


