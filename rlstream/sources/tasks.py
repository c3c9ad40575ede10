"""Toy verifiable tasks with a fixed train / held-out split, and their exact-match verifier.

Every task yields `(task_id, prompt_text, answer, split)`. The held-out set is
drawn with its own fixed seed, so it never changes with the stream seed and
never appears in the training stream or the supervised warm-up.
"""

from __future__ import annotations

import itertools
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

HELDOUT_SEED = 20240601
HELDOUT_SIZE = 256
EOS_TEXT = "<eos>"
PAD_TEXT = "<pad>"

TaskItem = tuple[str, str, str, str]  # (task_id, prompt_text, answer, split)


def _reverse_pairs() -> list[tuple[str, str]]:
    return [(s + ">", s[::-1]) for s in ("".join(t) for t in itertools.product(string.ascii_lowercase, repeat=3))]


def _arithmetic_pairs() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10, 100) for b in range(10, 100)]


@dataclass
class TaskFamily:
    """A finite universe of (prompt, answer) pairs split once into train and held-out."""

    name: str
    build: Callable[[], list[tuple[str, str]]]
    max_new_tokens: int
    heldout_size: int = HELDOUT_SIZE
    _split: tuple[list[tuple[str, str]], list[tuple[str, str]]] | None = field(default=None, repr=False)

    def split(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Return (train pairs, held-out pairs); the same on every call and in every process."""
        if self._split is None:
            pairs = self.build()
            order = list(range(len(pairs)))
            random.Random(HELDOUT_SEED).shuffle(order)
            held = set(order[: self.heldout_size])
            train = [p for i, p in enumerate(pairs) if i not in held]
            heldout = [pairs[i] for i in sorted(held)]
            self._split = (train, heldout)
        return self._split

    def stream(self, seed: int = 0, split: str = "train", count: int | None = None) -> Iterator[TaskItem]:
        """Yield tasks: train is an endless seeded shuffle (epoch after epoch); heldout is the fixed set once."""
        train, heldout = self.split()
        if split == "heldout":
            items = heldout if count is None else heldout[:count]
            for i, (prompt, answer) in enumerate(items):
                yield f"{self.name}-heldout-{i:05d}", prompt, answer, "heldout"
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
        rng = random.Random(seed)
        produced = 0
        for epoch in itertools.count():
            order = list(range(len(train)))
            rng.shuffle(order)
            for j in order:
                if count is not None and produced >= count:
                    return
                prompt, answer = train[j]
                yield f"{self.name}-train-s{seed}-{produced:08d}", prompt, answer, "train"
                produced += 1

    def warmup_pairs(self, fraction: float, seed: int = 0) -> list[tuple[str, str]]:
        """A seeded subset of the training pairs (at least one) for supervised warm-up."""
        train, _ = self.split()
        n = max(1, round(fraction * len(train)))
        return random.Random(seed).sample(train, n)


TASKS: dict[str, TaskFamily] = {
    # 3 letters + <eos>; held-out reversals must be learnt as an algorithm, not looked up.
    "reverse": TaskFamily("reverse", _reverse_pairs, max_new_tokens=4),
    # Sums of two two-digit numbers: up to 3 digits + <eos>.
    "arithmetic": TaskFamily("arithmetic", _arithmetic_pairs, max_new_tokens=4),
}


def get_task(name: str) -> TaskFamily:
    """Look a task up in TASKS, with a clear error for unknown names."""
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None


def generate(name: str, seed: int = 0, split: str = "train", count: int | None = None) -> Iterator[TaskItem]:
    """Shorthand for `get_task(name).stream(seed, split, count)`."""
    return get_task(name).stream(seed=seed, split=split, count=count)


def clean_response(text: str) -> str:
    """Cut at the first <eos>, drop padding, strip whitespace."""
    return text.split(EOS_TEXT, 1)[0].replace(PAD_TEXT, "").strip()


def verify(task_name: str, response_text: str, answer: str) -> float:
    """Exact match of the cleaned response against the answer: 1.0 or 0.0."""
    get_task(task_name)
    return 1.0 if clean_response(response_text) == answer.strip() else 0.0
