"""The trainer on several ranks (``--nproc N``) as one exactly-once unit.

Rank 0 is the trainer the log knows: it alone owns the consumer, the window, the transaction and the publish.
Every step it broadcasts the batch; every rank trains its share of the micro-batches (data parallel, gradients
reduced by DDP or DeepSpeed ZeRO); at each publish every rank writes its own shard of the training state
(``trainer/shards.py``) and, under ZeRO-3 and FSDP2, hands rank 0 its part of the parameters, and rank 0 writes the
version's folder and then commits the step's offsets and its PolicyVersion once. The other ranks only follow rank 0's commands (``Ranks.follow``), so the unit is no less
exactly-once than one process: nothing they do reaches the log.

Who starts the ranks: either the trainer itself (``--nproc N``: ``launch`` spawns N ranks on this machine, on a
free loopback port) or a launcher that started every rank as its own process: ``torchrun`` (``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, read as given) or ``srun`` (``SLURM_NTASKS``,
``SLURM_PROCID``, ``SLURM_LOCALID``, mapped to the same; ``launcher_ranks``). Either way global rank 0 alone is the
leader, and a rank's device is its *local* rank's GPU (``cuda:LOCAL_RANK``; on the CPU every rank uses gloo). The
command lines that work (``rlstream.cli`` as a module, so a launcher can run it as its script)::

    # one machine, 2 ranks started by the trainer
    rlstream run trainer --nproc 2 ...
    # one machine, 2 ranks started by torchrun (its own free port: --standalone)
    torchrun --standalone --nproc-per-node 2 -m rlstream.cli run trainer ...
    # two machines, 8 GPUs each (run on both; HOST0 is the first one's address, PORT any free port there)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:PORT \\
        -m rlstream.cli run trainer ...
    # Slurm: one task per rank (--ntasks-per-node = GPUs per node); srun sets no rendezvous, so set it
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=PORT
    srun --kill-on-bad-exit=1 --ntasks-per-node 8 python -m rlstream.cli run trainer ...

Under a launcher leave ``--nproc`` out (or give the launcher's world size): the launcher, not the trainer, starts
the ranks. Run ``rlstream run trainer`` itself under ``srun``, not in the batch script alone: a batch script with
``--ntasks N`` carries ``SLURM_NTASKS=N`` too and would wait for ranks that never start.

The launcher watches the ranks. A rank that dies takes the trainer down (``launch`` kills the others and exits
non-zero; torchrun does the same; srun needs ``--kill-on-bad-exit=1``); its supervisor restarts every rank, which
resume from the last announced version as a single trainer does. SIGTERM to torchrun reaches every rank: rank 0
ends its step and stops the others, all exit 0, and torchrun itself then exits 1 with its own SignalException
(torchrun's way, not a failed step). Liveness is the launcher's job, so the
collectives wait without a timeout of their own (a trainer waits on Kafka for as long as the loop is idle).
Verified on the CPU only (gloo: ``--nproc``, torchrun on one node and as two "nodes" over loopback, srun's
variables set by hand); NCCL across real machines and a real Slurm cluster have not run here.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

from rlstream.errors import UsageError, UserError
from rlstream.models.devices import resolve_device
from rlstream.models.resources import cpu_cores

log = logging.getLogger(__name__)

#: How long a collective may wait: the launcher, not a timeout, notices a dead rank.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=30)


def check_nproc(nproc: int, device: str, threads: int) -> None:
    """``--nproc`` must fit the devices present: one CUDA device per rank, or on the CPU a core per torch thread."""
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: expected at least 1 rank")
    if nproc == 1:
        return
    if device.startswith("cuda:"):
        raise UsageError(f"--device {device} names one GPU; --nproc {nproc} needs one per rank: use --device cuda")
    if resolve_device(device, local_rank=0).type == "cuda":
        count = torch.cuda.device_count()
        if nproc > count:
            raise UsageError(f"--nproc {nproc}: this machine has {count} CUDA device(s), one per rank")
        return
    cores = cpu_cores()
    if nproc * max(1, threads) > cores:
        raise UsageError(f"--nproc {nproc}: on the CPU each rank needs its own cores and this process may use "
                         f"{cores} CPU core(s) (its affinity); with --threads {threads} that is at most "
                         f"{max(1, cores // max(1, threads))} rank(s)")


class Ranks:
    """This process's place among the trainer's ranks; in a world of one every call is a no-op.

    ``local_rank``/``local_world``: its place among the ranks on its own machine (its GPU, its share of the cores).
    """

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int | None = None, local_world: int | None = None):
        self.rank, self.world = rank, world
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world = world if local_world is None else local_world

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def command(self, name: str, payload=None) -> None:
        """Rank 0 tells the followers what to do next (they run the same call after it)."""
        if self.world > 1:
            self.broadcast((name, payload))

    def follow(self, service) -> None:
        """A follower's life: build the model with rank 0, then run its commands until it says stop."""
        service._build(self.broadcast())
        while True:
            name, payload = self.broadcast()
            if name == "stop":
                return
            if name == "step":
                service._train(payload)
            elif name == "save":
                service._checkpoint_parts(*payload)
            elif name == "ref":
                service._load_ref(payload)
            else:
                raise RuntimeError(f"trainer rank {self.rank}: unknown command {name!r} from rank 0")


