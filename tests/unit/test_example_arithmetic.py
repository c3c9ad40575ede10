"""The arithmetic recipe's cheap parts: its problems are right and deterministic, held-out and train are disjoint,
and its tokenizer survives the save_pretrained round trip with digits one per token and a working chat template."""
from __future__ import annotations

import re

from examples.arithmetic import data
from examples.arithmetic.build import chat_text
from examples.arithmetic.evaluate import math_reward
from examples.arithmetic.tokenizer import chat_prompt, check_round_trip, train_tokenizer


def test_every_answer_is_the_arithmetic_of_its_worked_lines():
    train, test = data.split(0, 500, 50)
    for p in train + test:
        *lines, final = p.answer.split("\n")
        assert final == f"#### {p.value}"
        for line in lines:  # "a + b = c" or "a - b = c"
            a, op, b, eq, c = line.split()
            assert eq == "=" and int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)), line
        assert int(lines[-1].split()[-1]) == p.value
        assert math_reward(p.answer, p.answer) == 1.0


def test_problems_are_seeded_and_held_out_ones_never_train():
    train, test = data.split(3, 400, 40)
    assert (train, test) == data.split(3, 400, 40)
    assert data.split(4, 400, 40) != (train, test)
    assert not {p.question for p in train} & {p.question for p in test}
    assert data.split(3, 100, 40)[1] == test  # the held-out set does not depend on how much train is asked for


def test_tokenizer_round_trip_digits_and_chat_template(tmp_path):
    train, test = data.split(0, 300, 10)
    tok = train_tokenizer((chat_text(p) for p in train), vocab_size=400)
    tok.save_pretrained(tmp_path)
    check_round_trip(tok, tmp_path, [chat_text(p) for p in test])  # raises on any difference
    text = tok.decode(chat_prompt(tok, "Tom has 12 apples."))
    assert text == "<|im_start|>user\nTom has 12 apples.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    digits = tok.convert_ids_to_tokens(tok("1234")["input_ids"])
    assert [t for t in digits if re.search(r"\d", t)] == ["1", "2", "3", "4"]
