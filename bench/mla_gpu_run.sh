#!/usr/bin/env bash
# One GPU call for the MLA attention kernel (issue 6): the localizing check with the variant A/B and the split
# sweep, per-kernel device times (attention vs merge), the GPU conformance (policy, serving properties, speed goals), then the bench with the best variant.
# Usage (repository root, on the GPU machine; set MLA_COMMIT where .git is stale):
#   OUT=dir [BENCH=1] bash bench/mla_gpu_run.sh [extra pytest arguments for the bench, e.g. -k "33 or 1-"]
# Writes $OUT/{check.txt,profile.txt,tests.txt,bench.txt,mla_attention.{json,md,png}}; prints short tails.
set -u
OUT=${OUT:-/tmp/mla_out}
mkdir -p "$OUT"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
q="-q -p no:cacheprovider --tb=short"

timeout ${CHECK_TIMEOUT:-240} python3 bench/mla_gpu_check.py "$OUT/best_defines" > "$OUT/check.txt" 2>&1
echo "check rc=$?"; grep -v DeprecationWarning "$OUT/check.txt" | grep -v "^  out = \|^  f = " | tail -45

if [ "${SWEEP:-0}" = 1 ]; then   # every split count per shape against the plan's (bench/mla_split_sweep.py)
  timeout ${SWEEP_TIMEOUT:-200} python3 bench/mla_split_sweep.py "$OUT/split_sweep.json" > "$OUT/sweep.txt" 2>&1
  echo "sweep rc=$?"; cut -c1-220 "$OUT/sweep.txt" | tail -14
fi

for cfg in ${PROF_CONFIGS:-auto}; do     # e.g. PROF_CONFIGS="auto mla_mma_w8_m64_n64_s2"
  timeout ${PROF_TIMEOUT:-90} python3 bench/mla_profile.py $cfg >> "$OUT/profile.txt" 2>&1
  echo "profile $cfg rc=$?"
done
grep "^T=" "$OUT/profile.txt"

timeout ${TEST_TIMEOUT:-240} python3 -m pytest conformance/test_mla_attention.py $q -rxX > "$OUT/tests.txt" 2>&1
echo "conformance rc=$?"; grep -E "passed|failed|FAILED|XPASS|XFAIL|Error" "$OUT/tests.txt" | tail -12

if [ "${BENCH:-0}" = 1 ]; then
  export MLA_BENCH_OUT=$OUT MLA_BENCH_DEFINES=$(cat "$OUT/best_defines" 2>/dev/null)
  timeout ${BENCH_TIMEOUT:-300} python3 -m pytest -o addopts="" --import-mode=importlib bench/test_bench_mla.py \
    --benchmark-only --benchmark-json "$OUT/mla_benchmark.json" $q "$@" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$? (defines: ${MLA_BENCH_DEFINES:-none})"
  tail -25 "$OUT/mla_attention.md" 2>/dev/null
fi
