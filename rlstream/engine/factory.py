"""Building a backend by name: an engine in this process, or a fleet of servers checked before first use."""
from __future__ import annotations

import logging
from pathlib import Path

from rlstream.errors import UserError
from rlstream.engine.base import InferenceBackend
from rlstream.engine.fleet import FleetOptions, ServerFleet
from rlstream.engine.servers import APIS, TOKENIZER_PROBE, ServerError

log = logging.getLogger(__name__)

LOCAL = ("auto", "transformers", "vllm")
#: ``auto`` on a machine without CUDA: below this many parameters plain transformers beats in-process vLLM. vLLM's
#: engine step (scheduler, KV-cache bookkeeping, sampler) costs a fixed few ms of CPU whatever the model; under a
#: ~0.5 M-parameter model that was twice the forward itself (0.115 against 0.053 CPU-s a version on the demo task,
#: benchmarks/loop_cost.py --modes fast,fast-transformers), and the fixed cost stops mattering long before 10 M.
SMALL_MODEL_PARAMETERS = 10_000_000
SERVERS = tuple(APIS)
KINDS = LOCAL + SERVERS


def server_urls(urls: tuple[str, ...] | list[str] = (), urls_file: str = "") -> list[str]:
    """The servers named by repeated --engine-url (each may hold several, comma-separated) and by a file listing one
    URL per line (blank lines and ``#`` comments skipped); duplicates once, in order."""
    found = [u.strip() for item in urls for u in item.split(",") if u.strip()]
    if urls_file:
        try:
            lines = Path(urls_file).read_text().splitlines()
        except OSError as exc:
            raise UserError(f"--engine-urls-file {urls_file}: {exc.strerror or exc}") from None
        found += [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]
    for url in found:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"inference server URL {url!r} must start with http:// or https://")
    return list(dict.fromkeys(found))


def make_backend(kind: str, folder: Path, threads: int = 1, urls: tuple[str, ...] | list[str] = (), model: str = "",
                 version: int = -1, dtype: str = "auto", max_context: int = 0, fleet: FleetOptions | None = None,
                 tokenizer=None, api_key: str = "", push_timeout_s: float = 600.0, device: str = "auto",
                 gpu_memory_utilization: float = 0.9, enforce_eager: str = "auto",
                 attn_implementation: str = "auto", lora_serving: str = "auto") -> InferenceBackend:
    """Build a backend by name, holding policy ``version`` (the weights in ``folder``) in ``dtype`` with a context of
    ``max_context`` tokens (0: the model's own); ``auto`` is vLLM when importable, else transformers. ``device``
    places an in-process engine (auto: CUDA when present; vLLM takes the first GPU it sees, ``check_vllm_device``);
    ``gpu_memory_utilization`` is the share of a GPU's memory in-process vLLM may take (weights and KV cache; its CPU
    build sizes the cache by VLLM_CPU_KVCACHE_SPACE); ``enforce_eager`` its CUDA graphs (``resolve_enforce_eager``);
    ``attn_implementation`` the transformers engine's attention (``models.loading.resolve_attention``);
    ``lora_serving`` how an in-process engine serves a LoRA run (vLLM: ``engine.local.resolve_lora_serving``; the
    transformers engine merges unless asked for adapter). ``threads``
    0 follows the machine (``models.devices.resolve_threads``).

    A server kind (``vllm-server``, ``sglang``, ``openai``) gets a fleet of ``urls``: each must answer, and its
    tokenizer must be the policy's (``tokenizer``, checked on a probe text where the server can tokenize); servers
    that take weights are pushed ``folder`` as ``version`` and must confirm it. ``openai`` keeps ``version`` pinned.
    """
    if kind in SERVERS:
        return start_fleet(kind, folder, list(urls), model, version, fleet or FleetOptions(), tokenizer, api_key,
                           push_timeout_s)
    from rlstream.models.devices import resolve_threads
    backend = _make_local(kind, folder, resolve_threads(threads), dtype, max_context, device, gpu_memory_utilization,
                          enforce_eager, attn_implementation, lora_serving)
    backend.version = version
    return backend


def _make_local(kind: str, folder: Path, threads: int, dtype: str, max_context: int, device: str = "auto",
                gpu_memory_utilization: float = 0.9, enforce_eager: str = "auto",
                attn_implementation: str = "auto", lora_serving: str = "auto") -> InferenceBackend:
    from rlstream.engine.local import TransformersBackend, VLLMBackend
    from rlstream.models.devices import resolve_device
    if kind == "auto":
        kind = auto_kind(folder, device)
    if kind == "transformers":
        from rlstream.models.loading import flash_attn_installed, resolve_attention
        place = resolve_device(device)
        attention = resolve_attention(attn_implementation, place.type, place.type == "cuda" and flash_attn_installed())
        return TransformersBackend(folder, threads=threads, dtype=dtype, device=str(place),
                                   attn_implementation=attention, lora_serving=lora_serving)
    if kind == "vllm":
        from rlstream.models.devices import check_vllm_device
        check_vllm_device(device)
        import torch
        cuda = device != "cpu" and torch.cuda.is_available()
        return VLLMBackend(folder, threads=threads, max_model_len=max_context, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization,
                           enforce_eager=resolve_enforce_eager(enforce_eager, cuda), lora_serving=lora_serving)
    raise ValueError(f"unknown backend {kind!r}; use one of {', '.join(KINDS)}")


