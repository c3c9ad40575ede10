"""Chaos: SIGKILL random stages of the running loop, restart them, then reconcile topics and archive.

    python -m benchmarks.chaos [--kills 20] [--run R] [--seed 0] [--tasks 160] [--bootstrap HOST:PORT]

Runs trainer, rollout, env, reward and archive, each its own ``rlstream run`` process (``--fused``: env and reward
chained in one, ``rlstream run env+reward``, killed as one; ``--standby``: each stage also has a warm standby,
``--standby`` with the same ``--instance``, that takes over when the killed one's session lapses), and a
prompt source of a fixed number of tasks (G samples each): one share at the start and one at
each kill, so that the killed stage always has work waiting for it. Every ``--interval`` seconds
(jittered) it SIGKILLs one stage (each stage once per round, in a random order) and starts it
again with the same ``--instance``, so the new transactional producer fences its zombie. Once
the loop has drained it stops every stage and checks, from read_committed reads of every topic
and from the archive (SQL through ``open_archive``):

- every task has exactly G trajectories, or a recorded failure (a dead letter of its prompt or episode);
- every trajectory has exactly one reward per reward version (or a dead letter from the reward stage);
- nothing is duplicated downstream: unique ids per topic (prompts, actions, observations, trajectories,
  rewards, policy versions, dead letters), and in every archive table unique (topic, partition, offset)
  and unique ids; the archive holds exactly the committed records of the topics;
- policy versions strictly increase, each the child of the one before;
- no trajectory failed and nothing was dead-lettered: a kill costs time, never a sample (each one found is
  printed with its reason);
- the trainer trained each sample at most once: over every PolicyVersion, samples trained + refused (stale) +
  evicted + skipped = the rewards its group committed (``trainer_books``).

With ``--standby`` the kill always hits the stage's active process (the one whose log says it took its instance
over), and the killed process comes back as the pair's new standby; before each kill, every stage's standby is
standing by again, so each recovery is a warm takeover.

Recovery of a kill is the time from the SIGKILL until the killed stage's consumer group
commits offsets beyond those it had at the kill: the restarted process has consumed,
processed and committed new input (for the trainer: published the next policy version;
for the archive: inserted a batch). Kills are sequential: the next one comes
``--interval`` s after the previous stage recovered (or gave up after ``--recovery-timeout``).

The summary line is ``tasks=… trajectories=… lost=… duplicated=… recovery_p99=…s`` (then kills and policy
versions), then the ``RESULT chaos`` line; the exit code is 1 when an invariant fails.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from confluent_kafka.admin import AdminClient

from benchmarks.harness.books import Books, archive_check, archive_counts, duplicates, policy_order, trainer_books
from benchmarks.harness.groups import advanced, group_offsets
from benchmarks.harness.loop import ROOT, wait_until
from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard, run_name
from benchmarks.harness.stats import percentile
from rlstream.config import KafkaSettings
from rlstream.infra.supervisor import ONE_THREAD, StageProc, Supervisor, stage_env
from rlstream.kafka.tail import TopicTail
from rlstream.kafka.topics import create_topics
from rlstream.schemas.records import SamplingParams
from rlstream.sources.prompts import PromptProducer, make_task, task_items

STAGES = ("rollout", "env", "reward", "trainer", "archive")
#: With --fused: env and reward chained in one process (rlstream run env+reward), killed as one.
FUSED_STAGES = ("rollout", "env+reward", "trainer", "archive")
#: --standby: every process's session, so a killed one's membership lapses (and its standby takes over) this soon.
STANDBY_SESSION_MS = 1000
#: Recovery goals (p99 seconds): a restarted process against a warm standby (the deploy issue's goal).
RECOVERY_GOAL_S = {False: 10.0, True: 3.0}
#: Stop order: upstream first, so each stage finishes what it was given; the archive last.
STOP_ORDER = ["rollout", "env", "reward", "env+reward", "trainer", "archive"]


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the results)."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs to deliver (default 20)")
    p.add_argument("--run", default="", help="run name (default: a fresh bench-chaos-<time>-<id>, deleted when it ends)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule and of the tasks")
    p.add_argument("--tasks", type=int, default=0, help="tasks to produce (default: 8 per kill, at least 24)")
    p.add_argument("--group-size", type=int, default=4, help="samples per task (G)")
    p.add_argument("--groups-per-step", type=int, default=2, help="trainer groups per update")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between a recovery and the next kill")
    p.add_argument("--stages", default="", help="stages that may be killed (comma-separated; default: every one)")
    p.add_argument("--fused", action="store_true", help="env and reward chained in one process and one transaction "
                                                        "(rlstream run env+reward): the same accounting must hold")
    p.add_argument("--standby", action="store_true",
                   help="a warm standby per stage (--standby, the same --instance, --session-timeout-ms "
                        f"{STANDBY_SESSION_MS}); a kill hits the active process and the standby takes over")
    p.add_argument("--backend", default="transformers", choices=("auto", "transformers", "vllm"),
                   help="rollout engine (transformers restarts fastest)")
    p.add_argument("--eta", type=int, default=2,
                   help="the loop's staleness bound η (0 refuses every sample of an older version: exercises the "
                        "trainer's books with refusals)")
    p.add_argument("--partitions", type=int, default=4, help="partitions per topic of the fresh run")
    p.add_argument("--bootstrap", default=os.environ.get("RLSTREAM_BOOTSTRAP", ""),
                   help="Kafka bootstrap (default $RLSTREAM_BOOTSTRAP, else the local broker, started if needed)")
    p.add_argument("--kafka-config", default=os.environ.get("RLSTREAM_KAFKA_CONFIG", ""),
                   help="extra librdkafka settings k=v,k=v (SASL/SSL of your cluster)")
    p.add_argument("--archive", default="", help="archive URL (default: chdb:// under the run's folder)")
    p.add_argument("--workdir", default="", help="logs, weights and archive (default .rlstream/runs/<run>)")
    p.add_argument("--warmup-timeout", type=float, default=600, help="seconds for every stage to first commit")
    p.add_argument("--recovery-timeout", type=float, default=120, help="longest wait for a killed stage's progress")
    p.add_argument("--drain-timeout", type=float, default=600, help="longest wait for the loop to drain at the end")
    return p.parse_args(argv)


class PromptSource(threading.Thread):
    """Produces a fixed number of tasks, a share at a time (``release``), trickled at ``rate`` per second."""

    def __init__(self, kafka: KafkaSettings, count: int, group_size: int, seed: int, rate: float = 4.0):
        super().__init__(name="prompts", daemon=True)
        self.kafka, self.count, self.group_size, self.seed, self.rate = kafka, count, group_size, seed, rate
        self.sent: list[str] = []
        self._allowed = 0
        self._more = threading.Condition()
        self.error: BaseException | None = None

    def release(self, n: int | None = None) -> None:
        """Allow ``n`` more tasks (all that are left when None)."""
        with self._more:
            self._allowed = self.count if n is None else min(self.count, self._allowed + n)
            self._more.notify_all()

    def run(self) -> None:
        try:
            items, max_new = task_items("reverse", "train", self.seed)
            out = PromptProducer(self.kafka)
            sampling = SamplingParams(temperature=1.0, max_tokens=max_new)
            for i in range(self.count):
                with self._more:
                    self._more.wait_for(lambda: i < self._allowed)
                task = make_task("reverse", next(items), self.group_size, sampling, prefix=f"{self.kafka.run}-")
                out.send(task)
                self.sent.append(task.task_id)
                time.sleep(1 / self.rate)
            out.flush()
        except BaseException as exc:  # reported by main, never swallowed
            self.error = exc


def start_loop(args, bootstrap: str, run: str, workdir: Path, archive: str) -> Supervisor:
    """The loop's stage processes, supervised, not started yet."""
    env = stage_env(bootstrap, run, RLSTREAM_ETA=str(args.eta), **ONE_THREAD)
    if args.kafka_config:
        env["RLSTREAM_KAFKA_CONFIG"] = args.kafka_config
    logs = workdir / "logs"
    plan = {
        "trainer": ["run", "trainer", "--weights", str(workdir / "weights"), "--warmup-steps", "0",
                    "--groups-per-step", str(args.groups_per_step), "--window-groups", str(4 * args.groups_per_step),
                    "--threads", "1", "--instance", "0"],
        "rollout": ["run", "rollout", "--backend", args.backend, "--threads", "1", "--instance", "0",
                    "--batch-size", "32"],
        "env": ["run", "env", "--instance", "0", "--sandbox", "subprocess"],
        "reward": ["run", "reward", "--instance", "0"],
        "archive": ["run", "archive", "--archive", archive, "--instance", "0"],
    }
    if args.fused:
        del plan["env"], plan["reward"]
        plan["env+reward"] = ["run", "env+reward", "--instance", "0", "--sandbox", "subprocess"]
    sup = Supervisor()
    for name, argv in plan.items():  # a chain's progress is its first stage's group's
        if args.standby:
            argv = [*argv, "--standby", "--session-timeout-ms", str(STANDBY_SESSION_MS)]
            sup.add(StageProc(standby_name(name), argv, env, logs / f"{name}.b.log",
                              group=f"{run}.{name.split('+')[0]}", cwd=ROOT))
        sup.add(StageProc(name, argv, env, logs / f"{name}.log", group=f"{run}.{name.split('+')[0]}", cwd=ROOT))
    return sup


