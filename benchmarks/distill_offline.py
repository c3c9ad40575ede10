"""On-policy distillation in one process, without the bus: how many updates a fresh student needs to reach a held-out
target under each loss and its settings. A diagnosis of ``distill_vs_rl`` (which times the whole loop): here each
update samples from the student (``--lag`` versions old, as the async loop's η makes them), the teacher scores the
samples as the teacher stage does, and the trainer's own ``policy_update`` takes the step; held-out greedy accuracy is
measured every ``--eval-every`` updates. Only updates are counted, not seconds: the bus and the stage processes are
what ``distill_vs_rl`` measures.

    python -m benchmarks.distill_offline --teacher .rlstream/distill-teacher --runs opd:1e-4,opd:3e-4,rl:1e-4
        [--top-k 47] [--kl forward] [--lag 2] [--temperature 1.0] [--lr-warmup-steps 0] [--is-cap 5] [--target 0.5]
        [--max-updates 300] [--seed 0]

A run is ``LOSS:LR`` (``LOSS`` a trainer ``--loss``, ``rl`` for ppo); ``--top-k`` K > 0 gives the student the
teacher's top-K form (K = the vocabulary: the whole distribution, the exact KL).
"""
from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

import torch

from benchmarks.harness.loop import log
from benchmarks.harness.record import record
from benchmarks.harness.workloads import reverse_score
from rlstream.models.logprobs import token_logprobs, top_k
from rlstream.models.tiny import build_model, build_tokenizer
from rlstream.sources.tasks import get_task
from rlstream.trainer.advantages import compute_advantages
from rlstream.trainer.distill import DistillConfig
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.update import Batch, UpdateConfig, policy_update
from rlstream.trainer.warmup import greedy_exact_match, supervised_warmup


