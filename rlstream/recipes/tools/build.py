"""Build the tools recipe's model: a small Qwen2 that can write a calculator call, and sometimes does.

    python -m rlstream.recipes.tools.build --out DIR [--seed S] [--tool-rate R] [--sft-steps N]

writes into DIR

- ``model/``: a Qwen2 checkpoint (float32 safetensors, untied embeddings) with a byte-level BPE tokenizer trained
  on the task's episodes (digits one per token, ``<|im_end|>`` ending each action), loadable by vLLM;
- ``summary.json``: what the summary line prints.

The task and its held-out set are rlstream's built-in ``calculator`` tool task (``--task calculator``: two-digit
products, the env evaluates ``calc(...)`` in the sandbox), so the loop needs no dataset file. Why a warm-up: the
tokenizer of the demo's tiny model cannot write ``calc(37*91)``, and RL cannot discover a tool call a policy never
makes. The warm-up is supervised on episodes of which only ``--tool-rate`` call the tool (the rest answer at once,
which the model cannot learn to do right), so the policy starts calling the tool sometimes but, greedy, mostly
guesses: the learning the loop has to do is to call the tool every time and carry its result into the answer.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlstream.recipes.arithmetic.build import non_negative, positive
from rlstream.recipes.arithmetic.model import ModelShape, build_model, count_parameters
from rlstream.recipes.arithmetic.tokenizer import train_tokenizer
from rlstream.recipes.tools import transcripts
from rlstream.recipes.tools.evaluate import evaluate
from rlstream.recipes.tools.warmup import sft
from rlstream.sources.tool_tasks import get_task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlstream.recipes.tools.build",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", type=Path, required=True, help="folder to write model/ into")
    p.add_argument("--seed", type=int, default=0, help="seed of the warm-up's data, weights and batches")
    p.add_argument("--tool-rate", type=float, default=0.3,
                   help="share of warm-up episodes that call the tool (default 0.3)")
    p.add_argument("--sft-steps", type=non_negative, default=600, help="supervised warm-up steps (default 600)")
    p.add_argument("--batch-size", type=positive(int), default=32, help="warm-up batch size (default 32)")
    p.add_argument("--lr", type=positive(float), default=1e-3, help="warm-up learning rate (default 1e-3)")
    p.add_argument("--vocab-size", type=positive(int), default=320, help="BPE vocabulary size (default 320)")
    p.add_argument("--hidden", type=positive(int), default=128, help="model width (default 128)")
    p.add_argument("--layers", type=positive(int), default=4, help="model depth (default 4)")
    p.add_argument("--check-rows", type=positive(int), default=64, help="held-out problems the build checks")
    p.add_argument("--samples", type=positive(int), default=2, help="temperature-1 samples per checked problem")
    p.add_argument("--threads", type=positive(int), default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: exists and is not a folder")
    if not 0 < args.tool_rate <= 1:
        p.error(f"--tool-rate must be in (0, 1], got {args.tool_rate}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    train_pairs, heldout_pairs = get_task("calculator").split()
    train = [transcripts.Problem(q, a) for q, a in train_pairs]
    heldout = [transcripts.Problem(q, a) for q, a in heldout_pairs]
    rng = random.Random(args.seed)
    episodes = [(p, transcripts.tool_turns(p) if rng.random() < args.tool_rate else transcripts.direct_turns(p))
                for p in train]

    tokenizer = train_tokenizer([transcripts.text(p, turns) for p, turns in episodes] +
                                [transcripts.text(p, transcripts.tool_turns(p)) for p in train[:500]],
                                vocab_size=args.vocab_size)
    shape = ModelShape(hidden=args.hidden, layers=args.layers, intermediate=3 * args.hidden)
    model = build_model(tokenizer, shape, seed=args.seed)
    examples = [transcripts.encode(tokenizer, p, turns) for p, turns in episodes]
    sft_seconds = sft(model, examples, tokenizer.pad_token_id, args.sft_steps, batch_size=args.batch_size,
                      lr=args.lr, seed=args.seed)

    folder = args.out / "model"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    loaded_tok = AutoTokenizer.from_pretrained(folder)
    for p, turns in episodes[:50]:  # the loop's tokenizer (vLLM's, AutoTokenizer) must split as the warm-up did
        assert transcripts.encode(loaded_tok, p, turns) == transcripts.encode(tokenizer, p, turns), p

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    check = evaluate(loaded, loaded_tok, heldout[:args.check_rows], samples=args.samples, seed=args.seed)
    summary = {"parameters": count_parameters(loaded), "vocab": len(tokenizer), "tool_rate": args.tool_rate,
               "sft_steps": args.sft_steps, "sft_seconds": round(sft_seconds, 1), **check.as_dict(),
               "seconds": round(time.perf_counter() - started, 1), "seed": args.seed}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{folder}: {summary['parameters'] / 1e6:.2f} M parameters, vocab {summary['vocab']}, {args.sft_steps} "
          f"SFT steps in {sft_seconds:.0f} s; held-out ({len(heldout[:args.check_rows])}): {check}; "
          f"built in {summary['seconds']:.0f} s")
    return summary


if __name__ == "__main__":
    main()