def standby_name(stage: str) -> str:
    """The supervisor's name for a stage's second process (--standby)."""
    return f"{stage}~b"


def since_start(proc: StageProc) -> str:
    """Its log since its last start."""
    text = proc.log_tail(400_000)
    return text[text.rfind("=== start"):]


def active(proc: StageProc) -> bool:
    """Whether this --standby process holds its instance (kafka/group.py logs its takeover, or that no one held it)."""
    return proc.alive() and "taking over" in since_start(proc)


def standing_by(proc: StageProc) -> bool:
    """Whether this --standby process is loaded and waiting."""
    text = since_start(proc)
    return proc.alive() and "standing by" in text and "taking over" not in text


def main(argv: list[str] | None = None) -> int:
    """Run, kill, drain, reconcile; 0 when every invariant holds."""
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the stage processes are stopped rather than left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(args.seed)
    stages = FUSED_STAGES if args.fused else STAGES
    killable = [s.strip() for s in args.stages.split(",") if s.strip()] or list(stages)
    if unknown := set(killable) - set(stages):
        raise SystemExit(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(stages)}")
    bootstrap = args.bootstrap
    if not bootstrap:
        from rlstream.infra import broker
        bootstrap = broker.up()
    run = args.run or run_name("chaos")
    workdir = Path(args.workdir or ROOT / ".rlstream" / "runs" / run).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    archive = args.archive or f"chdb://{workdir / 'archive'}"
    kafka = KafkaSettings(bootstrap=bootstrap, run=run, kafka_config=args.kafka_config)
    client = kafka.client_config()
    create_topics(client, run, partitions=args.partitions)
    admin = AdminClient(client)
    n_tasks = args.tasks or max(24, 8 * args.kills)
    # One share of the tasks to warm up, one at each kill: the killed stage always has work waiting for it.
    share = max(args.groups_per_step, n_tasks // (args.kills + 1))
    log(f"run {run} on {bootstrap}: {n_tasks} tasks x G={args.group_size}, {share} at the start and at each of "
        f"{args.kills} kills; logs in {workdir / 'logs'}")

    sup = start_loop(args, bootstrap, run, workdir, archive)
    tail = TopicTail(client, run, name="chaos-tail")
    source = PromptSource(kafka, n_tasks, args.group_size, args.seed)
    kills: list[dict] = []
    failed_to_drain = False
    # Each stage's processes: itself, and with --standby its second process (which of the two is active changes).
    pairs = {name: [sup.procs[name]] + ([sup.procs[standby_name(name)]] if args.standby else []) for name in stages}
    try:
        def supervise() -> None:
            for name, code in sup.check():
                log(f"{name} had exited on its own (exit code {code}); restarted (see its log)")

        sup.procs["trainer"].start()
        wait_until(lambda: supervise() or tail.count("policy-versions"), args.warmup_timeout, 0.5,
                   f"the trainer's first policy version (see {sup.procs['trainer'].log_path})")
        for name in ("archive", "reward", "env", "env+reward", "rollout"):
            if name in pairs:
                pairs[name][0].start()
        source.start()
        source.release(share)
        # Warm: every stage has committed once, so the first kill does not hit a process still starting.
        wait_until(lambda: supervise() or all(group_offsets(admin, p[0].group) for p in pairs.values()),
                   args.warmup_timeout, 1.0, "every stage's first commit")
        if args.standby:  # started once every stage holds its instance, so none takes over a starting primary
            for pair in pairs.values():
                pair[1].start()
        log("every stage has committed; killing")

        for k in range(args.kills):
            time.sleep(args.interval * rng.uniform(0.5, 1.5))
            supervise()
            if k % len(killable) == 0:  # every stage once per round, in a random order
                order = rng.sample(killable, len(killable))
            name = order[k % len(killable)]
            if args.standby:  # warm: each stage's other process is loaded and standing by
                wait_until(lambda: supervise() or all(any(standing_by(p) for p in pair) for pair in pairs.values()),
                           args.warmup_timeout, 0.5, "every stage's standby to stand by")
                proc = next((p for p in pairs[name] if active(p)), pairs[name][0])
            else:
                proc = pairs[name][0]
            killed_at = time.monotonic()
            proc.kill()
            source.release(share)
            # A commit the dying process had already sent may still land: take the baseline just after.
            time.sleep(0.3)
            before, versions_before = group_offsets(admin, proc.group), tail.count("policy-versions")
            proc.start()  # with --standby: the pair's new standby

            def progressed() -> bool:
                # A trainer step commits its samples' offsets with the version it announces; either shows it.
                return advanced(before, group_offsets(admin, proc.group)) or (
                    name == "trainer" and tail.count("policy-versions") > versions_before)
            try:
                wait_until(lambda: supervise() or progressed(), args.recovery_timeout, 0.25,
                           f"{name} to commit again")
                recovery = time.monotonic() - killed_at
            except TimeoutError:
                recovery = None
            kills.append({"stage": name, "recovery": recovery})
            log(f"kill {k + 1}/{args.kills}: {name} -> "
                + (f"progress again after {recovery:.1f}s" if recovery is not None else "no progress (timed out)"))

        source.release()
        source.join(300)
        if source.error is not None:
            raise source.error
        log(f"all {len(source.sent)} tasks produced; draining")
        books = Books(tail, source.sent, args.group_size)
        deadline = time.monotonic() + args.drain_timeout
        last_report = 0.0
        while True:
            supervise()
            missing = books.missing()
            topic_counts = {t: tail.count(t) for t in ("prompts", "actions", "observations", "trajectories",
                                                        "rewards", "policy-versions", "dead-letters")}
            archived = archive_counts(archive, run) or {}
            behind = {t: n - archived.get(t, 0) for t, n in topic_counts.items() if n > archived.get(t, 0)}
            if not any(missing.values()) and not behind and tail.caught_up():
                break
            if time.monotonic() > deadline:
                failed_to_drain = True
                log(f"gave up draining: missing {missing}, archive behind by {behind}")
                break
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                log(f"draining: missing {missing}, archive behind by {behind}")
            time.sleep(1.0)
    finally:
        # Each stage's standby before its active process, so no standby takes over a stage that is stopping.
        codes = sup.stop_all([p.name for n in STOP_ORDER if n in sup.procs
                              for p in sorted(pairs[n], key=lambda p: not standing_by(p))])
        log(f"stopped: exit codes {codes}")
        tail.settle(timeout=120)
        tail.close()

    # -- reconcile -------------------------------------------------------------------------------------------
    books = Books(tail, source.sent, args.group_size)
    missing = books.missing()
    dup_topics = duplicates(tail)
    versions_bad = policy_order(tail)
    arch_missing, arch_dup, arch_extra = archive_check(archive, run, tail)
    n_traj = len({s.record.trajectory_id for s in tail.snapshot("trajectories") if s.record})
    # A kill must cost nothing but time: a failed trajectory or a dead letter is a finding, listed with its reason.
    failures = [(s.record.trajectory_id, s.record.failure.stage if s.record.failure else "?",
                 s.record.failure.failure_class if s.record.failure else "?")
                for s in tail.snapshot("trajectories") if s.record and s.record.status == "failed"]
    failed = len(failures)
    letters = collections.Counter((s.record.stage, s.record.reason) for s in tail.snapshot("dead-letters") if s.record)
    for tid, stage, cls in failures[:20]:
        print(f"failed trajectory {tid}: {cls} at {stage}")
    for s in tail.snapshot("dead-letters")[:20]:
        if s.record:
            print(f"dead letter from {s.record.stage}: {s.record.reason}: {s.record.error[:200]}")
    n_versions = len(tail.snapshot("policy-versions"))
    tb = trainer_books(admin, run, tail)
    books_ok = tb["trained"] + tb["refused"] + tb["evicted"] + tb["skipped"] == tb["consumed"]
    print(f"trainer books: trained {tb['trained']} + refused {tb['refused']} (stale {tb['stale']}) + evicted "
          f"{tb['evicted']} + skipped {tb['skipped']} = {tb['trained'] + tb['refused'] + tb['evicted'] + tb['skipped']}"
          f"; rewards the trainer committed: {tb['consumed']} ({'equal' if books_ok else 'NOT EQUAL'}); "
          f"left in its window at the stop: {tb['left']}")
    lost = sum(missing.values()) + sum(arch_missing.values())
    duplicated = sum(dup_topics.values()) + sum(arch_dup.values()) + sum(arch_extra.values())
    measured = [k["recovery"] for k in kills if k["recovery"] is not None]
    by_stage = collections.defaultdict(list)
    for k in kills:
        by_stage[k["stage"]].append("timeout" if k["recovery"] is None else f"{k['recovery']:.1f}")
    print("kills: " + "; ".join(f"{s} [{', '.join(v)}]" for s, v in sorted(by_stage.items())))
    print(f"missing: {missing}; archive missing: {arch_missing}")
    print(f"duplicated on topics: {dup_topics}; in archive: {arch_dup}; archive rows not on topics: {arch_extra}")
    print(f"failed trajectories: {failed}; dead letters: {dict(letters)}; unplanned exits: {sup.crashes}")
    if versions_bad:
        print("policy versions out of order: " + "; ".join(versions_bad[:10]))
    ok = (lost == 0 and duplicated == 0 and failed == 0 and not letters and not versions_bad and not failed_to_drain
          and n_versions > 0 and books_ok)
    print(f"tasks={len(source.sent)} trajectories={n_traj} lost={lost} duplicated={duplicated} "
          f"recovery_p99={percentile(measured, 99):.1f}s kills={len(kills)} timeouts={len(kills) - len(measured)} "
          f"policy_versions={n_versions} versions_increasing={'yes' if not versions_bad else 'no'}", flush=True)
    # Each stage's slowest recovery too: a standby pays for some stages and not for others.
    per_stage = {f"recovery_max_{stage.replace('+', '_')}_s": max((k["recovery"] for k in kills
                                                                  if k["stage"] == stage and k["recovery"] is not None),
                                                                 default=None)
                 for stage in sorted({k["stage"] for k in kills})}
    record("chaos", dict(ok=ok, kills=len(kills), lost=lost, duplicated=duplicated,
                         recovery_p99_s=percentile(measured, 99), failed=failed, dead_letters=sum(letters.values()),
                         trained=tb["trained"], refused=tb["refused"], evicted=tb["evicted"], consumed=tb["consumed"],
                         books_equal=books_ok, **per_stage),
           [Goal("ok", ">=", 1), Goal("lost", "<=", 0), Goal("duplicated", "<=", 0),
            Goal("recovery_p99_s", "<=", RECOVERY_GOAL_S[args.standby])], seed=args.seed)
    # Scratch once it passed (harness/scratch.py); a failed run keeps its records to read. A run the user named is
    # theirs to keep, and so is a folder they gave.
    if not args.run and ok:
        discard(bootstrap, run, None if args.workdir else workdir, folders=("weights", "archive"))
    elif not args.run:
        log(f"run {run} kept for its records (`rlstream topics --delete --run {run}` when done)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
