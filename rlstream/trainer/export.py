"""``rlstream export``: one version of a policy out of the weight store, as a folder anything loads.

A whole-weights version is copied as it is (a transformers checkpoint). A LoRA version (``--lora-rank``) gives its
bare PEFT adapter (``<out>/adapter``) and, with ``--merge``, the adapter merged into its base (``<out>/merged``):
a plain transformers checkpoint that ``from_pretrained`` and vLLM load. The base is the one the adapter's config
names, checked against the content hash its folder is named by (``base-<hash>``, ``trainer/lora.py``): an adapter
is merged into its own base only.
"""
from __future__ import annotations

import argparse
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rlstream.config import LoopSettings, add_arguments, knob, load
from rlstream.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportSettings:
    """``rlstream export``'s knobs."""

    ROLE: ClassVar[str] = "EXPORT"

    store: str = knob(".rlstream/weights", "The weight store the trainer wrote (its --weights)")
    version: int = knob(-1, "The policy version to export (-1: the newest in the store)")
    out: str = knob("export", "Folder to write the export into (created; must be empty or absent)")
    merge: bool = knob(False, "A LoRA version: also write the adapter merged into its base (<out>/merged)")


def export(store_uri: str, policy: str, version: int, out: Path, merge: bool, cache_dir: Path) -> dict[str, Path]:
    """Export ``policy`` ``version`` from the store into ``out``; return what was written (name -> folder)."""
    from rlstream.policy.adapters import is_adapter
    from rlstream.policy.weights import WeightStore
    store = WeightStore(store_uri)
    held = store.versions(policy)
    if not held:
        raise UserError(f"export: the store {store_uri!r} holds no version of {policy!r} (give --store, --policy)")
    version = held[-1] if version < 0 else version
    if version not in held:
        raise UserError(f"export: {policy} v{version} is not in the store {store_uri!r}; it holds v"
                        + ", v".join(map(str, held)))
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"export: {out} is not empty; give another --out")
    folder = store.fetch(policy, version, cache_dir)
    if not is_adapter(folder):
        _copy(folder, out)
        return {"model": out}
    written = {"adapter": out / "adapter"}
    _copy(folder, written["adapter"])
    if merge:
        written["merged"] = out / "merged"
        merge_adapter(folder, written["merged"], cache_dir)
    return written


def merge_adapter(adapter: Path, out: Path, cache_dir: Path) -> None:
    """Write ``adapter`` merged into its base (the base its config names, hash-checked) as a checkpoint folder."""
    import json

    from peft import PeftModel

    from rlstream.models.loading import load_model, load_tokenizer
    from rlstream.policy.adapters import ADAPTER_CONFIG
    from rlstream.policy.deltas import folder_hash
    from rlstream.policy.weights import fetch_uri
    base_uri = json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    try:
        base = fetch_uri(base_uri, cache_dir)
    except OSError as exc:
        raise UserError(f"export --merge: the base {base_uri} the adapter names is not readable ({exc})") from None
    named = base.name.removeprefix("base-")
    digest = folder_hash(base)
    if not digest.startswith(named):
        raise UserError(f"export --merge: the base folder {base} holds base {digest[:16]}, not the base {named} the "
                        "adapter was trained on")
    merged = PeftModel.from_pretrained(load_model(base, "auto", flag="LoRA base"), str(adapter)).merge_and_unload()
    out.mkdir(parents=True)
    merged.save_pretrained(out, safe_serialization=True)
    load_tokenizer(adapter, flag="adapter").save_pretrained(out)


def _copy(folder: Path, out: Path) -> None:
    from rlstream.policy.deltas import PRIVATE
    shutil.copytree(folder, out, dirs_exist_ok=True, ignore=lambda _, names: [n for n in names if n in PRIVATE])


def cmd_export(args: argparse.Namespace) -> None:
    loop, s = load(LoopSettings, args), load(ExportSettings, args)
    written = export(s.store, loop.policy, s.version, Path(s.out), s.merge, loop.home_path / "weights-cache")
    for name, folder in written.items():
        print(f"{name}: {folder}")


def add_command(subparsers) -> None:
    """``rlstream export --policy P [--version N] --out DIR [--merge]``."""
    p = subparsers.add_parser("export", help="write one policy version out of the weight store (a LoRA version: "
                                             "its adapter, and with --merge the merged model)")
    add_arguments(p, LoopSettings, only=("policy", "home"))
    add_arguments(p, ExportSettings)
    p.set_defaults(func=cmd_export)