def free_port() -> int:
    """A port free on loopback now, for ranks this process starts itself (never a fixed one: two trainers, or a
    trainer and anything else, on one machine must not meet on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Launched:
    """The ranks a launcher started: this process's place among them and where they meet."""

    launcher: str  # "torchrun" (any launcher setting WORLD_SIZE) or "srun"
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int


def launcher_ranks(env=None) -> Launched | None:
    """The ranks a launcher started this process as, read from its environment; None when no launcher did.
    Inconsistent variables are a UsageError saying what to set.

    ``WORLD_SIZE`` set (torchrun, or anything that speaks its variables): ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` must be set too. Else ``SLURM_NTASKS`` above 1 with ``SLURM_PROCID`` (srun): ``SLURM_LOCALID``
    is the local rank; ``MASTER_PORT`` must be set, ``MASTER_ADDR`` too unless the job step is on one node.
    """
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE"):
        launcher, names = "torchrun", ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        fix = "start every rank with torchrun, which sets them all (or unset WORLD_SIZE to run one trainer)"
    elif env.get("SLURM_PROCID") and env.get("SLURM_NTASKS", "1") not in ("", "1"):  # srun's one task: a trainer
        launcher, names = "srun", ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
        fix = "start the trainer with srun, one task per rank"
    else:
        return None
    world_name, rank_name, local_name, local_world_name = names
    world = _int(env, world_name, launcher, fix)
    if world < 1:
        raise UsageError(f"{world_name}={world}: expected at least 1 rank")
    if world == 1:
        # A world of one is a plain trainer; under torchrun itself (its run id set) it may not start ranks of its own
        # (check_launcher). Elsewhere WORLD_SIZE=1 is no launcher's: a single-process engine sets it (ZeRO).
        return Launched(launcher, 0, 1, 0, 1, "", 0) if env.get("TORCHELASTIC_RUN_ID") else None
    rank, local_rank = _int(env, rank_name, launcher, fix), _int(env, local_name, launcher, fix)
    if not 0 <= rank < world:
        raise UsageError(f"{rank_name}={rank} with {world_name}={world}: a rank is 0 to {world - 1}; {fix}")
    # Only a thread share hangs on the local world: where a launcher leaves it out, assume every rank is here.
    local_world = _int(env, local_world_name, launcher, fix) if env.get(local_world_name, "").isdigit() else world
    if not 0 <= local_rank < max(local_world, 1):
        raise UsageError(f"{local_name}={local_rank} with {local_world} rank(s) on this machine; {fix}")
    one_node = launcher == "srun" and env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES")) == "1"
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_node else "")
    if not addr:
        raise UsageError(f"{launcher} started {world} ranks but MASTER_ADDR is not set: "
                         + ('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) before '
                            "srun" if launcher == "srun" else fix))
    if not env.get("MASTER_PORT"):
        raise UsageError(f"{launcher} started {world} ranks but MASTER_PORT is not set: export MASTER_PORT=<a free "
                         f"port on {addr}> before {'srun' if launcher == 'srun' else 'starting the ranks'}")
    port = _int(env, "MASTER_PORT", launcher, fix)
    return Launched(launcher, rank, world, local_rank, local_world, addr, port)


