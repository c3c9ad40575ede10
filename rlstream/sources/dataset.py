"""The user's own prompts: a dataset read with the ``datasets`` library, its columns mapped onto Task records.

A dataset is a JSONL/JSON, Parquet or CSV file, or a folder written by ``save_to_disk``. Its rows are taken in a
fixed order, epoch after epoch (each epoch shuffled by its own seed, or in the dataset's order), and numbered by a
sequence number ``seq = epoch * rows + k``: the order is a function of the dataset and the settings alone, so a
restarted source recomputes it and continues from any ``seq`` (``rlstream.sources.exactly_once``).

A row that cannot become a Task (no prompt, a prompt that is not text, messages that are not a list of
{role, content}) is an ``Item`` with an error instead of a Task: it goes to dead letters and the source goes on.
The Task schema has no field for chat messages: they travel as JSON in ``metadata["messages"]`` (the trajectory
keeps them as they were), and the rollout turns them into prompt ids with the model's chat template. The Task's
``prompt`` is their plain transcript (``render_messages``), for people and SQL. ``chat=True`` makes a plain prompt
column a conversation of one user message (after ``system_prompt``, when given), so an instruct model gets its
template on a dataset like GSM8K that has only a question column.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.errors import UsageError
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import DeadLetter, SamplingParams, Task

#: File suffix -> the ``datasets`` builder that reads it.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

#: Metadata keys the source writes itself; a metadata column may not take them.
RESERVED_METADATA = ("source_id", "epoch", "row", "messages")

#: Most bytes of a bad row kept in its dead letter (the letter must fit on the broker; the row index says where
#: the rest is).
MAX_ROW_BYTES = 1 << 20


@dataclass(frozen=True)
class Columns:
    """Which dataset column holds what. ``messages`` set: the prompt comes from it and ``prompt`` is not used."""

    prompt: str = "prompt"
    messages: str = ""
    answer: str = "answer"
    metadata: tuple[str, ...] = ()
    id: str = ""

    def mapped(self) -> list[tuple[str, str]]:
        """(flag, column) of every column this mapping reads."""
        out = [("--messages-column", self.messages) if self.messages else ("--prompt-column", self.prompt)]
        if self.answer:
            out.append(("--answer-column", self.answer))
        if self.id:
            out.append(("--id-column", self.id))
        out += [("--metadata-columns", c) for c in self.metadata]
        return out


def parse_column_list(raw: str) -> tuple[str, ...]:
    """``a,b , c`` -> ("a", "b", "c")."""
    return tuple(c.strip() for c in raw.split(",") if c.strip())


def load(path: str, flag: str = "--dataset", cache_dir: str | None = None):
    """The ``datasets.Dataset`` at ``path`` (a file by its suffix, or a ``save_to_disk`` folder); UsageError if none.

    A saved DatasetDict gives its ``train`` split, or its only one.
    """
    import datasets  # slow to import: only a dataset source pays for it
    datasets.disable_progress_bars()
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file or folder")
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                splits = list(ds)
                if "train" not in ds and len(splits) != 1:
                    raise UsageError(f"{flag} {path}: a DatasetDict without a 'train' split; its splits: "
                                     f"{', '.join(splits)} (save the one to use on its own)")
                ds = ds["train" if "train" in ds else splits[0]]
            return ds
        builder = FORMATS.get(p.suffix.lower())
        if builder is None:
            raise UsageError(f"{flag} {path}: unknown format {p.suffix!r}; expected one of "
                             f"{', '.join(FORMATS)} or a folder written by save_to_disk")
        return datasets.load_dataset(builder, data_files=str(p), split="train", cache_dir=cache_dir)
    except UsageError:
        raise
    except Exception as exc:  # the library's own error says what is wrong with the file
        raise UsageError(f"{flag} {path}: cannot be read as a dataset: {type(exc).__name__}: {exc}") from None


def check_columns(column_names: Sequence[str], columns: Columns, flag: str = "--dataset") -> None:
    """UsageError naming a mapped column the dataset lacks, with the columns it has; or a reserved metadata name."""
    present = list(column_names)
    for option, name in columns.mapped():
        if name not in present:
            raise UsageError(f"{flag}: no column {name!r} ({option}); the dataset's columns: {', '.join(present)}")
    for name in columns.metadata:
        if name in RESERVED_METADATA:
            raise UsageError(f"--metadata-columns: {name!r} is a metadata key the source writes itself "
                             f"({', '.join(RESERVED_METADATA)}); rename the column")


def source_id(path: str, columns: Columns, split: str, shuffle_seed: int) -> str:
    """The default identity of a source: the dataset's name and a hash of what decides its records and their order.

    Two datasets (or one dataset mapped two ways) written to one run get two ids, so neither resumes from the
    other's position. The number of epochs is not part of it: raising it continues the same source.
    """
    what = json.dumps([str(Path(path).resolve()), split, shuffle_seed, columns.prompt, columns.messages,
                       columns.answer, list(columns.metadata), columns.id])
    return f"{clean_id(Path(path).stem)}-{hashlib.sha1(what.encode()).hexdigest()[:10]}"


def clean_id(raw: str) -> str:
    """``raw`` with what a transactional id or a task id should not hold replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw) or "dataset"


