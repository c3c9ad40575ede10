"""The process lifecycle's bookkeeping (rlstream/runtime/lifecycle.py) and the missing-package error; the signals
and exits themselves are tested on real processes in tests/integration/test_lifecycle.py."""
from __future__ import annotations

from rlstream.errors import MissingPackage, UserError
from rlstream.runtime.lifecycle import Lifecycle


def test_a_stop_calls_every_registered_loop_once_and_a_late_one_at_once():
    life = Lifecycle("t")  # no deadline: nothing can end this test process
    calls: list[str] = []
    life.on_stop(lambda: calls.append("a"))
    forget = life.on_stop(lambda: calls.append("b"))
    forget()  # a loop that returned is not called
    life.stop("test")
    life.stop("again")
    assert calls == ["a"] and life.stopping.is_set() and life.stop_reason == "test"
    life.on_stop(lambda: calls.append("late"))  # registered after the stop: stopped as it starts
    assert calls == ["a", "late"]


def test_an_optional_package_names_its_install_command_and_any_other_module_keeps_its_traceback():
    missing = MissingPackage.of(ModuleNotFoundError("No module named 'vllm.engine'", name="vllm.engine"))
    assert isinstance(missing, UserError) and "'vllm' is not installed" in str(missing)
    assert "make setup-vllm" in str(missing)
    assert "make side-installs" in str(MissingPackage.of(ModuleNotFoundError("x", name="faust")))
    assert MissingPackage.of(ModuleNotFoundError("No module named 'my_rewards'", name="my_rewards")) is None
    assert MissingPackage.of(ModuleNotFoundError("no name")) is None


def test_every_make_target_an_install_command_names_exists():
    from pathlib import Path
    from rlstream.errors import INSTALL_COMMANDS
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    targets = {word for command in INSTALL_COMMANDS.values() for i, word in enumerate(command.split())
               if i and command.split()[i - 1] == "make"}
    assert targets >= {"setup-vllm", "side-installs"}
    assert all(f"\n{t}:" in makefile for t in targets), [t for t in targets if f"\n{t}:" not in makefile]


def test_a_process_that_must_restart_says_why_in_one_line_and_exits_75(monkeypatch, capsys):
    """RestartToResume (e.g. a trainer whose announcing transaction was aborted): no traceback, EX_TEMPFAIL."""
    from rlstream import cli
    from rlstream.errors import RestartToResume

    def aborted(args):
        raise RestartToResume("trainer: the transaction announcing v7 was aborted")
    monkeypatch.setattr(cli, "cmd_topics", aborted)
    assert cli.main(["topics", "--run", "r"]) == RestartToResume.EXIT_CODE == 75
    err = capsys.readouterr().err
    assert err.strip() == "rlstream topics: trainer: the transaction announcing v7 was aborted" and "Traceback" not in err
