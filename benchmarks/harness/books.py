"""The books a loop's run is checked by, from read_committed reads of its topics and from its archive: nothing lost
(every task's samples, every trajectory's rewards, or a dead letter saying why), nothing duplicated (per topic and
per archive table), policy versions in order, and the trainer's train-at-most-once accounting. chaos and three_hosts
judge their runs by them."""
from __future__ import annotations

import collections

from confluent_kafka.admin import AdminClient

from benchmarks.harness.groups import committed_with_metadata
from rlstream.kafka.inflight import decode_done_ahead
from rlstream.kafka.tail import TopicTail
from rlstream.kafka.topics import topic_name
from rlstream.schemas.codec import default_codec
from rlstream.schemas.records import RECORD_TYPES

#: Archive table -> the topics archived into it.
ARCHIVE_TABLES = {"tasks": ["prompts", "eval-prompts"], "episodes": ["actions", "observations"],
                  "trajectories": ["trajectories"], "rewards": ["rewards", "eval-rewards"],
                  "policy_versions": ["policy-versions"], "dead_letters": ["dead-letters"]}


def decode_letter_target(letter) -> tuple[str, str] | None:
    """(kind, id) of what a dead letter stood for: ('task', id), ('episode', id) or ('trajectory', id)."""
    try:
        name, value = default_codec().decode(letter.value)
        record = RECORD_TYPES[name].from_dict(value)
    except Exception:
        return None
    if name == "Task":
        return "task", record.task_id
    if name == "Episode":
        return "episode", record.episode_id
    if name == "Trajectory":
        return "trajectory", record.trajectory_id
    if name == "ScoredTrajectory":
        return "trajectory", record.trajectory.trajectory_id
    return None


class Books:
    """What the topics say, folded into the counts the invariants need."""

    def __init__(self, tail: TopicTail, task_ids: list[str], group_size: int):
        self.tail, self.task_ids, self.g = tail, task_ids, group_size

    def letters(self) -> dict[str, set[str]]:
        covered: dict[str, set[str]] = collections.defaultdict(set)
        for s in self.tail.snapshot("dead-letters"):
            if s.record is None:
                continue
            target = decode_letter_target(s.record)
            if target is not None:
                covered[f"{s.record.stage}:{target[0]}"].add(target[1])
                covered[target[0]].add(target[1])
        return covered

    def missing(self) -> dict[str, int]:
        """Samples not (yet) accounted for: trajectories of tasks, and rewards of trajectories."""
        letters = self.letters()
        trajectories = {s.record.trajectory_id for s in self.tail.snapshot("trajectories") if s.record}
        rewarded = collections.defaultdict(set)
        for s in self.tail.snapshot("rewards") + self.tail.snapshot("eval-rewards"):  # held-out answers: the latter
            if s.record:
                rewarded[s.record.reward.reward_version].add(s.record.trajectory.trajectory_id)
        versions = set(rewarded) or {"v1"}
        prompts = {s.record.task_id for s in self.tail.snapshot("prompts") if s.record}
        missing_tasks = sum(1 for t in self.task_ids if t not in prompts)
        missing_traj = 0
        for t in self.task_ids:
            if t in letters["task"]:
                continue  # the prompt itself was dead-lettered: a recorded failure of the whole task
            for i in range(self.g):
                e = f"{t}:{i}"
                if e not in trajectories and e not in letters["episode"]:
                    missing_traj += 1
        missing_rewards = sum(1 for v in versions for tid in trajectories
                              if tid not in rewarded[v] and tid not in letters["reward:trajectory"])
        return {"tasks": missing_tasks, "trajectories": missing_traj, "rewards": missing_rewards}


def duplicates(tail: TopicTail) -> dict[str, int]:
    """Records a topic holds more than once, by the identity each topic's records must have."""
    ident = {
        "prompts": lambda r: r.task_id,
        "eval-prompts": lambda r: r.task_id,
        # A multi-turn episode passes each topic once per turn.
        "actions": lambda r: (r.episode_id, len(r.turns)),
        "observations": lambda r: (r.episode_id, len(r.turns)),
        "trajectories": lambda r: r.trajectory_id,
        "rewards": lambda r: (r.trajectory.trajectory_id, r.reward.reward_version),
        "eval-rewards": lambda r: (r.trajectory.trajectory_id, r.reward.reward_version),
        "policy-versions": lambda r: (r.policy, r.version),
        "dead-letters": lambda r: (r.stage, r.topic, r.partition, r.offset),
    }
    out = {}
    for topic, key in ident.items():
        counts = collections.Counter(key(s.record) for s in tail.snapshot(topic) if s.record is not None)
        out[topic] = sum(c - 1 for c in counts.values())
    return out


