"""deploy/helm/rlstream's values and the rlstream settings its workloads read, for the chart's tests with and
without helm (tests/unit/test_helm_chart.py, test_helm_chart_render.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from rlstream import cli, config
from rlstream.config import KafkaSettings, LoopSettings, env_name
from rlstream.runtime.settings import RuntimeSettings
from tests.helpers import ROOT

CHART = ROOT / "deploy" / "helm" / "rlstream"
VALUES_FILES = [CHART / "values.yaml", *sorted((CHART / "ci").glob("*-values.yaml"))]
SHARED = (LoopSettings, KafkaSettings, RuntimeSettings)
#: Variables the chart sets that are no settings field: read by config.KafkaSettings.client_config and the archive.
EXTRA_ENV = {*config.KAFKA_SECRET_ENV, config.CLICKHOUSE_USER_ENV, config.CLICKHOUSE_PASSWORD_ENV}


def values(path: Path = CHART / "values.yaml") -> dict:
    """A values file as helm reads it."""
    return yaml.safe_load(path.read_text())


def merged(path: Path) -> dict:
    """A shape's values over the chart's defaults, merged as helm merges maps (lists and scalars replace)."""
    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base.get(k), over[k]) if k in over else base[k] for k in {**base, **over}}
        return over
    return merge(values(), values(path)) if path.name != "values.yaml" else values()


def settings_classes(command: str) -> dict[type, tuple[str, ...] | None]:
    """The settings classes whose flags and variables a chart workload's process reads (and which of their fields,
    None: all), as its command's parser adds them."""
    if command in cli.STAGES:
        _, settings_cls = cli._stage_parts(command)
        return {**dict.fromkeys(SHARED), **({settings_cls: None} if settings_cls else {})}
    if command == "gateway":
        from rlstream.gateway.server import GatewaySettings
        return {**dict.fromkeys(SHARED), GatewaySettings: None}  # flags for a few, but every variable is read
    if command == "prompts":
        from rlstream.sources.prompts import PromptSettings
        return {LoopSettings: None, KafkaSettings: None, PromptSettings: None}
    raise AssertionError(f"no rlstream command {command}")


def env_names(classes: dict[type, tuple[str, ...] | None]) -> set[str]:
    """The variables those settings classes read (their fields', or only the named ones')."""
    return {f.metadata.get("env", env_name(cls, f.name)) for cls, only in classes.items()
            for f in dataclasses.fields(cls) if only is None or f.name in only}
