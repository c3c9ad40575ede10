"""LoRA's two goals (issue 29), in one run: a version's publish -> generating latency with a rank-16 adapter against
whole weights, and the trainer's peak RSS with LoRA against a full fine-tune.

    python -m benchmarks.lora_publish [--steps 8] [--rank 16] [--transport store|kafka] [--dtype bf16]
    python -m benchmarks.lora_publish --hidden 64 --layers 2 --intermediate 128 --vocab 512 --steps 2   # smoke
    python -m benchmarks.lora_publish --model DIR/model   # a Hugging Face folder instead: SmolLM2-135M-Instruct
        # after `python -m rlstream.recipes.smollm2.build --out DIR` (tied embeddings: LoRA leaves the head out)

The default model, built in code (random init, no download), has TinyLlama's shape, the issue's 1 B parameters:
a Qwen2 of hidden 2048, 22 layers, MLP 5632, 32 heads over 4 KV heads, a 32k vocabulary, untied (1.1 B).
``--hidden/--layers/--intermediate/--vocab`` size it down.

Each mode (``full``, ``lora``, ``lora-adapter``) is a trainer process of its own, a child of this one, so its peak RSS
(``VmHWM``) is the trainer's alone: the model in ``--dtype`` (bf16 by default, so the 1 B full
fine-tune's weights, gradients and AdamW moments, about 9 GB, fit a 24 GB machine beside the worker; ``fp32`` doubles
them), the trainer's engine (``trainer.sharding.make_engine``: AdamW over what requires a gradient, a LoRA run's
adapter alone) taking ``--steps`` steps of a language-model loss on random tokens, and every version published as
``TrainerService._publish`` does: the folder written into a ``WeightStore`` by ``PendingVersion`` (whole weights:
``VersionWriter``; LoRA: the trainer's own ``LoraTraining``, which writes the base once by content hash and each
version's adapter folder), the load probe computed, the PolicyVersion committed in a transaction (with
``--transport kafka`` the version's chunks through ``WeightLogWriter`` first, a LoRA run's base once with its first
version). The RSS after the imports, before the model exists, is reported too: at small sizes it is most of both.

This process is the rollout worker, as the stage is: a ``PolicyWatcher`` sees the committed record,
``PolicyWeights`` prefetches and loads the version into the in-process transformers engine (whole weights swapped in;
a LoRA version's adapter, after the base-hash rule, merged over the base the engine was built from in mode ``lora``,
into PEFT's layers unmerged in mode ``lora-adapter``: ``--lora-serving``), which samples one token. The clock runs from the version's creation (after its optimizer step, before its folder is written; the
trainer's ``created_at``) to that token (``time.monotonic``, one clock for both processes). The trainer waits for
the worker's token before its next step, so neither side's CPU is in the other's figure. Version 0 builds the
worker's engine and is not counted. Needs a broker ($RLSTREAM_BOOTSTRAP).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.harness.record import Goal, record
from benchmarks.harness.stats import percentile
from rlstream.models.resources import peak_rss

#: Each mode's policy: whole weights; LoRA served merged (the transformers engine's default); LoRA served unmerged
#: (``--lora-serving adapter``: PEFT's layers in the engine, a load moving the adapter alone).
POLICY = {"full": "full", "lora": "lora", "lora-adapter": "lora-adapter"}
SERVING = {"lora": "merged", "lora-adapter": "adapter"}
PROTOCOL = "@@ "  # a line of the trainer child's stdout meant for this process


def build_model(args):
    """(model, tokenizer) in ``--dtype``: ``--model`` FOLDER, or a Qwen2 built in code of the asked size."""
    from rlstream.models.loading import load_model, load_tokenizer
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.model:
        return load_model(args.model, args.dtype), load_tokenizer(args.model)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rlstream.models.tiny import build_tokenizer
    torch.manual_seed(0)
    heads = max(1, args.hidden // 64)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 8), max_position_embeddings=256,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(dtype), build_tokenizer()


def say(**message) -> None:
    print(PROTOCOL + json.dumps(message), flush=True)


def trainer(args) -> None:
    """The child: one mode's trainer (module docstring); each version announced on stdout, the next step taken once
    the worker answers on stdin."""
    from rlstream.config import KafkaSettings
    from rlstream.kafka import records
    from rlstream.kafka.transactions import TransactionalProducer
    from rlstream.policy.probe import trainer_probe
    from rlstream.policy.weight_log import WeightLogWriter
    from rlstream.policy.weights import WeightStore
    from rlstream.schemas import headers as hdr
    from rlstream.schemas.records import PolicyVersion
    from rlstream.trainer.checkpoint import PendingVersion, VersionWriter
    from rlstream.trainer.lora import LoraTraining
    from rlstream.trainer.settings import TrainerSettings
    from rlstream.trainer.sharding import make_engine
    torch.set_num_threads(args.threads)
    imported = peak_rss()
    policy, lora = POLICY[args.mode], args.mode in SERVING
    kafka = KafkaSettings(bootstrap=args.bootstrap, run=args.run)
    store = WeightStore(str(Path(args.work) / f"store-{args.mode}"))
    model, tok = build_model(args)
    params, vocab = sum(p.numel() for p in model.parameters()), model.config.vocab_size
    training = LoraTraining(TrainerSettings(lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                                            weights_transport=args.transport), eta=2) if lora else None
    if training:
        model = training.fresh(model, tok, store, policy, lead=True)
    engine = make_engine(model, 1e-5, 1.0, "none")
    model = engine.model
    writer = training.writer(model, tok) if training else VersionWriter(model, tok)
    log_writer = WeightLogWriter(args.run, policy) if args.transport == "kafka" else None
    txn = TransactionalProducer(kafka, f"{args.run}.{args.mode}", who="bench", transaction_timeout_ms=60000)
    txn.start()
    writes = ThreadPoolExecutor(1, thread_name_prefix="publish-write")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    for version in range(args.steps + 1):
        if version:
            ids = torch.randint(0, vocab, (2, args.seq), generator=g)
            model.train()
            engine.step(engine.forward(input_ids=ids, labels=ids).loss)
            model.eval()
        created, created_ms = time.monotonic(), hdr.now_ms()
        written = {}

        def write(folder, on_content):
            def hand_over(content, digest):
                if log_writer is not None:
                    log_writer.prepare(content, version)
                on_content(content, digest)
            written["content"], written["digest"] = writer.write(folder, on_content=hand_over)

        pending = PendingVersion(writes, store, policy, version, write)
        probe_ids, probe_lps = trainer_probe(model)  # while the folder is written, as TrainerService._publish does

        def body():
            uri = None
            if log_writer is not None:
                content, digest = pending.content()
                uri = log_writer.produce(txn, content, digest, version)
            stored = pending.uri()  # the folder is there before the record that announces it
            uri = uri or stored
            pv = PolicyVersion(policy, version, uri, created_at=created_ms, published_at=hdr.now_ms(),
                               content_hash=written["digest"], probe_token_ids=probe_ids, probe_logprobs=probe_lps,
                               **(training.fields() if training else {}))
            records.produce(txn, args.run, "policy-versions", policy.encode(), pv, version)
        assert txn.transact(body), "publishing transaction aborted"
        if log_writer is not None:
            log_writer.committed()
        version_bytes = sum(len(v) for v in written["content"].files.values()) + \
            sum(t.numel() * t.element_size() for t in written["content"].tensors.values())
        say(version=version, created=created, publish_s=time.monotonic() - created, version_mb=version_bytes / 1e6)
        if sys.stdin.readline().strip() != "next":
            return
        store.prune(policy, keep_from=version - 2, keep={0})
    say(peak_rss=peak_rss(), import_rss=imported, params=params, trainable=trainable)


def worker(args, mode: str, run: str, work: Path, client_config: dict) -> dict:
    """This process: follow ``mode``'s trainer child as a rollout worker; its rows and the child's RSS."""
    from rlstream.engine.local import TransformersBackend
    from rlstream.policy.watcher import PolicyWatcher
    from rlstream.policy.weights import PolicyWeights
    from rlstream.schemas.records import SamplingParams
    policy = POLICY[mode]
    watcher = PolicyWatcher(client_config, run, policy)
    weights = PolicyWeights(work / f"cache-{mode}", client_config, run)
    sampling = SamplingParams(max_tokens=1, temperature=1.0)
    argv = [sys.executable, "-m", "benchmarks.lora_publish", "--role", "trainer", "--mode", mode, "--run", run,
            "--work", str(work), "--bootstrap", args.bootstrap, "--steps", str(args.steps), "--rank", str(args.rank),
            "--transport", args.transport, "--dtype", args.dtype, "--hidden", str(args.hidden), "--layers",
            str(args.layers), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab), "--seq",
            str(args.seq), "--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows, backend, out = [], None, {}
    try:
        for line in child.stdout:
            if not line.startswith(PROTOCOL):
                sys.stdout.write(line)
                continue
            msg = json.loads(line[len(PROTOCOL):])
            if "peak_rss" in msg:
                out.update(msg)
                continue
            v = msg["version"]
            assert watcher.wait_for(v, 300), f"{policy} v{v} not seen"
            pv = watcher.latest
            t0 = time.monotonic()
            if backend is None:  # the worker's start: its engine built from the version's (or its base's) folder
                backend = TransformersBackend(weights.engine_folder(pv), threads=args.threads,
                                              lora_serving=SERVING.get(mode, "auto"))
                backend.version = pv.version  # what the rollout stage's build says of the engine it built
                weights.adopt(pv, backend)
                weights.verify_first(pv, backend)
            else:  # as the rollout stage swaps (PolicyFollower.prefetch, then swap)
                weights.prefetch(pv, folder=not backend.loads_tensors)
                weights.load(pv, backend)
            loaded = time.monotonic()
            backend.generate([[1, 5, 6]], sampling)
            done = time.monotonic()
            assert backend.version == v, (backend.version, v)
            rows.append({"version": v, "total": done - msg["created"], "publish": msg["publish_s"],
                         "load": loaded - t0, "mb": msg["version_mb"]})
            print(f"{mode:>12} v{v}: {msg['version_mb']:9.2f} MB, created->generating {done - msg['created']:.3f} s "
                  f"(trainer's publish {msg['publish_s']:.3f} s, worker's load {loaded - t0:.3f} s)", flush=True)
            child.stdin.write("next\n")
            child.stdin.flush()
    finally:
        watcher.close()
        if child.poll() is None and child.stdin:
            child.stdin.close()
        child.wait(600)
    if child.returncode != 0 or "peak_rss" not in out:
        raise SystemExit(f"the {mode} trainer exited {child.returncode} without its figures")
    out["rows"] = [r for r in rows if r["version"] > 0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="versions measured per mode (after version 0)")
    ap.add_argument("--rank", type=int, default=16, help="the LoRA rank (alpha = 2 x rank, every linear layer)")
    ap.add_argument("--transport", choices=("store", "kafka"), default="store",
                    help="how versions reach the worker: the weight store's folder, or the weights log")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the trained model's dtype")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=32, help="tokens of each of a step's 2 sequences")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and of the worker")
    ap.add_argument("--model", default="", help="a Hugging Face folder instead of the model built in code")
    ap.add_argument("--role", choices=("bench", "trainer"), default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=tuple(POLICY), default="full", help=argparse.SUPPRESS)
    ap.add_argument("--run", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", default=os.environ.get("RLSTREAM_BOOTSTRAP", "127.0.0.1:9092"),
                    help="the broker (default $RLSTREAM_BOOTSTRAP)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.role == "trainer":
        trainer(args)
        return
    from benchmarks.harness.scratch import discard_at_exit, run_name
    from rlstream.kafka.topics import create_topics
    torch.set_num_threads(args.threads)
    client = {"bootstrap.servers": args.bootstrap}
    run = run_name("lora")
    create_topics(client, run)
    discard_at_exit(args.bootstrap, run)  # a 1 B run's weights topic holds GBs
    work = Path(tempfile.mkdtemp(prefix="lora-publish-bench-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  commit {commit}  "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cores {os.cpu_count()}", flush=True)
    got = {mode: worker(args, mode, run, work, client) for mode in POLICY}
    full, lora = got["full"], got["lora"]
    p99 = {m: percentile([r["total"] for r in got[m]["rows"]], 99) for m in got}
    p50 = {m: percentile([r["total"] for r in got[m]["rows"]], 50) for m in got}
    mb = {m: percentile([r["mb"] for r in got[m]["rows"]], 50) for m in got}
    print(f"model: {full['params'] / 1e6:.1f} M parameters in {args.dtype}; LoRA rank {args.rank} trains "
          f"{lora['trainable'] / 1e6:.2f} M; transport {args.transport}")
    for m in POLICY:
        print(f"{m:>12}: n={len(got[m]['rows'])} version {mb[m]:.2f} MB; created->generating p50 {p50[m]:.3f} s "
              f"p99 {p99[m]:.3f} s; trainer peak RSS {got[m]['peak_rss'] / 2**20:.0f} MiB (after its imports "
              f"{got[m]['import_rss'] / 2**20:.0f} MiB)")
    record("lora_publish", dict(
        params_m=full["params"] / 1e6, trainable_m=lora["trainable"] / 1e6, rank=args.rank, steps=args.steps,
        transport=args.transport, dtype=args.dtype, full_version_mb=mb["full"], lora_version_mb=mb["lora"],
        full_p50_s=p50["full"], full_p99_s=p99["full"], lora_p50_s=p50["lora"], lora_p99_s=p99["lora"],
        lora_vs_full_p99_ratio=p99["lora"] / p99["full"], lora_adapter_p50_s=p50["lora-adapter"],
        lora_adapter_p99_s=p99["lora-adapter"], lora_adapter_vs_full_p99_ratio=p99["lora-adapter"] / p99["full"],
        full_rss_mib=full["peak_rss"] / 2**20, lora_rss_mib=lora["peak_rss"] / 2**20,
        import_rss_mib=full["import_rss"] / 2**20, lora_vs_full_rss_ratio=lora["peak_rss"] / full["peak_rss"],
        # Where each mode's time goes: the trainer's publish (its load probe beside the folder's write, then the
        # transaction) and the worker's load (fetch, load, its own probe); the rest is the watch and the token.
        **{f"{m.replace('-', '_')}_{part}_p50_s": percentile([r[part] for r in got[m]["rows"]], 50)
           for m in POLICY for part in ("publish", "load")}),
        # The goals, set for 1 B parameters (the default size); smaller models only show the path works.
        [Goal("lora_p99_s", "<=", 0.3), Goal("lora_vs_full_p99_ratio", "<=", 0.1),
         Goal("lora_adapter_p99_s", "<=", 0.3), Goal("lora_adapter_vs_full_p99_ratio", "<=", 0.1),
         Goal("lora_vs_full_rss_ratio", "<=", 0.5)])


if __name__ == "__main__":
    main()
