"""The trainer on several ranks (``--nproc N``) as one exactly-once unit.

Rank 0 is the trainer the log knows: it alone owns the consumer, the window, the transaction and the publish.
Every step it broadcasts the batch; every rank trains its share of the micro-batches (data parallel, gradients
reduced by DDP or DeepSpeed ZeRO); before each publish every rank hands rank 0 its optimizer shard (and, under
ZeRO-3, its part of the parameters), and rank 0 writes the checkpoint and then commits the step's offsets and its
PolicyVersion once. The other ranks only follow rank 0's commands (``Ranks.follow``), so the unit is no less
exactly-once than one process: nothing they do reaches the log.

The launcher (``launch``) starts the ranks and watches them. A rank that dies takes the trainer down (the others
are killed, the launcher exits non-zero); its supervisor restarts every rank, which resume from the last
announced version as a single trainer does. Liveness is the launcher's job, so the collectives wait without a
timeout of their own (a trainer waits on Kafka for as long as the loop is idle).
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import time

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
    """This process's place among the trainer's ranks; in a world of one every call is a no-op."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

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

    def gather(self, obj) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.lead else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

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
                service._checkpoint_parts()
            elif name == "ref":
                service._load_ref(payload)
            else:
                raise RuntimeError(f"trainer rank {self.rank}: unknown command {name!r} from rank 0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    placed = resolve_device(device, local_rank=rank)
    if placed.type == "cuda":
        torch.cuda.set_device(placed)
    torch.distributed.init_process_group("nccl" if placed.type == "cuda" else "gloo", rank=rank, world_size=world,
                                         timeout=COLLECTIVE_TIMEOUT)
    started = time.monotonic()
    try:
        target(Ranks(rank, world), *args)
        torch.distributed.destroy_process_group()
    finally:
        log.info("rank %d done after %.0f s", rank, time.monotonic() - started)
    # Out without the interpreter's teardown: with gloo's and FSDP2's threads about, a C++ destructor at exit now and
    # then aborted a rank whose work was all done and committed ("terminate called without an active exception"),
    # which failed a finished trainer. What the rank wrote is flushed by now; its Kafka clients were closed by target.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
