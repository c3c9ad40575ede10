"""The engine's knobs, declared once and composed by each role that runs an engine.

- ``DeviceSettings``: what any in-process engine takes (threads, dtype, device, attention, GPU memory share) and how
  it follows the policy (``wait_policy_s``, ``retry_load_s``). The teacher's settings extend it.
- ``EngineSettings``: those, plus the inference backend and its server fleet. Rollout's and the gateway's settings
  extend it, and ``build_backend`` makes the backend from it.

Each field is a flag of the role that composes it, read from that role's variable (``RLSTREAM_ROLLOUT_THREADS``,
``RLSTREAM_GATEWAY_THREADS``, ``RLSTREAM_TEACHER_THREADS``: ``rlstream.config``), so no two roles' names collide.
No torch here: the command line imports this to parse flags.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlstream.config import knob
from rlstream.engine.factory import KINDS, SERVERS, make_backend, server_urls
from rlstream.engine.fleet import FleetOptions
from rlstream.models.loading import ATTENTION

DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class DeviceSettings:
    """Where an in-process engine runs, and how it follows the policy."""

    threads: int = knob(0, "Torch / engine threads for this process (0: OMP_NUM_THREADS when set, as the demo's "
                           "placement sets it, else this process's cores; small machines: give each stage a budget)")
    dtype: str = knob("auto", "Engine dtype: auto (the checkpoint's own), bf16, fp16, fp32", choices=DTYPES)
    device: str = knob("auto", "In-process engine: auto (CUDA when present, else the CPU), cpu, cuda or cuda:N "
                               "(in-process vLLM takes the first visible GPU: place it with CUDA_VISIBLE_DEVICES)")
    attn_implementation: str = knob("auto", "Transformers engine's attention: auto (transformers' choice, sdpa), "
                                            "sdpa, flash_attention_2, eager", choices=ATTENTION)
    gpu_memory_utilization: float = knob(0.9, "In-process vLLM on a GPU: the share of the GPU's memory it may take for "
                                               "weights and KV cache (lower it to share the GPU with a trainer)")
    wait_policy_s: float = knob(600.0, "How long to wait at start for the first announced policy version")
    retry_load_s: float = knob(1.0, "After a failed load of a version, wait this long before trying it again (a "
                                    "newer announced version is tried at once)")

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1], a share "
                             "of the GPU's memory")


@dataclass(frozen=True)
class EngineSettings(DeviceSettings):
    """An inference engine: in this process, or a fleet of servers each version is pushed to."""

    backend: str = knob("auto", "Inference engine: auto (vLLM if installed, else transformers; transformers for a "
                                "model under 10 M parameters on the CPU), transformers, vllm (in this process); "
                                "vllm-server, sglang (servers rlstream pushes each version to), openai (any "
                                "OpenAI-compatible endpoint; serving only, version pinned)", choices=KINDS)
    engine_url: tuple[str, ...] = knob((), "Base URL of an inference server (server backends); repeat the flag, or "
                                           "comma-separate, for several")
    engine_urls_file: str = knob("", "File listing inference server URLs, one per line (# comments)")
    engine_model: str = knob("", "Model name to send to the servers (default: the name each server lists first)")
    request_timeout_s: float = knob(300.0, "Server backends: most seconds a request may take, waiting included")
    request_retries: int = knob(3, "Server backends: times a request is re-sent to another server after a "
                                   "server-side failure")
    push_timeout_s: float = knob(600.0, "Server backends: most seconds a server may take to load a version")
    retry_push_s: float = knob(10.0, "Server backends: a server that failed to load the current version is pushed it "
                                     "again after this long")
    health_interval_s: float = knob(2.0, "Server backends: seconds between health checks of each server")
    max_concurrency: int = knob(0, "Server backends: most requests in flight per server (0: unlimited)")
    requests_per_min: float = knob(0.0, "Server backends: most requests per minute per server (0: unlimited)")
    tokens_per_min: float = knob(0.0, "Server backends: most prompt + completion tokens per minute per server "
                                      "(0: unlimited)")
    hedge: bool = knob(False, "Backends vllm-server and sglang: a server left idle before its batch ends also takes "
                              "the batch's unfinished requests from the others; the first reply is kept, the other "
                              "cancelled, both sampled with one seed")
    max_context: int = knob(0, "Longest prompt + response the engine takes, in tokens (0: the model's "
                               "max_position_embeddings)")
    enforce_eager: str = knob("auto", "In-process vLLM: on (no CUDA graphs), off, or auto (off on CUDA: graphs "
                                      "capture the decode steps; on for the CPU)", choices=("auto", "on", "off"))
    lora_serving: str = knob("auto", "In-process engines, a LoRA run's versions: adapter (vLLM's LoRA slots, a "
                                     "LoRARequest per version; in the transformers engine PEFT's LoRA layers, a "
                                     "load moving the adapter alone), merged (each version's adapter merged into "
                                     "the base's weights and loaded in place: the base's generation speed, a merge "
                                     "per version), or auto (vLLM: merged on the CPU, adapter on a GPU; "
                                     "transformers: merged)",
                             choices=("auto", "adapter", "merged"))

    @property
    def remote(self) -> bool:
        """A fleet of servers rather than an engine in this process."""
        return self.backend in SERVERS

    def urls(self) -> tuple[str, ...]:
        return server_urls(self.engine_url, self.engine_urls_file)


def build_backend(s: EngineSettings, folder: Path, version: int, max_context: int, tokenizer=None,
                  api_key_env: str = ""):
    """The backend ``s`` names, holding ``version`` (the weights in ``folder``); a fleet's servers are checked
    against ``tokenizer`` and pushed the version. ``api_key_env``: the variable holding a hosted endpoint's key
    (never a flag: it would show in process listings)."""
    options = FleetOptions(request_timeout_s=s.request_timeout_s, retries=s.request_retries,
                           health_interval_s=s.health_interval_s, retry_push_s=s.retry_push_s,
                           concurrency=s.max_concurrency, requests_per_min=s.requests_per_min,
                           tokens_per_min=s.tokens_per_min, hedge=s.hedge)
    return make_backend(s.backend, folder, threads=s.threads, urls=s.urls(), model=s.engine_model, version=version,
                        dtype=s.dtype, max_context=max_context, fleet=options, tokenizer=tokenizer,
                        push_timeout_s=s.push_timeout_s, api_key=os.environ.get(api_key_env, "") if api_key_env else "",
                        device=s.device, gpu_memory_utilization=s.gpu_memory_utilization,
                        enforce_eager=s.enforce_eager, attn_implementation=s.attn_implementation,
                        lora_serving=s.lora_serving)
