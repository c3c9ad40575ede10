"""GSM8K-style arithmetic word problems, generated from a seed.

Each problem is a ``question`` in words and an ``answer`` written the way GSM8K writes one: a worked line, then
``#### N`` (two lines for a two-step problem). The numbers are small (none above 20) and the operations few (add,
subtract, add-then-subtract), so a model of a few million parameters learns the format fast, and copying the
numbers and the arithmetic only in part: the gap that RL has to close.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Tom", "Ann", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe", "Leo", "Emma", "Jack", "Nina", "Omar", "Ivy",
         "Paul", "Rosa", "Dan", "Kate", "Raj", "Lena", "Carlos", "Grace", "Hugo", "Aisha", "Felix", "Yuki", "Noah",
         "Sofia", "Ethan", "Chloe", "Liam", "Maya", "Oscar", "Ruby", "Victor", "Hannah"]
OBJECTS = ["apples", "pears", "marbles", "stickers", "books", "pens", "cookies", "cards", "shells", "coins",
           "stamps", "balloons", "eggs", "toys", "flowers", "candies", "pencils", "oranges", "buttons", "cupcakes",
           "crayons", "rocks", "tickets", "bananas", "muffins", "beads", "puzzles", "kites"]
GAIN = ["buys", "finds", "gets", "picks", "wins", "receives", "collects", "bakes"]  # the count goes up
LOSS = ["gives away", "loses", "sells", "eats", "drops", "trades", "breaks", "donates"]  # ... and down

#: The largest operand of a sum, and of what is taken away; so no number in a problem is above 2 * MAX_OPERAND.
MAX_OPERAND = 10


@dataclass(frozen=True)
class Problem:
    """One word problem: its text and its GSM8K-style answer (``worked line(s)\\n#### N``)."""

    question: str
    answer: str

    @property
    def value(self) -> int:
        """The final answer, the number after ``####``."""
        return int(self.answer.rsplit("####", 1)[1])

    def row(self) -> dict[str, str]:
        """The JSONL row: exactly the ``question`` and ``answer`` columns."""
        return {"question": self.question, "answer": self.answer}


def _sum(rng: random.Random) -> tuple[int, int, int]:
    """Operands of 1..MAX_OPERAND whose sum is uniform over what they can reach.

    Uniform answers leave no number right much more often than another: a policy that learns to answer the most
    common number everywhere (a cheap local optimum RL finds) would score little.
    """
    total = rng.randint(2, 2 * MAX_OPERAND)
    a = rng.randint(max(1, total - MAX_OPERAND), min(MAX_OPERAND, total - 1))
    return a, total - a, total


def _add(rng: random.Random) -> Problem:
    name, obj, verb = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(GAIN)
    a, b, total = _sum(rng)
    question = f"{name} has {a} {obj} and {verb} {b} more. How many {obj} does {name} have now?"
    return Problem(question, f"{a} + {b} = {total}\n#### {total}")


def _together(rng: random.Random) -> Problem:
    first, second = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    a, b, total = _sum(rng)
    question = f"{first} has {a} {obj} and {second} has {b} {obj}. How many {obj} do they have together?"
    return Problem(question, f"{a} + {b} = {total}\n#### {total}")


def _subtract(rng: random.Random) -> Problem:
    name, obj, verb = rng.choice(NAMES), rng.choice(OBJECTS), rng.choice(LOSS)
    left, b = rng.randint(1, MAX_OPERAND), rng.randint(1, MAX_OPERAND)  # at least one left, uniformly
    a = left + b
    question = f"{name} has {a} {obj} and {verb} {b} of them. How many {obj} does {name} have left?"
    return Problem(question, f"{a} - {b} = {left}\n#### {left}")


def _two_step(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    gain, loss = rng.choice(GAIN), rng.choice(LOSS)
    a, b, total = _sum(rng)
    left = rng.randint(1, total - 1)
    c = total - left
    question = (f"{name} has {a} {obj}, {verb_phrase(gain, b)}, then {verb_phrase(loss, c)}. "
                f"How many {obj} does {name} have now?")
    return Problem(question, f"{a} + {b} = {total}\n{total} - {c} = {left}\n#### {left}")


def verb_phrase(verb: str, n: int) -> str:
    """``buys 3 more`` / ``gives away 3``: the count after the verb, with "more" when it adds."""
    return f"{verb} {n} more" if verb in GAIN else f"{verb} {n}"


#: Problem kinds and their weights: mostly one step, a few two-step ones for variety in difficulty.
KINDS: list[tuple[Callable[[random.Random], Problem], int]] = [(_add, 3), (_together, 2), (_subtract, 4),
                                                                 (_two_step, 1)]


def problems(rng: random.Random) -> Iterable[Problem]:
    """An endless stream of problems drawn from ``rng``."""
    makers = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    while True:
        yield rng.choices(makers, weights)[0](rng)


def split(seed: int, train_rows: int, test_rows: int) -> tuple[list[Problem], list[Problem]]:
    """``train_rows`` and ``test_rows`` distinct problems; no test question appears in train.

    The test set is drawn first and then train skips its questions, so the held-out set of a seed does not depend
    on how many train rows are asked for.
    """
    seen: set[str] = set()
    out: list[list[Problem]] = [[], []]
    stream = problems(random.Random(seed))
    for target, size in ((1, test_rows), (0, train_rows)):
        while len(out[target]) < size:
            p = next(stream)
            if p.question not in seen:
                seen.add(p.question)
                out[target].append(p)
    return out[0], out[1]


def write_jsonl(path: Path, rows: Iterable[Problem]) -> None:
    """One JSON object per line: the ``question`` and ``answer`` columns."""
    with path.open("w") as f:
        for p in rows:
            f.write(json.dumps(p.row()) + "\n")
