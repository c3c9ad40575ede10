#!/usr/bin/env bash
# `make bench`: every benchmark of benchmarks/README.md, at settings that finish within about 90 minutes on 2 cores.
# SMOKE=1 runs each at the smallest size that still goes through all of it (CI's tests/e2e/test_benchmarks.py):
# the figures are then meaningless, only that each script reaches its RESULT line is checked.
# Each script has a hard time limit, so one that hangs cannot take the rest down; logs land in $OUT.
# Scripts run as modules from the repository root (python -m benchmarks.X): that is how they import the harness.
# Each run appends its raw line to benchmarks/results/<name>.jsonl (benchmarks/harness/record.py), from which
# `python -m benchmarks.harness.tables --write` regenerates benchmarks/README.md's tables; smoke runs append to
# $OUT/results instead (RLSTREAM_BENCH_RESULTS), so figures that mean nothing never reach the repository.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.rlstream/bench/$(date +%Y%m%d-%H%M%S)}
SMOKE=${SMOKE:-0}
PY=${PY:-python}
mkdir -p "$OUT"
if [[ $SMOKE == 1 ]]; then
  export RLSTREAM_BENCH_RESULTS=${RLSTREAM_BENCH_RESULTS:-$OUT/results}
fi
export PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
started=$(date +%s)
failed=()

# bench NAME LIMIT_S "FULL ARGS" "SMOKE ARGS" [VARIANT]: run benchmarks.NAME, keep stdout+stderr in $OUT/NAME.log,
# show its last lines, and fail the step unless it exited 0 and printed its `RESULT NAME ...` line
# (benchmarks/harness/result). VARIANT, a second configuration of the same script, logs under that name instead and
# runs in the full run only (the smoke run has already been through the script once).
# JOBS=N runs up to N benchmarks at once: only for SMOKE=1 (CI), whose figures mean nothing anyway, and where most
# of each script's time is process start, imports and fixed waits rather than CPU; a timed run keeps JOBS=1, since
# two benchmarks side by side make each other's figures noise. Each report is printed in the listed order.
JOBS=${JOBS:-1}
if [[ $SMOKE != 1 && $JOBS != 1 ]]; then
  echo "JOBS=$JOBS is for SMOKE=1 only: timed benchmarks run one at a time (their figures would be noise)" >&2
  exit 2
fi
names=()
run_one() {
  local name=$1 limit=$2 args=$3 log=$4 code t0=$SECONDS
  {
    echo "== $log $args (at most ${limit}s; load average $(cut -d' ' -f1 /proc/loadavg))"
    # shellcheck disable=SC2086  # the argument strings are word-split on purpose
    timeout --kill-after=30 "$limit" "$PY" -m "benchmarks.$name" $args >"$OUT/$log.log" 2>&1
    code=$?
    grep -v '^\[' "$OUT/$log.log" | grep -v -E '^(INFO|WARNING|DEBUG)|Warning|warn\(' | tail -12
    if [[ $code != 0 ]] || ! grep -q "^RESULT $name " "$OUT/$log.log"; then
      echo "   $log FAILED (exit $code, or no RESULT line): see $OUT/$log.log"
      touch "$OUT/$log.failed"
    fi
    echo "   $log took $((SECONDS - t0)) s"
  } >"$OUT/$log.report" 2>&1
}
# BENCH_SKIP=NAME,... leaves those out of a SMOKE=1 run: the smoke test skips what another test already runs bigger.
BENCH_SKIP=${BENCH_SKIP:-}
if [[ $SMOKE != 1 && -n $BENCH_SKIP ]]; then echo "BENCH_SKIP is for SMOKE=1 only" >&2; exit 2; fi
bench() {
  local args=$3 log=${5:-$1}
  [[ $SMOKE == 1 ]] && args=$4
  if [[ $SMOKE == 1 && -n ${5:-} ]]; then return; fi
  if [[ ",$BENCH_SKIP," == *",$1,"* ]]; then echo "== $1 skipped (BENCH_SKIP)"; return; fi
  names+=("$log")
  rm -f "$OUT/$log.failed"
  if ((JOBS == 1)); then run_one "$1" "$2" "$args" "$log"; cat "$OUT/$log.report"; return; fi
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  run_one "$1" "$2" "$args" "$log" &
}
# barrier: the benchmarks started so far have finished (for one that reads what an earlier one wrote).
barrier() { wait; }

