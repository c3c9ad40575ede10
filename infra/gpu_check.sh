#!/usr/bin/env bash
# The GPU profile's gate (make setup-gpu). Before the install (no argument): refuse, with what to run instead,
# where nvidia-smi is missing or lists no GPU: the profile's wheels are CUDA builds that only an NVIDIA driver runs.
# After it (`after PY`): refuse where nvidia-smi sees GPUs and the installed torch does not (a driver older than
# torch's CUDA, most often), rather than let a run train on the CPU of a GPU host without a word.
set -euo pipefail
say() { echo "setup-gpu: $*" >&2; }
if ! command -v nvidia-smi >/dev/null 2>&1; then
  say "no nvidia-smi on this machine, so no NVIDIA driver: the GPU profile installs CUDA builds (vLLM's CUDA wheel)"
  say "that cannot run here. On a CPU machine run \`make setup-vllm\`; to check that the GPU profile resolves"
  say "without a GPU, run \`make gpu-dry-run\`."
  exit 1
fi
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
if [[ "$gpus" == 0 ]]; then
  say "nvidia-smi is here but lists no GPU (nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -1)); fix the driver first,"
  say "or run \`make setup-vllm\` for the CPU profile."
  exit 1
fi
if [[ "${1:-}" == after ]]; then
  py="$2"
  if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    torch="$("$py" -c "import torch; print(torch.__version__, 'built for CUDA', torch.version.cuda)" 2>&1 | tail -1)"
    driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
    say "nvidia-smi sees $gpus GPU(s) (driver $driver) but torch does not: torch $torch."
    say "A driver older than that CUDA is the usual cause: update the driver. Stopping rather than train on the CPU."
    exit 1
  fi
  echo "setup-gpu: torch sees $("$py" -c "import torch; print(torch.cuda.device_count())") GPU(s)"
fi
