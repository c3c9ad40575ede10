"""Three hosts on one machine: the loop across network namespaces joined only by links, a broker killed mid-run.

    python -m benchmarks.three_hosts [--target 0.5] [--minutes 15] [--kill-at-version 4] [--seed 0]

Needs root and iproute2 (``ip netns``, veth pairs). Three hosts, each a network namespace with its own ``--home``,
host A the hub: B, C and this machine each have one veth link, to A (``network``):

- host A: a 3-broker Kafka cluster (``rlstream up --brokers 3``, every topic replicated 3 times, 2 in sync) and the
  archive;
- host B: the trainer's rank 0, its weights to the workers through the weights log (``--weights-transport
  kafka``);
- host C: rollout, env, reward, the prompt source (the demo's task, paced, with held-out rounds) and, with
  ``--trainer-ranks 2`` (the default), the trainer's rank 1: the two ranks are one torchrun job across B and C
  (static rendezvous on B, gloo over the links, through A). The ranks' store (``--weights``: each rank writes its
  shard of the training state there) is the one folder both hosts mount, as a ReadWriteMany volume or an object
  store would be on a cluster; the workers read no file of it.

The driver (this process) has a link to A too, as an operator's machine would: it creates the topics, watches the
topics, kills a broker and does the books. The loop runs the demo's stages with the demo's settings until held-out
reward reaches ``--target`` by the demo's rule (a complete evaluation round by a trained version); once the trainer
has announced ``--kill-at-version``, one broker (not the first: the driver's bootstrap list keeps the rest) is
SIGKILLed and stays dead. Then the prompt source stops, the loop drains (every task's trajectories and rewards
on the topics, and the archive holding every record, asked from inside host A), every stage stops, and the chaos
benchmark's books run: nothing lost or duplicated on any topic or in the archive, versions in order, and the
trainer's trained + refused + evicted + skipped equal to the rewards its group committed.

The summary line is ``reached=… seconds_to_target=… versions=… lost=… duplicated=… broker_killed_at=v… …
longest_pause_after_kill_s=…`` (the longest the loop went without a new version once the broker died), then the
``RESULT three_hosts`` line; the exit code is 1 when the target was missed or a book does not balance.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

from confluent_kafka.admin import AdminClient

from benchmarks.harness.books import Books, archive_check, duplicates, policy_order, trainer_books
from benchmarks.harness.loop import ROOT, wait_until
from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard
from rlstream.config import LoopSettings
from rlstream.demo import DemoSettings, Progress, fold, latest_complete_round
from rlstream.infra import broker
from rlstream.infra.supervisor import ONE_THREAD, StageProc, Supervisor, stage_env
from rlstream.kafka.tail import TopicTail, UnknownTopic
from rlstream.kafka.topics import create_topics

HOSTS = ("a", "b", "c")
#: Stop order: the source first, then each stage after the one feeding it; the archive last.
STOP_ORDER = ["prompts", "rollout", "env", "reward", "trainer", "trainer-1", "archive"]
#: The trainer's rendezvous port on host B (torchrun's static rendezvous, rank 0's TCP store).
RENDEZVOUS_PORT = 29511
#: Topics whose every record the archive must hold before the books (as the chaos benchmark's drain).
ARCHIVED = ("prompts", "eval-prompts", "actions", "observations", "trajectories", "rewards", "eval-rewards",
            "policy-versions", "dead-letters")


def log(msg: str) -> None:
    print(f"[three-hosts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DemoSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=float, default=0.5, help="held-out reward to reach (default 0.5)")
    p.add_argument("--minutes", type=float, default=15.0, help="give up after this long (default 15)")
    p.add_argument("--kill-at-version", type=int, default=4, help="SIGKILL a broker once this version is announced")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (the tiny model and its warm-up)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="the tiny model's supervised warm-up")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (the demo's)")
    p.add_argument("--heldout-count", type=int, default=d.heldout_count, help="held-out tasks per round")
    p.add_argument("--trainer-ranks", type=int, default=2, choices=(1, 2),
                   help="2: the trainer's ranks on B and C under torchrun (gloo over the links); 1: B alone")
    p.add_argument("--drain-timeout", type=float, default=300, help="longest wait for the loop to drain")
    p.add_argument("--workdir", default="", help="homes and logs (default .rlstream/runs/<run>)")
    return p.parse_args(argv)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@contextmanager
def network(tag: str):
    """{host: (namespace, address, link)}: a namespace per host, B, C and this machine's own namespace each joined to
    A by a veth pair of their own (A is the hub, as the switch in front of the brokers' host would be), routed to A's
    service address, on which A's brokers listen. A forwards between B and C alone (the trainer's ranks), inside its
    own namespace: this machine's firewall, which may drop bridged or forwarded traffic (Docker's does), is not on
    the path. Everything is removed on exit."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("three_hosts needs root and iproute2's ip (network namespaces, veth pairs)")
    net = f"10.{150 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    service = f"{net}.1"  # host A's address, on its loopback: reachable over any of its links
    made: list[tuple[str, ...]] = []
    try:
        spaces = {h: f"rls{tag}{h}" for h in HOSTS}
        for ns in spaces.values():
            ip("netns", "add", ns)
            made.append(("netns", "del", ns))
        ip("netns", "exec", spaces["a"], "ip", "link", "set", "lo", "up")
        ip("netns", "exec", spaces["a"], "ip", "addr", "add", f"{service}/32", "dev", "lo")
        ip("netns", "exec", spaces["a"], "sysctl", "-qw", "net.ipv4.ip_forward=1")
        hosts = {"a": (spaces["a"], service, "lo")}
        hubs = {}
        for k, peer in enumerate(("b", "c", ""), start=1):  # "": this machine's own namespace (the driver)
            hub, end = f"rv{tag}a{k}", f"rv{tag}{peer or 'd'}"
            hub_ip, end_ip = f"{net}.{4 * k + 1}", f"{net}.{4 * k + 2}"
            ip("link", "add", hub, "type", "veth", "peer", "name", end)
            made.append(("link", "del", end))  # deleting either end deletes the pair, wherever it is
            ip("link", "set", hub, "netns", spaces["a"])
            ip("netns", "exec", spaces["a"], "ip", "addr", "add", f"{hub_ip}/30", "dev", hub)
            ip("netns", "exec", spaces["a"], "ip", "link", "set", hub, "up")
            at = ("netns", "exec", spaces[peer], "ip") if peer else ()
            if peer:
                ip("link", "set", end, "netns", spaces[peer])
                ip(*at, "link", "set", "lo", "up")
            ip(*at, "addr", "add", f"{end_ip}/30", "dev", end)
            ip(*at, "link", "set", end, "up")
            ip(*at, "route", "add", f"{service}/32", "via", hub_ip)
            if peer:
                hosts[peer] = (spaces[peer], end_ip, end)
                hubs[peer] = hub_ip
        for here, there in (("b", "c"), ("c", "b")):
            ip("netns", "exec", spaces[here], "ip", "route", "add", f"{hosts[there][1]}/32", "via", hubs[here])
        yield hosts, service
    finally:
        for args in reversed(made):
            ip(*args, check=False)


