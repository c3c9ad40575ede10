"""Trainer tokens/s on the recipe's model against a plain torch training loop on the same batches, in one run.

    python -m benchmarks.trainer_tokens [--steps 20] [--groups-per-step 8] [--model DIR] [--threads 1] [--seed 0]
    python -m benchmarks.trainer_tokens --smoke        # 2 small steps, well under 20 s: does it still run

- rlstream: per step what the trainer service's ``_step`` does before it publishes: ``build_batch(groups, "grpo",
  pad_id)`` from the ScoredTrajectory records, then ``policy_update`` on a ``TorchEngine`` with ``UpdateConfig()``
  (decoupled PPO-clip, truncated importance weight, grad-norm clip 1.0, AdamW lr 1e-4). build_batch is on the clock.
- plain: the textbook loop on the same padded tokens, prepared off the clock (``pad_sequence`` and the GRPO
  advantages of each group): forward, ``log_softmax`` + ``gather`` of the targets, the same clipped PPO objective
  written inline (token mean over the loss mask), backward, ``clip_grad_norm_``, AdamW step, ``loss.item()``.
- Both start from the same weights (a deepcopy) with the same optimizer settings and see the same seeded steps. Each
  step runs both sides back to back, the order alternating (AB, BA, ...), so machine load falls on both alike; the
  first --warmup steps are not counted. A per-step ratio is plain's time / rlstream's (rlstream tokens/s over
  plain's); the spread is over those pairs. The same ratio of process CPU time is printed too: with one torch
  thread it is the work each side did, which another job's load on the cores inflates less than wall time.
- Tokens: non-pad tokens of the batch (prompt + response); trained tokens: the loss mask's.
- Per-version checkpoint cost (the trainer's ``_publish``, which a per-step figure of the service includes and this
  loop does not): ``save_pretrained`` + tokenizer + ``torch.save`` of the AdamW state through the weight store
  (the tiny char tokenizer stands in for the model built in code), timed apart after the loop. Not timed: the
  Kafka transaction that announces the version.

The model: ``--model DIR`` (a Hugging Face folder), else a Qwen2ForCausalLM of the recipe's size built in code
(hidden 256, 4 layers, 4 heads, 2 kv heads, intermediate 1024, vocab 2048, untied, float32: ~5.0 M parameters).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from benchmarks.harness.record import Goal, record
from benchmarks.harness.result import commit
from rlstream.policy.weights import WeightStore
from rlstream.schemas.records import Reward, SamplingParams, ScoredTrajectory, Task, Trajectory
from rlstream.trainer import shards
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.update import UpdateConfig, build_batch, policy_update

LR = 1e-4  # TrainerSettings.lr
GROUP_SIZE = 8


# -- model and batches -------------------------------------------------------------------------------------------

def make_model(model_dir: str | None, seed: int):
    """(model, tokenizer or None, pad_id): the folder's model, else the recipe-sized Qwen2 built from ``seed``."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = None
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except Exception:  # a folder with weights only: the checkpoint cost then leaves the tokenizer out
            pass
        pad = model.config.pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
        return model, tokenizer, int(pad if pad is not None else 0)
    config = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         use_sliding_window=False, dtype="float32")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), None, 0


def make_steps(n_steps: int, groups_per_step: int, vocab: int, pad_id: int, seed: int,
               prompt_len=(30, 60), response_len=(8, 64)) -> list[list[list[ScoredTrajectory]]]:
    """Seeded steps of complete groups: one prompt per group, G responses of random ids and lengths, 0/1 rewards."""
    rng = random.Random(seed)
    ids = [i for i in range(3, vocab) if i != pad_id]  # no pad, bos or eos inside a sequence
    steps = []
    for s in range(n_steps):
        groups = []
        for g in range(groups_per_step):
            gid = f"s{s}g{g}"
            task = Task(task_id=gid, group_id=gid, task_name="bench", env_name="single", env_version="1",
                        prompt="", sampling=SamplingParams(temperature=1.0), created_at=0, group_size=GROUP_SIZE,
                        prompt_token_ids=[1] + rng.choices(ids, k=rng.randint(*prompt_len) - 1))
            group = []
            for i in range(GROUP_SIZE):
                n = rng.randint(*response_len)
                traj = Trajectory(trajectory_id=f"{gid}:{i}", group_id=gid, sample_index=i, task=task, response="",
                                  min_policy_version=0, max_policy_version=0,
                                  token_ids=rng.choices(ids, k=n - 1) + [2], loss_mask=[1] * n,
                                  # near a random model's -ln(vocab), so the importance weights stay near 1
                                  behaviour_logprobs=[-rng.uniform(6.5, 8.5) for _ in range(n)])
                group.append(ScoredTrajectory(traj, Reward(float(rng.random() < 0.5), "bench")))
            groups.append(group)
        steps.append(groups)
    return steps


# -- the plain loop ----------------------------------------------------------------------------------------------

