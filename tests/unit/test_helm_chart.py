"""deploy/helm/rlstream against the code, without helm: the chart's topics, stages, consumer-group inputs, variables
and flags are the ones rlstream uses (imported from rlstream, so the two cannot drift apart silently). The rendered
chart is checked against the same sources by test_helm_chart_render.py where helm is installed."""
from __future__ import annotations

import ast
import re

import pytest

from rlstream import cli, config
from rlstream.kafka.topics import CO_PARTITIONED, MAX_MESSAGE_BYTES, TOPICS
from tests.helpers import ROOT
from tests.helpers.chart import CHART, EXTRA_ENV, VALUES_FILES, env_names, merged, settings_classes, values

COMMANDS = [*cli.STAGES, "gateway", "prompts"]


def test_topics_and_partitions_are_the_codes():
    topology = values()["topology"]
    assert topology["maxMessageBytes"] == MAX_MESSAGE_BYTES
    assert list(topology["coPartitioned"]) == list(CO_PARTITIONED)
    assert set(topology["topics"]) == set(TOPICS)
    for name, spec in TOPICS.items():
        chart = topology["topics"][name]
        assert chart["partitions"] == spec.partitions, name
        assert chart["retentionMs"] == spec.config["retention.ms"], name
        assert chart.get("cleanupPolicy") == spec.config.get("cleanup.policy"), name


# Parsing rollout's flags imports it, and torch with it: seconds alone, minutes on a loaded machine.
@pytest.mark.timeout(300)
def test_each_scaled_stage_is_a_stage_with_those_inputs():
    """The KEDA triggers' topics and groups come from topology.inputs: each key a stage (group <run>.<name>), each
    list that stage's input topics."""
    for stage, inputs in values()["topology"]["inputs"].items():
        stage_cls, _ = cli._stage_parts(stage)
        assert stage_cls.name == stage
        assert list(inputs) == list(stage_cls.inputs), stage
    templates = (CHART / "templates" / "scaledobjects.yaml").read_text()
    # The group id StageRunner joins: f"{run}.{stage.name}".
    assert 'consumerGroup: {{ printf "%s.%s" $root.Values.run $stage | quote }}' in templates
    assert 'topic: {{ printf "%s.%s" $root.Values.run . | quote }}' in templates


def test_every_variable_the_chart_names_is_read_by_the_code():
    known = set().union(*(env_names(settings_classes(cmd)) for cmd in COMMANDS)) | EXTRA_ENV
    texts = {p: p.read_text() for p in [*CHART.glob("templates/*"), *VALUES_FILES]}
    named = {(p.name, n) for p, text in texts.items() for n in re.findall(r"RLSTREAM_[A-Z0-9_]*[A-Z0-9]", text)}
    # RLSTREAM_{{ $role }}_... would be a template-built name: none is, so each name is checked whole.
    assert not [p for p, text in texts.items() if re.search(r"RLSTREAM_\{\{", text)]
    unknown = sorted((f, n) for f, n in named if n not in known)
    assert not unknown, f"variables no rlstream process reads: {unknown}"
    assert len(named) > 10  # the scan found the chart's variables


# Parsing rollout's flags imports it, and torch with it: seconds alone, minutes on a loaded machine.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_each_workloads_values_are_its_processes_flags_and_variables(path, monkeypatch):
    """Per shape: each workload's `args` parse with its own command's parser, and each of its `env` variables is one
    its process reads, with a value its settings accept (a wrong choice or type fails here, not in a pod)."""
    v = merged(path)
    workloads = {stage: v["stages"][stage] for stage in ("rollout", "env", "reward", "teacher", "archive")}
    argv = {stage: ["run", stage, *w.get("args", [])] for stage, w in workloads.items()}
    gateway = v["stages"]["gateway"]
    workloads["gateway"], argv["gateway"] = gateway, ["gateway", "--host", "0.0.0.0", "--port", str(gateway["port"]),
                                                      *gateway["args"]]
    workloads["prompts"], argv["prompts"] = v["stages"]["prompts"], ["prompts", *v["stages"]["prompts"]["args"]]
    workloads["trainer"], argv["trainer"] = v["trainer"], ["run", "trainer", *v["trainer"]["args"]]
    shared = {k: str(x) for k, x in v["env"].items() if k.startswith("RLSTREAM_")}
    for command, w in workloads.items():
        key = "run" if command in cli.STAGES else command
        parser = cli.build_parser(command if key == "run" else None)
        try:
            parser.parse_args(argv[command])
        except SystemExit:
            pytest.fail(f"{path.name}: {command}'s args {argv[command][1:]} do not parse as its flags", pytrace=False)
        classes = settings_classes(command)
        env = {**shared, **{k: str(x) for k, x in w.get("env", {}).items()}}
        foreign = sorted(set(env) - env_names(classes) - EXTRA_ENV)
        assert not foreign, f"{path.name}: {command} does not read {foreign}"
        with monkeypatch.context() as m:
            for k, x in env.items():
                m.setenv(k, x)
            for cls in classes:
                config.load(cls)  # a UsageError names the variable and what it expects


def test_template_flags_are_rlstream_flags():
    """The flags the templates themselves pass to rlstream (the gateway's address, `rlstream topics`)."""
    options = {}
    for command in ("gateway", "topics"):
        sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices[command]
        options[command] = {o for a in sub._actions for o in a.option_strings}
    stages = (CHART / "templates" / "stages.yaml").read_text()
    gateway = re.search(r'list "gateway"([^)]*)\)', stages).group(1)
    assert set(re.findall(r'"(--[a-z-]+)"', gateway)) <= options["gateway"]
    topics = (CHART / "templates" / "topics.yaml").read_text()
    flags = set(re.findall(r'"(--[a-z-]+)"', topics))
    assert flags and flags <= options["topics"], flags - options["topics"]


def test_vllm_servers_load_the_projects_worker_extension():
    template = (CHART / "templates" / "vllm.yaml").read_text()
    path = re.search(r'"--worker-extension-cls" "([\w.]+)"', template).group(1)
    module, cls = path.rsplit(".", 1)
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()  # parsed, not imported: vLLM is optional
    assert cls in {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    assert "VLLM_SERVER_DEV_MODE" in template


def test_the_dashboard_is_the_projects_own_through_a_link():
    """One copy: the chart's file is a link to infra/grafana's dashboard (helm follows it), not a second copy."""
    link = CHART / "files" / "rlstream-dashboard.json"
    assert link.is_symlink()
    assert link.resolve() == (ROOT / "infra" / "grafana" / "dashboards" / "rlstream.json").resolve()
    assert '.Files.Get "files/rlstream-dashboard.json"' in (CHART / "templates" / "monitoring.yaml").read_text()
