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


def publish(lora, model, tok, store, version, writer=None):
    """A LoRA version as the trainer publishes it: the adapter folder in the store (by ``writer``, the trainer's one
    writer for every version: PEFT's save for the first, its own after; a new one: PEFT's), the PolicyVersion naming
    its base."""
    writer = writer or lora.writer(model, tok)
    written = {}

    def write(folder):
        written["hash"] = writer.write(folder)[1]
    uri = store.put("policy", version, write)
    return PolicyVersion(policy="policy", version=version, weights_uri=uri, created_at=0, published_at=0,
                         content_hash=written["hash"], **lora.fields())




def served_versions(tmp_path, model, tok, make_backend, versions: int = 3, eta: int = 0):
    """Train ``model``'s adapter (rank 4) a real step per version but the first, publish each version as the trainer
    does, and load it into the engine ``make_backend(folder)`` builds from the first one's base, as a worker does
    (``PolicyWeights``, base rule and load probe included); yields (version, published record, engine, the PEFT model,
    its optimizer's engine) after each load."""
    from rlstream.policy.weights import PolicyWeights, WeightStore
    from rlstream.trainer.engine import TorchEngine
    from rlstream.trainer.lora import LoraTraining
    from rlstream.trainer.settings import TrainerSettings
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0), **({"eta": eta} if eta else {}))
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
    weights = PolicyWeights(tmp_path / "cache")
    writer = lora.writer(peft_model, tok)
    backend = None
    for version in range(versions):
        if version:
            train_a_step(engine, version)
        pv = publish(lora, peft_model, tok, store, version, writer)
        if backend is None:
            backend = make_backend(weights.engine_folder(pv))
            weights.adopt(pv, backend)
        else:
            weights.load(pv, backend)
        yield version, pv, backend, peft_model, engine