def _int(env, name: str, launcher: str, fix: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        what = "is not set" if not value else f"is {value!r}, not a number"
        raise UsageError(f"{name} {what}, though {launcher}'s other rank variables are set: {fix}") from None


def check_launcher(nproc: int, launched: Launched | None) -> None:
    """``--nproc`` under a launcher: the launcher's world wins, so only a ``--nproc`` that agrees with it is taken."""
    # A launcher's world of one too: the ranks --nproc would start could not join its rendezvous (torchrun's store).
    if launched is not None and nproc not in (1, launched.world):
        raise UsageError(f"--nproc {nproc} under {launched.launcher}, which started {launched.world} ranks: the "
                         "launcher starts the ranks, so leave --nproc out (or set the ranks through the launcher)")


def check_ranks(nproc: int, device: str, threads: int) -> Launched | None:
    """The launcher's ranks (``launcher_ranks``) checked against ``--nproc``, or ``--nproc`` against the machine."""
    launched = launcher_ranks()
    check_launcher(nproc, launched)
    if launched is None:  # a launcher's ranks are placed by it (one per GPU it was told of)
        check_nproc(nproc, device, threads)
    return launched


def start_ranks(nproc: int, launched: Launched | None, target, args: tuple, device: str) -> bool:
    """Run ``target(ranks, *args)`` on several ranks, as a launcher's rank or by starting ``nproc`` ranks here;
    False (nothing run) for a world of one."""
    if launched is not None and launched.world > 1:
        join_launched(launched, target, args, device)
        return True
    if nproc > 1:
        launch(nproc, target, args, device)
        return True
    return False


def join_launched(launched: Launched, target, args: tuple, device: str) -> None:
    """Run ``target(ranks, *args)`` as the rank a launcher started this process as; the launcher watches it."""
    os.environ.update(RANK=str(launched.rank), WORLD_SIZE=str(launched.world), LOCAL_RANK=str(launched.local_rank),
                      LOCAL_WORLD_SIZE=str(launched.local_world), MASTER_ADDR=launched.master_addr,
                      MASTER_PORT=str(launched.master_port))
    if launched.rank > 0:  # as under launch: the followers stop when rank 0 says so
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("trainer rank %d of %d (local rank %d, %s) pid %d", launched.rank, launched.world, launched.local_rank,
             launched.launcher, os.getpid())
    _run_rank(Ranks(launched.rank, launched.world, launched.local_rank, launched.local_world), device, target, args)


def launch(nproc: int, target, args: tuple, device: str) -> None:
    """Run ``target(ranks, *args)`` on ``nproc`` ranks and watch them; returns when all finished cleanly.

    SIGTERM/SIGINT go to rank 0 alone, which finishes its step and tells the followers to stop. A rank that exits
    otherwise (crash, SIGKILL) ends the trainer: the rest are killed and a UserError says which rank died.
    """
    import torch.multiprocessing as mp
    port = free_port()
    ctx = mp.start_processes(_rank_entry, args=(nproc, port, device, target, args), nprocs=nproc, join=False,
                             start_method="spawn")
    pids = ctx.pids()
    log.info("trainer ranks started: %s", ", ".join(f"rank {r} pid {p}" for r, p in enumerate(pids)))
    forward = lambda *_: os.kill(pids[0], signal.SIGTERM)  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # On a failure join kills the other ranks at once: blocked in a collective with the dead one, they could
        # not finish anyway.
        while not ctx.join(timeout=0.5, grace_period=0):
            pass
    except mp.ProcessExitedException as exc:  # join has killed the other ranks
        raise UserError(f"trainer rank {exc.error_index} (pid {pids[exc.error_index]}) died ({exc}); the other ranks "
                        "were stopped. Restart the trainer: it resumes from the last announced version") from None
    except mp.ProcessRaisedException as exc:
        raise UserError(f"trainer rank {exc.error_index} failed; the other ranks were stopped:\n{exc}") from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _rank_entry(rank: int, world: int, port: int, device: str, target, args: tuple) -> None:
    """One rank's process: dies with the launcher, joins the process group, runs ``target``."""
    try:  # Linux: a rank whose launcher was SIGKILLed must not live on holding the trainer's identity
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if rank > 0:
        # Followers stop when rank 0 says so; a terminal's Ctrl-C reaches them too and must not cut a step short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    _run_rank(Ranks(rank, world), device, target, args)


def _run_rank(ranks: Ranks, device: str, target, args: tuple) -> None:
    """Join the process group (``env://``: the variables set above) on this rank's device, run ``target``, exit."""
    placed = resolve_device(device, local_rank=ranks.local_rank)
    if placed.type == "cuda":
        torch.cuda.set_device(placed)
    torch.distributed.init_process_group("nccl" if placed.type == "cuda" else "gloo", rank=ranks.rank,
                                         world_size=ranks.world, timeout=COLLECTIVE_TIMEOUT)
    started = time.monotonic()
    try:
        target(ranks, *args)
        torch.distributed.destroy_process_group()
    finally:
        log.info("rank %d done after %.0f s", ranks.rank, time.monotonic() - started)
    # Out without the interpreter's teardown: with gloo's and FSDP2's threads about, a C++ destructor at exit now and
    # then aborted a rank whose work was all done and committed ("terminate called without an active exception"),
    # which failed a finished trainer. What the rank wrote is flushed by now; its Kafka clients were closed by target.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def warn_of_a_left_lock(max_age_s: float = 600.0) -> Path | None:
    """Warn when DeepSpeed's C++ op folder holds a lock file older than any build: on the CPU every DeepSpeed
    process compiles or checks its shared-memory op under torch's file lock, and waits without end while that file
    exists. A process killed holding it (in its build, or its second of checking) leaves it behind."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age > max_age_s:
        log.warning("DeepSpeed will wait for %s, left %.0f min ago: if no DeepSpeed build is running on this "
                    "machine, delete that file (a process killed while building or checking the op left it)",
                    lock, age / 60)
        return lock
    return None
