"""The load probe: after every weight load, an engine's log-probs of a fixed short token sequence must equal the
trainer's for that version, or the version is refused.

Why: an engine can load a version and still not serve it. vLLM's CPU build keeps a tied output head's packed
copy at the old values after ``reload_weights`` (measured on a tiny tied Llama: log-probs up to 13-23 nats off
the trainer's), so rollout sampled from a policy that was neither version. The trainer computes the probe's per-token
log-probs when it publishes (``trainer_probe``); they travel on the PolicyVersion (``probe_token_ids``,
``probe_logprobs``); whoever loads the version compares the engine's own (``InferenceBackend.probe_logprobs``)
with ``check``. A version published without them (an older trainer, a sharded one) is not probed.

The gap is the mean absolute difference per token. An engine that computes in fp32 (``precise``) is allowed
``PRECISE`` nats: the trainer's probe runs in its parameters' dtype, outside any autocast, so fp32 on both sides
(vLLM against transformers measured ~1e-5). Any other engine is allowed ``TOLERANCE`` nats plus ``RELATIVE`` of the
trainer's mean absolute log-prob: bf16 moves log-probs of unlikely tokens (the probe's are random, so mostly
unlikely) in proportion to their size. So the probe catches a drift of the weights from the version's that moves
the log-probs by more than that: every wrong load and stale head seen so far, not a change smaller than a few
percent under bf16.
"""
from __future__ import annotations

import logging

from rlstream import metrics

log = logging.getLogger(__name__)

#: Tokens in the probe: enough to touch many rows of the embeddings and the head, few enough to cost nothing.
PROBE_TOKENS = 16
#: Mean absolute gap (nats per token) between the engine's and the trainer's log-probs that always passes, and the
#: share of the trainer's mean absolute log-prob allowed on top. Measured here on tiny Llamas: fp32 against fp32
#: ~1e-6; the same weights computed in bf16, 0.08 at a mean log-prob of -14 (0.6 %); vLLM's stale tied head, 5.1.
TOLERANCE = 0.05
RELATIVE = 0.02
PRECISE = 0.01


class ProbeMismatch(ValueError):
    """The engine's log-probs for the probe are not the trainer's: the loaded weights are not the version's."""

    def __init__(self, version: int, engine: str, gap: float, expected: list[float], got: list[float],
                 precise: bool = False):
        self.version, self.engine, self.gap = version, engine, gap
        super().__init__(f"v{version} refused: {engine}'s log-probs of the load probe differ from the trainer's by "
                         f"{gap:.4f} nats a token (allowed {allowed(expected, precise):.4f}): "
                         f"trainer {_short(expected)}, engine {_short(got)}")


def _short(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values[:6]) + (", ...]" if len(values) > 6 else "]")


def probe_token_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed sequence spread over the whole vocabulary (a stride prime to any vocabulary size we meet), so rows
    of the embeddings and the head far apart are all read."""
    if vocab_size < 2:
        return []
    return [(7 + 7919 * i) % vocab_size for i in range(n)]


def trainer_probe(model, vocab_size: int | None = None) -> tuple[list[int], list[float]]:
    """The probe's token ids and, for each token after the first, its log-prob under ``model`` (a transformers
    causal LM, whole sequence in one forward, no grad, eval mode for the call): what every engine must reproduce."""
    import torch
    vocab = vocab_size or model.get_input_embeddings().weight.shape[0]
    ids = probe_token_ids(int(vocab))
    if not ids:
        return [], []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            seq = torch.tensor([ids], device=device)
            logits = model(input_ids=seq).logits[0, :-1].float()
            lps = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0]
    finally:
        model.train(was_training)
    return ids, [float(x) for x in lps.cpu()]


def allowed(expected: list[float], precise: bool = False) -> float:
    """The largest gap that passes for these trainer log-probs, on an engine computing in fp32 (``precise``) or
    not."""
    if precise:
        return PRECISE
    return TOLERANCE + RELATIVE * (sum(abs(x) for x in expected) / max(1, len(expected)))


def gap(expected: list[float], got: list[float]) -> float:
    """Mean absolute difference per token (inf when the lengths differ: the engine answered another probe)."""
    if len(expected) != len(got) or not expected:
        return float("inf")
    return sum(abs(a - b) for a, b in zip(expected, got)) / len(expected)


def check(version: int, engine: str, expected: list[float], got: list[float], precise: bool = False) -> None:
    """Pass, or count and log the refusal with both figures and raise ProbeMismatch."""
    g = gap(expected, got)
    if g <= allowed(expected, precise):
        log.debug("v%d probe on %s: gap %.2e", version, engine, g)
        return
    metrics.WEIGHTS_REFUSED.labels("probe_mismatch").inc()
    exc = ProbeMismatch(version, engine, g, expected, got, precise)
    log.error("%s", exc)
    raise exc
