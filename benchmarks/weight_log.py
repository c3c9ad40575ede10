"""Weights through Kafka: bytes per version of anchors and deltas after real optimizer steps, and publish-to-load
latency of a worker that shares no path with the trainer.

    python -m benchmarks.weight_log [--steps 12] [--anchor-every 10] [--hidden 256] [--layers 4] [--lr 1e-5]

A Qwen2 built in code (random init) trains with AdamW in fp32 on random tokens; each version is published as bf16
(what rollout engines load) through ``WeightLogWriter`` in a transaction with its PolicyVersion, as the trainer
does, and a ``WeightLogReader`` with its own cache directory rebuilds and hash-checks it at once. Printed: per
version its kind, payload bytes and share of a full anchor, the checkpoint's time (``save_pretrained``, read back,
content hash), the publishing transaction's, and the time from the version's creation (before its checkpoint is
written, as the trainer's PolicyVersion) to the rebuilt, verified folder (p50 / p99 over deltas and anchors); and
the baseline: ``safetensors.save_file`` of the same bf16 tensors to one local file (what a store on a shared path
costs the trainer). Needs a broker ($RLSTREAM_BOOTSTRAP). One process does both sides in turn, so the latency has
no queueing in it. ``--hidden 768 --layers 8 --vocab 16384`` is a ~100 M-parameter model.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.harness.result import result
from benchmarks.harness.stats import percentile
from rlstream.config import KafkaSettings
from rlstream.kafka import records
from rlstream.kafka.topics import create_topics
from rlstream.kafka.transactions import TransactionalProducer
from rlstream.policy.deltas import content_hash, read_folder
from rlstream.policy.weight_log import WeightLogReader, WeightLogWriter, parse_uri
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion


def build_model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one line per version, not a bar per save
    bootstrap = os.environ.get("RLSTREAM_BOOTSTRAP", "127.0.0.1:9092")
    run = "bench-wl-" + uuid.uuid4().hex[:8]
    create_topics({"bootstrap.servers": bootstrap}, run)
    kafka = KafkaSettings(bootstrap=bootstrap, run=run)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  commit {commit}  "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cores {os.cpu_count()}")

    model = build_model(args.hidden, args.layers, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    txn = TransactionalProducer(kafka, f"{run}.bench", who="bench", transaction_timeout_ms=120000)
    txn.start()
    writer = WeightLogWriter(run, "policy", args.anchor_every)
    work = Path(tempfile.mkdtemp(prefix="weight-log-bench-"))
    reader = WeightLogReader(kafka.client_config(), run, work / "worker-cache")
    print(f"model: Qwen2 {params / 1e6:.1f} M parameters, published as bf16 ({2 * params / 1e6:.1f} MB)")
    rows = []
    for version in range(args.steps + 1):
        if version:
            ids = torch.randint(0, args.vocab, (4, 64))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        bf16 = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        save_file(bf16, str(work / "plain.safetensors"))
        plain = time.perf_counter() - t0
        created = time.perf_counter()
        folder = work / "trainer" / f"v{version}"
        model.save_pretrained(folder, state_dict=bf16)
        content = read_folder(folder)
        digest = content_hash(content)
        started = time.perf_counter()
        pv = PolicyVersion("policy", version, "", created_at=hdr.now_ms(), published_at=hdr.now_ms(),
                           content_hash=digest)

        def body():
            pv.weights_uri = writer.produce(txn, content, digest, version)
            records.produce(txn, run, "policy-versions", b"policy", pv, version)
        assert txn.transact(body), "publishing transaction aborted"
        writer.committed()
        published = time.perf_counter()
        loaded = reader.fetch(pv)
        done = time.perf_counter()
        assert content_hash(read_folder(loaded)) == digest
        ref = parse_uri(pv.weights_uri)
        rows.append((version, "anchor" if ref.anchor == version else "delta", writer.last_payload_bytes,
                     published - started, done - created, started - created, plain))
    full = [r[2] for r in rows if r[1] == "anchor"]
    anchor_bytes = sum(full) / len(full)
    print(f"{'version':>7} {'kind':>6} {'payload MB':>10} {'of anchor':>9} {'checkpoint s':>12} {'publish s':>9} "
          f"{'to loaded s':>11} {'file s':>6}")
    for version, kind, size, pub, total, ckpt, plain in rows:
        print(f"{version:>7} {kind:>6} {size / 1e6:>10.2f} {size / anchor_bytes:>9.1%} {ckpt:>12.3f} {pub:>9.3f} "
              f"{total:>11.3f} {plain:>6.3f}")
    for kind in ("delta", "anchor"):
        lat = [r[4] for r in rows if r[1] == kind]
        sizes = [r[2] for r in rows if r[1] == kind]
        if lat:
            print(f"{kind}: n={len(lat)} mean {sum(sizes) / len(sizes) / 1e6:.2f} MB "
                  f"({sum(sizes) / len(sizes) / anchor_bytes:.1%} of an anchor); publish->loaded p50 "
                  f"{percentile(lat, 50):.3f} s p99 {percentile(lat, 99):.3f} s (checkpoint p50 "
                  f"{percentile([r[5] for r in rows if r[1] == kind], 50):.3f} s)")
    plain, size = [r[6] for r in rows], (work / "plain.safetensors").stat().st_size
    print(f"baseline: save_file of the bf16 tensors to a local file ({size / 1e6:.1f} MB) p50 "
          f"{percentile(plain, 50):.3f} s p99 {percentile(plain, 99):.3f} s")
    deltas = [r[2] for r in rows if r[1] == "delta"]
    result("weight_log", steps=args.steps, anchor_mb=anchor_bytes / 1e6,
           delta_of_anchor=sum(deltas) / len(deltas) / anchor_bytes if deltas else float("nan"),
           loaded_p50_s=percentile([r[4] for r in rows], 50), save_file_p50_s=percentile(plain, 50))


if __name__ == "__main__":
    main()