def in_ns(ns: str) -> tuple[str, ...]:
    """The command prefix that runs a process on a host."""
    return ("ip", "netns", "exec", ns)


class Pause:
    """The longest gap between consecutive announced versions from ``start`` (the kill) on, in seconds."""

    def __init__(self):
        self.version, self.at, self.longest = None, 0.0, 0.0

    def start(self, version: int, now: float) -> None:
        self.version, self.at = version, now

    def seen(self, version: int, now: float) -> None:
        if self.version is not None and version > self.version:
            self.longest = max(self.longest, now - self.at)
            self.version, self.at = version, now


def watch(client: dict, run: str, arrived: queue.SimpleQueue, timeout: float = 120.0) -> TopicTail:
    """The driver's view of held-out rewards and versions, once it reads every partition of both topics: the
    topics were just created, and a broker of the three that does not know them yet answers with none (a view
    begun then would read nothing, ever: seen once in CI, under load)."""
    topics = ("eval-rewards", "policy-versions")
    deadline = time.monotonic() + timeout
    while True:
        try:
            view = TopicTail(client, run, list(topics), name="hosts-view", keep=False, on_record=arrived.put)
        except UnknownTopic:  # the reader's own wait for the topics' metadata ran out: this one has a longer
            view = None
        if view is not None and {t for t, _ in view.assigned()} == set(topics):
            return view
        if view is not None:
            view.close()
        if time.monotonic() > deadline:
            raise SystemExit(f"the driver's view of {', '.join(topics)} found no partitions in {timeout:.0f} s")
        time.sleep(0.5)