"$PY" -m rlstream.cli up >/dev/null
bench bus_hop 300 "--records 5000 --rounds 3" "--records 200 --rounds 1 --transactions 5"
bench trainer_tokens 300 "--steps 10 --json $OUT/trainer_tokens.json" "--steps 2 --warmup 1 --checkpoints 1"
bench trainer_ranks 300 "--steps 8" "--steps 2 --warmup 1 --groups-per-step 2"
bench weight_log 300 "" "--steps 3 --anchor-every 2 --hidden 32 --layers 1 --vocab 256"
bench lora_publish 2400 "" "--hidden 64 --layers 2 --intermediate 128 --vocab 512 --steps 2"
bench reward_scaling 200 "--per-consumer 400 --json $OUT/reward_scaling.json" "--consumers 1,2 --per-consumer 20"
# The same group with a judge that computes for 10 ms instead of waiting: it can scale only as far as the cores.
bench reward_scaling 200 "--judge cpu --judge-s 0.01 --per-consumer 200 --json $OUT/reward_scaling_cpu.json" "" \
  reward_scaling-cpu
bench archive_ingest 300 "--count 20000 --tokens 1000" "--count 300 --tokens 1000"
bench analytics_queries 600 "--rows 200000" "--rows 2000 --repeat 1"
bench replay_throughput 300 "--count 5000 --archive" "--count 200 --batch-size 50 --archive"
bench teacher_tokens 600 "" "--smoke"
bench fleet_tokens 600 "--rounds 3" "--tasks 2 --group-size 2 --max-tokens 4 --rounds 1"
bench weight_publish 300 "--seconds 50 --json $OUT/weight_publish.json" "--seconds 5"
bench memory 240 "--minutes 1.5 --json $OUT/memory.json" "--minutes 0.25"
bench goodput_async_vs_sync 480 "--seconds 60 --json $OUT/goodput.json" "--seconds 5 --modes async"
bench chaos 600 "--kills 5 --seed 7" "--kills 1 --tasks 8"
# Needs root (network namespaces); CI runs it through tests/integration/test_three_hosts.py instead of the smoke run.
bench three_hosts 1200 "--target 0.5" "--target 0.3 --minutes 10"
# A lower target and cap than the README's full run (held-out 0.5, at most 480 s a run): the time budget.
bench vs_trl 900 "--target 0.3 --latencies 0.2,0 --max-seconds 120 --sync-probe-steps 0 --json $OUT/vs_trl.json" \
  "--target 0.05 --max-seconds 20 --latencies 0 --sync-probe-steps 0 --eval-every 5 --warmup-steps 30"
bench loop_cost 900 "--versions 150 --modes fast,fused,checkpoint-every-version --json $OUT/loop_cost.json" \
  "--versions 3 --skip 1 --warmup-steps 5 --backend transformers --modes fused,checkpoint-every-version"
# The distillation students as measured in the READMEs: the teacher's whole distribution (the tiny vocabulary is 47),
# forward KL, at the lr they learn best at (benchmarks/distill_offline.py's sweep); RL at its own 1e-4.
bench distill_vs_rl 1800 "--target 0.5 --max-seconds 300 --modes opd,rl --top-k 47 --opd-kl forward --opd-lr 3e-4" \
  "--teacher untrained --target 0 --max-seconds 30 --modes opd --eval-every 1 --top-k 8 --opd-kl forward"
# After distill_vs_rl, which saves the teacher it trained at .rlstream/distill-teacher (at smoke size it trains from an
# untrained teacher instead, so it need not wait).
[[ $SMOKE == 1 ]] || barrier
bench distill_offline 900 "--runs opd:1e-4,opd:3e-4 --top-k 47 --kl forward --lag 2 --max-updates 200" \
  "--teacher untrained --runs opd:1e-4 --top-k 8 --max-updates 2 --eval-every 1 --warmup-steps 2"
bench learning_probe 300 "--max-seconds 120" "--steps 2 --max-seconds 20 --warmup-steps 5 --eval-every 1"
# A recipe over 3 seeds, 20 minutes each (the real-checkpoint recipe's goal); at smoke size the arithmetic recipe once.
bench recipe_learning 4000 "--recipe smollm2 --seeds 0,1,2" "--recipe arithmetic --size smoke --seeds 0"
# After recipe_learning, which builds the smollm2 folder it times the step on.
bench trainer_step_cpu 900 "--model .rlstream/recipes/smollm2/model" "--smoke"
bench lora_generation 1800 "--model .rlstream/recipes/smollm2/model" "--smoke"
# The smollm2 recipe against TRL's GRPOTrainer, both sides per seed (at most 20 minutes each); at smoke size TRL's side
# alone, one update (rlstream's side is recipe_learning's run, smoke-tested above and by tests/e2e's recipe tests).
bench recipe_vs_trl 8000 "--seeds 0,1,2" "--size smoke --systems trl --seeds 0"
wait
if ((JOBS > 1)); then for name in "${names[@]}"; do cat "$OUT/$name.report"; done; fi
for name in "${names[@]}"; do [[ -f "$OUT/$name.failed" ]] && failed+=("$name"); done
echo "== done in $(( $(date +%s) - started )) s; logs and JSON in $OUT; raw lines in ${RLSTREAM_BENCH_RESULTS:-benchmarks/results}"
if (( ${#failed[@]} )); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
