"""LoRA versions on the policy's side: what marks a version's folder as an adapter, and the one rule about them.

A LoRA version (``--lora-rank``) is published as a PEFT adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``, plus the tokenizer); its PolicyVersion names the base it was trained on by content
hash (``base_hash``) and where that base's folder is (``base_uri``, a complete transformers checkpoint in the same
store, written once).

Invariant: **an adapter is only ever applied to the base it was trained on.** It is enforced once, in
``PolicyWeights`` (``check_base``), before any engine is handed an adapter: an engine holding another base refuses
the version with both hashes (``BaseMismatch``, a ValueError: the worker keeps what it serves).
"""
from __future__ import annotations

from pathlib import Path

from rlstream.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: In a LoRA base's folder: what an engine that reserves adapter slots up front (vLLM) must know before it starts,
#: ``{"max_rank": R, "resident": η + 1}`` (the trainer's rank; the adapters a worker keeps at once).
LORA_BASE = "rlstream_lora.json"


def lora_base(folder: Path) -> dict | None:
    """The LoRA-base marker of ``folder`` (None: not a LoRA base)."""
    import json
    marker = Path(folder) / LORA_BASE
    return json.loads(marker.read_text()) if marker.exists() else None


def is_adapter(folder: Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter rather than a whole model."""
    return (Path(folder) / ADAPTER_CONFIG).exists()


class BaseMismatch(ValueError):
    """An adapter trained on one base, offered to an engine that holds another."""


def check_base(policy: str, version: int, trained_on: str, held: str, engine: str) -> None:
    """Refuse ``version``'s adapter unless the engine's base (``held``, a content hash) is the one it was trained on."""
    if held != trained_on:
        raise BaseMismatch(f"{policy} v{version} refused: its adapter was trained on base {trained_on[:16] or '?'} "
                           f"but the {engine} engine holds base {held[:16] or '(unknown)'}; an adapter is applied "
                           "only to its own base (start the worker on this run's base)")


def check_serves_adapters(backend, policy: str, version: int) -> None:
    """A LoRA version needs an engine that applies adapters: UserError naming the engine and the flag otherwise."""
    if not getattr(backend, "serves_adapters", False):
        name = getattr(backend, "name", "this")
        raise UserError(f"{policy} v{version} is a LoRA adapter, and the {name} engine cannot serve adapters: run "
                        "this worker with --backend transformers, or train without --lora-rank")
