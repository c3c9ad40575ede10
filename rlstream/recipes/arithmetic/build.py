"""Build the arithmetic recipe's inputs: a dataset of GSM8K-style word problems and a small chat model that half
knows how to solve them.

    python -m rlstream.recipes.arithmetic.build --out DIR [--seed S]

writes into DIR

- ``train.jsonl``, ``test.jsonl``: ``question`` / ``answer`` rows, the answer a worked line and ``#### N``; no test
  question is in train;
- ``model/``: a Qwen2 checkpoint (float32 safetensors, untied embeddings) with a byte-level BPE tokenizer trained
  on the generated text and a ChatML chat template, loadable by transformers' Auto classes and by vLLM;
- ``summary.json``: what the summary line prints.

Why: RL needs a policy that is right some of the time, so that a group of samples holds both rewards. A model hub
checkpoint is out of reach here, so the script stands in for "the instruct model a user brings": it trains the
tokenizer and a short supervised warm-up (a fixed number of steps, so a seed gives the same model everywhere), then
measures held-out accuracy of the saved folder with rlstream's ``math`` verifier, greedy and at temperature 1.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlstream.recipes.arithmetic import data
from rlstream.recipes.arithmetic.evaluate import accuracy
from rlstream.recipes.arithmetic.model import ModelShape, build_model, count_parameters, encode_examples, sft
from rlstream.recipes.arithmetic.tokenizer import check_round_trip, train_tokenizer


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above zero."""
    def parse(raw: str):
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {raw}")
        return value
    return parse


def non_negative(raw: str) -> int:
    """An argparse type: a whole number, 0 allowed."""
    if not raw.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number of 0 or more, got {raw!r}")
    return int(raw)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlstream.recipes.arithmetic.build",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", type=Path, required=True, help="folder to write the dataset and model/ into")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems, the initial weights and the warm-up")
    p.add_argument("--train-rows", type=positive(int), default=20_000, help="train problems (default 20000)")
    p.add_argument("--test-rows", type=positive(int), default=200, help="held-out problems (default 200)")
    p.add_argument("--vocab-size", type=positive(int), default=1024, help="BPE vocabulary size (default 1024)")
    p.add_argument("--sft-steps", type=non_negative, default=200,
                   help="supervised warm-up steps; 0 saves the untrained model (default 200)")
    p.add_argument("--batch-size", type=positive(int), default=16, help="warm-up batch size (default 16)")
    p.add_argument("--lr", type=positive(float), default=1e-3, help="warm-up peak learning rate (default 1e-3)")
    p.add_argument("--final-lr", type=float, default=1.0,
                   help="warm-up learning rate at the end, as a fraction of --lr (default 1: no decay; a decayed "
                        "model's extra accuracy is lost to RL's first updates)")
    p.add_argument("--samples", type=positive(int), default=8,
                   help="temperature-1 samples per held-out problem for the sampled accuracy (default 8)")
    p.add_argument("--threads", type=positive(int), default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: exists and is not a folder")
    if not 0 < args.final_lr <= 1:
        p.error(f"--final-lr must be in (0, 1], got {args.final_lr}")
    return args


def chat_text(problem: data.Problem) -> str:
    """A problem as the model sees it in training, for the tokenizer to learn its merges from."""
    return f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n{problem.answer}<|im_end|>\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    train, test = data.split(args.seed, args.train_rows, args.test_rows)
    data.write_jsonl(out / "train.jsonl", train)
    data.write_jsonl(out / "test.jsonl", test)

    tokenizer = train_tokenizer((chat_text(p) for p in train), vocab_size=args.vocab_size)
    model = build_model(tokenizer, ModelShape(), seed=args.seed)
    sft_seconds = sft(model, encode_examples(tokenizer, train), tokenizer.pad_token_id, args.sft_steps,
                      batch_size=args.batch_size, lr=args.lr, final_lr=args.final_lr, seed=args.seed)

    folder = out / "model"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    check_round_trip(tokenizer, folder, [chat_text(p) for p in test])

    # Measure the saved folder, as the loop will load it, not the model in memory.
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    acc = accuracy(loaded, AutoTokenizer.from_pretrained(folder), test, samples=args.samples, seed=args.seed)
    summary = {
        "parameters": count_parameters(loaded), "vocab": len(tokenizer), "train_rows": len(train),
        "test_rows": len(test), "sft_steps": args.sft_steps, "sft_seconds": round(sft_seconds, 1),
        "greedy_accuracy": acc.greedy, "sampled_accuracy": acc.sampled, "samples": acc.samples,
        "mixed_groups": acc.mixed_groups, "seconds": round(time.perf_counter() - started, 1), "seed": args.seed,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{folder}: {summary['parameters'] / 1e6:.2f} M parameters, vocab {summary['vocab']}, "
          f"{args.sft_steps} SFT steps in {sft_seconds:.0f} s; held-out ({len(test)}): {acc}; "
          f"built in {summary['seconds']:.0f} s")
    return summary


if __name__ == "__main__":
    main()
