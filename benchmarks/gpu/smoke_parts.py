"""What the GPU smoke run's checks are made of (``benchmarks/gpu/smoke.py``): random Qwen2 policies built in code
on the demo tokenizer, tied or untied; complete groups of scored samples and the trainer's batches of them; policy
versions as trainer steps make them; the trainer's log-probs of given tokens; and the small comparisons the checks
share. Library imports that need more than torch and transformers stay inside the functions."""
from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import torch

class Skip(Exception):
    """The check cannot run here; ``part`` names the missing package where that is why."""

    def __init__(self, reason: str, part: str = ""):
        super().__init__(reason)
        self.part = part


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed here", part=module)


def close(a: float, b: float, rel: float, floor: float = 1.0) -> bool:
    """``a`` and ``b`` within ``rel`` of the larger of their size and ``floor`` (a loss near 0 is compared on the
    scale of 1, not of itself)."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel * max(abs(a), abs(b), floor)


def worst(pairs) -> float:
    return max((abs(a - b) for a, b in pairs), default=0.0)


# -- models and batches ------------------------------------------------------------------------------------------

def tokenizer():
    from rlstream.models.tiny import build_tokenizer
    return build_tokenizer()


def new_model(args, tied: bool = False, seed: int = 0):
    """A random Qwen2 on the demo tokenizer's vocabulary, fp32, tied or untied input and output embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tokenizer()
    heads = max(1, args.hidden // 32)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads, head_dim=32,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=256,
                         tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, use_sliding_window=False, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def save(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer().save_pretrained(folder)
    return folder


def groups(seed: int, n_groups: int = 2, size: int = 4, vocab: int = 47, tokens: list[list[int]] | None = None,
           prompts: list[list[int]] | None = None):
    """Complete groups of scored samples: random prompts and responses of mixed lengths (or the given ones)."""
    from rlstream.schemas.records import Reward, SamplingParams, ScoredTrajectory, Task, Trajectory
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        gid = f"s{seed}g{g}"
        prompt = prompts[g] if prompts else [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(3, 12))]
        task = Task(task_id=gid, group_id=gid, task_name="smoke", env_name="smoke", env_version="1", prompt="",
                    sampling=SamplingParams(temperature=1.0), created_at=0, group_size=size, prompt_token_ids=prompt)
        group = []
        for i in range(size):
            resp = tokens[g * size + i] if tokens else [rng.randrange(4, vocab) for _ in range(rng.randint(2, 20))]
            traj = Trajectory(trajectory_id=f"{gid}:{i}", group_id=gid, sample_index=i, task=task, response="",
                              min_policy_version=0, max_policy_version=0, token_ids=resp, loss_mask=[1] * len(resp),
                              behaviour_logprobs=[-math.log(vocab) + rng.uniform(-0.3, 0.3) for _ in resp])
            group.append(ScoredTrajectory(traj, Reward(float((i + g) % 2), "smoke")))
        out.append(group)
    return out


def batches(n: int, seed: int = 0):
    from rlstream.trainer.update import build_batch
    return [build_batch(groups(seed + s), "grpo", tokenizer().pad_token_id) for s in range(n)]


def trainer_logprobs(model, device, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's log-probs of ``tokens`` after ``prompt`` (``update.sequence_logprobs``, fp32, no autocast)."""
    from rlstream.trainer.update import build_batch, sequence_logprobs
    [[sample]] = groups(0, 1, 1, tokens=[tokens], prompts=[prompt])
    batch = build_batch([[sample]], "grpo", tokenizer().pad_token_id).to(device)
    model.to(device).eval()
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch)
    return logp[0, len(prompt) - 1:].tolist()


def versions(args, tied: bool, n: int) -> list[dict]:
    """``n`` policy versions as the trainer makes them: v0 a random model, each next one a trainer step on it
    (lr 1e-2, so each version's log-probs differ from the last by far more than the tolerance)."""
    from rlstream.trainer.sharding import make_engine
    from rlstream.trainer.microbatch import train_step
    from rlstream.trainer.update import UpdateConfig
    engine = make_engine(new_model(args, tied=tied), lr=1e-2, device=args.device)
    out = [{k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}]
    for b in batches(n - 1, seed=100):
        train_step(engine, b, UpdateConfig())
        out.append({k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()})
    return out


def reference(args, tied: bool, state: dict):
    model = new_model(args, tied=tied)
    model.load_state_dict(state)
    return model


def prompts_of(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 47) for _ in range(rng.randint(3, 9))] for _ in range(n)]
