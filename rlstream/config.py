"""Typed settings: frozen dataclasses whose every field is a CLI flag and an RLSTREAM_* variable.

Precedence: command-line flag, then environment variable, then the default
(which runs the local demo). Each field's ``metadata['help']`` is its help text.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlstream.errors import UsageError

T = TypeVar("T")


def knob(default: Any, help: str, **kw) -> Any:
    """A settings field with its help text (shown by --help)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def env_name(name: str) -> str:
    return "RLSTREAM_" + name.upper()


def _parse(kind: Any, raw: str, name: str) -> Any:
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


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per field of a settings dataclass."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else "(see help)"
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {default}]"
        kind = _kind(hints[f.name])
        if kind is bool:
            group.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
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
            values[f.name] = given[f.name]
        elif env_name(f.name) in os.environ:
            raw = os.environ[env_name(f.name)]
            values[f.name] = _parse(_kind(hints[f.name]), raw, env_name(f.name))
            choices = f.metadata.get("choices")
            if choices and values[f.name] not in choices:
                raise ValueError(f"{env_name(f.name)}: expected one of {', '.join(choices)}, got {raw!r}")
    return cls(**values)


def load(cls: type[T], args: argparse.Namespace | dict | None = None, **overrides) -> T:
    """Settings for a command from its flags and the environment; a bad value is a UsageError."""
    try:
        return from_sources(cls, args, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class KafkaSettings:
    """Where the broker is and how to reach it."""

    bootstrap: str = knob("127.0.0.1:9092", "Kafka bootstrap servers (host:port[,host:port])")
    run: str = knob("demo", "Run name; every topic and consumer group is prefixed with it")
    kafka_config: str = knob("", "Extra librdkafka settings as k=v,k=v (SASL/SSL pass through here)")

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
        # Secrets also arrive as their own variables so they stay out of process listings.
        for env, key in (("RLSTREAM_KAFKA_SASL_USERNAME", "sasl.username"),
                         ("RLSTREAM_KAFKA_SASL_PASSWORD", "sasl.password"),
                         ("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "security.protocol"),
                         ("RLSTREAM_KAFKA_SASL_MECHANISM", "sasl.mechanism"),
                         ("RLSTREAM_KAFKA_SSL_CA_LOCATION", "ssl.ca.location")):
            if os.environ.get(env):
                conf[key] = os.environ[env]
        return conf