def collate(groups: list[list[ScoredTrajectory]], pad_id: int) -> dict[str, torch.Tensor]:
    """The textbook collate of one step (off the clock): right-padded rows, shifted masks, GRPO advantages."""
    rows = [s for g in groups for s in g]
    seq = [torch.tensor(s.trajectory.task.prompt_token_ids + s.trajectory.token_ids) for s in rows]
    prompt = [len(s.trajectory.task.prompt_token_ids) for s in rows]
    ids = pad_sequence(seq, batch_first=True, padding_value=pad_id)
    attn = pad_sequence([torch.ones(len(x), dtype=torch.long) for x in seq], batch_first=True)
    mask = pad_sequence([torch.tensor([0.0] * p + [float(m) for m in s.trajectory.loss_mask])
                         for p, s in zip(prompt, rows)], batch_first=True)
    behaviour = pad_sequence([torch.tensor([0.0] * p + s.trajectory.behaviour_logprobs)
                              for p, s in zip(prompt, rows)], batch_first=True)
    r = torch.tensor([[s.reward.total for s in g] for g in groups])
    adv = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, unbiased=False, keepdim=True) + 1e-6)).flatten()
    return {"input_ids": ids, "attention_mask": attn, "mask": mask[:, 1:], "behaviour": behaviour[:, 1:],
            "advantages": adv}


def plain_step(model, optimizer, b: dict[str, torch.Tensor], cfg: UpdateConfig) -> float:
    """One textbook step: forward, log-probs of the targets, PPO-clip with the truncated IS weight, AdamW."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    mask, adv = b["mask"], b["advantages"][:, None]
    old = logp.detach()  # one update per batch: the proximal policy is this forward's
    weight = torch.exp((old - b["behaviour"]) * mask).clamp(max=cfg.is_cap)
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    loss = -(weight * surrogate * mask).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return loss.item()


# -- the checkpoint the trainer writes per version ---------------------------------------------------------------

def checkpoint_cost(model, tokenizer, engine: TorchEngine, repeats: int) -> list[float]:
    """Seconds per version of what ``TrainerService._publish`` writes through the weight store (config +
    safetensors, the tokenizer when there is one, the AdamW state, consumed_ahead.json), on the store's disk."""
    Path(".rlstream").mkdir(exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=".rlstream")
    store = WeightStore(root)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        shards.save(engine, str(folder / shards.FOLDER), "none", 1)  # the AdamW state, through DCP
        (folder / "consumed_ahead.json").write_text("[]")

    times = []
    try:
        for v in range(repeats):
            t0 = time.perf_counter()
            store.put("bench", v, write)
            times.append(time.perf_counter() - t0)
            store.prune("bench", keep_from=v - 2, keep={0})  # as the trainer does with eta 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times


# -- the run -----------------------------------------------------------------------------------------------------

