"""The ``rlstream`` command line: what users type and what tests and benchmarks drive."""
from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys

from rlstream import config
from rlstream.config import KafkaSettings, LoopSettings
from rlstream.config import load as settings
from rlstream.errors import MissingPackage, RestartToResume, UsageError, UserError

#: The two kinds of process ``rlstream run`` starts: a stage (decode, handle, encode) that the StageRunner drives,
#: and a service with a loop of its own (``serve(kafka, runtime)`` until ``stop()``): the trainer, the archive, the
#: monitor. Both live by the one process lifecycle (``runtime/lifecycle.py``).
STAGE, SERVICE = "stage", "service"

#: Process name -> (kind, module, class, settings class or None). Imported lazily: torch is slow to load.
STAGES: dict[str, tuple[str, str, str, str | None]] = {
    "reward": (STAGE, "rlstream.stages.reward", "RewardStage", "RewardSettings"),
    "env": (STAGE, "rlstream.stages.env", "EnvStage", "EnvSettings"),
    "rollout": (STAGE, "rlstream.stages.rollout", "RolloutStage", "RolloutSettings"),
    "teacher": (STAGE, "rlstream.stages.teacher", "TeacherStage", "TeacherSettings"),
    "trainer": (SERVICE, "rlstream.trainer.service", "TrainerService", "TrainerSettings"),
    "archive": (SERVICE, "rlstream.archive.sink", "ArchiveSink", "ArchiveSettings"),
    "monitor": (SERVICE, "rlstream.monitoring.monitor", "Monitor", "MonitorSettings"),
}


def kafka_settings(args: argparse.Namespace) -> KafkaSettings:
    """The command's Kafka settings, returned once the broker answers (--broker-wait-s)."""
    from rlstream.kafka.topics import wait_for_broker
    kafka = settings(KafkaSettings, args)
    wait_for_broker(kafka.client_config(), kafka.broker_wait_s)
    return kafka


def cmd_up(args: argparse.Namespace) -> None:
    from rlstream.infra import broker
    print(broker.up(settings(LoopSettings, args).home_path, brokers=args.brokers, host=args.host))


def cmd_down(args: argparse.Namespace) -> None:
    from rlstream.infra import broker
    home = settings(LoopSettings, args).home_path
    broker.down(home)
    print("broker stopped (data kept under", home, ")")


def _topic_partitions(pairs: list[str]) -> dict[str, int]:
    """``--topic-partitions TOPIC=N`` flags as a dict."""
    out = {}
    for pair in pairs:
        topic, _, count = pair.partition("=")
        if not count.isdigit():
            raise UsageError(f"--topic-partitions {pair!r}: expected TOPIC=N, e.g. rewards=16")
        out[topic] = int(count)
    return out


def cmd_topics(args: argparse.Namespace) -> None:
    from rlstream.kafka.topics import TOPICS, create_topics, delete_topics, partition_counts, topic_name
    if args.delete:
        kafka = kafka_settings(args)
        deleted = delete_topics(kafka.client_config(), kafka.run)
        for name in deleted:
            print("deleted " + name)
        if not deleted:
            print(f"run {kafka.run} has no topics on {kafka.bootstrap}")
        return
    overrides = _topic_partitions(args.topic_partitions)
    counts = partition_counts(args.partitions, overrides)  # refused before the broker is asked anything
    kafka = kafka_settings(args)
    created = create_topics(kafka.client_config(), kafka.run, replication=args.replication,
                            partitions=args.partitions, overrides=overrides)
    for logical in TOPICS:
        name = topic_name(kafka.run, logical)
        print(("created " if name in created else "exists  ") + name +
              (f" ({counts[logical]} partitions)" if name in created else ""))


def _stage_parts(stage: str):
    _, module_name, cls_name, settings_name = STAGES[stage]
    module = importlib.import_module(module_name)
    settings_cls = getattr(module, settings_name) if settings_name else None
    return getattr(module, cls_name), settings_cls


def cmd_run(args: argparse.Namespace) -> int:
    """One stage or service process, on the process lifecycle (``runtime/lifecycle.py``): its signals, its stop
    deadline, its metrics server and its exit code."""
    from rlstream.runtime import lifecycle
    from rlstream.runtime.settings import RuntimeSettings
    runtime = settings(RuntimeSettings, args)
    # Before the broker wait: a Ctrl-C while waiting stops the process as it would any other time.
    life = lifecycle.process().configure(args.stage, runtime.stop_timeout_s)
    try:
        _run_process(args, life, runtime)
    except BaseException:
        life.finish(lifecycle.EXIT_USER)  # main() says what went wrong; the exit must not hang on a thread either
        raise
    return life.finish()


def _make_stage(name: str, args: argparse.Namespace):
    stage_cls, settings_cls = _stage_parts(name)
    stage_settings = settings(settings_cls, args) if settings_cls else None
    loop = settings(LoopSettings, args)
    extra = {"loop": loop} if "loop" in inspect.signature(stage_cls).parameters else {}
    try:
        return stage_cls(stage_settings, **extra) if settings_cls else stage_cls(**extra)
    except ValueError as exc:  # stages validate their settings on construction
        raise UsageError(str(exc)) from None


