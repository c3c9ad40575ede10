"""The tools recipe at smoke size: ``rlstream.recipes.tools.build`` makes a tiny tool-calling model, and the recipe's
multi-turn loop (rollout ⇄ the built-in ``calculator`` env ⇄ the ``calculator`` reward ⇄ trainer, every stage its
own process over the real broker) trains it for two policy versions.

Checked: the model the build warmed up writes ``calc(...)`` calls, the env runs them in the sandbox and the answer
comes back as the next turn's context, the reward is the recipe's, and the trainer publishes versions 1 and 2 from
these episodes. Whether it learns is the recipe's run (examples/tools/README.md), not this test.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rlstream.recipes.tools import build, recipe
from tests.helpers import ROOT
from tests.helpers.kafka import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

GROUP, GROUPS, STEPS = 2, 2, 2


@pytest.mark.timeout(600)
def test_the_tools_recipe_builds_tiny_and_its_multi_turn_loop_trains_two_versions(bootstrap, run_name, tmp_path,
                                                                                   start_stage):
    # Every warm-up episode calls the tool, so that even 80 steps of a tiny model write calls.
    summary = build.main(["--out", str(tmp_path / "tools"), "--sft-steps", "80", "--tool-rate", "1", "--hidden",
                          "64", "--layers", "2", "--check-rows", "8", "--samples", "1", "--lr", "3e-3"])
    assert summary["heldout_sampled_tool_rate"] > 0, summary
    folder = tmp_path / "tools" / "model"
    loop = ("--group-size", str(GROUP), "--groups-per-step", str(GROUPS))
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "prompts", "--bootstrap", bootstrap, "--run", run_name,
                          "--task", recipe.DEMO["task"], "--count", str(GROUPS * STEPS + 2), *loop],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    trainer = start_stage("trainer", bootstrap, run_name, "--model", str(folder), "--weights", str(tmp_path / "w"),
                          "--task", recipe.DEMO["task"], "--warmup-steps", "0", "--lr", str(recipe.DEMO["lr"]),
                          "--max-steps", str(STEPS), "--window-groups", "4", *loop)
    start_stage("rollout", bootstrap, run_name, "--backend", "transformers", "--wait-policy-s", "240")
    start_stage("env", bootstrap, run_name, "--sandbox", "subprocess")
    start_stage("reward", bootstrap, run_name, "--reward", recipe.DEMO["reward"])
    assert trainer.wait(420) == 0, trainer.log_tail(3000)

    versions = [s.record.version for s in read_all(bootstrap, run_name, "policy-versions", expect=STEPS + 1)]
    assert versions == list(range(STEPS + 1))
    scored = [s.record for s in read_all(bootstrap, run_name, "rewards", expect=GROUP * GROUPS * STEPS, timeout=60)]
    called = [r for r in scored if any(t.tool_call is not None for t in r.trajectory.turns)]
    assert called, [r.trajectory.turns[0].text for r in scored]
    for r in called:
        traj = r.trajectory
        assert traj.task.env_name == "calculator" and r.reward.verifier_version.startswith("calculator")
        action, observation = traj.turns[0], traj.turns[1]
        assert action.role == "action" and action.tool_call.name == "calc" and observation.role == "observation"
        # The sandbox's answer is what the model saw next; a well-formed product is computed right.
        assert observation.text == f"={action.tool_result.output.strip()}\n", (action, observation)
        # Well-formed: no leading zeros (Python refuses "015" as a literal, and the sandbox says so instead).
        product = re.fullmatch(r"(0|[1-9]\d*)\*(0|[1-9]\d*)", action.tool_call.arguments)
        if product:
            assert observation.text == f"={int(product[1]) * int(product[2])}\n"
        # The observation's tokens sit between the two actions, outside the loss.
        assert traj.loss_mask[observation.token_start:observation.token_end] == \
            [0] * (observation.token_end - observation.token_start) > []
        assert set(traj.loss_mask[action.token_start:action.token_end]) == {1}
