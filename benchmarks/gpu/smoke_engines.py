"""The smoke run's inference-engine checks (``benchmarks/gpu/smoke.py``): each engine's behaviour log-probs against
the trainer's, for the version it holds, after every kind of load: the transformers engine, in-process vLLM (with a
swap mid-generation; a tied model through the load probe) and vLLM's OpenAI server (a pushed version, confirmed by ``/weight_info``)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.gpu.smoke_parts import need, prompts_of, reference, save, trainer_logprobs, versions, worst

def compare(args, tied: bool, state: dict, prompts, gens, tol: float, label: str, figures: dict) -> None:
    """Each generation's log-probs against the trainer's for the version in ``state``."""
    model = reference(args, tied, state)
    if not gens or any(not g.token_ids or len(g.logprobs) != len(g.token_ids) for g in gens):
        raise AssertionError(f"{label}: a generation without tokens, or without a log-prob for each")
    diffs = [worst(zip(g.logprobs, trainer_logprobs(model, args.device, p, g.token_ids)))
             for p, g in zip(prompts, gens)]
    figures[f"{label}_max_dlogprob"] = max(diffs)
    figures[f"{label}_tokens"] = sum(len(g.token_ids) for g in gens)
    if max(diffs) > tol:
        raise AssertionError(f"{label}: behaviour log-probs differ from the trainer's by up to {max(diffs):.4g} "
                             f"(tolerance {tol})")


def behaviour_check(args, work: Path, tied: bool) -> dict:
    from rlstream.engine.local import TransformersBackend
    from rlstream.schemas.records import SamplingParams
    states = versions(args, tied, 3)
    root = work / ("tied" if tied else "untied")
    folders = [save(reference(args, tied, s), root / f"v{i}") for i, s in enumerate(states)]
    backend = TransformersBackend(folders[0], device=str(args.device))
    backend.version = 0
    prompts, params, figures, tol = prompts_of(4), SamplingParams(temperature=1.0, max_tokens=8, seed=1), {}, 2e-3
    compare(args, tied, states[0], prompts, backend.generate(prompts, params), tol, "v0", figures)
    backend.load_weights(folders[1], 1)
    compare(args, tied, states[1], prompts, backend.generate(prompts, params), tol, "v1_folder", figures)
    backend.load_tensors({k: v.to(args.device) for k, v in states[2].items()}, 2)
    compare(args, tied, states[2], prompts, backend.generate(prompts, params), tol, "v2_tensors", figures)
    _versions_differ(args, tied, states, prompts, figures)
    return figures


def _versions_differ(args, tied, states, prompts, figures) -> None:
    """The versions' log-probs differ from each other by far more than the tolerance: a stale load would fail."""
    toks = [4, 5, 6, 7, 8]
    lps = [trainer_logprobs(reference(args, tied, s), args.device, prompts[0], toks) for s in states]
    figures["between_versions_min_dlogprob"] = gap = min(worst(zip(a, b)) for a, b in zip(lps, lps[1:]))
    if gap < 0.05:
        raise AssertionError(f"consecutive versions' log-probs differ by only {gap:.3g}: the check cannot tell them "
                             "apart")


