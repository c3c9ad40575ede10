"""The arithmetic recipe's cheap parts (rlstream/recipes/arithmetic): the problem generator, and a tiny build's tokenizer,
chat template and model folder. The warm-up itself and its accuracy are measured by running build.py, not here."""
from __future__ import annotations

import json
import re

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from rlstream.recipes.arithmetic import build, data
from rlstream.recipes.arithmetic.evaluate import math_reward


def worked_value(answer: str) -> int:
    """Check every worked line's arithmetic and return the last line's result."""
    *lines, final = answer.split("\n")
    assert final.startswith("#### ") and lines
    result = None
    for line in lines:
        left, right = line.split(" = ")
        a, op, b = left.split(" ")
        assert result is None or int(a) == result, f"{answer!r}: a step does not start from the last result"
        result = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert int(right) == result, f"{answer!r}: {line} is wrong"
    return result


def test_problems_are_deterministic_and_correct():
    train, test = data.split(7, 2000, 100)
    assert (train, test) == data.split(7, 2000, 100)
    assert data.split(8, 2000, 100)[1] != test
    for p in train + test:
        assert worked_value(p.answer) == p.value > 0
        assert all(0 < int(n) <= 2 * data.MAX_OPERAND for n in re.findall(r"\d+", p.question))
        assert math_reward(p.answer, p.answer) == 1.0  # the gold answer passes the loop's verifier
    # Every kind is drawn; the answers are spread, with no number a free win.
    assert any("\n" in p.answer.split("####")[0].strip() for p in train)
    values = [p.value for p in train]
    assert max(values.count(v) for v in set(values)) / len(values) < 0.1


def test_held_out_questions_are_not_in_train_and_do_not_depend_on_its_size():
    train, test = data.split(0, 3000, 200)
    assert len({p.question for p in train}) == 3000 and len({p.question for p in test}) == 200
    assert not {p.question for p in train} & {p.question for p in test}
    assert data.split(0, 500, 200)[1] == test


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """build.py on 200 train rows, no warm-up."""
    out = tmp_path_factory.mktemp("arith")
    summary = build.main(["--out", str(out), "--train-rows", "200", "--test-rows", "8", "--sft-steps", "0",
                          "--samples", "1", "--vocab-size", "400"])
    return out, summary


def test_tiny_build_writes_the_dataset_and_summary(tiny_build):
    out, summary = tiny_build
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and all(set(r) == {"question", "answer"} for r in rows)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert 5_000_000 <= summary["parameters"] <= 30_000_000
    assert summary["sft_steps"] == 0 and 0.0 <= summary["greedy_accuracy"] <= 1.0


def test_tiny_build_model_folder_round_trips(tiny_build):
    out, summary = tiny_build
    folder = out / "model"
    tok = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "qwen2" and config.tie_word_embeddings is False
    assert config.max_position_embeddings >= 512 and config.vocab_size == len(tok) == summary["vocab"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert GenerationConfig.from_pretrained(folder).eos_token_id == tok.eos_token_id
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 15 more. How many apples does Tom have now?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tok(text)["input_ids"] and ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    # Digits one token each, wherever they are.
    pieces = tok.convert_ids_to_tokens(tok("12 + 305 = 317\n#### 317")["input_ids"])
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12305317317")
