"""Every recipe at smoke size through the ``rlstream`` console script of a non-editable install, run from a folder
outside the repository: what a person who ran ``pip install .`` (the Dockerfile's way) types. The wheel is built
from a copy of the project's files, installed with ``--target`` into a folder of its own, and put first on the
path, so the recipes cannot come from the clone.

Each run must build its recipe, publish trained versions, finish a held-out evaluation of one of them, and leave
no dead letters; the smollm2 recipe's trajectories must have gone through the model's ChatML template. Whether a
recipe learns is its benchmark's question, not this test's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream import recipes
from tests.helpers import ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: SmolLM2's <|im_start|>: its chat template opens the system, the user and the assistant turn with it.
IM_START = 1


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """The environment of a non-editable install (its ``bin/rlstream`` on PATH, its files first on the path)."""
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "rlstream", src / "rlstream", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=300)
    wheel = next((tmp / "dist").glob("rlstream-*.whl"))
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)], check=True,
                   timeout=300)
    env = dict(os.environ, PATH=f"{site / 'bin'}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(site),
               RLSTREAM_HOME=str(ROOT / ".rlstream"))  # the project's broker, which `make test` started
    where = subprocess.run([sys.executable, "-c", "import rlstream; print(rlstream.__file__)"], cwd=tmp, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(site), where
    return env


def rlstream(env: dict, cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("rlstream", path=env["PATH"]), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_recipe_list_names_every_recipe_with_its_hardware(installed, tmp_path):
    out = rlstream(installed, tmp_path, "demo", "--recipe", "list", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(recipes.NAMES)
    assert all("measured on" in line for line in lines)


@pytest.mark.parametrize("name", recipes.NAMES)
@pytest.mark.timeout(1200)
def test_every_recipe_runs_at_smoke_size_from_an_installed_copy(installed, tmp_path, name):
    # Built now, not left over from an earlier run.
    shutil.rmtree(ROOT / ".rlstream" / "recipes" / f"{name}-smoke", ignore_errors=True)
    run = f"recipe-{name}-{os.getpid()}"
    archive = f"chdb://{tmp_path / 'archive'}"
    out = rlstream(installed, tmp_path, "demo", "--recipe", name, "--recipe-size", "smoke", "--run", run,
                   "--archive", archive, timeout=1100)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert f"building the {name} recipe at smoke size" in text
    summary = re.search(r"reward (\S+) -> (\S+) over (\d+) policy versions in (\d+) s", text)
    assert summary and int(summary[3]) >= 1, text[-4000:]

    def sql(query: str) -> list[int]:
        done = rlstream(installed, tmp_path, "sql", "--archive", archive, "--format", "csv", query, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return [int(x) for x in done.stdout.strip().splitlines()[-1].split(",")]

    assert sql(f"SELECT count() FROM rlstream.dead_letters WHERE run = '{run}'") == [0]
    rows, templated = sql(f"SELECT count(), countIf(prompt_token_ids[1] = {IM_START} AND "
                          f"countEqual(prompt_token_ids, {IM_START}) = 3) FROM rlstream.rewards WHERE run = '{run}'")
    assert rows > 0
    if name == "smollm2":
        assert templated == rows, (rows, templated)
    # Passed: its checkpoints (2 GB for smollm2's four versions) go, on a disk that CI shares with what runs beside
    # the tests. A failed run's stay, to be read.
    shutil.rmtree(ROOT / ".rlstream" / "runs" / run, ignore_errors=True)
