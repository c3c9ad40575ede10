"""Prompt sources: built-in verifiable task generators, JSONL files and the user's datasets, produced to ``prompts``.

``rlstream prompts --run R --task reverse --count 1000`` writes tasks once;
``--paced`` keeps writing while following the trainer, never more than
(version + η + 1) steps of groups ahead, so nothing generated goes stale
(AReaL's capacity rule, applied at the source so any number of rollout workers obey it).

``rlstream prompts --dataset PATH`` writes a dataset's rows (``rlstream.sources.dataset``) exactly once per epoch:
in transactions, resuming after the last committed row when restarted (``rlstream.sources.exactly_once``).
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
from rlstream.kafka.topics import topic_name, wait_for_broker
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import SamplingParams, Task, prompt_topic
from rlstream.sources.dataset import Columns, DatasetSource, Item, clean_id
from rlstream.sources.dataset import load as load_dataset
from rlstream.sources.dataset import parse_column_list, source_id
from rlstream.sources.exactly_once import ExactlyOnceWriter, Out

log = logging.getLogger(__name__)

#: Task name -> environment that steps it.
ENV_OF = {"reverse": "single", "arithmetic": "single", "calculator": "calculator"}

#: Most new tokens per turn of a dataset's tasks unless --max-tokens says otherwise.
DATASET_TOKENS = 256


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
    dataset: str = knob("", "Training prompts from a dataset instead of --task: a .jsonl/.json, .parquet or .csv file "
                            "or a folder written by save_to_disk; each row once per epoch, resumable (--count unused)")
    eval_dataset: str = knob("", "Held-out prompts from a dataset (formats as --dataset), greedy, one sample each: "
                                 "written once before training, or with --paced --heldout-every N once per round")
    prompt_column: str = knob("prompt", "Dataset column of the prompt text")
    messages_column: str = knob("", "Dataset column of chat messages (a list of {role, content}) to use instead of "
                                    "--prompt-column; kept as JSON in the Task's metadata['messages']")
    chat: bool = knob(False, "Make each --prompt-column prompt a user message, so the rollout applies the model's "
                             "chat template (implied by --messages-column)")
    system_prompt: str = knob("", "With --chat or --messages-column: a system message put before each conversation "
                                  "that has none")
    answer_column: str = knob("answer", "Dataset column of the answer or reference ('' for none)")
    metadata_columns: str = knob("", "Dataset columns copied into the Task's metadata, comma-separated")
    id_column: str = knob("", "Dataset column of a task id (default: the source id and the row index)")
    epochs: int = knob(1, "Passes over --dataset")
    shuffle_seed: int = knob(-1, "Seed of each epoch's shuffle of --dataset (-1: the dataset's order)")
    source_id: str = knob("", "Identity of the dataset source, whose position a restart resumes from (default: "
                              "the dataset's name and a hash of its path, split, seed and columns); a source given one resumes "
                              "correctly only with the same dataset, seed and columns")
    batch_rows: int = knob(256, "Dataset rows per transaction")
    batch_pause: float = knob(0.0, "Seconds each dataset transaction waits before its commit (a gentle rate)")


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
        self.out.send(prompt_topic(task), task.task_id, task, -1, task.trace_id)

    def flush(self, timeout: float = 60.0) -> None:
        self.out.flush(timeout)


def produce(kafka: KafkaSettings, s: PromptSettings, loop: LoopSettings = LoopSettings(),
            stop=lambda: False) -> int:
    """Produce tasks per the settings; returns how many were written."""
    if s.dataset or s.eval_dataset:
        return produce_dataset(kafka, s, loop, stop)
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


def open_dataset(path: str, flag: str, s: PromptSettings, loop: LoopSettings, split: str,
                 suffix: str = "") -> DatasetSource:
    """The dataset source at ``path`` per the settings (held-out: greedy, one sample, one pass in order)."""
    columns = Columns(s.prompt_column, s.messages_column, s.answer_column, parse_column_list(s.metadata_columns),
                      s.id_column)
    heldout = split == "heldout"
    seed = -1 if heldout else s.shuffle_seed
    sid = clean_id(s.source_id) + suffix if s.source_id else source_id(path, columns, split, seed)
    sampling = SamplingParams(temperature=0.0 if heldout else s.temperature, max_tokens=s.max_tokens or DATASET_TOKENS)
    ds = load_dataset(path, flag, cache_dir=str(loop.home_path / "datasets"))
    return DatasetSource(ds, columns, path=path, source_id=sid, epochs=1 if heldout else s.epochs, shuffle_seed=seed,
                         split=split, group_size=1 if heldout else loop.group_size, sampling=sampling, flag=flag,
                         chat=s.chat, system_prompt=s.system_prompt)


def _out(src: DatasetSource, item: Item) -> Out:
    """What one item writes: its Task, or a dead letter when the row could not become one."""
    if item.task is not None:
        return Out(item.seq, prompt_topic(item.task), item.task.task_id, item.task, item.task.trace_id)
    letter = src.dead_letter(item)
    return Out(item.seq, "dead-letters", letter.key, letter, letter.headers["traceparent"].decode())


def _write(writer: ExactlyOnceWriter, items: Iterator[Item], src: DatasetSource, batch_rows: int, stop) -> int:
    """Write ``items`` (consecutive positions from ``writer.next``) in transactions of ``batch_rows``; how many."""
    n = 0
    while not stop():
        batch = [_out(src, item) for item in itertools.islice(items, max(1, batch_rows))]
        if not batch:
            break
        writer.write(batch)
        n += len(batch)
    return n


def produce_dataset(kafka: KafkaSettings, s: PromptSettings, loop: LoopSettings, stop=lambda: False) -> int:
    """Write --eval-dataset and/or --dataset exactly once (resuming where an earlier run stopped); records written.

    Not paced: the held-out set first (the baseline evaluation), then every epoch of the training set. Paced:
    training rows within the trainer's allowance, and with --heldout-every N round r of the held-out set once the
    policy reaches version r * N (a round cut short by a restart is finished first).
    """
    if s.paced and not s.dataset:
        raise UsageError("--paced with --eval-dataset needs --dataset (the training prompts it paces)")
    if s.batch_rows < 1:
        raise UsageError(f"--batch-rows must be at least 1, got {s.batch_rows}")
    # A transaction open longer than its timeout (30 s) is aborted by the broker: every batch would be redone forever.
    if not 0 <= s.batch_pause <= 20:
        raise UsageError(f"--batch-pause must be between 0 and 20 seconds, got {s.batch_pause}")
    suffix = ".eval" if s.dataset else ""
    evals = open_dataset(s.eval_dataset, "--eval-dataset", s, loop, "heldout", suffix) if s.eval_dataset else None
    train = open_dataset(s.dataset, "--dataset", s, loop, s.split) if s.dataset else None
    writers = {src.source_id: ExactlyOnceWriter(kafka, src.source_id, stopping=stop, pause_s=s.batch_pause)
               for src in (evals, train) if src is not None}
    for w in writers.values():
        w.start()
    if not s.paced or s.split == "heldout":
        n = 0
        for src in (evals, train):
            if src is not None:
                w = writers[src.source_id]
                n += _write(w, src.items(w.next), src, s.batch_rows, stop)
        return n
    return _dataset_paced(kafka, s, loop, train, writers[train.source_id],
                          (evals, writers[evals.source_id]) if evals and s.heldout_every else None, stop)


def _dataset_paced(kafka: KafkaSettings, s: PromptSettings, loop: LoopSettings, train: DatasetSource,
                   tw: ExactlyOnceWriter, rounds: tuple[DatasetSource, ExactlyOnceWriter] | None, stop) -> int:
    """The paced dataset source: the allowance rule of the built-in tasks, counted in positions (a dead letter
    takes its row's place, so the source stays a little behind the allowance rather than ahead of it)."""
    from rlstream.policy.watcher import PolicyWatcher
    watcher = PolicyWatcher(kafka.client_config(), kafka.run, loop.policy)
    n, waited = 0, None
    try:
        while not stop() and tw.next < len(train):
            seen = watcher.version
            version = max(seen, 0)
            if rounds is not None and watcher.version >= 0 and rounds[0].rows:
                evals, ew = rounds
                r, k = divmod(ew.next, evals.rows)
                if k or version >= r * s.heldout_every:
                    # Round r's ids carry the version it was due at, so a restart mid-round gives it the same ids.
                    items = (evals.item(r * evals.rows + j, r, evals.order(r)[j], f"v{r * s.heldout_every}-r{r}-")
                             for j in range(k, evals.rows))
                    n += _write(ew, items, evals, s.batch_rows, stop)
            allowed = min((version + loop.eta + 1) * loop.groups_per_step, len(train))
            if tw.next < allowed:
                n += _write(tw, train.items(tw.next, min(allowed, tw.next + s.batch_rows)), train, s.batch_rows, stop)
            else:
                if waited != seen:  # once per version: what it wrote is committed, and it writes no more until then
                    log.info("paced source at its allowance for policy version %d: %d training positions written; "
                             "waiting for the next version", seen, tw.next)
                    waited = seen
                watcher.wait_for(version + 1, 0.5)
        return n
    finally:
        watcher.close()


def cmd_prompts(args: argparse.Namespace, stop=lambda: False) -> None:
    """``rlstream prompts``; ``stop``: ends a paced source between writes (the CLI passes its process's stop)."""
    kafka, s, loop = load(KafkaSettings, args), load(PromptSettings, args), load(LoopSettings, args)
    wait_for_broker(kafka.client_config(), kafka.broker_wait_s)
    try:
        n = produce(kafka, s, loop, stop=stop)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if s.dataset or s.eval_dataset:
        print(f"wrote {n} records of {' and '.join(filter(None, (s.eval_dataset, s.dataset)))} to "
              f"{topic_name(kafka.run, 'prompts')} (held-out rows: {topic_name(kafka.run, 'eval-prompts')}; rows "
              "that are no task: dead-letters)")
    else:
        topic = "eval-prompts" if s.split == "heldout" else "prompts"
        print(f"produced {n} {s.split} tasks of {s.task} to {topic_name(kafka.run, topic)}")


def add_command(sub) -> None:
    """Register ``rlstream prompts``."""
    p = sub.add_parser("prompts", help="produce tasks to the run's prompts topic (held-out ones: eval-prompts)")
    add_arguments(p, LoopSettings)
    add_arguments(p, KafkaSettings)
    add_arguments(p, PromptSettings)
    p.set_defaults(func=cmd_prompts)
