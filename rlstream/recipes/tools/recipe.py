"""The tools recipe for ``rlstream demo --recipe tools`` (see rlstream/recipes/__init__.py): what ``build``
writes, and the loop settings that train it.

The loop is multi-turn: rollout writes an action, the env stage's built-in ``calculator`` env runs its
``calc(...)`` in the sandbox and answers with an observation, rollout continues the same episode (same key, same
worker) with it, and the ``calculator`` reward scores the right answer after a successful call. No dataset file:
the prompts are the built-in ``calculator`` tool task's (``rlstream prompts --task calculator``), its held-out set
fixed.
"""

SUMMARY = "a 0.9 M-parameter model built in code learns to call a calculator tool over two turns (multi-turn env)"
MEASURED_ON = "2 CPU cores, no GPU"

#: The module that writes the recipe's folder (``python -m BUILD --out DIR``).
BUILD = "rlstream.recipes.tools.build"

#: At smoke size: a short warm-up in which every episode calls the tool, so that a tiny model writes calls.
SMOKE_BUILD = ("--sft-steps", "80", "--tool-rate", "1", "--hidden", "64", "--layers", "2", "--check-rows", "8",
               "--samples", "1", "--lr", "3e-3")

#: Demo settings; model is a path inside the built folder.
DEMO = {
    "model": "model",
    "task": "calculator",  # env calculator, up to 4 turns, 16 new tokens a turn
    "reward": "calculator",  # 1 for the right answer after a successful calc call, else 0
    "lr": 2e-4,  # a 0.9 M-parameter model; not tuned (no time for a sweep yet)
    "lr_warmup_steps": 10,
    "minutes": 10.0,
    "target": 0.9,
    "heldout_every": 5,
    "heldout_count": 64,  # the first 64 of the task's 256 held-out problems, greedy
}

#: Loop settings: 8 prompts of 8 samples per update.
LOOP = {"group_size": 8, "groups_per_step": 8}

#: At smoke size the run ends at its first held-out evaluation of a trained version.
SMOKE_DEMO = {"minutes": 6.0, "target": 0.0, "heldout_every": 1, "heldout_count": 8, "lr_warmup_steps": 0}
SMOKE_LOOP = {"group_size": 2, "groups_per_step": 2}
