"""Version 0, the policy a new run starts from: ``--model`` as given (or the demo's tiny model), the supervised
warm-up on rank 0 (``--warmup-steps``), and, with ``--lora-rank``, that model made the frozen base of an adapter
(``trainer/lora.py``)."""
from __future__ import annotations

import logging

from rlstream.models.loading import TINY, check_folder, load_model, load_tokenizer, read_chat_template, torch_dtype

log = logging.getLogger(__name__)


def initial_policy(s, attention: str | None):
    """Version 0's model and tokenizer: ``--model`` as given, or the tiny model built from its seed."""
    if s.model == TINY:
        from rlstream.models.tiny import build_model, build_tokenizer
        tokenizer = build_tokenizer()
        if s.chat_template:
            tokenizer.chat_template = read_chat_template(s.chat_template)
        return build_model(tokenizer, seed=s.seed).to(torch_dtype(s.dtype)), tokenizer
    folder = check_folder(s.model)
    tokenizer = load_tokenizer(folder, s.chat_template)
    model = load_model(folder, s.dtype, attn_implementation=attention)
    log.info("version 0 is %s as given (%.1f M parameters, %s)", s.model,
             sum(p.numel() for p in model.parameters()) / 1e6, next(model.parameters()).dtype)
    return model, tokenizer


def version_zero(s, attention: str | None, lead: bool, lora=None, store=None, policy: str = ""):
    """Version 0's model (wrapped with a fresh adapter under ``lora``) and tokenizer; the warm-up runs on the
    ``lead`` rank alone (the engine starts every rank from its weights)."""
    model, tokenizer = initial_policy(s, attention)
    if s.warmup_steps > 0 and lead:
        from rlstream.trainer.warmup import supervised_warmup
        info = supervised_warmup(model, tokenizer, s.task, fraction=s.warmup_fraction, steps=s.warmup_steps,
                                 seconds=None, seed=s.seed)
        log.info("supervised warm-up: %s", info)
    if lora is not None:
        model = lora.fresh(model, tokenizer, store, policy, lead)
    return model, tokenizer