def policy_order(tail: TopicTail) -> list[str]:
    """Problems with the announced versions: each must be the next one after its parent."""
    problems = []
    by_policy = collections.defaultdict(list)
    for s in sorted(tail.snapshot("policy-versions"), key=lambda s: (s.partition, s.offset)):
        if s.record is not None:
            by_policy[s.record.policy].append(s.record)
    for policy, versions in by_policy.items():
        for prev, cur in zip(versions, versions[1:]):
            if cur.version <= prev.version:
                problems.append(f"{policy} v{cur.version} announced after v{prev.version}")
            elif cur.parent_version != prev.version:
                problems.append(f"{policy} v{cur.version} has parent v{cur.parent_version}, not v{prev.version}")
    return problems


def trainer_books(admin: AdminClient, run: str, tail: TopicTail) -> dict[str, int]:
    """The trainer's train-at-most-once books, from the topics alone.

    ``consumed``: the rewards the trainer's group has committed (read_committed records below each committed offset,
    plus those its offset metadata lists as done ahead of it). Every version's PolicyVersion says, in the transaction
    that committed them, how many of them it trained and what became of the rest (trainer/gate.py:OutcomeBooks); a
    sample trained twice after a SIGKILL, or one lost from the books, breaks the sum.
    """
    committed = committed_with_metadata(admin, f"{run}.trainer")
    topic = topic_name(run, "rewards")
    done = {tp: (offset, decode_done_ahead(offset, metadata)) for tp, (offset, metadata) in committed.items()
            if tp[0] == topic}
    consumed = 0
    for s in tail.snapshot("rewards"):
        offset, ahead = done.get((topic, s.partition), (0, set()))
        consumed += s.offset < offset or s.offset in ahead
    versions = [s.record for s in tail.snapshot("policy-versions") if s.record is not None]
    books = {"consumed": consumed, "trained": sum(v.samples_trained for v in versions)}
    for key in ("refused", "evicted", "skipped"):
        books[key] = int(sum(v.metrics.get(f"{key}_step", 0.0) for v in versions))
    books["stale"] = int(sum(v.metrics.get("stale_step", 0.0) for v in versions))
    books["left"] = len(tail.snapshot("rewards")) - consumed  # in the window at the stop (never committed)
    return books


def archive_check(url: str, run: str, tail: TopicTail) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(missing, duplicated, extra) archive rows per table, against the committed records of the topics."""
    from rlstream.archive.query import open_archive
    ids = {"tasks": "task_id", "episodes": "(direction, episode_id, length(`turns.role`))",
           "trajectories": "trajectory_id", "rewards": "(trajectory_id, reward_version)",
           "policy_versions": "(policy, version)", "dead_letters": "(stage, original_topic, original_partition, "
                                                                "original_offset)"}
    missing, dup, extra = {}, {}, {}
    with open_archive(url) as archive:
        for table, topics in ARCHIVE_TABLES.items():
            where = f"run = '{run}'"
            if table == "dead_letters":
                where += " AND stage != 'archive'"  # records the archive could not decode are counted below
            _, rows = archive.query(f"SELECT count(), uniqExact(topic, partition, offset), uniqExact({ids[table]}) "
                                    f"FROM rlstream.{table} WHERE {where}")
            n, uniq_pos, uniq_id = rows[0]
            dup[table] = (n - uniq_pos) + (uniq_pos - uniq_id)
            _, rows = archive.query(f"SELECT topic, partition, offset FROM rlstream.{table} WHERE {where}")
            archived = {(t, int(p), int(o)) for t, p, o in rows}
            committed = {(s.topic, s.partition, s.offset) for t in topics for s in tail.snapshot(t)}
            missing[table] = len(committed - archived)
            extra[table] = len(archived - committed)
        _, rows = archive.query(f"SELECT count() FROM rlstream.dead_letters WHERE run = '{run}' AND stage = 'archive'")
        extra["undecodable"] = int(rows[0][0])  # the loop's own records always decode
    return missing, dup, extra


def archive_counts(url: str, run: str) -> dict[str, int] | None:
    """Rows per archived topic while the loop runs (None while the archive does not answer)."""
    from rlstream.archive.query import ArchiveError, open_archive
    sql = " UNION ALL ".join(f"SELECT topic, count() FROM rlstream.{t} WHERE run = '{run}' GROUP BY topic"
                             for t in ARCHIVE_TABLES)
    try:
        with open_archive(url) as archive:
            return {t: int(n) for t, n in archive.query(sql)[1]}
    except ArchiveError:
        return None
