"""deploy/slurm/rlstream.sbatch run with stand-ins for Slurm's `srun` and `scontrol` (no Slurm here: they record
what the script would start, each srun step run once as task 0) and for the Python (it records its argv): the node
split, the partitions, the refusals, and every rlstream command line checked against rlstream's own parser."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlstream import cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "rlstream.sbatch"

SRUN = """#!/bin/bash
# A stand-in for srun: record the step, then run its command once as task 0.
python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' srun "$@" >> "$LOG"
while [[ "$1" == --* ]]; do shift; done
SLURM_PROCID=0 exec "$@"
"""
SCONTROL = """#!/bin/bash
printf 'node%s\\n' 1 2 3 4 5
"""
# The script ends the job when its first step ends and stops the rest, so a stand-in step that ended at once could
# stop the others before they record themselves (it did on a loaded CI machine). Each step waits until all
# $STEPS have recorded (or 60 s pass), as real steps run side by side; the topics command, run before any step, does not.
# Only the Python's own lines count: srun's lines name the same command, and counting them let a step end once two
# steps had started and two more were only recorded by srun (a CI run at 02595f0 lost a step that way).
PYTHON = """#!/bin/bash
python3 -c 'import json,sys; print(json.dumps(sys.argv[1:]))' python "$@" >> "$LOG"
[[ " $* " == *" topics "* ]] && exit 0
for _ in $(seq 600); do
  (( $(grep -c '^\\["python".*"rlstream.cli", "run"' "$LOG") >= STEPS )) && exit 0
  sleep 0.1
done
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("fakepython", PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"

    def run(**env):
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "SLURM_JOB_ID": "77",
                "SLURM_JOB_NODELIST": "node[1-5]", "SLURM_JOB_NUM_NODES": "5", "RLSTREAM_BOOTSTRAP": "k1:9092",
                "STORE": "/shared/store", "RLSTREAM_PYTHON": str(bin_dir / "fakepython"), "GPUS_PER_NODE": "8",
                "TRAINER_NODES": "1", "ROLLOUT_NODES": "4", "STEPS": "4", **env}
        done = subprocess.run(["bash", str(SCRIPT), "--", "--lr", "1e-6", "--max-steps", "5"], env=full,
                              capture_output=True, text=True, timeout=60)
        lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        return done, lines
    return run


def rlstream_argv(line: list[str]) -> list[str]:
    return line[line.index("rlstream.cli") + 1:]


# Parsing rollout's flags imports it, and torch with it: seconds alone, minutes on a loaded machine.
@pytest.mark.timeout(300)
def test_trainer_on_n_nodes_rollout_on_m_and_every_command_parses(slurm):
    done, lines = slurm(ROLLOUT_ARGS="--max-new-tokens 64", REWARD_ARGS="--reward math")
    assert done.returncode == 0, done.stderr
    steps = [x for x in lines if x[0] == "srun"]
    commands = [rlstream_argv(x) for x in lines if x[0] == "python"]
    assert [c[0] for c in commands] == ["topics", "run", "run", "run", "run"]  # the topics before any step
    assert commands[0] == ["topics", "--replication", "3", "--partitions", "32"]  # one per rollout worker
    by_stage = {c[1]: c for c in commands[1:]}
    assert set(by_stage) == {"trainer", "rollout", "env", "reward"}
    for argv in commands:
        cli.build_parser(argv[1] if argv[0] == "run" else None).parse_args(argv)
    # The steps start side by side, in any order.
    trainer_step = next(x for x in steps if "torch.distributed.run" in x)
    rollout_step = next(x for x in steps if any("run rollout" in a for a in x))
    assert "--nodelist=node1" in trainer_step and "--kill-on-bad-exit=1" in trainer_step
    assert "--nodelist=node2,node3,node4,node5" in rollout_step and "--ntasks=32" in rollout_step
    torchrun = next(x for x in lines if x[0] == "python" and "torch.distributed.run" in x)
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == "node1:29400"
    assert torchrun[torchrun.index("--nnodes") + 1] == "1" and torchrun[torchrun.index("--nproc-per-node") + 1] == "8"
    assert by_stage["trainer"][-4:] == ["--lr", "1e-6", "--max-steps", "5"]
    assert by_stage["rollout"][by_stage["rollout"].index("--instance") + 1] == "rollout-0"
    assert by_stage["rollout"][-2:] == ["--max-new-tokens", "64"]
    assert by_stage["reward"][-2:] == ["--reward", "math"]


@pytest.mark.parametrize("env,says", [
    ({"PARTITIONS": "16"}, "32 rollout workers but PARTITIONS=16: 16 would be idle"),
    ({"ROLLOUT_NODES": "5"}, "is more than the 5 nodes allocated"),
    ({"RLSTREAM_BOOTSTRAP": ""}, "export RLSTREAM_BOOTSTRAP"),
])
def test_what_the_run_cannot_use_is_refused_before_anything_starts(slurm, env, says):
    done, lines = slurm(**env)
    assert done.returncode != 0
    assert says in done.stderr, done.stderr
    assert not lines
