"""The inference engines, one package that rollout, the gateway and the teacher use, behind one interface: token ids
in, sampled token ids, their log-probs and each token's policy version out.

- ``base``: the interface (``InferenceBackend``, ``Generation``).
- ``local``: engines in the rollout process (transformers, vLLM).
- ``servers``: one HTTP inference server (vLLM's OpenAI-compatible server, SGLang, a generic OpenAI endpoint): the
  request and response mapping, weight pushes, health and tokenizer checks.
- ``fleet``: many servers as one backend: pushes confirmed per server, least-loaded routing with episode affinity,
  health checks, failover.
- ``limits``: per-server rate limits for hosted endpoints.
- ``vllm_worker``: code run inside vLLM's worker (a tied output head refreshed after each reload).
- ``factory``: ``make_backend`` by name.
- ``settings``: the engine's knobs, declared once (``EngineSettings``, ``DeviceSettings``) and composed by rollout's,
  the gateway's and the teacher's settings; ``build_backend`` from them.
- ``follower``: ``PolicyFollower``, how every engine follows the policy (watch, first, prefetch, load, confirm,
  retry: one rule).
"""
from rlstream.engine.base import BetweenSteps, Generation, InferenceBackend
from rlstream.engine.factory import KINDS, make_backend, server_urls
from rlstream.engine.fleet import FleetOptions, NoServerAvailable, ServerFleet
from rlstream.engine.local import TransformersBackend, VLLMBackend

__all__ = ["BetweenSteps", "FleetOptions", "Generation", "InferenceBackend", "KINDS", "NoServerAvailable",
           "ServerFleet", "TransformersBackend", "VLLMBackend", "make_backend", "server_urls"]