def _run_process(args: argparse.Namespace, life, runtime) -> None:
    kafka = kafka_settings(args)  # waits for the broker (--broker-wait-s), then a UserError
    from rlstream.runtime.chain import CHAINS
    from rlstream.runtime.profile import maybe_start
    maybe_start(args.stage)  # a chain too: its file is named env+reward-PID
    if args.stage in CHAINS:  # two stages, one process, one transaction each batch (runtime/chain.py)
        first, second = (_make_stage(name, args) for name in CHAINS[args.stage])
        life.serve_metrics(runtime.metrics_port, runtime.metrics_addr)
        from rlstream.runtime.runner import StageRunner
        StageRunner(first, kafka, runtime, then=second).run()
        return
    stage = _make_stage(args.stage, args)
    life.serve_metrics(runtime.metrics_port, runtime.metrics_addr)
    if STAGES[args.stage][0] == SERVICE:
        # A service: ``serve(kafka, runtime)`` runs its loop until ``stop()`` (or its own end).
        forget = life.on_stop(stage.stop)
        try:
            stage.serve(kafka, runtime)
        finally:
            forget()
    else:
        from rlstream.runtime.runner import StageRunner
        StageRunner(stage, kafka, runtime).run()  # the runner registers its own stop with the lifecycle


def build_parser(stage: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlstream", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("up", help="start a local Kafka broker (data under HOME, .rlstream/); prints the bootstrap")
    p.add_argument("--brokers", type=int, default=1, choices=(1, 3), help="1, or 3 for a replicated cluster")
    p.add_argument("--host", default=None,
                   help="the address of this machine the broker listens on and advertises (default "
                        "$RLSTREAM_KAFKA_HOST or 127.0.0.1; the port is $RLSTREAM_KAFKA_PORT or 9092)")
    config.add_arguments(p, LoopSettings, only=("home",))
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop the local Kafka broker (data kept)")
    config.add_arguments(p, LoopSettings, only=("home",))
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("topics", help="create the run's topics (or delete them: --delete)")
    config.add_arguments(p, LoopSettings, only=("run",))
    config.add_arguments(p, KafkaSettings)
    p.add_argument("--replication", type=int, default=1, help="replication factor (3 on a 3-broker cluster)")
    p.add_argument("--partitions", type=int, default=None,
                   help="partitions of every topic (default: each topic's own, 8 for the loop's): the most consumers "
                        "of one stage's group that share its work; existing topics are kept as they are")
    p.add_argument("--topic-partitions", action="append", default=[], metavar="TOPIC=N",
                   help="one topic's partitions (repeat the flag); prompts, eval-prompts, actions and observations "
                        "must stay equal")
    p.add_argument("--delete", action="store_true",
                   help="delete the run's topics instead, and their records with them (what the archive holds stays)")
    p.set_defaults(func=cmd_topics)

    from rlstream.runtime.chain import CHAINS
    p = sub.add_parser("run", help="run one stage process: " + ", ".join([*STAGES, *CHAINS]))
    p.add_argument("stage", choices=sorted([*STAGES, *CHAINS]), metavar="STAGE",
                   help="one of " + ", ".join(STAGES) + "; or " + ", ".join(CHAINS) + ": both stages in one process "
                        "and one transaction, every topic kept (rlstream/runtime/chain.py)")
    config.add_arguments(p, LoopSettings)
    config.add_arguments(p, KafkaSettings)
    from rlstream.runtime.settings import RuntimeSettings
    config.add_arguments(p, RuntimeSettings)
    for name in CHAINS.get(stage, (stage,) if stage in STAGES else ()):
        _, settings_cls = _stage_parts(name)
        if settings_cls:
            config.add_arguments(p, settings_cls)
    p.set_defaults(func=cmd_run)

    for extra in ("rlstream.sources.prompts", "rlstream.archive.query", "rlstream.stages.replay",
                  "rlstream.archive.report", "rlstream.envs.server", "rlstream.gateway.server", "rlstream.demo",
                  "rlstream.trainer.export"):
        importlib.import_module(extra).add_command(sub)
    sub.choices["prompts"].set_defaults(func=cmd_prompts)
    return parser


def cmd_prompts(args: argparse.Namespace) -> None:
    """``rlstream prompts`` on the process lifecycle: SIGTERM/SIGINT end a paced source between writes, its last one
    flushed, exit 0 (an orchestrator stops it this way)."""
    from rlstream.runtime import lifecycle
    from rlstream.sources.prompts import cmd_prompts as produce_prompts
    life = lifecycle.process().configure("prompts", 60.0)
    try:
        produce_prompts(args, stop=life.stopping.is_set)
    finally:
        life.finish()


def _missing_package(exc: ModuleNotFoundError, who: str) -> int:
    """Exit code 1 with the install command when an optional package is missing; any other module (a user's own, or
    a broken install) raises on, since its traceback says where."""
    missing = MissingPackage.of(exc)
    if missing is None:
        raise exc
    print(f"{who}: {missing}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlstream`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # A stage's own flags are only known once the stage is named.
    stage = argv[argv.index("run") + 1] if "run" in argv and argv.index("run") + 1 < len(argv) else None
    try:
        parser = build_parser(stage)  # imports the stage's module for its flags
    except ValueError as exc:
        print(f"rlstream: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _missing_package(exc, "rlstream")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except ModuleNotFoundError as exc:
        return _missing_package(exc, f"rlstream {args.command}")
    except UsageError as exc:
        print(f"rlstream {args.command}: {exc}", file=sys.stderr)
        return 2
    except UserError as exc:  # the broker's and the archive's errors too: their messages say what to do
        print(f"rlstream {args.command}: {exc}", file=sys.stderr)
        return 1
    except RestartToResume as exc:
        print(f"rlstream {args.command}: {exc}", file=sys.stderr)
        return RestartToResume.EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from rlstream.kafka.errors import KafkaException
        if isinstance(exc, KafkaException):  # the broker's own answer, e.g. an unknown topic or a refused ACL
            print(f"rlstream {args.command}: {exc}", file=sys.stderr)
            return 1
        raise
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
