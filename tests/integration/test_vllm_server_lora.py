"""LoRA versions on vLLM servers (the CPU build) through the fleet: each version loaded as an adapter of its own name
over the base the server was started on, its log-probs those of PEFT's merge, its tokens stamped with it, the
oldest adapters unloaded; a server that cannot take adapters refuses each one and gets no work."""
from __future__ import annotations

import copy

import pytest
import torch

from rlstream.engine import make_backend
from rlstream.engine.servers import ADAPTERS_KEPT, http_json
from rlstream.models.loading import load_tokenizer
from rlstream.policy.weights import PolicyWeights, WeightStore
from rlstream.schemas.records import SamplingParams
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.lora import LoraTraining
from rlstream.trainer.settings import TrainerSettings
from tests.helpers.lora import SEQ, logprobs, publish, tiny, train_a_step
from tests.helpers.servers import start_vllm_server

pytestmark = pytest.mark.slow

RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.mark.timeout(900)
def test_vllm_servers_serve_each_lora_version_and_one_without_lora_gets_no_work(tmp_path):
    model, tok = tiny(False)
    store = WeightStore(str(tmp_path / "store"))
    lora = LoraTraining(TrainerSettings(lora_rank=4, lora_alpha=8.0), eta=1)
    peft_model = lora.fresh(model, tok, store, "policy", lead=True)
    engine = TorchEngine(peft_model, lr=1e-2, max_grad_norm=1.0)
    weights = PolicyWeights(tmp_path / "cache")
    pv = publish(lora, peft_model, tok, store, 0)
    base = weights.engine_folder(pv)
    servers = [start_vllm_server(base, tmp_path / "lora.log", extra=("--enable-lora", "--max-lora-rank", "8"),
                                 env_extra=RUNTIME_LORA),
               start_vllm_server(base, tmp_path / "plain.log", env_extra=RUNTIME_LORA)]  # no --enable-lora
    fleet = None
    try:
        for server in servers:
            server.wait_ready()
        # The tokenizer as rollout loads it, from the folder the servers serve.
        fleet = make_backend("vllm-server", base, urls=[s.url for s in servers], version=0,
                             tokenizer=load_tokenizer(base))
        weights.adopt(pv, fleet)  # the first version's adapter over the base both were started on
        with_lora, plain = fleet.servers
        for version in range(5):
            if version:
                train_a_step(engine, version)
                pv = publish(lora, peft_model, tok, store, version)
                weights.load(pv, fleet)
            assert fleet.version == version and with_lora.version == version
            assert plain.version != version and "adapter" in plain.why, plain.why  # refused: quarantined
            assert with_lora.api.model == f"rlstream-v{version}"
            merged = copy.deepcopy(peft_model).merge_and_unload()
            served = torch.tensor(with_lora.api.probe_logprobs(SEQ))
            assert torch.allclose(served, logprobs(merged), atol=2e-3), f"v{version}: {served} vs {logprobs(merged)}"
            gens = fleet.generate([SEQ[:4]] * 3, SamplingParams(temperature=1.0, max_tokens=3, seed=version))
            assert all(g.versions == [version] * len(g.token_ids) for g in gens), "tokens not stamped with it"
        listed = {m["id"] for m in http_json("GET", servers[0].url + "/v1/models")["data"]}
        kept = {f"rlstream-v{v}" for v in range(5 - ADAPTERS_KEPT, 5)}
        assert kept <= listed and not ({"rlstream-v0", "rlstream-v1"} & listed), listed
    finally:
        if fleet is not None:
            fleet.close()
        for server in servers:
            server.kill()
