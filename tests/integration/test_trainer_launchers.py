"""The trainer's ranks started by a launcher rather than by ``--nproc``: torchrun on one node, torchrun as two
"nodes" meeting over a c10d rendezvous on loopback, and srun's variables (set by hand: no Slurm here) on two plain
processes. Each against the real broker trains the same two steps as ``--nproc 2``, to the same losses, with one
leader: every version announced once by one trainer, and no fencing. Also the launcher variables' checks."""
from __future__ import annotations

import re

import pytest

from rlstream.errors import UsageError
from rlstream.infra.supervisor import StageProc, stage_env
from rlstream.kafka.topics import create_topics
from rlstream.schemas import headers as hdr
from rlstream.trainer.distributed import Launched, check_launcher, free_port, launcher_ranks
from tests.helpers.batches import TOLERANCE
from tests.helpers.cores import require_cores
from tests.helpers.kafka import produce, read_all, wait_for
from tests.helpers.trainer import varied_group

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
TRAINER = ("run", "trainer", "--threads", "1", "--window-groups", "2", "--groups-per-step", "2", "--eta", "1",
           "--warmup-steps", "0", "--device", "cpu", "--micro-batch-tokens", "24", "--poll-timeout-s", "0.1",
           "--max-steps", "2")


def torchrun(*flags: str) -> list[str]:
    return [*flags, "-m", "rlstream.cli"]


def two_steps(bootstrap: str, tmp_path, name: str, starts: list[tuple[str, list[str], dict[str, str]]], *more: str):
    """Start the trainer's processes (module, argv before ``run trainer``, extra env) on a fresh run; feed two
    steps of two groups each once the version before is announced; every process must exit 0. Returns the
    PolicyVersions and the log."""
    run = f"{name}{free_port()}"
    create_topics({"bootstrap.servers": bootstrap}, run, partitions=2)
    log = tmp_path / f"{name}.log"
    procs = [StageProc(f"trainer{i}", [*argv, *TRAINER, *more, "--weights", str(tmp_path / name)],
                       stage_env(bootstrap, run, **env), log, module=module, cwd=ROOT)
             for i, (module, argv, env) in enumerate(starts)]
    try:
        for p in procs:
            p.start()

        def announced(n):
            assert all(p.alive() or p.returncode == 0 for p in procs), log.read_text()[-4000:]
            return len(read_all(bootstrap, run, "policy-versions")) >= n

        for step, gids in ((1, [1, 2]), (2, [3, 4])):
            wait_for(lambda: announced(step), 300, f"v{step - 1}")
            header = hdr.build(step - 1, hdr.new_traceparent(), "v1")
            produce(bootstrap, run, "rewards", [(f"task-{g}".encode(), s, header) for g in gids
                                                for s in varied_group(g)])
        for p in procs:
            assert p.wait(300) == 0, log.read_text()[-4000:]
    finally:
        for p in procs:
            p.kill()
    return [r.record for r in read_all(bootstrap, run, "policy-versions", expect=3)], log.read_text()


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_torchrun_and_srun_ranks_train_as_nproc_does_with_one_leader(bootstrap, tmp_path):
    require_cores(2)
    ref, _ = two_steps(bootstrap, tmp_path, "nproc", [("rlstream.cli", [], {})], "--nproc", "2")
    ref_losses = [v.metrics["loss"] for v in ref[1:]]  # v0 is the warm-up's: no step, no loss
    assert [v.version for v in ref] == [0, 1, 2]
    rdzv = f"127.0.0.1:{free_port()}"
    srun_port = str(free_port())
    srun = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "MASTER_PORT": srun_port}
    variants = {
        "torchrun": [("torch.distributed.run", torchrun("--standalone", "--nproc-per-node", "2"), {})],
        # Two agents, one process each: two "nodes" whose ranks meet through the c10d store on loopback.
        "nnodes": [("torch.distributed.run", torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
                                                       "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "nn"), {})
                   for _ in range(2)],
        "srun": [("rlstream.cli", [], dict(srun, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(2)],
    }
    for name, starts in variants.items():
        seen, log = two_steps(bootstrap, tmp_path, name, starts)
        # One leader: each version announced once, by one trainer, each on the one before; nobody fenced.
        assert [(v.version, v.parent_version) for v in seen] == [(0, -1), (1, 0), (2, 1)], name
        assert len({v.trainer_id for v in seen}) == 1, name
        assert not re.search(r"fenc", log, re.IGNORECASE), f"{name}: {log[-3000:]}"
        # Really two ranks (not two rank 0s): rank 1 said so, and its launcher was the one meant.
        launcher = "srun" if name == "srun" else "torchrun"
        assert f"trainer rank 1 of 2 (local rank {0 if name == 'nnodes' else 1}, {launcher})" in log, name
        assert [v.metrics["loss"] for v in seen[1:]] == pytest.approx(ref_losses, rel=TOLERANCE, abs=1e-7), name
    # The steps trained something: the comparison above can fail.
    assert len({round(x, 6) for x in ref_losses}) == 2


def test_launcher_variables_map_to_ranks():
    torch_env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "node0", "MASTER_PORT": "4711"}
    assert launcher_ranks(torch_env) == Launched("torchrun", 3, 4, 1, 2, "node0", 4711)
    slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_NNODES": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "4711"}
    assert launcher_ranks(slurm) == Launched("srun", 2, 4, 0, 2, "node0", 4711)
    # srun on one node: loopback; a single task, or no launcher at all: a plain trainer.
    one_node = dict(slurm, SLURM_NNODES="1", MASTER_ADDR="")
    assert launcher_ranks(one_node).master_addr == "127.0.0.1"
    assert launcher_ranks({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert launcher_ranks({}) is None
    # A world of one: torchrun's is one (its store: no --nproc of our own), a leftover WORLD_SIZE=1 is nothing.
    assert launcher_ranks({"WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}).world == 1
    assert launcher_ranks({"WORLD_SIZE": "1", "RANK": "0"}) is None


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK is not set"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "RANK=2 with WORLD_SIZE=2"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE is 'two', not a number"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "MASTER_PORT": "1"},
     "scontrol show hostnames"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1"}, "export MASTER_PORT"),
])
def test_inconsistent_launcher_variables_say_what_to_set(env, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        launcher_ranks(env)


def test_nproc_under_a_launcher_is_refused_unless_it_agrees():
    launched = Launched("torchrun", 0, 4, 0, 2, "a", 1)
    with pytest.raises(UsageError, match="leave --nproc out"):
        check_launcher(2, launched)
    with pytest.raises(UsageError, match="leave --nproc out"):  # torchrun's world of one: its store, not ours
        check_launcher(2, Launched("torchrun", 0, 1, 0, 1, "", 0))
    check_launcher(4, launched)
    check_launcher(1, launched)
    check_launcher(8, None)