def render_messages(messages: list[dict]) -> str:
    """The plain transcript of chat messages that the rollout tokenizes as the prompt."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def as_text(value: Any) -> str:
    """A cell as metadata or answer text: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def _check_messages(value: Any) -> list[dict]:
    """The messages of a row, or ValueError saying how they are not a non-empty list of {role, content} texts."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} is not a {{role: text, content: text}}: {str(m)[:200]}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


@dataclass
class Item:
    """One row at one position of the source's order: a Task, or the error that kept it from being one."""

    seq: int
    epoch: int
    row: int
    task: Task | None = None
    error: str | None = None
    raw: dict = field(default_factory=dict)  # the row as read (for its dead letter)


class DatasetSource:
    """A dataset's rows as Tasks, in a fixed order of ``epochs`` passes; ``items(seq)`` continues from any position."""

    def __init__(self, ds, columns: Columns, *, path: str, source_id: str, epochs: int = 1, shuffle_seed: int = -1,
                 split: str = "train", group_size: int = 8, sampling: SamplingParams = SamplingParams(),
                 name: str | None = None, flag: str = "--dataset", chat: bool = False, system_prompt: str = ""):
        check_columns(ds.column_names, columns, flag)
        if epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {epochs}")
        self.ds, self.columns, self.path, self.source_id = ds, columns, path, source_id
        self.epochs, self.shuffle_seed, self.split = epochs, shuffle_seed, split
        self.group_size, self.sampling = group_size, sampling
        self.chat, self.system_prompt = chat or bool(columns.messages), system_prompt
        self.name = name or clean_id(Path(path).stem)
        self.rows = len(ds)
        self._order: tuple[int, list[int] | range] | None = None

    def __len__(self) -> int:
        """Positions in all epochs together."""
        return self.epochs * self.rows

    def order(self, epoch: int) -> list[int] | range:
        """Row indexes in the order of ``epoch``: shuffled by (seed, epoch), or the dataset's order (seed < 0)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle_seed < 0:
                rows: list[int] | range = range(self.rows)
            else:
                import numpy as np
                rows = np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.rows).tolist()
            self._order = (epoch, rows)
        return self._order[1]

    def items(self, start: int = 0, stop: int | None = None) -> Iterator[Item]:
        """The items at positions ``start`` (inclusive) to ``stop`` (exclusive; default: the end)."""
        for seq in range(start, len(self) if stop is None else min(stop, len(self))):
            epoch, k = divmod(seq, self.rows)
            yield self.item(seq, epoch, self.order(epoch)[k])

    def item(self, seq: int, epoch: int, row: int, prefix: str = "") -> Item:
        """The item of dataset row ``row`` at position ``seq`` (``prefix``: before its task id)."""
        raw = self.ds[row]
        try:
            return Item(seq, epoch, row, task=self._task(raw, epoch, row, prefix), raw=raw)
        except ValueError as exc:
            return Item(seq, epoch, row, error=f"row {row}: {exc}", raw=raw)

    def _task(self, raw: dict, epoch: int, row: int, prefix: str) -> Task:
        """The Task of one row; ValueError saying why the row cannot be one."""
        c = self.columns
        metadata = {k: as_text(raw[k]) for k in c.metadata if raw[k] is not None}
        if c.messages:
            messages = _check_messages(raw[c.messages])
        else:
            prompt = raw[c.prompt]
            if prompt is None:
                raise ValueError(f"no prompt (column {c.prompt!r} is empty)")
            if not isinstance(prompt, str):
                raise ValueError(f"the prompt (column {c.prompt!r}) is a {type(prompt).__name__}, not text")
            if not prompt:
                raise ValueError(f"the prompt (column {c.prompt!r}) is an empty string")
            messages = [{"role": "user", "content": prompt}]
        if self.chat:
            if self.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            prompt = render_messages(messages)
            metadata["messages"] = json.dumps(messages, ensure_ascii=False)
        answer = raw[c.answer] if c.answer else None
        base = as_text(raw[c.id]) if c.id and raw[c.id] is not None else f"{self.source_id}-r{row}"
        # One id per row and epoch: a group of the next epoch must not join the groups of the last.
        task_id = f"{prefix}{base}-e{epoch}"
        metadata.update(source_id=self.source_id, epoch=str(epoch), row=str(row))
        return Task(task_id=task_id, group_id=task_id, task_name=self.name, env_name="single", env_version="1",
                    prompt=prompt, sampling=self.sampling, created_at=hdr.now_ms(),
                    answer=None if answer is None else as_text(answer), metadata=metadata,
                    group_size=self.group_size, split=self.split, max_turns=1, trace_id=hdr.new_traceparent())

    def dead_letter(self, item: Item) -> DeadLetter:
        """The dead letter of an item that is no Task: where the row is (path, epoch, row) and the row itself."""
        value = json.dumps(item.raw, default=str, ensure_ascii=False).encode()
        if len(value) > MAX_ROW_BYTES:
            value = None  # the row index says where it is; the letter must fit on the broker
        traceparent = hdr.new_traceparent()
        return DeadLetter(stage="prompts", reason="invalid", error=f"{self.path}: epoch {item.epoch}, {item.error}",
                          topic=self.path, partition=item.epoch, offset=item.row, failed_at=hdr.now_ms(),
                          key=f"{self.source_id}-r{item.row}-e{item.epoch}".encode(), value=value,
                          headers={"traceparent": traceparent.encode()}, trace_id=hdr.trace_id(traceparent))
