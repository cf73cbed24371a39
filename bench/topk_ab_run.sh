#!/usr/bin/env bash
# One GPU call for the top-K block-size A/B (issue 5): bench/topk_probe.py at DDTREE_TOPK_THREADS = 256, 1024, 512,
# then the tree GPU conformance and the tree bench at the block size whose whole build was fastest (summed over the
# probe's cases), then an ncu profile of the top-K kernels (L = 15, budget 256, normal logits) at that size.
# Usage (repository root, on the GPU machine; DDTREE_COMMIT where .git is stale): OUT=dir bash bench/topk_ab_run.sh
# Writes $OUT/{probe_<T>.{txt,json},best_threads.txt,tree_tests.txt,tree_bench.txt,tree_<date>.*,ncu_*}.
set -u
OUT=${OUT:-/tmp/topk_ab}
mkdir -p "$OUT"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 DDTREE_BENCH_OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
for T in 256 1024 512; do
  DDTREE_TOPK_THREADS=$T timeout 150 python3 bench/topk_probe.py --out "$OUT/probe_$T.json" > "$OUT/probe_$T.txt" 2>&1
  echo "probe T=$T rc=$?"
done
best=$(python3 - "$OUT" <<'PY'
import json, os, sys
out, best = sys.argv[1], None
for t in (256, 1024, 512):
    p = os.path.join(out, f"probe_{t}.json")
    if not os.path.exists(p):
        continue
    rows = json.load(open(p))["rows"]
    if not all(r["same_as_reference"] for r in rows):
        continue
    total = sum(r["build_single"] for r in rows)
    if best is None or total < best[1]:
        best = (t, total)
print(best[0] if best else 256)
PY
)
echo "$best" > "$OUT/best_threads.txt"; echo "best T=$best"
q="-q -p no:cacheprovider --tb=short"
DDTREE_TOPK_THREADS=$best timeout ${TEST_TIMEOUT:-170} python3 -m pytest conformance/test_tree_numba.py -k gpu $q -rP \
  > "$OUT/tree_tests.txt" 2>&1
echo "conformance rc=$?"; grep -E "passed|failed|FAILED" "$OUT/tree_tests.txt" | tail -4
DDTREE_TOPK_THREADS=$best timeout ${BENCH_TIMEOUT:-170} python3 -m pytest bench/test_bench_tree.py $q \
  > "$OUT/tree_bench.txt" 2>&1
echo "bench rc=$?"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
DDTREE_TOPK_THREADS=$best DDTREE_NUMBA_LINEINFO=1 timeout ${NCU_TIMEOUT:-100} "$NCU" --kernel-name regex:'topk' \
  --launch-skip 6 --launch-count 2 --set full --import-source no -f -o /tmp/tk \
  python3 bench/tree_profile.py 15 256 normal \
  > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"
"$NCU" -i /tmp/tk.ncu-rep --page details --csv > "$OUT/ncu_details.csv" 2>&1
"$NCU" -i /tmp/tk.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
for T in 256 1024 512; do tail -7 "$OUT/probe_$T.txt"; done
tail -18 "$OUT"/tree_*.md 2>/dev/null
