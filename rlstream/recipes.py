"""Recipes for ``rlstream demo --recipe NAME``: a model and a dataset that an example builds, and the settings that
train one on the other.

A recipe is the module ``examples.<name>.recipe`` of a clone of the repository (examples are not installed with
the package). It defines ``BUILD`` (the module that writes the recipe's folder: ``python -m BUILD --out DIR``),
``DEMO`` (demo settings; the values ``model``, ``dataset`` and ``eval_dataset`` are paths inside that folder) and
``LOOP`` (loop settings). The folder is built once, under ``HOME/recipes/<name>``.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from rlstream.errors import UsageError, UserError

#: Names ``--recipe`` takes (each an ``examples/<name>/recipe.py``).
NAMES = ("arithmetic", "tools")

#: Written last by a finished build, so an interrupted one is built again.
BUILT = "BUILT"

#: Demo settings that name files inside the recipe's folder.
PATHS = ("model", "dataset", "eval_dataset")


def prepare(name: str, home: Path) -> tuple[dict, dict]:
    """(demo settings, loop settings) of a recipe, its folder built first if it is not yet."""
    try:
        recipe = importlib.import_module(f"examples.{name}.recipe")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("examples"):
            raise
        raise UsageError(f"--recipe {name}: recipes live in the repository's examples/ folder, which this install "
                         "does not have; run rlstream demo from the root of a clone") from None
    folder = home / "recipes" / name
    if not (folder / BUILT).exists():
        root = Path(recipe.__file__).resolve().parents[2]
        print(f"rlstream demo: building the {name} recipe into {folder} (once)", flush=True)
        done = subprocess.run([sys.executable, "-m", recipe.BUILD, "--out", str(folder)], cwd=root)
        if done.returncode != 0:
            raise UserError(f"--recipe {name}: building it failed (exit {done.returncode}); see the output above")
        (folder / BUILT).write_text(name)
    demo = {k: str(folder / v) if k in PATHS else v for k, v in recipe.DEMO.items()}
    return demo, dict(recipe.LOOP)
