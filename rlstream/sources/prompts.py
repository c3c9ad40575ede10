"""Prompt sources: built-in verifiable task generators and JSONL files, produced to ``prompts``.

``rlstream prompts --run R --task reverse --count 1000`` writes tasks once;
``--paced`` keeps writing while following the trainer, never more than
(version + η + 1) steps of groups ahead, so nothing generated goes stale
(AReaL's capacity rule, applied at the source so any number of rollout workers obey it).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rlstream.config import KafkaSettings, LoopSettings, add_arguments, knob, load
from rlstream.errors import UsageError
from rlstream.kafka.records import TypedProducer
from rlstream.kafka.topics import topic_name
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import SamplingParams, Task

log = logging.getLogger(__name__)

#: Task name -> environment that steps it.
ENV_OF = {"reverse": "single", "arithmetic": "single", "calculator": "calculator"}


@dataclass(frozen=True)
class PromptSettings:
    """Knobs of a prompt source."""

    ROLE: ClassVar[str] = "PROMPTS"

    task: str = knob("reverse", "Built-in task (reverse, arithmetic, calculator) or a .jsonl file of "
                                "{task_id, prompt, answer} lines")
    count: int = knob(100, "Training tasks to produce (0 with --paced: until stopped)")
    split: str = knob("train", "train or heldout", choices=("train", "heldout"))
    temperature: float = knob(1.0, "Sampling temperature of training tasks (held-out ones are greedy)")
    max_tokens: int = knob(0, "Most new tokens per turn (0: the task's own limit)")
    seed: int = knob(0, "Seed of the training-task shuffle")
    paced: bool = knob(False, "Follow the trainer: stay at most (version + eta + 1) steps of groups ahead")
    heldout_every: int = knob(0, "With --paced: produce the held-out set after every N policy versions (0: never)")
    heldout_count: int = knob(64, "Held-out tasks per evaluation round")


def task_items(name: str, split: str, seed: int) -> tuple[Iterator[tuple[str, str, str | None, str]], int]:
    """(task_id, prompt, answer, split) items of a built-in task or a JSONL file, and its max new tokens."""
    if name.endswith(".jsonl"):
        path = Path(name)
        if not path.exists():
            raise ValueError(f"--task {name}: no such file")

        def lines():
            for n, line in enumerate(path.read_text().splitlines()):
                if line.strip():
                    row = json.loads(line)
                    yield str(row.get("task_id", f"{path.stem}-{n}")), row["prompt"], row.get("answer"), \
                        row.get("split", split)
        return lines(), 16
    if name == "calculator":
        from rlstream.sources import tool_tasks
        return tool_tasks.generate(name, seed=seed, split=split), tool_tasks.get_task(name).max_new_tokens
    from rlstream.sources import tasks
    try:
        task = tasks.get_task(name)
    except KeyError as exc:
        raise ValueError(str(exc).strip('"')) from None
    return task.stream(seed=seed, split=split), task.max_new_tokens


def make_task(task_name: str, item: tuple, group_size: int, sampling: SamplingParams, prefix: str = "") -> Task:
    """The Task record of one generated item."""
    task_id, prompt, answer, split = item
    return Task(task_id=prefix + task_id, group_id=prefix + task_id, task_name=task_name,
                env_name=ENV_OF.get(task_name, "single"), env_version="1", prompt=prompt, sampling=sampling,
                created_at=hdr.now_ms(), answer=answer, group_size=group_size, split=split,
                max_turns=4 if ENV_OF.get(task_name) == "calculator" else 1, trace_id=hdr.new_traceparent())


class PromptProducer:
    """Writes Task records with their headers (policy_version -1: no policy has touched them yet)."""

    def __init__(self, kafka: KafkaSettings):
        self.out = TypedProducer(kafka)

    def send(self, task: Task) -> None:
        self.out.send("prompts", task.task_id, task, -1, task.trace_id)

    def flush(self, timeout: float = 60.0) -> None:
        self.out.flush(timeout)


def produce(kafka: KafkaSettings, s: PromptSettings, loop: LoopSettings = LoopSettings(),
            stop=lambda: False) -> int:
    """Produce tasks per the settings; returns how many were written."""
    items, max_new = task_items(s.task, s.split, s.seed)
    name = Path(s.task).stem if s.task.endswith(".jsonl") else s.task
    out = PromptProducer(kafka)
    greedy = SamplingParams(temperature=0.0, max_tokens=s.max_tokens or max_new)
    sampled = SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens or max_new)
    if s.split == "heldout":
        n = 0
        for item in itertools.islice(items, s.count or None):
            out.send(make_task(name, item, 1, greedy))
            n += 1
        out.flush()
        return n
    if not s.paced:
        n = 0
        for item in itertools.islice(items, s.count):
            out.send(make_task(name, item, loop.group_size, sampled))
            n += 1
        out.flush()
        return n
    return _produce_paced(kafka, s, loop, name, items, out, sampled, greedy, stop)


def _produce_paced(kafka, s: PromptSettings, loop: LoopSettings, name, items, out: PromptProducer, sampled, greedy,
                   stop) -> int:
    from rlstream.policy.watcher import PolicyWatcher
    watcher = PolicyWatcher(kafka.client_config(), kafka.run, loop.policy)
    n, evaluated, round_ = 0, -1, 0
    try:
        while not stop() and (s.count == 0 or n < s.count):
            version = max(watcher.version, 0)
            if s.heldout_every and version >= evaluated + s.heldout_every and watcher.version >= 0:
                # Each round gets its own ids so the archive keeps every evaluation.
                held, _ = task_items(name, "heldout", 0)
                for item in itertools.islice(held, s.heldout_count):
                    out.send(make_task(name, item, 1, greedy, prefix=f"v{version}-r{round_}-"))
                evaluated, round_ = version, round_ + 1
            allowed = (version + loop.eta + 1) * loop.groups_per_step
            if n < allowed:
                for item in itertools.islice(items, allowed - n):
                    out.send(make_task(name, item, loop.group_size, sampled))
                    n += 1
                out.flush(10)
            else:
                watcher.wait_for(version + 1, 0.5)
        out.flush()
        return n
    finally:
        watcher.close()


def cmd_prompts(args: argparse.Namespace) -> None:
    kafka, s, loop = load(KafkaSettings, args), load(PromptSettings, args), load(LoopSettings, args)
    try:
        n = produce(kafka, s, loop)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"produced {n} {s.split} tasks of {s.task} to {topic_name(kafka.run, 'prompts')}")


def add_command(sub) -> None:
    """Register ``rlstream prompts``."""
    p = sub.add_parser("prompts", help="produce tasks to the run's prompts topic")
    add_arguments(p, LoopSettings)
    add_arguments(p, KafkaSettings)
    add_arguments(p, PromptSettings)
    p.set_defaults(func=cmd_prompts)
