"""The supervisor with stand-in processes (tests/helpers/sleeper.py): stop, kill, restart alike, stop in order."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from rlstream.infra.supervisor import StageProc, Supervisor
from tests.helpers import ROOT
from tests.helpers.kafka import wait_for


def sleeper(tmp_path: Path, name: str, *argv: str) -> StageProc:
    """A StageProc of the sleeper, logging under tmp_path."""
    return StageProc(name, list(argv), dict(os.environ), tmp_path / f"{name}.log", module="tests.helpers.sleeper",
                     cwd=ROOT)


def ready(proc: StageProc, starts: int = 1) -> None:
    """Wait until the latest start has its SIGTERM handler in place (a signal before that would hit Python's)."""
    wait_for(lambda: proc.log_tail(10_000).count("ready") >= starts, 30, f"{proc.name} to start")


def gone(pid: int) -> bool:
    """The process has ended (exited, or a zombie waiting for its new parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sigterm_stops_it_and_it_starts_again_alike(tmp_path):
    proc = sleeper(tmp_path, "s", "0").start()
    ready(proc)
    assert proc.alive() and proc.returncode is None
    assert proc.stop(timeout=10) == 0 and proc.exited() and not proc.crashed()
    proc.start()
    ready(proc, 2)
    proc.kill()
    assert proc.returncode == -signal.SIGKILL and proc.starts == 2
    assert len(re.findall(r"^=== start \d ", proc.log_tail(), re.M)) == 2, "each start is marked in one log"


def test_sigterm_ignored_ends_in_sigkill_after_the_timeout(tmp_path):
    proc = sleeper(tmp_path, "stubborn", "0", "ignore-term").start()
    ready(proc)
    assert proc.stop(timeout=1) == -signal.SIGKILL
    # SIGTERM first, which it outlived; SIGKILL only then.
    assert "term ignored" in proc.log_tail(), proc.log_tail()


def test_kill_takes_its_children_with_it(tmp_path):
    proc = sleeper(tmp_path, "parent", "0", "child").start()
    ready(proc)
    child = int(re.search(r"^child (\d+)$", proc.log_tail(), re.M).group(1))
    assert not gone(child)
    proc.kill()
    wait_for(lambda: gone(child), 10, "the child to end with its parent's process group")


def test_the_supervisor_restarts_unplanned_exits_and_stops_in_order(tmp_path):
    sup = Supervisor()
    quitter = sup.add(sleeper(tmp_path, "quitter", "0.3"))
    sup.add(sleeper(tmp_path, "steady", "0"))
    sup.start_all()
    try:
        wait_for(lambda: sup.dead() == ["quitter"], 30, "the quitter to exit on its own")
        assert sup.check() == [("quitter", 3)] and sup.crashes == [("quitter", 3)]
        assert quitter.alive() and quitter.starts == 2 and quitter.argv == ["0.3"]
        ready(sup.procs["steady"])
        ready(quitter, 2)
        codes = sup.stop_all(["steady"], timeout=10)
    finally:
        for p in sup.procs.values():
            p.kill()
    assert list(codes) == ["steady", "quitter"], "the given order first, then the rest"
    # The quitter may exit on its own again around the stop, and a SIGTERM that lands while Python shuts down
    # (its handlers reset) ends it by the signal.
    assert codes["steady"] == 0 and codes["quitter"] in (0, 3, -signal.SIGTERM)
    assert sup.dead() == [] and sup.check() == [], "processes stopped on purpose are not restarted"
