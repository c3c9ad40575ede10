"""rlstream.recipes.prepare: a built recipe's settings, its LoRA variant's over them (no build: the folder is marked
built)."""
from __future__ import annotations

from rlstream import recipes


def test_the_lora_variant_overrides_only_what_it_names(tmp_path):
    folder = tmp_path / "recipes" / "smollm2"
    folder.mkdir(parents=True)
    (folder / recipes.BUILT).write_text("smollm2")
    whole, loop = recipes.prepare("smollm2", tmp_path)
    lora, lora_loop = recipes.prepare("smollm2", tmp_path, lora=True)
    variant = recipes.load("smollm2").LORA_DEMO
    assert {k: lora[k] for k in variant} == variant and lora["lr"] != whole["lr"]
    assert {k: v for k, v in lora.items() if k not in variant} == {k: v for k, v in whole.items() if k not in variant}
    assert lora_loop == loop and whole["model"] == str(folder / "model")
    # A recipe without a LoRA variant is unchanged by it.
    (tmp_path / "recipes" / "arithmetic").mkdir()
    (tmp_path / "recipes" / "arithmetic" / recipes.BUILT).write_text("arithmetic")
    assert recipes.prepare("arithmetic", tmp_path, lora=True) == recipes.prepare("arithmetic", tmp_path)
