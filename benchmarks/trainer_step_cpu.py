"""One trainer step on the CPU under each precision and thread setting, against float32 on one thread with the whole
vocabulary head (how the smollm2 recipe's trainer ran before 2026-12-05), in one run on the same batch.

    python -m benchmarks.trainer_step_cpu --model .rlstream/recipes/smollm2/model [--rows 32] [--rounds 3]
    python -m benchmarks.trainer_step_cpu --smoke      # the model built in code, 4 rows: does it still run

Each step is ``policy_update`` on a ``TorchEngine`` (decoupled PPO-clip, grad-norm clip, AdamW), what the trainer
service runs per version, on a batch shaped like the recipe's: ``--rows`` rows of a ``--prompt``-token prompt and a
response of ``--response`` tokens or fewer (lengths spread evenly down to half of it), right-padded, the loss mask
on the response. Settings, each a figure in seconds per step (median over ``--rounds``):

- ``fp32_whole_1t``: float32, one thread, the vocabulary head at every position (the baseline);
- ``fp32_1t``: the head only where a loss counts a token (``update.sequence_logprobs``, ``logits_to_keep``);
- ``bf16_1t``: and the forward under bf16 autocast (``--autocast bf16``; float32 master weights);
- ``bf16_all``: and every core (``--trainer-threads -1``);
- ``lora16_bf16_all``: as ``bf16_all``, a rank-16 LoRA adapter on every linear layer but the head (the recipe's
  ``--lora-rank 16``, PEFT's layers through ``trainer.lora.wrap``) trained on a copy of the model; its
  ``lora16_vs_full`` is ``bf16_all``'s seconds over its own (above 1: the adapter's step is faster).

Each round runs every setting once, the order rotating from round to round so that load falls on all alike; the
first round is a warm-up and not counted. Ratios are the baseline's seconds over each setting's (above 1: faster).
Whether bf16 is fast depends on the CPU: AVX512-BF16 or AMX do it in hardware, others emulate it (slower).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.record import record
from rlstream.models.resources import cpu_cores
from rlstream.trainer import update
from rlstream.trainer.engine import TorchEngine
from rlstream.trainer.lora import ALL_LINEAR, wrap
from rlstream.trainer.update import Batch, UpdateConfig, policy_update

#: name -> (threads: 1 or every core, autocast, the head only at counted positions, LoRA rank: 0 the whole model)
SETTINGS = {"fp32_whole_1t": (1, "off", False, 0), "fp32_1t": (1, "off", True, 0), "bf16_1t": (1, "bf16", True, 0),
            "bf16_all": (0, "bf16", True, 0), "lora16_bf16_all": (0, "bf16", True, 16)}


def batch_of(rows: int, prompt: int, response: int, vocab: int, seed: int) -> Batch:
    """Random tokens in the recipe's shape: a prompt, a response of ``response`` down to half of it, padding."""
    g = torch.Generator().manual_seed(seed)
    width = prompt + response
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    attn = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width)
    for r in range(rows):
        n = response - (response // 2) * r // max(1, rows - 1)
        attn[r, :prompt + n] = 1
        mask[r, prompt:prompt + n] = 1
    ids = ids * attn
    adv = torch.randn(rows, 1, generator=g).expand(rows, width).clone() * mask
    behaviour = -torch.rand(rows, width, generator=g) * mask
    return Batch(ids, attn, mask[:, 1:], behaviour[:, 1:], None, adv[:, 1:], torch.rand(rows, generator=g), 0.7)


def load_model(folder: str):
    if folder:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    from rlstream.models.tiny import build_model, build_tokenizer
    return build_model(build_tokenizer(), seed=0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a Hugging Face folder (default: the tiny model built in code)")
    p.add_argument("--rows", type=int, default=32, help="rows per step (the recipe's: 4 prompts x 8 samples)")
    p.add_argument("--prompt", type=int, default=60, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=96, help="most response tokens per row")
    p.add_argument("--rounds", type=int, default=3, help="counted rounds, each running every setting once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="4 rows of 8 + 8 tokens, 1 round, the tiny model")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.rows, args.prompt, args.response, args.rounds = "", 4, 8, 8, 1
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (build the smollm2 recipe's folder with "
                "python -m rlstream.recipes.smollm2.build --out DIR, or omit --model for the tiny model)")
    model = load_model(args.model)
    vocab = model.get_input_embeddings().num_embeddings
    batch = batch_of(args.rows, args.prompt, args.response, vocab, args.seed)
    # One model for the whole-model settings (they differ in how, not what); LoRA wraps a copy of it in place.
    lora = wrap(copy.deepcopy(model), 16, 16.0, 0.0, (ALL_LINEAR,))  # the trainer's default alpha and dropout
    engines = {name: TorchEngine(lora if rank else model, lr=1e-6, max_grad_norm=1.0, autocast_mode=autocast)
               for name, (_, autocast, _, rank) in SETTINGS.items()}
    keeps = update._takes_logits_to_keep
    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for round_ in range(args.rounds + 1):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            threads, _, head_at_counted, _ = SETTINGS[name]
            torch.set_num_threads(threads or cpu_cores())
            update._takes_logits_to_keep = keeps if head_at_counted else (lambda forward: False)
            started = time.perf_counter()
            policy_update(engines[name], batch, UpdateConfig())
            if round_:  # the first round warms every path up
                seconds[name].append(time.perf_counter() - started)
        update._takes_logits_to_keep = keeps
    base = statistics.median(seconds["fp32_whole_1t"])
    figures: dict[str, float] = {"rows": args.rows, "tokens": int(batch.attention_mask.sum()),
                                 "cores": cpu_cores()}
    for name, values in seconds.items():
        figures[f"{name}_s"] = round(statistics.median(values), 3)
        if name != "fp32_whole_1t":
            figures[f"{name}_ratio"] = round(base / statistics.median(values), 3)
    figures["lora16_vs_full"] = round(statistics.median(seconds["bf16_all"])
                                      / statistics.median(seconds["lora16_bf16_all"]), 3)
    print(json.dumps(figures), flush=True)
    record("trainer_step_cpu", figures, [], seed=args.seed)


if __name__ == "__main__":
    main()
