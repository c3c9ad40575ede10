"""The compose image that fetches Kafka's jars (the Dockerfile's kafka-jars stage) runs rlstream's broker code on a
bare Python with only the files that stage copies: what those files import must be among them. Found the hard way:
broker_config's UserError import broke the compose build while every other test passed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

from tests.helpers import ROOT


def test_the_kafka_jars_stage_copies_everything_its_modules_import(tmp_path):
    stage = re.search(r"^FROM \S+ AS kafka-jars\n(.*?)^FROM ", (ROOT / "Dockerfile").read_text(), re.M | re.S)[1]
    copies = re.findall(r"^COPY (rlstream\S*) /src/(\S+)$", stage, re.M)
    assert copies, stage
    for src, dst in copies:
        (tmp_path / dst).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, tmp_path / dst)
    # -S: no site-packages, as on the stage's bare Python (no confluent_kafka, no torch).
    done = subprocess.run([sys.executable, "-S", "-c", "import rlstream.infra.broker, rlstream.infra.broker_image"],
                          cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
