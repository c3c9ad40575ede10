"""Typed settings: one LoopSettings for every role, role-namespaced environment variables, no colliding names."""
from __future__ import annotations

import dataclasses

import pytest

from rlstream import cli, config
from rlstream.archive.query import SqlSettings
from rlstream.archive.report import ReportSettings
from rlstream.archive.sink import ArchiveSettings
from rlstream.config import KafkaSettings, LoopSettings, env_name, load
from rlstream.demo import DemoSettings
from rlstream.errors import UsageError
from rlstream.gateway.server import GatewaySettings
from rlstream.monitoring.monitor import MonitorSettings
from rlstream.runtime.settings import RuntimeSettings
from rlstream.sources.prompts import PromptSettings
from rlstream.stages.env import EnvSettings
from rlstream.stages.replay import ReplaySettings
from rlstream.stages.reward import RewardSettings
from rlstream.stages.rollout import RolloutSettings
from rlstream.stages.teacher import TeacherSettings
from rlstream.trainer.service import TrainerSettings

ALL = [LoopSettings, KafkaSettings, RuntimeSettings, RewardSettings, EnvSettings, RolloutSettings, TeacherSettings,
       TrainerSettings, ArchiveSettings, MonitorSettings, ReplaySettings, PromptSettings, SqlSettings,
       ReportSettings, GatewaySettings, DemoSettings]


def test_no_two_fields_share_an_environment_variable():
    seen: dict[str, str] = {}
    for cls in ALL:
        for f in dataclasses.fields(cls):
            if not f.metadata.get("flag", True):
                continue  # set through another class's flag of the same name (KafkaSettings.run)
            name = env_name(cls, f.name)
            assert name not in seen, f"{cls.__name__}.{f.name} and {seen[name]} both read {name}"
            seen[name] = f"{cls.__name__}.{f.name}"


def test_role_variables_say_the_role_once():
    assert env_name(TrainerSettings, "source") == "RLSTREAM_TRAINER_SOURCE"
    assert env_name(ReplaySettings, "source") == "RLSTREAM_REPLAY_SOURCE"
    assert env_name(RewardSettings, "reward") == "RLSTREAM_REWARD"
    assert env_name(RewardSettings, "reward_version") == "RLSTREAM_REWARD_VERSION"
    assert env_name(ArchiveSettings, "archive_batch_rows") == "RLSTREAM_ARCHIVE_BATCH_ROWS"
    assert env_name(LoopSettings, "eta") == "RLSTREAM_ETA"


def test_a_replay_variable_does_not_reach_the_trainer(monkeypatch):
    """RLSTREAM_SOURCE=archive, meant for replay, used to break `rlstream run trainer`."""
    monkeypatch.setenv("RLSTREAM_REPLAY_SOURCE", "archive")
    assert load(TrainerSettings).source == "rewards"
    assert load(ReplaySettings).source == "archive"


def test_loop_settings_reach_every_role_from_one_flag(monkeypatch):
    monkeypatch.setenv("RLSTREAM_ETA", "5")
    args = cli.build_parser("trainer").parse_args(["run", "trainer", "--run", "r1", "--policy", "p", "--lr", "0.5"])
    loop, kafka, trainer = load(LoopSettings, args), load(KafkaSettings, args), load(TrainerSettings, args)
    assert (loop.run, loop.policy, loop.eta) == ("r1", "p", 5)
    assert kafka.run == "r1"  # topic names follow the loop's run
    assert trainer.lr == 0.5


@pytest.mark.parametrize("command", [["run", s] for s in cli.STAGES] + [["replay"], ["prompts"], ["sql", "x"],
                                                                      ["report"], ["up"], ["down"], ["topics"],
                                                                      ["export"]])
def test_every_command_parses_its_flags_without_collisions(command):
    parser = cli.build_parser(command[1] if command[0] == "run" else None)
    parser.parse_args(command)  # argparse raises on a flag declared twice


def test_a_bad_value_is_a_usage_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("RLSTREAM_TRAINER_LR", "fast")
    with pytest.raises(UsageError, match="RLSTREAM_TRAINER_LR"):
        config.load(TrainerSettings)


def test_a_repeatable_knob_takes_the_flag_several_times_or_a_comma_separated_variable(monkeypatch):
    import argparse

    from rlstream.config import add_arguments, from_sources
    from rlstream.stages.rollout import RolloutSettings
    parser = argparse.ArgumentParser()
    add_arguments(parser, RolloutSettings)
    args = parser.parse_args(["--engine-url", "http://a:8000", "--engine-url", "http://b:8000,http://c:8000"])
    assert from_sources(RolloutSettings, args).engine_url == ("http://a:8000", "http://b:8000", "http://c:8000")
    monkeypatch.setenv("RLSTREAM_ROLLOUT_ENGINE_URL", "http://d:1, http://e:2")
    assert from_sources(RolloutSettings).engine_url == ("http://d:1", "http://e:2")
