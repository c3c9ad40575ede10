"""Teacher tokens/s through the teacher stage against the same scoring called directly, in one run.

    python -m benchmarks.teacher_tokens [--samples 256] [--prompt-tokens 64] [--response-tokens 192] [--top-k 8]
                                        [--model DIR] [--no-vllm] [--seed 0]
    python -m benchmarks.teacher_tokens --smoke        # a few small samples: does it still run

- stage: ``rlstream run teacher --teacher DIR --top-k K`` as its own process on a fresh run of the local broker. A
  first record is scored before the clock starts (the process, the model and the consumer group are up); then the
  samples are produced as scored trajectories and the clock runs until every feedback record is read back
  (committed): decode, the teacher's forward, both feedback forms, encode, the Kafka transaction.
- direct: the stage's own scorer (``stages/teacher/scoring.TorchScorer``, transformers) on the same rows in this
  process: the forward and the top-k alone, no Kafka.
- vllm: vLLM's prompt log-probs on the same rows (``LLM.generate`` with ``prompt_logprobs=K``, ``max_tokens=1``,
  in process, one thread), what a vLLM teacher would call; skipped with ``--no-vllm`` or without vLLM.

Tokens: prompt + response tokens of every sample (each is scored). Every side runs on one thread. The model:
``--model DIR`` (a Hugging Face folder with a tokenizer), else a Qwen2 of the arithmetic recipe's size built in code
(hidden 256, 4 layers, vocab 2048, float32, ~5 M parameters) saved with the tiny model's tokenizer files (the
stage compares tokenizer files only; no text is tokenized).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from benchmarks.harness.record import record  # noqa: E402
from benchmarks.harness.scratch import discard_at_exit, run_name  # noqa: E402
from rlstream.config import KafkaSettings  # noqa: E402
from rlstream.infra.supervisor import StageProc, stage_env  # noqa: E402
from rlstream.kafka.records import TypedProducer  # noqa: E402
from rlstream.kafka.tail import read_to_end  # noqa: E402
from rlstream.kafka.topics import create_topics  # noqa: E402
from rlstream.policy.weights import tokenizer_hash  # noqa: E402
from rlstream.schemas import headers as hdr  # noqa: E402
from rlstream.schemas.records import (PolicyVersion, Reward, SamplingParams, ScoredTrajectory, Task,  # noqa: E402
                                      Trajectory)
from rlstream.stages.teacher.scoring import TorchScorer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build_folder(folder: Path, model_dir: str, seed: int) -> Path:
    """The teacher's folder: ``model_dir`` as given, or the recipe-sized Qwen2 with the tiny tokenizer's files."""
    if model_dir:
        return Path(model_dir)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlstream.models.tiny import build_tokenizer
    config = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         use_sliding_window=False, dtype="float32")
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save_pretrained(folder)
    return folder


def samples(n: int, prompt: int, response: int, vocab: int, seed: int) -> list[ScoredTrajectory]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        task = Task(task_id=f"t{i}", group_id=f"t{i}", task_name="bench", env_name="single", env_version="1",
                    prompt="", sampling=SamplingParams(), created_at=hdr.now_ms(),
                    prompt_token_ids=[rnd.randrange(3, vocab) for _ in range(prompt)], group_size=1)
        traj = Trajectory(trajectory_id=f"x{i}", group_id=task.group_id, sample_index=0, task=task, response="",
                          min_policy_version=0, max_policy_version=0,
                          token_ids=[rnd.randrange(3, vocab) for _ in range(response)], loss_mask=[1] * response,
                          behaviour_logprobs=[-1.0] * response)
        out.append(ScoredTrajectory(traj, Reward(1.0, "v1")))
    return out


def rows_of(batch: list[ScoredTrajectory]) -> list[list[int]]:
    return [s.trajectory.task.prompt_token_ids + s.trajectory.token_ids for s in batch]


def time_stage(folder: Path, batch: list[ScoredTrajectory], k: int, workdir: Path) -> float:
    """Seconds from producing ``batch`` to reading back its feedback, through a running teacher stage."""
    bootstrap = os.environ.get("RLSTREAM_BOOTSTRAP") or __import__("rlstream.infra.broker", fromlist=["up"]).up()
    run = run_name("teacher")
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=2)
    discard_at_exit(bootstrap, run)
    producer = TypedProducer(KafkaSettings(bootstrap=bootstrap, run=run))
    pv = PolicyVersion(policy="policy", version=0, weights_uri=str(folder), created_at=hdr.now_ms(),
                       published_at=hdr.now_ms(), tokenizer_hash=tokenizer_hash(folder))
    producer.send("policy-versions", b"policy", pv, 0)
    producer.send("rewards", b"warm", batch[0], 0)  # scored before the clock starts
    producer.flush()
    proc = StageProc("teacher", ["run", "teacher", "--teacher", str(folder), "--top-k", str(k), "--threads", "1",
                                 "--home", str(workdir / "home"), "--timeout-s", "600", "--handler-timeout-s", "900"],
                     stage_env(bootstrap, run, OMP_NUM_THREADS="1"), workdir / "teacher.log", cwd=ROOT).start()
    conf = {"bootstrap.servers": bootstrap}
    try:
        read_to_end(conf, run, "feedback", expect=1, timeout=300)
        started = time.perf_counter()
        for s in batch:
            producer.send("rewards", s.trajectory.group_id.encode(), s, 0)
        producer.flush()
        got = read_to_end(conf, run, "feedback", expect=len(batch) + 1, timeout=1800)
        elapsed = time.perf_counter() - started
        if len(got) < len(batch) + 1 or any(g.record.status != "ok" for g in got):
            raise RuntimeError(f"the stage returned {len(got) - 1} of {len(batch)} scored samples:\n"
                               + proc.log_tail())
        return elapsed
    finally:
        proc.stop()


def time_direct(folder: Path, rows: list[list[int]], k: int) -> float:
    from rlstream.models.loading import load_model
    scorer = TorchScorer(load_model(folder), torch.device("cpu"), batch_tokens=8192)
    scorer.score(rows[:2], 1.0, k)  # warm-up
    started = time.perf_counter()
    scorer.score(rows, 1.0, k)
    return time.perf_counter() - started


def time_vllm(folder: Path, rows: list[list[int]], k: int) -> float | None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        from vllm import LLM
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt
    except ImportError:
        return None
    llm = LLM(model=str(folder), dtype="float32", max_model_len=max(len(r) for r in rows) + 1, enforce_eager=True,
              skip_tokenizer_init=True, load_format="safetensors", seed=0)
    params = VSampling(max_tokens=1, prompt_logprobs=k, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert len(outs) == len(rows) and all(o.prompt_logprobs for o in outs)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--response-tokens", type=int, default=192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--model", default="")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="8 samples of 8 + 24 tokens, no vLLM")
    a = p.parse_args()
    if a.smoke:
        a.samples, a.prompt_tokens, a.response_tokens, a.no_vllm = 8, 8, 24, True
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="teacher-bench-") as tmp:
        folder = build_folder(Path(tmp) / "teacher", a.model, a.seed)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        batch = samples(a.samples, a.prompt_tokens, a.response_tokens, vocab, a.seed)
        rows = rows_of(batch)
        tokens = sum(map(len, rows))
        figures = {"stage": time_stage(folder, batch, a.top_k, Path(tmp)), "direct": time_direct(folder, rows, a.top_k)}
        if not a.no_vllm:
            figures["vllm"] = time_vllm(folder, rows, a.top_k)
    load = os.getloadavg()[0]
    print(f"{a.samples} samples, {tokens} tokens, top-k {a.top_k}, load {load:.1f}")
    for name, seconds in figures.items():
        if seconds is None:
            print(f"  {name:6s} not installed")
            continue
        print(f"  {name:6s} {tokens / seconds:9.0f} tokens/s ({seconds:.2f} s)")
    stage = tokens / figures["stage"]
    ratios = {name: stage / (tokens / s) for name, s in figures.items() if s and name != "stage"}
    print("  stage / " + ", stage / ".join(f"{n}: {r:.2f}x" for n, r in ratios.items()))
    print(json.dumps({"samples": a.samples, "tokens": tokens, "top_k": a.top_k, "load": load,
                      "seconds": figures, "stage_over": ratios}))
    record("teacher_tokens", {"samples": a.samples, "tokens": tokens, "top_k": a.top_k, "stage_tokens_per_s": stage,
                              **{f"stage_over_{n}": r for n, r in ratios.items()}}, seed=a.seed)


if __name__ == "__main__":
    main()