def sample_step(student, teacher, tok, pairs: list[tuple[str, str]], group: int, temperature: float, k: int):
    """One step's samples (``group`` per prompt) from ``student``, with their rewards and the teacher's scores, as
    a trainer Batch (advantages GRPO within each group; the teacher at the sampling temperature, as the stage)."""
    task = get_task("reverse")
    prompts = [p for p, _ in pairs for _ in range(group)]
    enc = tok(prompts, return_tensors="pt")  # the reverse task's prompts are all one length: no padding
    n = enc["input_ids"].shape[1]
    with torch.no_grad():
        out = student.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                               max_new_tokens=task.max_new_tokens, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)
    resp = out[:, n:]
    # Tokens up to and including the first <eos> are the student's; generate pads the rest.
    after_eos = (resp == tok.eos_token_id).long().cumsum(-1) - (resp == tok.eos_token_id).long()
    acted = (after_eos == 0).float()
    ids = torch.cat([enc["input_ids"], torch.where(acted.bool(), resp, tok.pad_token_id)], dim=1)
    attn = torch.cat([enc["attention_mask"], acted.long()], dim=1)
    mask = torch.cat([torch.zeros(len(prompts), n), acted], dim=1)[:, 1:]
    texts = tok.batch_decode(resp, skip_special_tokens=False)
    answers = [a for _, a in pairs for _ in range(group)]
    rewards = torch.tensor([reverse_score(t, a) for t, a in zip(texts, answers)])
    adv = torch.cat([compute_advantages("grpo", r[None])[0] for r in rewards.split(group)])
    with torch.no_grad():
        s_logits = student(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
        behaviour = token_logprobs(s_logits, ids[:, 1:]) * mask
        t_lp = token_logprobs(t_logits, ids[:, 1:]) * mask
        topk = top_k(t_logits, k) if k else (None, None)
    return Batch(ids, attn, mask, behaviour, t_lp, adv[:, None].expand_as(mask).clone(), rewards, temperature,
                 topk[0], topk[1])


def sampled_heldout(model, tok, temperature: float, group: int = 8) -> float:
    """Mean exact match of ``group`` samples per held-out prompt at ``temperature`` (what the loop's reward sees)."""
    _, heldout = get_task("reverse").split()
    batch = sample_step(model, model, tok, heldout, group, temperature, 0)
    return float(batch.rewards.mean())


def run_one(loss: str, lr: float, teacher, args) -> dict:
    """A fresh student (the demo's warm-up) trained by ``loss`` at ``lr``: its held-out curve over updates."""
    tok = build_tokenizer()
    student = build_model(tok, seed=0)
    supervised_warmup(student, tok, "reverse", fraction=0.005, steps=args.warmup_steps, seconds=None, seed=0)
    engine = TorchEngine(student, lr, 1.0, lr_warmup_steps=args.lr_warmup_steps)
    cfg = UpdateConfig(loss="ppo" if loss == "rl" else loss, is_cap=args.is_cap,
                       distill=DistillConfig(kl=args.kl))
    torch.manual_seed(args.seed)
    train, _ = get_task("reverse").split()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    pending: deque[Batch] = deque()
    curve, started, at = [], time.monotonic(), 0
    acc = greedy_exact_match(student, tok, "reverse")
    curve.append((0, acc))
    for update in range(1, args.max_updates + 1):
        # Each update draws a fresh step of prompts from the student as it is now, and trains on the step drawn
        # --lag updates ago (the async loop's staleness).
        while len(pending) <= args.lag:
            pairs = [train[order[(at + i) % len(order)]] for i in range(args.groups)]
            at += args.groups
            student.eval()
            pending.append(sample_step(student, teacher, tok, pairs, args.group_size, args.temperature,
                                       args.top_k if loss != "rl" else 0))
        stats = policy_update(engine, pending.popleft(), cfg)
        if update % args.eval_every == 0:
            acc = greedy_exact_match(student, tok, "reverse")
            curve.append((update, acc))
            kl = stats.get("opd_kl", float("nan"))
            log(f"{loss}:{lr:g}", f"u{update} held-out {acc:.3f} reward {stats['reward_mean']:.2f} kl {kl:.3f}")
            if acc >= args.target and args.stop_at_target:
                break
    reached = next((u for u, a in curve if a >= args.target), None)
    return {"curve": curve, "updates_to_target": reached, "best": max(a for _, a in curve),
            "seconds": time.monotonic() - started}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default=".rlstream/distill-teacher",
                    help="the teacher's model folder (distill_vs_rl saves one there); untrained: the tiny model as "
                         "built, for a smoke run")
    ap.add_argument("--warmup-steps", type=int, default=300, help="the students' supervised warm-up (the demo's)")
    ap.add_argument("--runs", default="opd:1e-4,rl:1e-4", help="LOSS:LR,... (LOSS: rl, opd, ppo+opd, ppo+opd-sum)")
    ap.add_argument("--top-k", type=int, default=0, help="the teacher's top-k form (0: the sampled token alone)")
    ap.add_argument("--kl", default="reverse", choices=("reverse", "forward", "mixed"))
    ap.add_argument("--lr-warmup-steps", type=int, default=0, help="the trainer's --lr-warmup-steps")
    ap.add_argument("--is-cap", type=float, default=5.0)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the student")
    ap.add_argument("--lag", type=int, default=0, help="versions between sampling a step and training on it")
    ap.add_argument("--groups", type=int, default=16, help="prompts a step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--max-updates", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM
    tok = build_tokenizer()
    if args.teacher == "untrained":
        teacher = build_model(tok, seed=1).eval()
    elif not (Path(args.teacher) / "config.json").exists():
        raise SystemExit(f"--teacher {args.teacher}: no model there; `python -m benchmarks.distill_vs_rl` trains and "
                         "saves one at .rlstream/distill-teacher")
    else:
        teacher = AutoModelForCausalLM.from_pretrained(Path(args.teacher), dtype=torch.float32).eval()
    log("teacher", f"held-out greedy {greedy_exact_match(teacher, tok, 'reverse'):.3f}, sampled at T "
                   f"{args.temperature}: {sampled_heldout(teacher, tok, args.temperature):.3f} (the student's ceiling)")
    out = {}
    for spec in args.runs.split(","):
        loss, lr = spec.split(":")
        r = run_one(loss, float(lr), teacher, args)
        out[spec] = r
        print(f"{spec:16s} top-k {args.top_k} {args.kl} lag {args.lag} T {args.temperature} lr warm-up "
              f"{args.lr_warmup_steps}: "
              + (f"{r['updates_to_target']} updates to {args.target}" if r["updates_to_target"] is not None
                 else f"not reached in {args.max_updates} (best {r['best']:.2f})")
              + f"  ({r['seconds']:.0f} s)  curve " + " ".join(f"{u}:{a:.2f}" for u, a in r["curve"]), flush=True)
    record("distill_offline", {s.replace(":", "_"): (r["updates_to_target"] if r["updates_to_target"] is not None
                                                      else "none") for s, r in out.items()}, seed=args.seed)
    return out


if __name__ == "__main__":
    main()
