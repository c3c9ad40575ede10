#!/usr/bin/env bash
# `make bench`: every benchmark of benchmarks/README.md at settings that finish within 30 minutes on 2 cores.
# Each script has a hard time limit, so one that hangs cannot take the rest down; results land in $OUT.
# Scripts run as modules from the repository root (python -m benchmarks.X): that is how they import the harness.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.rlstream/bench/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
started=$(date +%s)
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run, keep stdout+stderr in $OUT/NAME.log, show the results
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s; load average $(cut -d' ' -f1 /proc/loadavg))"
  if ! timeout --kill-after=30 "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    echo "   $name FAILED or timed out: see $OUT/$name.log"
    failed=1
  fi
  grep -v '^\[' "$OUT/$name.log" | grep -v -E '^(INFO|WARNING|DEBUG)|Warning|warn\(' | tail -20
}

rlstream up >/dev/null
step bus_hop 120 python -m benchmarks.bus_hop --records 5000
step trainer_tokens 300 python -m benchmarks.trainer_tokens --steps 10 --json "$OUT/trainer_tokens.json"
step reward_scaling 150 python -m benchmarks.reward_scaling --per-consumer 400 --json "$OUT/reward_scaling.json"
step weight_publish 200 python -m benchmarks.weight_publish --seconds 50 --json "$OUT/weight_publish.json"
step memory 200 python -m benchmarks.memory --minutes 1.5 --json "$OUT/memory.json"
step goodput 420 python -m benchmarks.goodput_async_vs_sync --seconds 60 --json "$OUT/goodput.json"
# A lower target and cap than the README's full run (held-out 0.5, at most 480 s a run): the 30-minute budget.
step vs_trl 720 python -m benchmarks.vs_trl --target 0.3 --max-seconds 120 --sync-probe-steps 0 \
  --json "$OUT/vs_trl.json"
echo "== done in $(( $(date +%s) - started )) s; logs and JSON in $OUT"
exit $failed
