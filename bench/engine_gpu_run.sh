#!/usr/bin/env bash
# One GPU call for the engine (issue 8): conformance (engine + norm/RoPE kernels), the trained-pair and K2.6-width
# benches, the speed goals. Usage (repository root, on the GPU machine; set DDTREE_COMMIT where .git is stale):
#   OUT=dir bash bench/engine_gpu_run.sh
# Writes $OUT/{tests.txt,bench.txt,engine_trained.{json,md,png},k26_engine.{json,md,png}}; prints short tails.
# PROFILE_LAYERS=N (12 on an H200, 6 on an H100) adds the per-kernel profile of K2.6 verifies: $OUT/profile_k26.*
set -u
OUT=${OUT:-/tmp/engine_out}
mkdir -p "$OUT"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export DDTREE_BENCH_OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
q="-q -p no:cacheprovider --tb=short"

timeout ${TEST_TIMEOUT:-200} python3 -m pytest conformance/test_engine.py conformance/test_norm_rope.py conformance/test_debug.py -m gpu $q -rP \
  > "$OUT/tests.txt" 2>&1
echo "conformance rc=$?"; grep -E "cases equal|near-tie divergence\(s\)$|passed|failed|FAILED" "$OUT/tests.txt" | tail -12

timeout ${BENCH_TIMEOUT:-300} python3 -m pytest bench/test_bench_engine.py $q -x > "$OUT/bench.txt" 2>&1
echo "engine bench rc=$?"
timeout ${K26_TIMEOUT:-150} python3 -m pytest bench/test_bench_k26.py $q >> "$OUT/bench.txt" 2>&1
echo "k26 bench rc=$?"

timeout ${SPEED_TIMEOUT:-200} python3 -m pytest conformance/test_engine_speed.py $q -rP >> "$OUT/tests.txt" 2>&1
echo "speed rc=$?"; grep -E "tokens/s:|ratio [0-9]" "$OUT/tests.txt" | tail -3

if [ -n "${PROFILE_LAYERS:-}" ]; then           # where each K2.6 verify's time goes (bench/engine_profile.py)
  timeout ${PROFILE_TIMEOUT:-150} python3 bench/engine_profile.py k26 "$PROFILE_LAYERS" --configs ar,8,64 \
    --json "$OUT/profile_k26.json" > "$OUT/profile_k26.txt" 2>&1
  echo "profile rc=$?"; grep "== .*verify" "$OUT/profile_k26.txt"
fi

tail -22 "$OUT/engine_trained.md" 2>/dev/null; tail -7 "$OUT/k26_engine.md" 2>/dev/null
