"""The generated CLI reference (docs/gen_reference.py) names every knob of every settings class, so it cannot drift.

The settings classes are found here independently of the generator: by reading every module of the package for
dataclasses with ``knob(...)`` fields, so a class the command line forgot to wire in fails this test too.
"""
from __future__ import annotations

import ast
import importlib.util
import sys

import pytest

from rlstream import config
from tests.helpers import ROOT


def _declared_knobs() -> dict[str, tuple[str, list[tuple[str, bool]]]]:
    """Class name -> (its ROLE, [(field, is a flag)]) for every class in rlstream/ with knob() fields, its bases'
    included (``rlstream.engine.settings``' classes are composed by inheritance); a class that is only a base of
    others is checked through them, under their ROLE."""
    found, bases = {}, {}
    for path in sorted((ROOT / "rlstream").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            role, knobs = "", []
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id == "ROLE" and isinstance(item.value, ast.Constant)):
                    role = item.value.value
                if (isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Call)
                        and getattr(item.value.func, "id", "") == "knob"):
                    flag = not any(k.arg == "flag" and isinstance(k.value, ast.Constant) and k.value.value is False
                                   for k in item.value.keywords)
                    knobs.append((item.target.id, flag))
            if knobs:
                assert node.name not in found, f"two settings classes named {node.name}"
                found[node.name] = (role, knobs)
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def every_knob(name: str) -> list[tuple[str, bool]]:
        return [k for base in bases[name] if base in found for k in every_knob(base)] + found[name][1]
    only_bases = {b for name in found for b in bases[name]}
    return {name: (role, every_knob(name)) for name, (role, _) in found.items() if name not in only_bases}


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_names_every_knob_with_its_variable(generator):
    declared = _declared_knobs()
    assert {"LoopSettings", "KafkaSettings", "RuntimeSettings", "TrainerSettings", "RolloutSettings"} <= set(declared)
    listed = {(f.settings, f.flags.split(", ")[0]): f for c in generator.commands() for f in c.flags}
    page = generator.cli_page()
    missing, wrong = [], []
    for cls, (role, knobs) in declared.items():
        for name, is_flag in knobs:
            if not is_flag:
                continue
            flag = "--" + name.replace("_", "-")
            shown = listed.get((cls, flag))
            if shown is None:
                missing.append(f"{cls}.{name} ({flag})")
                continue
            env = config.env_name(type(cls, (), {"ROLE": role}), name)
            if shown.env != env or f"<code>{env}</code>" not in page:
                wrong.append(f"{cls}.{name}: {shown.env} != {env}")
    assert not missing, f"knobs on no command of the CLI reference: {missing}"
    assert not wrong, wrong


def test_the_reference_shows_a_flags_default_and_help(generator):
    trainer = next(c for c in generator.commands() if c.name == "rlstream run trainer")
    flag = next(f for f in trainer.flags if f.flags == "--micro-batch-tokens")
    assert (flag.env, flag.default, flag.settings) == ("RLSTREAM_TRAINER_MICRO_BATCH_TOKENS", "-1", "TrainerSettings")
    assert "micro-batches" in flag.help
    # A plain argparse option has its default and no variable.
    up = next(c for c in generator.commands() if c.name == "rlstream up")
    brokers = next(f for f in up.flags if f.flags == "--brokers")
    assert (brokers.env, brokers.default, brokers.settings) == ("", "1", "")