def stop_gang(sup: Supervisor, timeout: float = 60.0) -> int | None:
    """Stop the trainer's torchrun job as its ranks expect: SIGTERM to rank 0 itself, which finishes its step and
    tells the other rank to stop; both workers exit 0, and so do both agents. (An agent answers a SIGTERM of its own
    by tearing its workers down and exiting 1, and the other node's agent then loses its rendezvous store.) The
    rank-0 agent's exit code; the supervisor's SIGTERM and SIGKILL if the job does not end within ``timeout``."""
    agents = [sup.procs["trainer"], sup.procs["trainer-1"]]
    rank0 = agents[0].pid
    for task in Path(f"/proc/{rank0}/task").glob("*"):
        for child in (task / "children").read_text().split() if (task / "children").exists() else ():
            os.kill(int(child), signal.SIGTERM)  # the agent's workers: rank 0, this node's one
    deadline = time.monotonic() + timeout
    for agent in agents:
        agent.asked_to_stop = True
        try:
            agent.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.stop(10)
    return agents[0].proc.returncode


def archive_rows(ns: str, url: str, run: str) -> dict[str, int] | None:
    """Rows per archived topic, asked inside host A (its archive's SQL endpoint is on A's loopback)."""
    code = ("import json, sys; from benchmarks.harness.books import archive_counts; "
            f"print(json.dumps(archive_counts({url!r}, {run!r})))")
    done = subprocess.run([*in_ns(ns), sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = uuid.uuid4().hex[:6]
    run = f"hosts-{tag}"
    workdir = Path(args.workdir or ROOT / ".rlstream" / "runs" / run).resolve()
    homes = {h: workdir / f"host-{h}" for h in HOSTS}
    for home in homes.values():
        home.mkdir(parents=True, exist_ok=True)
    archive = f"chdb://{homes['a'] / 'archive'}"
    group_size = LoopSettings().group_size  # the G every stage runs with here, which the books count by
    with ExitStack() as stack:
        hosts, _ = stack.enter_context(network(tag))
        (ns_a, addr_a, _), (_, addr_b, _) = hosts["a"], hosts["b"]
        started = time.monotonic()
        # Host A's brokers, started inside A: they listen on A's address alone.
        up = subprocess.run([*in_ns(ns_a), sys.executable, "-m", "rlstream.infra.broker", "up", "--brokers", "3",
                             "--host", addr_a, "--home", str(homes["a"])], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
        if up.returncode != 0:
            raise SystemExit(f"host A's brokers did not start:\n{up.stdout}\n{up.stderr}")
        stack.callback(broker.down, homes["a"])
        bootstrap = up.stdout.strip().splitlines()[-1]
        log(f"run {run}: brokers {bootstrap} on host A; homes and logs under {workdir}")
        client = {"bootstrap.servers": bootstrap}
        create_topics(client, run, replication=3, partitions=4)
        admin = AdminClient(client)
        sup = Supervisor()
        base = stage_env(bootstrap, run, **ONE_THREAD, RLSTREAM_ARCHIVE=archive)
        trainer = ["run", "trainer", "--weights", str(workdir / "trainer-store" if args.trainer_ranks > 1 else
                                                      homes["b"] / "weights"),
                   "--model", "tiny", "--task", "reverse", "--lr", str(args.lr), "--warmup-steps",
                   str(args.warmup_steps), "--seed", str(args.seed), "--instance", "0", "--weights-transport", "kafka"]
        plan = {
            "archive": ("a", ["run", "archive", "--instance", "0"]),
            "trainer": ("b", trainer),
            "rollout": ("c", ["run", "rollout", "--backend", "transformers", "--instance", "0", "--batch-size",
                              "64"]),
            "env": ("c", ["run", "env", "--instance", "0"]),
            "reward": ("c", ["run", "reward", "--instance", "0"]),
            "prompts": ("c", ["prompts", "--task", "reverse", "--count", "0", "--heldout-count",
                              str(args.heldout_count), "--paced", "--heldout-every", "2"]),
        }
        launch = {}
        if args.trainer_ranks > 1:  # one torchrun job, a node on B (rank 0) and one on C
            plan["trainer-1"] = ("c", trainer)
            launch = {name: ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr",
                             addr_b, "--master-port", str(RENDEZVOUS_PORT), "--max-restarts", "0", "-m",
                             "rlstream.cli"] for rank, name in enumerate(("trainer", "trainer-1"))}
        for name, (h, argv_) in plan.items():
            # gloo binds the host's link to A (its other interface is a loopback the peer cannot reach).
            env = dict(base, RLSTREAM_HOME=str(homes[h]), GLOO_SOCKET_IFNAME=hosts[h][2])
            sup.add(StageProc(name, [*launch[name], *argv_] if name in launch else argv_, env,
                              workdir / "logs" / f"{name}.log", prefix=in_ns(hosts[h][0]), cwd=ROOT,
                              module="torch.distributed.run" if name in launch else "rlstream.cli"))
        stack.callback(lambda: sup.stop_all(STOP_ORDER, timeout=60))
        sup.start_all()
        arrived: queue.SimpleQueue = queue.SimpleQueue()
        view = watch(client, run, arrived)
        stack.callback(view.close)
        progress, best, first, reached_s, killed_at = Progress(), None, None, None, None
        # The longest the loop stood still after the kill: seconds between one announced version and the next,
        # from the kill on (a wedged client call shows up here, not in the time to the target alone).
        paused = Pause()
        while time.monotonic() - started < args.minutes * 60:
            for name, code in sup.check():
                log(f"{name} exited with {code}; restarted (see its log)")
            try:
                while True:
                    fold(progress, arrived.get(timeout=0.5), started)
            except queue.Empty:
                pass
            paused.seen(progress.version, time.monotonic())
            done = latest_complete_round(progress, args.heldout_count, time.monotonic() - started)
            if done is not None:
                first = first if first is not None else min(progress.rounds.values())[1]
                best = done
            if killed_at is None and progress.version >= args.kill_at_version:
                nodes = broker.status(homes["a"])
                victim = max(nodes)  # not node 1, whose address the workers' bootstrap lists first
                os.kill(nodes[victim]["pid"], signal.SIGKILL)
                killed_at = progress.version
                paused.start(killed_at, time.monotonic())
                log(f"v{progress.version}: SIGKILLed broker {victim} ({nodes[victim]['bootstrap']}); it stays dead")
            if best is not None and best[0] > 0 and best[1] >= args.target:
                reached_s = time.monotonic() - started
                log(f"held-out {best[1]:.2f} by v{best[0]} after {reached_s:.0f} s: target {args.target} reached")
                break
        else:
            log(f"target {args.target} not reached in {args.minutes} min (best {best})")

        # Drain: no more prompts; every task's samples through, and the archive holding every record.
        sup.procs["prompts"].stop(60)
        tail = TopicTail(client, run, name="hosts-books")
        stack.callback(tail.close)
        wait_until(tail.caught_up, 120, 1.0, "the books' reader to catch up")
        task_ids = [s.record.task_id for s in tail.snapshot("prompts") if s.record]
        books = Books(tail, task_ids, group_size)
        deadline = time.monotonic() + args.drain_timeout
        while time.monotonic() < deadline:
            missing = books.missing()
            counts = {t: tail.count(t) for t in ARCHIVED}
            rows = archive_rows(ns_a, archive, run) or {}
            behind = {t: n - rows.get(t, 0) for t, n in counts.items() if n > rows.get(t, 0)}
            if not any(missing.values()) and not behind and tail.caught_up():
                break
            log(f"draining: missing {missing}, archive behind by {behind}")
            time.sleep(3.0)
        codes = {name: stop_gang(sup) if name == "trainer" and "trainer-1" in sup.procs else sup.procs[name].stop(60)
                 for name in STOP_ORDER if name in sup.procs}
        log(f"stopped: exit codes {codes}")
        tail.settle(timeout=120)
        missing = books.missing()
        dup_topics = duplicates(tail)
        versions_bad = policy_order(tail)
        tb = trainer_books(admin, run, tail)
        n_versions = len(tail.snapshot("policy-versions"))
    # Everything on the hosts has stopped and the network is gone: the archive is read from its files.
    arch_missing, arch_dup, arch_extra = archive_check(archive, run, tail)
    lost = sum(missing.values()) + sum(arch_missing.values())
    duplicated = sum(dup_topics.values()) + sum(arch_dup.values()) + sum(arch_extra.values())
    books_ok = tb["trained"] + tb["refused"] + tb["evicted"] + tb["skipped"] == tb["consumed"]
    print(f"missing: {missing}; archive missing: {arch_missing}")
    print(f"duplicated on topics: {dup_topics}; in archive: {arch_dup}; archive rows not on topics: {arch_extra}")
    print(f"trainer books: trained {tb['trained']} + refused {tb['refused']} + evicted {tb['evicted']} + skipped "
          f"{tb['skipped']}; rewards the trainer committed: {tb['consumed']} ({'equal' if books_ok else 'NOT EQUAL'})")
    if versions_bad:
        print("policy versions out of order: " + "; ".join(versions_bad[:10]))
    reached = reached_s is not None
    ok = reached and lost == 0 and duplicated == 0 and not versions_bad and books_ok and killed_at is not None
    print(f"reached={'yes' if reached else 'no'} seconds_to_target={reached_s or float('nan'):.0f} "
          f"heldout_start={first if first is not None else float('nan'):.2f} "
          f"heldout_best={best[1] if best else float('nan'):.2f} versions={n_versions} tasks={len(task_ids)} "
          f"lost={lost} duplicated={duplicated} broker_killed_at=v{killed_at} unplanned_exits={len(sup.crashes)} "
          f"trainer_ranks={args.trainer_ranks} longest_pause_after_kill_s={paused.longest:.1f}",
          flush=True)
    record("three_hosts", dict(ok=ok, reached=reached, seconds_to_target=reached_s, versions=n_versions,
                               tasks=len(task_ids), lost=lost, duplicated=duplicated, books_equal=books_ok,
                               broker_killed_at_version=killed_at, unplanned_exits=len(sup.crashes),
                               trainer_ranks=args.trainer_ranks, longest_pause_after_kill_s=paused.longest),
           [Goal("ok", ">=", 1), Goal("lost", "<=", 0), Goal("duplicated", "<=", 0)], seed=args.seed)
    # Its brokers' data, archive and weights (the hosts' homes) are scratch once it passed; its logs stay. A failed
    # run keeps them to read, and a folder the user gave is theirs.
    if ok and not args.workdir:
        discard(None, run, workdir, folders=(*(f"host-{h}" for h in HOSTS), "trainer-store"))
    elif not ok:
        log(f"the hosts' data kept under {workdir} for the failure's records")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
