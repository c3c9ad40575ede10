"""SGLang's native API mapped to rlstream's Generation and weight pushes.

SGLang has no CPU build, so no server runs here: these tests check the request and response mapping against
SGLang's documented API (docs/basic_usage/native_api, sampling_params and lora: ``/generate`` with ``input_ids``,
``sampling_params`` and ``return_logprob``; ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]``;
``meta_info.finish_reason.type``; ``/update_weights_from_disk`` answering ``success`` and ``message``;
``/get_model_info`` with ``model_path`` and ``weight_version``). The HTTP call is replaced by a recorder that
answers with the documented reply shapes.
"""
from __future__ import annotations

import pytest

from rlstream.schemas.records import SamplingParams
from rlstream.engine.fleet import FleetOptions, ServerFleet
from rlstream.engine.servers import PushRejected, SGLangAPI


class Recorded(SGLangAPI):
    """SGLangAPI whose HTTP calls are recorded and answered from ``replies`` (path -> JSON)."""

    def __init__(self, replies):
        super().__init__("http://sglang:30000")
        self.replies, self.calls = replies, []

    def _call(self, method, path, body=None, timeout=None, call=None):
        self.calls.append((method, path, body))
        return self.replies[path]


def generate_reply(pairs, finish="length", version="3"):
    return {"text": "...", "output_ids": [p[1] for p in pairs],
            "meta_info": {"output_token_logprobs": pairs, "finish_reason": {"type": finish},
                          "weight_version": version, "prompt_tokens": 3, "completion_tokens": len(pairs)}}


def test_generate_sends_token_ids_and_asks_for_the_sampled_tokens_log_probs():
    api = Recorded({"/generate": generate_reply([[-0.5, 11, None], [-1.25, 12, None]], finish="stop")})
    gen, version = api.generate([1, 2, 3], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=8, seed=4))
    [(method, path, body)] = api.calls
    assert (method, path) == ("POST", "/generate")
    assert body == {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                        "sampling_seed": 4}}
    assert (gen.token_ids, gen.logprobs, gen.finish_reason, version) == ([11, 12], [-0.5, -1.25], "stop", "3")


def test_a_reply_without_log_probs_is_an_error_naming_the_server():
    api = Recorded({"/generate": {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}}})
    with pytest.raises(ValueError, match="http://sglang:30000.*output_token_logprobs"):
        api.generate([1], SamplingParams(max_tokens=1))


def test_push_loads_from_disk_with_the_version_and_a_refusal_keeps_the_message():
    api = Recorded({"/update_weights_from_disk": {"success": True, "message": "Succeeded to update model weights."}})
    api.push("/weights/v3", 3)
    assert api.calls == [("POST", "/update_weights_from_disk", {"model_path": "/weights/v3", "weight_version": "3"})]
    api.replies["/update_weights_from_disk"] = {"success": False, "message": "Failed to get weights iterator"}
    with pytest.raises(PushRejected, match="Failed to get weights iterator"):
        api.push("/weights/v4", 4)


def test_model_info_names_the_served_model_and_its_weight_version():
    api = Recorded({"/get_model_info": {"model_path": "Qwen/Qwen2.5-0.5B", "tokenizer_path": "Qwen/Qwen2.5-0.5B",
                                        "is_generation": True, "weight_version": "7"}})
    assert api.served_model() == "Qwen/Qwen2.5-0.5B" and api.weight_version() == "7"


def test_a_reply_made_by_other_weights_than_confirmed_is_never_stamped():
    """SGLang names the weight version of each reply: the fleet checks it against the version it recorded at
    dispatch, and sends the request elsewhere rather than stamp a version the server did not use."""
    stale = Recorded({"/generate": generate_reply([[-0.1, 5, None]], version="2"),
                      "/update_weights_from_disk": {"success": True, "message": "ok"}})
    good = Recorded({"/generate": generate_reply([[-0.2, 6, None]], version="3"),
                     "/update_weights_from_disk": {"success": True, "message": "ok"}})
    fleet = ServerFleet([stale, good], FleetOptions(request_timeout_s=5, workers=2))
    try:
        fleet.load_weights("/weights/v3", 3)
        gens = fleet.generate([[1]] * 4, SamplingParams(max_tokens=1))
        assert [g.token_ids for g in gens] == [[6]] * 4 and all(g.versions == [3] for g in gens)
        assert fleet.servers[0].version == -1  # it must confirm again before it gets work
    finally:
        fleet.close()


def test_a_lora_version_is_an_adapter_of_its_own_name_that_each_request_names():
    """SGLang's /load_lora_adapter (success, error_message) and /unload_lora_adapter; /generate names the adapter in
    lora_path. Three are kept; a refusal says why and keeps what the server serves."""
    api = Recorded({"/load_lora_adapter": {"success": True, "error_message": ""},
                    "/unload_lora_adapter": {"success": True, "error_message": ""},
                    "/generate": generate_reply([[-0.5, 11, None]], version="0")})
    for version in range(4):
        api.push_adapter(f"/weights/v{version}", version)
    loads = [body for _, path, body in api.calls if path == "/load_lora_adapter"]
    assert loads == [{"lora_name": f"rlstream-v{v}", "lora_path": f"/weights/v{v}"} for v in range(4)]
    assert [body for _, path, body in api.calls if path == "/unload_lora_adapter"] == [{"lora_name": "rlstream-v0"}]
    gen, named = api.generate([1, 2], SamplingParams(max_tokens=1))
    assert api.calls[-1][2]["lora_path"] == "rlstream-v3" and gen.token_ids == [11]
    assert named is None  # weight_version names the base: no word on the adapter's version
    api.replies["/load_lora_adapter"] = {"success": False, "error_message": "LoRA is not enabled"}
    with pytest.raises(PushRejected, match="LoRA is not enabled"):
        api.push_adapter("/weights/v4", 4)
    api.generate([1, 2], SamplingParams(max_tokens=1))
    assert api.calls[-1][2]["lora_path"] == "rlstream-v3"