def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps (each side runs every one)")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and not counted")
    p.add_argument("--groups-per-step", type=int, default=8, help=f"groups of {GROUP_SIZE} per step (4-16)")
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the recipe-sized Qwen2 in code)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's default is 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoints", type=int, default=5, help="versions written to time the checkpoint (0: skip)")
    p.add_argument("--smoke", action="store_true", help="2 steps of 2 groups, 1 warm-up: a quick does-it-run")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup, args.groups_per_step, args.checkpoints = 2, 1, 2, 1
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # save_pretrained's shard bar, once per timed checkpoint

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model, tokenizer, pad_id = make_model(args.model, args.seed)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    steps = make_steps(args.warmup + args.steps, args.groups_per_step, vocab, pad_id, args.seed)
    cfg = UpdateConfig()

    rl_model = copy.deepcopy(model)
    engine = TorchEngine(rl_model, lr=LR, max_grad_norm=cfg.max_grad_norm)
    plain_model = copy.deepcopy(model)
    plain_model.train()
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=LR, weight_decay=0.0)
    del model
    plain_batches = [collate(groups, pad_id) for groups in steps]

    print(f"trainer_tokens: {args.model or 'Qwen2 in code'}, {params / 1e6:.2f} M parameters, vocab {vocab}; "
          f"{args.groups_per_step} groups x {GROUP_SIZE} per step, {args.warmup} warm-up + {args.steps} timed steps; "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average "
          f"{'/'.join(f'{x:.2f}' for x in load_start)} at start", flush=True)

    rl_t, plain_t, rl_cpu, plain_cpu, build_t, toks, trained, first_losses = [], [], [], [], [], [], [], None
    for k, groups in enumerate(steps):
        pb = plain_batches[k]

        def rl_side():
            t0, c0 = time.perf_counter(), time.process_time()
            batch = build_batch(groups, "grpo", pad_id)
            t1 = time.perf_counter()
            stats = policy_update(engine, batch, cfg)
            return time.perf_counter() - t0, t1 - t0, stats["loss"], batch, time.process_time() - c0

        def plain_side():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = plain_step(plain_model, plain_opt, pb, cfg)
            return time.perf_counter() - t0, loss, time.process_time() - c0

        if k % 2 == 0:
            rl, pl = rl_side(), plain_side()
        else:
            pl, rl = plain_side(), rl_side()
        batch = rl[3]
        if k == 0:
            # Same weights, same tokens: the two sides must compute the same loss, or they are not doing the same work.
            assert torch.equal(batch.input_ids, pb["input_ids"]), "the two sides were fed different tokens"
            first_losses = (rl[2], pl[1])
        if k < args.warmup:
            continue
        rl_t.append(rl[0])
        build_t.append(rl[1])
        plain_t.append(pl[0])
        rl_cpu.append(rl[4])
        plain_cpu.append(pl[2])
        toks.append(int(batch.attention_mask.sum()))
        trained.append(int(batch.loss_mask.sum()))
    load_end = os.getloadavg()

    if tokenizer is None and not args.model:
        from rlstream.models.tiny import build_tokenizer
        tokenizer = build_tokenizer()  # a stand-in: the model in code has none, and the trainer writes one each version
    ckpt = checkpoint_cost(rl_model, tokenizer, engine, args.checkpoints) if args.checkpoints > 0 else []
    with torch.no_grad():
        max_diff = max(float((a - b).abs().max()) for a, b in zip(rl_model.parameters(), plain_model.parameters()))

    n_tok, n_trained = sum(toks), sum(trained)
    rl_tps, plain_tps = n_tok / sum(rl_t), n_tok / sum(plain_t)
    ratios = [pt / rt for pt, rt in zip(plain_t, rl_t)]
    med = statistics.median(ratios)
    q1, q3 = quartiles(ratios)
    cpu_ratio = sum(plain_cpu) / sum(rl_cpu)
    cpu_ratios = [pc / rc for pc, rc in zip(plain_cpu, rl_cpu)]
    cq1, cq3 = quartiles(cpu_ratios)
    ckpt_s = statistics.median(ckpt) if ckpt else float("nan")
    step_s = statistics.median(rl_t)
    today = datetime.date.today().isoformat()
    rev = commit()
    loads = "/".join(f"{x:.2f}" for x in load_start) + " -> " + "/".join(f"{x:.2f}" for x in load_end)

    print(f"  batch: {n_tok / len(toks):.0f} tokens a step ({n_trained / len(toks):.0f} trained), "
          f"{args.groups_per_step * GROUP_SIZE} rows; first-step loss rlstream {first_losses[0]:.6f} "
          f"plain {first_losses[1]:.6f}; max |weight difference| after {len(steps)} steps {max_diff:.2e}")
    print(f"  rlstream {rl_tps:9.0f} tokens/s ({n_trained / sum(rl_t):7.0f} trained/s), "
          f"{1e3 * step_s:6.1f} ms a step (median), of which build_batch {1e3 * statistics.median(build_t):.1f} ms")
    print(f"  plain    {plain_tps:9.0f} tokens/s ({n_trained / sum(plain_t):7.0f} trained/s), "
          f"{1e3 * statistics.median(plain_t):6.1f} ms a step (median)")
    if ckpt:
        print(f"  per-version checkpoint (save_pretrained, tokenizer, optimizer state through the weight store): "
              f"{1e3 * ckpt_s:.1f} ms median of {len(ckpt)} ({1e3 * min(ckpt):.1f}-{1e3 * max(ckpt):.1f}), "
              f"{100 * ckpt_s / step_s:.0f} % of a step on top")
    print(f"trainer_tokens {today} commit {rev} load {loads} threads {torch.get_num_threads()}: "
          f"rlstream {rl_tps:.0f} tokens/s, plain torch {plain_tps:.0f} tokens/s, "
          f"ratio {rl_tps / plain_tps:.3f} (per-step median {med:.3f}, IQR {q1:.3f}-{q3:.3f}, "
          f"min-max {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs; goal >= 0.95); "
          f"CPU-time ratio {cpu_ratio:.3f} (IQR {cq1:.3f}-{cq3:.3f}); "
          f"per-version checkpoint cost {1e3 * ckpt_s:.1f} ms", flush=True)
    record("trainer_tokens", dict(steps=args.steps, rlstream_tokens_per_s=rl_tps, plain_tokens_per_s=plain_tps,
                                  ratio=rl_tps / plain_tps, ratio_median=med, cpu_ratio=cpu_ratio,
                                  checkpoint_ms=1e3 * ckpt_s), [Goal("ratio", ">=", 0.95)], seed=args.seed)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": today, "commit": rev, "load_start": load_start, "load_end": load_end,
            "threads": torch.get_num_threads(), "model": args.model or "qwen2-in-code", "parameters": params,
            "groups_per_step": args.groups_per_step, "steps": args.steps, "warmup": args.warmup,
            "tokens": n_tok, "trained_tokens": n_trained, "rlstream_tokens_per_s": rl_tps,
            "plain_tokens_per_s": plain_tps, "ratio": rl_tps / plain_tps, "ratio_median": med,
            "ratio_iqr": [q1, q3], "ratio_min": min(ratios), "ratio_max": max(ratios), "cpu_ratio": cpu_ratio,
            "cpu_ratio_iqr": [cq1, cq3], "rlstream_step_s": rl_t, "plain_step_s": plain_t,
            "rlstream_cpu_s": rl_cpu, "plain_cpu_s": plain_cpu, "build_batch_s": build_t,
            "checkpoint_s": ckpt, "first_losses": first_losses, "max_weight_diff": max_diff}, indent=1))


if __name__ == "__main__":
    main()