def vllm_check(args, work: Path) -> dict:
    need("vllm")
    from rlstream.engine.local import VLLMBackend
    from rlstream.schemas.records import SamplingParams
    states = versions(args, False, 4)
    folders = [save(reference(args, False, s), work / "vllm" / f"v{i}") for i, s in enumerate(states)]
    backend = VLLMBackend(folders[0], max_model_len=256, gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        backend.version = 0
        prompts, params, figures, tol = prompts_of(4), SamplingParams(temperature=1.0, max_tokens=8, seed=1), {}, 2e-3
        compare(args, False, states[0], prompts, backend.generate(prompts, params), tol, "v0", figures)
        backend.load_weights(folders[1], 1)
        compare(args, False, states[1], prompts, backend.generate(prompts, params), tol, "v1_folder", figures)
        if not backend.loads_tensors:
            raise AssertionError("in-process vLLM does not take tensors (VLLM_ENABLE_V1_MULTIPROCESSING is not 0)")
        backend.load_tensors(dict(states[2]), 2)
        compare(args, False, states[2], prompts, backend.generate(prompts, params), tol, "v2_tensors", figures)
        _versions_differ(args, False, states, prompts, figures)
        figures.update(_swap(args, backend, folders[3], states, prompts * 2, tol))
    finally:
        backend.close()
    return figures


def vllm_tied_check(args, work: Path) -> dict:
    """A tied Qwen2 on in-process vLLM: after loading v1 from its folder and v2 from tensors, the engine's answer to
    the load probe is the trainer's for that version within the probe's own tolerance (``policy.probe.check``),
    and so are the log-probs of what it samples. The stale head this catches (vLLM keeping the head it packed at
    start-up) is what ``engine.vllm_worker.refresh_tied_head`` repairs after each reload."""
    need("vllm")
    from rlstream.engine.local import VLLMBackend
    from rlstream.policy.probe import allowed, check, gap, trainer_probe
    from rlstream.schemas.records import SamplingParams
    states = versions(args, True, 3)
    folders = [save(reference(args, True, s), work / "vllm-tied" / f"v{i}") for i, s in enumerate(states)]
    probes = [trainer_probe(reference(args, True, s).to(args.device)) for s in states]
    ids = probes[0][0]
    figures: dict = {"probe_tokens": len(ids)}
    # A stale head serves the previous version's head: the check tells versions apart only if the probe does.
    figures["between_versions_min_probe_gap"] = spread = min(gap(a[1], b[1]) for a, b in zip(probes, probes[1:]))
    backend = VLLMBackend(folders[0], max_model_len=256, gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        if not backend.tied:
            raise AssertionError("VLLMBackend does not see the model as tied: the head refresh would not run")
        if not backend.loads_tensors:
            raise AssertionError("in-process vLLM does not take tensors (VLLM_ENABLE_V1_MULTIPROCESSING is not 0)")
        backend.version = 0
        prompts, params = prompts_of(4), SamplingParams(temperature=1.0, max_tokens=8, seed=1)
        loads = {"v0": None, "v1_folder": lambda: backend.load_weights(folders[1], 1),
                 # As the folder holds it: the tied tensor once, no lm_head.weight to overwrite a stale head with.
                 "v2_tensors": lambda: backend.load_tensors({k: v for k, v in states[2].items()
                                                            if k != "lm_head.weight"}, 2)}
        for version, (label, load) in enumerate(loads.items()):
            if load is not None:
                load()
            expected = probes[version][1]
            got = backend.probe_logprobs(ids)
            figures[f"{label}_probe_gap"] = gap(expected, got)
            figures[f"{label}_probe_allowed"] = limit = allowed(expected, backend.probe_precise)
            if spread <= limit:
                raise AssertionError(f"consecutive versions' probes differ by only {spread:.3g} nats a token, within "
                                     f"the probe's tolerance {limit:.3g}: a stale head would pass")
            check(version, "vllm", expected, got, backend.probe_precise)  # ProbeMismatch: this check's FAIL
            compare(args, True, states[version], prompts, backend.generate(prompts, params), 2e-3, label, figures)
        figures["max_probe_gap"] = max(figures[f"{label}_probe_gap"] for label in loads)
    finally:
        backend.close()
    return figures


def _swap(args, backend, folder: Path, states, prompts, tol: float) -> dict:
    """v3 loaded after the engine's 3rd step of a generation on v2: sequences in flight get two segments."""
    from rlstream.schemas.records import SamplingParams
    seen = []

    def between_steps():
        seen.append(backend.version)
        if len(seen) == 3:
            backend.load_weights(folder, 3)

    gens = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=3), between_steps)
    models = {v: reference(args, False, states[v]) for v in (2, 3)}
    spanned, dmax = 0, 0.0
    for p, g in zip(prompts, gens):
        segments = [v for i, v in enumerate(g.versions) if i == 0 or g.versions[i - 1] != v]
        if segments not in ([2], [3], [2, 3]):
            raise AssertionError(f"a generation's version segments are {segments}, expected [2, 3] or one of them")
        refs = {v: trainer_logprobs(m, args.device, p, g.token_ids) for v, m in models.items()}
        dmax = max([dmax] + [abs(lp - refs[v][i]) for i, (v, lp) in enumerate(zip(g.versions, g.logprobs))])
        if segments == [2, 3]:
            spanned += 1
            if sorted(g.version_started_at) != [2, 3]:
                raise AssertionError(f"two segments but started-at stamps for {sorted(g.version_started_at)}")
    if dmax > tol:
        raise AssertionError(f"mid-generation swap: a token's log-prob differs by {dmax:.4g} from its version's")
    if not spanned:
        raise AssertionError("no generation was in flight across the swap")
    return {"swap_spanned": spanned, "swap_generations": len(gens), "swap_max_dlogprob": dmax}


def start_server(args, folder: Path, log: Path):
    """vLLM's OpenAI server on ``folder`` with its weight routes (dev mode), started now and waited for later."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from rlstream.trainer.distributed import free_port
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "256", "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    if args.device.type == "cuda":
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    else:
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def server_check(args, server, states) -> dict:
    need("vllm")
    if server is None:
        raise AssertionError("the vLLM server was not started")
    from rlstream.engine.servers import VLLMServerAPI
    from rlstream.schemas.records import SamplingParams
    proc, url, log = server
    deadline = time.monotonic() + args.server_timeout
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-600:].replace("\n", " | ")
                raise AssertionError(f"the vLLM server did not come up (exit {proc.poll()}): {tail}")
            time.sleep(1)
    api = VLLMServerAPI(url, "")
    api.model = api.model_id()
    figures = {}
    for version in (1, 2):
        started = time.perf_counter()
        api.push(args.server_folders[version], version)
        figures[f"v{version}_push_s"] = round(time.perf_counter() - started, 3)
        served = api.weight_version()
        figures[f"v{version}_weight_info"] = served
        if served != str(version):
            raise AssertionError(f"/weight_info says {served!r} after pushing v{version}")
        prompts = prompts_of(3, seed=version)
        gens = [api.generate(p, SamplingParams(temperature=1.0, max_tokens=8, seed=version))[0] for p in prompts]
        compare(args, False, states[version], prompts, gens, 2e-3, f"v{version}", figures)
    return figures
