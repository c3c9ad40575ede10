"""Typed Python records mirroring the .avsc schemas (a test keeps them in step).

``to_dict`` / ``from_dict`` convert to and from the dicts fastavro reads and
writes; token arrays are passed through as lists, not copied element-wise.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional


class Record:
    """Base of every typed record: dict conversion driven by the field types."""

    def to_dict(self) -> dict:
        """The fastavro-ready dict of this record (nested records converted)."""
        return _converters(type(self))[0](self)

    @classmethod
    def from_dict(cls, data: dict):
        """Build the typed record from a decoded dict (a missing key takes the field's default)."""
        return _converters(cls)[1](cls, data)


@lru_cache(maxsize=None)
def _converters(cls) -> tuple:
    """(to_dict, from_dict) of a record class, written out field by field once per class, as ``dataclasses``
    writes ``__init__``: a loop over the fields per record was a fifth of a pass-through hop's CPU."""
    out, fast, slow, env = [], [], [], {}
    for i, (name, kind, sub) in enumerate(_plan(cls)):
        if sub is not None:
            # A nested record's own converters, called directly: no classmethod and cache lookup per nested
            # record, no lambda made per field and call (a Trajectory holds five nested records).
            env[f"_c{i}"], (env[f"_to{i}"], env[f"_from{i}"]) = sub, _converters(sub)
        if kind == "plain":
            to, back, fast_back = f"self.{name}", "v", f"data[{name!r}]"
        elif kind == "record":
            to = f"None if (x := self.{name}) is None else _to{i}(x)"
            back = f"None if v is None else _from{i}(_c{i}, v)"
            fast_back = f"None if (v := data[{name!r}]) is None else _from{i}(_c{i}, v)"
        else:
            to = f"[_to{i}(x) for x in self.{name}]"
            back = f"[_from{i}(_c{i}, x) for x in v]"
            fast_back = f"[_from{i}(_c{i}, x) for x in data[{name!r}]]"
        out.append(f"{name!r}: {to}")
        fast.append(f"{name}={fast_back}")
        slow.append(f"    if {name!r} in data:\n        v = data[{name!r}]\n        kwargs[{name!r}] = {back}")
    source = (f"def to_dict(self):\n    return {{{', '.join(out)}}}\n"
              f"def _slow(cls, data):\n    kwargs = {{}}\n" + "\n".join(slow) + "\n    return cls(**kwargs)\n"
              f"def from_dict(cls, data):\n    try:\n        return cls({', '.join(fast)})\n"
              f"    except KeyError:\n        return _slow(cls, data)  # an older shape: defaults for what it lacks\n")
    exec(source, env)  # noqa: S102 - generated from the dataclass's own fields, as dataclasses does
    return env["to_dict"], env["from_dict"]


@lru_cache(maxsize=None)
def _plan(cls) -> tuple[tuple[str, str, Any], ...]:
    """Per field: (name, 'plain' | 'record' | 'records', nested record class)."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(hint)
        if isinstance(hint, type) and issubclass(hint, Record):
            plan.append((f.name, "record", hint))
        elif origin is typing.Union and args and isinstance(args[0], type) and issubclass(args[0], Record):
            plan.append((f.name, "record", args[0]))
        elif origin is list and args and isinstance(args[0], type) and issubclass(args[0], Record):
            plan.append((f.name, "records", args[0]))
        else:
            plan.append((f.name, "plain", None))
    return tuple(plan)


@dataclass(slots=True)
class SamplingParams(Record):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Task(Record):
    task_id: str
    group_id: str
    task_name: str
    env_name: str
    env_version: str
    prompt: str
    sampling: SamplingParams
    created_at: int
    prompt_token_ids: list[int] = field(default_factory=list)
    answer: Optional[str] = None
    metadata: dict[str, str] = field(default_factory=dict)
    group_size: int = 8
    split: str = "train"
    max_turns: int = 1
    trace_id: str = ""


@dataclass(slots=True)
class ToolCall(Record):
    name: str
    arguments: str


@dataclass(slots=True)
class ToolResult(Record):
    output: str
    exit_code: int = 0
    duration_ms: float = 0.0
    truncated: bool = False
    failure_class: Optional[str] = None


@dataclass(slots=True)
class Failure(Record):
    failure_class: str
    message: str
    stage: str


@dataclass(slots=True)
class Turn(Record):
    role: str
    text: str
    token_start: int
    token_end: int
    policy_version: int = -1
    finish_reason: str = ""
    tool_call: Optional[ToolCall] = None
    tool_result: Optional[ToolResult] = None
    started_at: int = 0
    finished_at: int = 0
    segment_versions: list[int] = field(default_factory=list)
    segment_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Episode(Record):
    episode_id: str
    group_id: str
    sample_index: int
    task: Task
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    failure: Optional[Failure] = None
    stage_times: dict[str, int] = field(default_factory=dict)
    trace_id: str = ""


def episode_key(episode: Episode) -> str:
    """The Kafka key of every record of an episode on prompts, actions and observations: its task's id.

    The prompt source keys a Task by its id, and the topics are co-partitioned, so turn 1 (generated from the
    prompts record) and every later turn (observations) of each of the task's G episodes land on the same
    partition, which the rollout group's range assignor gives to one worker: the one whose engine holds the
    episode's prefix. (A key per episode would scatter turn 2 onwards away from turn 1.)
    """
    return episode.task.task_id


def is_eval(task: Task) -> bool:
    """The eval lane: a task whose split is not ``train`` (held-out, evaluation) measures the policy and is never
    trained on. Its prompt travels on ``eval-prompts`` (rollout serves it ahead of any backlog) and its scored result
    on ``eval-rewards``, which no trainer reads; in between it shares the loop's topics and stages."""
    return task.split != "train"


def prompt_topic(task: Task) -> str:
    """The topic a source writes ``task`` to: its lane's."""
    return "eval-prompts" if is_eval(task) else "prompts"


def scored_topic(task: Task) -> str:
    """The topic the reward stage writes a scored trajectory of ``task`` to: its lane's."""
    return "eval-rewards" if is_eval(task) else "rewards"


@dataclass(slots=True)
class Trajectory(Record):
    trajectory_id: str
    group_id: str
    sample_index: int
    task: Task
    response: str
    min_policy_version: int
    max_policy_version: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    status: str = "ok"
    failure: Optional[Failure] = None
    stage_times: dict[str, int] = field(default_factory=dict)
    trace_id: str = ""


@dataclass(slots=True)
class Reward(Record):
    total: float
    reward_version: str
    breakdown: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    verifier_version: str = ""
    judge_version: str = ""
    latency_ms: float = 0.0
    failure_class: Optional[str] = None
    scored_at: int = 0
    turn_scores: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ScoredTrajectory(Record):
    trajectory: Trajectory
    reward: Reward


#: The most top-k entries a feedback record carries per token (NeMo-RL stores up to 64): the teacher stage refuses
#: a larger --top-k, the trainer a record that claims more.
MAX_TOP_K = 64


@dataclass(slots=True)
class TeacherFeedback(Record):
    scored: ScoredTrajectory
    teacher_version: str
    teacher_logprobs: list[float] = field(default_factory=list)
    teacher_model: str = ""
    latency_ms: float = 0.0
    teacher_top_k: int = 0
    teacher_topk_ids: list[int] = field(default_factory=list)
    teacher_topk_logprobs: list[float] = field(default_factory=list)
    status: str = "ok"
    teacher_device: str = ""
    failure_class: str = ""


@dataclass(slots=True)
class PolicyVersion(Record):
    policy: str
    version: int
    weights_uri: str
    created_at: int
    published_at: int
    step: int = 0
    parent_version: int = -1
    samples_trained: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    trainer_id: str = ""
    tokenizer_hash: str = ""
    content_hash: str = ""
    probe_token_ids: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)
    base_hash: str = ""
    base_uri: str = ""