#: ``--enforce-eager`` values.
ENFORCE_EAGER = ("auto", "on", "off")


def resolve_enforce_eager(knob: str, cuda: bool) -> bool:
    """Whether in-process vLLM runs eager: ``auto`` is off on CUDA (CUDA graphs capture the decode steps: the
    speed vLLM is there for) and on for the CPU (its CPU build has no graphs to capture, and the eager path is
    the one every test here runs). Not run on a GPU in this project: CUDA graphs have not been exercised."""
    if knob not in ENFORCE_EAGER:
        raise UserError(f"--enforce-eager {knob!r}: expected one of {', '.join(ENFORCE_EAGER)}")
    return knob == "on" or (knob == "auto" and not cuda)


def auto_kind(folder: Path, device: str = "auto") -> str:
    """What ``--backend auto`` runs: vLLM when importable, except for a small model on a machine without CUDA (see
    ``SMALL_MODEL_PARAMETERS``); transformers when vLLM is absent or broken. Says which, and why, in the log."""
    import torch
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    size = parameter_count(folder)
    if on_cpu and size is not None and size < SMALL_MODEL_PARAMETERS:
        log.info("backend auto: transformers (a %.2f M-parameter model on the CPU runs faster without vLLM's engine; "
                 "--backend vllm to use it anyway)", size / 1e6)
        return "transformers"
    try:
        import vllm  # noqa: F401
        return "vllm"
    except Exception as exc:  # absent, or a broken install: fall back, and say so
        log.info("vLLM unavailable (%s); using the transformers backend", exc)
        return "transformers"


def parameter_count(folder: Path) -> int | None:
    """Parameters in a checkpoint folder's safetensors files, from their headers (nothing loaded); None if it has
    none (a hub name, .bin weights)."""
    from safetensors import safe_open
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                n = 1
                for dim in f.get_slice(name).get_shape():
                    n *= dim
                total += n
    return total


def start_fleet(kind: str, folder: Path, urls: list[str], model: str, version: int, options: FleetOptions,
                tokenizer=None, api_key: str = "", push_timeout_s: float = 600.0) -> ServerFleet:
    """Check every server, push the first version to those that take weights, and start health checks."""
    if not urls:
        raise UserError(f"--backend {kind} needs at least one --engine-url (or --engine-urls-file)")
    apis = [APIS[kind](url, model, timeout_s=options.request_timeout_s,
                       push_timeout_s=push_timeout_s, api_key=api_key) for url in urls]
    for api in apis:
        _check_server(api, folder, tokenizer)
    fleet = ServerFleet(apis, options, pinned_version=version)
    if fleet.follows_policy:
        try:
            fleet.load_weights(folder, version)
        except OSError as exc:
            fleet.close()
            raise UserError(f"no inference server loaded the first policy version v{version}: {exc}") from None
    fleet.start_health_checks()
    return fleet


def _check_server(api, folder: Path, tokenizer) -> None:
    """An unreachable server, or one whose tokenizer is not the policy's, is refused by name."""
    try:
        served = api.served_model()
    except ServerError as exc:
        raise UserError(f"inference server {api.url} is unreachable or failing ({exc}); check --engine-url "
                        "and that the server is up") from None
    if not api.model:  # --engine-model not given: the name the server serves its model under
        api.model = api.model_id()
    if tokenizer is None:
        return
    policy_name = getattr(tokenizer, "name_or_path", "") or str(folder)
    try:
        theirs = api.tokenize(TOKENIZER_PROBE)
    except ServerError as exc:
        raise UserError(f"inference server {api.url} failed to tokenize a probe text: {exc}") from None
    if theirs is None:
        log.warning("%s has no /tokenize route: cannot check that %s uses the policy's tokenizer (%s)",
                    api.url, served, policy_name)
        return
    ours = list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    if theirs != ours:
        raise UserError(f"inference server {api.url} serves {served}, whose tokenizer does not match the policy's "
                        f"tokenizer {policy_name} (the probe text tokenizes to {theirs[:8]}... there, "
                        f"{ours[:8]}... here); serve the policy's model, or point --engine-url elsewhere")
