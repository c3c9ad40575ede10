"""LoRA training through PEFT (``--lora-rank``): the base frozen in ``--dtype``, only the adapter trained.

The trainer wraps its model with PEFT's LoRA layers (``wrap``); only the adapter's parameters require gradients,
so the engine's AdamW holds state for them alone. Each version is published as the adapter folder
(``AdapterWriter``), and the base once, beside the versions in the store, named by its content hash
(``publish_base``). A restart loads the announced base and the announced adapter over it (``resume``).

The KL reference (``--kl-coef``) is the same weights with the adapter switched off (``BaseReference``): no second
model in memory.

Checked before anything trains (``check_lora``): target modules that name no module of the model (the error lists
its linear modules), a rank larger than a targeted layer's dimension, and ``--sharding`` engines the adapter does
not work with yet (ZeRO, FSDP2: refused naming the flag). Plain torch and DDP train it (DDP all-reduces only the
parameters that require gradients).
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from concurrent.futures import Future
from pathlib import Path

import torch

from rlstream.errors import UserError
from rlstream.models.devices import autocast
from rlstream.policy.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LORA_BASE
from rlstream.policy.deltas import Content, content_hash, folder_hash, read_folder
from rlstream.policy.tensorfile import save_file

log = logging.getLogger(__name__)

#: ``--lora-target-modules`` default: PEFT's every linear layer except the output head.
ALL_LINEAR = "all-linear"
#: ``--sharding`` values LoRA trains under (DDP is ``none`` across ranks).
LORA_SHARDING = ("none",)


def linear_modules(model) -> list[str]:
    """The short names of the model's linear layers (what ``--lora-target-modules`` may name), output head included."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _targeted(model, targets: tuple[str, ...]) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers ``targets`` name (by short name; ``all-linear``: every one but the output head)."""
    head = model.get_output_embeddings()
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        if ALL_LINEAR in targets:
            if m is not head:
                out.append((name, m))
        elif name.rsplit(".", 1)[-1] in targets:
            out.append((name, m))
    return out


def check_lora(model, rank: int, targets: tuple[str, ...], sharding: str) -> None:
    """Refuse, before anything trains, what LoRA cannot do here (module docstring); UserError naming the flag."""
    if rank < 0:
        raise UserError(f"--lora-rank {rank}: a rank is positive (0: train the whole model)")
    if sharding not in LORA_SHARDING:
        raise UserError(f"--lora-rank with --sharding {sharding}: LoRA trains with --sharding none (plain torch, or "
                        "DDP over --nproc ranks); ZeRO and FSDP2 are not supported with an adapter yet")
    if not targets:
        raise UserError(f"--lora-target-modules is empty: name some of the model's linear modules "
                        f"({', '.join(linear_modules(model))}) or {ALL_LINEAR}")
    layers = _targeted(model, targets)
    if not layers:
        raise UserError(f"--lora-target-modules {','.join(targets)} names no module of the model; its linear modules "
                        f"are: {', '.join(linear_modules(model))} (or {ALL_LINEAR})")
    head = model.get_output_embeddings()
    if head in [m for _, m in layers] and getattr(model.config, "tie_word_embeddings", False):
        raise UserError("--lora-target-modules names the output head of a model whose input and output embeddings are "
                        "tied: an adapter on it cannot be merged without changing the input embedding too; leave it "
                        f"out ({ALL_LINEAR} does)")
    for name, m in layers:
        if rank > min(m.in_features, m.out_features):
            raise UserError(f"--lora-rank {rank} is larger than layer {name} ({m.in_features} -> {m.out_features}); "
                            f"give --lora-rank {min(m.in_features, m.out_features)} or less, or leave that module out "
                            "of --lora-target-modules")


def lora_config(rank: int, alpha: float, dropout: float, targets: tuple[str, ...]):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                      target_modules=ALL_LINEAR if ALL_LINEAR in targets else list(targets))


