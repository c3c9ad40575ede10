"""Recipes for ``rlstream demo --recipe NAME``: a model and a dataset that a recipe builds, and the settings that
train one on the other. Recipes are part of the installed package, so ``rlstream demo --recipe NAME`` works from
any directory and from a non-editable install; ``examples/`` keeps their walk-throughs.

A recipe is the module ``rlstream.recipes.<name>.recipe``. It defines

- ``SUMMARY``: one line for ``--recipe list``, and ``MEASURED_ON``: the hardware its figures come from;
- ``BUILD``: the module that writes the recipe's folder (``python -m BUILD --out DIR [SMOKE_BUILD...]``);
- ``DEMO``: demo settings (the values ``model``, ``dataset`` and ``eval_dataset`` are paths inside that folder)
  and ``LOOP``: loop settings;
- ``SMOKE_BUILD``, ``SMOKE_DEMO`` and ``SMOKE_LOOP``: build arguments, demo and loop settings at smoke size
  (``--recipe-size smoke``):
  the same code paths in a minute or two, to check that the recipe runs, not that it learns;
- optionally ``LORA_DEMO``: what its LoRA variant overrides, applied when ``--lora-rank`` is given (an adapter
  wants its own learning rate).

The folder is built once, under ``HOME/recipes/<name>`` (``<name>-smoke`` at smoke size).
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from rlstream.errors import UserError

#: Names ``--recipe`` takes (each a ``rlstream/recipes/<name>/recipe.py``).
NAMES = ("arithmetic", "smollm2", "tools")

#: ``--recipe list`` prints the recipes instead of running one.
LIST = "list"

#: Sizes ``--recipe-size`` takes.
SIZES = ("full", "smoke")

#: Written last by a finished build, so an interrupted one is built again.
BUILT = "BUILT"

#: Demo settings that name files inside the recipe's folder.
PATHS = ("model", "dataset", "eval_dataset")


def load(name: str) -> ModuleType:
    """The recipe module of ``name`` (one of NAMES)."""
    return importlib.import_module(f"rlstream.recipes.{name}.recipe")


def listing() -> str:
    """One line per recipe: its name, what it trains, and where its figures were measured."""
    rows = [(name, load(name)) for name in NAMES]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {r.SUMMARY} (measured on {r.MEASURED_ON})" for name, r in rows)


def prepare(name: str, home: Path, size: str = "full", lora: bool = False) -> tuple[dict, dict]:
    """(demo settings, loop settings) of a recipe at ``size``, its folder built first if it is not yet; ``lora``:
    its LoRA variant's settings (``LORA_DEMO``) over them."""
    recipe = load(name)
    smoke = size == "smoke"
    folder = home / "recipes" / (f"{name}-smoke" if smoke else name)
    if not (folder / BUILT).exists():
        print(f"rlstream demo: building the {name} recipe{' at smoke size' if smoke else ''} into {folder} (once)",
              flush=True)
        extra = list(recipe.SMOKE_BUILD) if smoke else []
        done = subprocess.run([sys.executable, "-m", recipe.BUILD, "--out", str(folder), *extra])
        if done.returncode != 0:
            raise UserError(f"--recipe {name}: building it failed (exit {done.returncode}); see the output above")
        (folder / BUILT).write_text(name)
    settings = {**recipe.DEMO, **(recipe.SMOKE_DEMO if smoke else {}),
                **(getattr(recipe, "LORA_DEMO", {}) if lora else {})}
    demo = {k: str(folder / v) if k in PATHS else v for k, v in settings.items()}
    return demo, {**recipe.LOOP, **(recipe.SMOKE_LOOP if smoke else {})}
