"""Typed settings: frozen dataclasses whose every field is a CLI flag and an environment variable.

One ``LoopSettings`` (run, policy, η, group size, home, archive) is shared by every
role; each role keeps its own knobs in its own class. Precedence: command-line
flag, then environment variable, then the default (which runs the local demo).
Each field's ``metadata['help']`` is its help text.

Environment names: a shared class (``ROLE = ""``) reads ``RLSTREAM_<FIELD>``; a
role's class reads ``RLSTREAM_<ROLE>_<FIELD>``, the role said once
(``TrainerSettings.source`` is ``RLSTREAM_TRAINER_SOURCE``, ``RewardSettings.reward``
is ``RLSTREAM_REWARD``), so no two roles' variables collide.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from rlstream.errors import UsageError

T = TypeVar("T")


def knob(default: Any, help: str, **kw) -> Any:
    """A settings field with its help text (shown by --help)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def env_name(cls: type, name: str) -> str:
    """The environment variable of a settings field (see the module docstring)."""
    role = getattr(cls, "ROLE", "")
    field_name = name.upper()
    if role and field_name != role and not field_name.startswith(role + "_"):
        field_name = f"{role}_{field_name}"
    return "RLSTREAM_" + field_name


def _flags(cls: type):
    """The fields of a settings class that are command-line flags (a field may be set only through another class's
    flag of the same name, e.g. KafkaSettings.run through LoopSettings.run)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def _is_list(kind: Any) -> bool:
    """A repeatable knob: ``tuple[str, ...]`` (the flag given several times, the variable comma-separated)."""
    return typing.get_origin(kind) is tuple


def _parse(kind: Any, raw: str, name: str) -> Any:
    if _is_list(kind):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true/false, got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}") from None
    return raw


def _kind(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and args else hint


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None) -> None:
    """Add one --flag per field of a settings dataclass (all but ``skip``, or just ``only``)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in _flags(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else "(see help)"
        help_text = f"{f.metadata.get('help', '')} [env {env_name(cls, f.name)}; default {default}]"
        kind = _kind(hints[f.name])
        if kind is bool:
            group.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        elif _is_list(kind):
            group.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), action="append",
                               help=help_text + " (repeatable)")
        else:
            group.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                               type=lambda raw, k=kind, n=flag: _parse_arg(k, raw, n),
                               choices=f.metadata.get("choices"), help=help_text)


def _parse_arg(kind: Any, raw: str, flag: str) -> Any:
    try:
        return _parse(kind, raw, flag)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def from_sources(cls: type[T], args: argparse.Namespace | dict | None = None, **overrides) -> T:
    """Build settings from CLI values, then RLSTREAM_* variables, then defaults."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif given.get(f.name) is not None:
            value = given[f.name]
            # A repeated flag arrives as a list; each occurrence may itself list several, comma-separated.
            values[f.name] = (_parse(_kind(hints[f.name]), ",".join(value), f.name)
                              if isinstance(value, list) and _is_list(_kind(hints[f.name])) else value)
        elif f.metadata.get("env", env_name(cls, f.name)) in os.environ:
            name = f.metadata.get("env", env_name(cls, f.name))
            raw = os.environ[name]
            values[f.name] = _parse(_kind(hints[f.name]), raw, name)
            choices = f.metadata.get("choices")
            if choices and values[f.name] not in choices:
                raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {raw!r}")
    return cls(**values)


def load(cls: type[T], args: argparse.Namespace | dict | None = None, **overrides) -> T:
    """Settings for a command from its flags and the environment; a bad value is a UsageError."""
    try:
        return from_sources(cls, args, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


DEFAULT_ARCHIVE = "chdb://.rlstream/archive"

#: librdkafka settings that also arrive as variables of their own, so secrets stay out of process listings (and
#: deploy/helm fills them from Kubernetes Secrets).
KAFKA_SECRET_ENV = {"RLSTREAM_KAFKA_SASL_USERNAME": "sasl.username",
                    "RLSTREAM_KAFKA_SASL_PASSWORD": "sasl.password",
                    "RLSTREAM_KAFKA_SECURITY_PROTOCOL": "security.protocol",
                    "RLSTREAM_KAFKA_SASL_MECHANISM": "sasl.mechanism",
                    "RLSTREAM_KAFKA_SSL_CA_LOCATION": "ssl.ca.location"}
#: A ClickHouse server archive's user and password: read from these variables only, never from a flag or the URL.
CLICKHOUSE_USER_ENV, CLICKHOUSE_PASSWORD_ENV = "RLSTREAM_CLICKHOUSE_USER", "RLSTREAM_CLICKHOUSE_PASSWORD"


@dataclass(frozen=True)
class LoopSettings:
    """What every role of one loop agrees on."""

    ROLE: ClassVar[str] = ""

    run: str = knob("demo", "Run name; every topic and consumer group is prefixed with it")
    policy: str = knob("policy", "Policy name: the trainer announces it on policy-versions, rollout and teacher follow it")
    eta: int = knob(2, "Staleness bound η: a sample is trained on only if the trainer's version minus its "
                       "policy_version is at most η; rollout pauses when it is more than η versions behind")
    group_size: int = knob(8, "Samples per prompt (G): a group's advantages are computed among its samples")
    groups_per_step: int = knob(16, "Complete groups per trainer update (the paced prompt source issues as many)")
    home: str = knob(".rlstream", "Local state: the broker's data, weights, run logs and the embedded archive")
    archive: str = knob("", "Archive URL: chdb://PATH (embedded; relative paths from the working directory) or "
                            "http(s)://HOST:PORT of a ClickHouse server; credentials only from "
                            "RLSTREAM_CLICKHOUSE_USER / RLSTREAM_CLICKHOUSE_PASSWORD (default: chdb://HOME/archive)")

    def __post_init__(self) -> None:
        if not self.archive:  # the embedded archive lives with the rest of the loop's local state
            object.__setattr__(self, "archive", f"chdb://{self.home.rstrip('/') or '.'}/archive")

    @property
    def home_path(self) -> Path:
        return Path(self.home).resolve()


@dataclass(frozen=True)
class KafkaSettings:
    """Where the broker is and how to reach it."""

    ROLE: ClassVar[str] = ""

    bootstrap: str = knob("127.0.0.1:9092", "Kafka bootstrap servers (host:port[,host:port])")
    kafka_config: str = knob("", "Extra librdkafka settings as k=v,k=v (SASL/SSL pass through here)")
    broker_wait_s: float = knob(60.0, "At start, wait this long for the broker to answer, saying so every 10 s, "
                                      "before giving up (containers started before their broker; 0: ask once)")
    # Topic and group names carry the run; its flag is LoopSettings.run.
    run: str = knob("demo", "Run name", flag=False)

    def client_config(self) -> dict[str, str]:
        """librdkafka settings common to every client of this process."""
        conf = {"bootstrap.servers": self.bootstrap}
        for n, item in enumerate(filter(None, (p.strip() for p in self.kafka_config.split(","))), 1):
            key, sep, value = item.partition("=")
            if not sep:
                # Never echo the item: it may be a password, or the tail of one that holds a comma.
                raise ValueError(f"--kafka-config expects k=v pairs; item {n} has no '=' (a secret with a comma "
                                 "belongs in RLSTREAM_KAFKA_SASL_PASSWORD)")
            conf[key.strip()] = value.strip()
        for env, key in KAFKA_SECRET_ENV.items():
            if os.environ.get(env):
                conf[key] = os.environ[env]
        return conf