def wrap(model, rank: int, alpha: float, dropout: float, targets: tuple[str, ...]):
    """``model`` with a fresh LoRA adapter (B = 0: the same outputs as the base); the base's parameters frozen."""
    from peft import get_peft_model
    peft_model = get_peft_model(model, lora_config(rank, alpha, dropout, targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("LoRA rank %d on %s: %.3f M of %.3f M parameters trained", rank, ",".join(targets), trainable / 1e6,
             total / 1e6)
    return peft_model


def resume(base, adapter_folder: Path):
    """The base with the adapter saved in ``adapter_folder`` over it, trainable again."""
    from peft import PeftModel
    return PeftModel.from_pretrained(base, str(adapter_folder), is_trainable=True)


def publish_base(model, tokenizer, store, policy: str, rank: int = 0, resident: int = 0) -> tuple[str, str]:
    """Write the (unwrapped) base once into the store as ``<policy>/base-<hash>``; return (its URI, its content hash).

    Named by its content, so a store shared by runs holds each base once and no run's base overwrites another's."""
    staging = Path(tempfile.mkdtemp(prefix=f"rlstream-{policy}-base-"))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / LORA_BASE).write_text(json.dumps({"max_rank": rank, "resident": resident}) + "\n")
        digest = folder_hash(staging)
        uri = store.put_named(policy, f"base-{digest[:16]}",
                              lambda folder: shutil.copytree(staging, folder, dirs_exist_ok=True))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return uri, digest


class AdapterWriter:
    """Writes a LoRA version's folder: the PEFT adapter (its config and weights) and the tokenizer; as
    ``VersionWriter.write`` does, its content and hash are handed to ``on_content`` before the folder is done.

    The first version goes through PEFT's ``save_pretrained`` (and the tokenizer's); it says which tensors an adapter
    folder holds, which parameter each is, and its other files (the adapter's config, the model card, the tokenizer's
    files), which no later version changes (the config's base path is set once, by ``LoraTraining.writer``). Later
    versions copy those parameters and write the file directly (``tensorfile``) beside the saved files' bytes, where
    PEFT walks the whole model's state dict and the tokenizer serialises its vocabulary again, every version, on the
    trainer's publish path, beside its load probe (``benchmarks/lora_publish.py``'s ``*_publish_p50_s``). Either
    way the content (and so the hash) is the same: the fast path is taken only when every saved tensor is a trained
    parameter of the model, tested against ``fast=False`` (``save_pretrained`` every time)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self._params: dict[str, torch.nn.Parameter] | None = None  # saved name -> parameter (None: PEFT's path)
        self._files: dict[str, bytes] = {}
        self._learned = False  # _learn ran (once: a model it found no fast path for keeps PEFT's, unasked again)

    def write(self, folder: Path, full_state=None, fast: bool = True, on_content=None):
        if self._params is not None and fast and full_state is None:
            return self._write_fast(folder, on_content)
        self.model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        if not (folder / ADAPTER_CONFIG).exists():
            raise RuntimeError(f"PEFT wrote no {ADAPTER_CONFIG} into {folder}")
        content = read_folder(folder)
        if not self._learned and full_state is None:
            self._learned = True
            self._learn(content)
        return _hand_over(content, on_content)

    def _learn(self, content) -> None:
        """Which trained parameter each saved tensor is (PEFT saves a parameter under its name less the adapter's
        ``.<name>``), where every saved tensor is one, equal to it, in the one file PEFT writes, and every trained
        parameter is saved: else every version goes through ``save_pretrained``."""
        adapter = getattr(self.model, "active_adapter", "default")
        trained = {n.replace(f".{adapter}", ""): p for n, p in self.model.named_parameters() if p.requires_grad}
        params = {name: trained.get(name) for name in content.tensors}
        if set(content.shards.values()) != {ADAPTER_WEIGHTS} or len(params) != len(trained) or not all(
                p is not None and p.shape == t.shape and p.dtype == t.dtype and torch.equal(p.detach().cpu(), t)
                for p, t in zip(params.values(), content.tensors.values())):
            log.info("the adapter's saved tensors are not its trained parameters: every version through PEFT")
            return
        self._params, self._files = dict(sorted(params.items())), dict(content.files)

    def _write_fast(self, folder: Path, on_content):
        tensors = {name: p.detach().to("cpu", copy=True) for name, p in self._params.items()}
        content = Content(tensors=tensors, shards={name: ADAPTER_WEIGHTS for name in tensors}, files=dict(self._files))
        written = _hand_over(content, on_content)
        folder.mkdir(parents=True, exist_ok=True)  # as save_pretrained makes it
        save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        for rel, data in self._files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        return written


def _hand_over(content: Content, on_content) -> tuple[Content, str]:
    """``content`` and its hash, handed to ``on_content`` (with the hash as a done future) first."""
    digest = Future()
    digest.set_result(content_hash(content))
    if on_content is not None:
        on_content(content, digest)
    return content, digest.result()


class BaseReference:
    """The KL reference of a LoRA policy: its own forward with the adapter disabled (the frozen base), no grad."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, **inputs):
        model = self.engine.model  # the PeftModel itself, not a DDP wrapper: no gradient sync for a reference
        with torch.no_grad(), autocast(self.engine.device, self.engine.autocast_mode), model.disable_adapter():
            return model(**inputs)


def is_lora(model) -> bool:
    from peft import PeftModel
    return isinstance(model, PeftModel)


class LoraTraining:
    """What the trainer does differently with ``--lora-rank``: the model it trains (``fresh``, ``resumed``), the
    writer of each version, the base fields of each PolicyVersion, and the KL reference."""

    def __init__(self, settings, eta: int = 2):
        self.resident = eta + 1  # the adapters a worker keeps at once: every version a sample may still come from
        self.rank, self.alpha, self.dropout = settings.lora_rank, settings.lora_alpha, settings.lora_dropout
        self.targets = tuple(t.strip() for item in settings.lora_target_modules for t in item.split(",") if t.strip())
        self.sharding, self.dtype = settings.sharding, settings.dtype
        self.base_uri = self.base_hash = ""  # the base every version names (rank 0's; set by fresh or announced)

    def fresh(self, model, tokenizer, store, policy: str, lead: bool):
        """Version 0: ``model`` (warmed up, if asked) becomes the frozen base, written once to the store by rank 0;
        the adapter starts at zero."""
        check_lora(model, self.rank, self.targets, self.sharding)
        if lead:
            self.base_uri, self.base_hash = publish_base(model, tokenizer, store, policy, self.rank, self.resident)
        return wrap(model, self.rank, self.alpha, self.dropout, self.targets)

    def announced(self, pv) -> None:
        """A restart: the base the announced version names, which every later version names too."""
        if not pv.base_hash:
            raise UserError(f"--lora-rank: {pv.policy} v{pv.version} in this run is whole weights, not an adapter; "
                            "resume it without --lora-rank, or start a new --run")
        self.base_uri, self.base_hash = pv.base_uri, pv.base_hash

    def resumed(self, folder: Path, cache_dir: Path):
        """The announced adapter in ``folder`` over its base (named in the adapter's config), trainable again."""
        from rlstream.models.loading import load_model
        from rlstream.policy.weights import fetch_uri
        config = folder / ADAPTER_CONFIG
        if not config.exists():
            raise UserError(f"--lora-rank: {folder} holds whole weights, not an adapter; resume it without "
                            "--lora-rank, or start a new --run")
        base_uri = json.loads(config.read_text())["base_model_name_or_path"]
        base = load_model(fetch_uri(base_uri, cache_dir), self.dtype, flag="LoRA base")
        check_lora(base, self.rank, self.targets, self.sharding)
        return resume(base, folder)

    def writer(self, model, tokenizer) -> AdapterWriter:
        # The adapter's config names where its base is: a restart (and a person with PEFT: a local store's is a path
        # PEFT reads) finds it there.
        from rlstream.policy.weights import local_path
        from urllib.parse import urlparse
        local = urlparse(self.base_uri).scheme in ("", "file")
        model.peft_config["default"].base_model_name_or_path = str(local_path(self.base_uri)) if local else \
            self.base_uri
        return AdapterWriter(model, tokenizer)

    def fields(self) -> dict:
        return {"base_hash": self.base_hash, "base_uri": self.base_uri}
