#!/usr/bin/env bash
# One GPU call for the tree path (issue 5): GPU conformance, the bench (all 16 rows unless -k is given), per-kernel
# durations under ncu. Usage (repository root, on the GPU machine; set DDTREE_COMMIT where .git is stale):
#   OUT=dir bash bench/tree_gpu_run.sh [-k "256 or 1024"]   (extra arguments go to the bench's pytest)
# Writes $OUT/{tree_tests.txt,tree_bench.txt,tree_<date>.{json,md},ncu_tree.txt}; prints short tails.
set -u
OUT=${OUT:-/tmp/tree_out}
mkdir -p "$OUT"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 DDTREE_BENCH_OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
q="-q -p no:cacheprovider --tb=short"

timeout ${TEST_TIMEOUT:-180} python3 -m pytest conformance/test_tree_numba.py -k gpu $q -rP > "$OUT/tree_tests.txt" 2>&1
echo "conformance rc=$?"; grep -E "passed|failed|FAILED" "$OUT/tree_tests.txt" | tail -5

timeout ${BENCH_TIMEOUT:-180} python3 -m pytest bench/test_bench_tree.py $q "$@" > "$OUT/tree_bench.txt" 2>&1
echo "bench rc=$?"

NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout ${NCU_TIMEOUT:-90} "$NCU" --kernel-name regex:'topk|beam' --launch-skip 6 --launch-count 3 \
  --metrics gpu__time_duration.sum python3 bench/tree_profile.py 15 256 draftlike > "$OUT/ncu_tree.txt" 2>&1
echo "ncu rc=$? (clock fixed at base; L = 15, budget 256, draft-like)"
grep -E "^  tree_|gpu__time_duration" "$OUT/ncu_tree.txt" | sed -E 's/\[.*//' | paste - - | awk '{print $1, $(NF)}'

tail -20 "$OUT"/tree_*.md 2>/dev/null