@dataclass(slots=True)
class WeightChunk(Record):
    policy: str
    version: int
    kind: str
    chunk: int
    chunks: int
    payload: bytes
    content_hash: str
    base_version: int = -1
    files: list[str] = field(default_factory=list)
    created_at: int = 0
    chunk_partitions: list[int] = field(default_factory=list)
    chunk_offsets: list[int] = field(default_factory=list)
    chunk_hashes: list[str] = field(default_factory=list)
    payload_hash: str = ""


@dataclass(slots=True)
class DeadLetter(Record):
    stage: str
    reason: str
    error: str
    topic: str
    partition: int
    offset: int
    failed_at: int
    key: Optional[bytes] = None
    value: Optional[bytes] = None
    headers: dict[str, bytes] = field(default_factory=dict)
    trace_id: str = ""


#: Record name -> typed class, for every record that travels on a topic.
RECORD_TYPES: dict[str, type[Record]] = {
    cls.__name__: cls
    for cls in (Task, Episode, Trajectory, ScoredTrajectory, TeacherFeedback, PolicyVersion, DeadLetter, WeightChunk)
}
#: Every typed class, nested ones included (the mirror test walks these).
ALL_TYPES: dict[str, type[Record]] = {
    cls.__name__: cls
    for cls in (SamplingParams, Task, ToolCall, ToolResult, Failure, Turn, Episode, Trajectory, Reward,
                ScoredTrajectory, TeacherFeedback, PolicyVersion, DeadLetter, WeightChunk)
}
