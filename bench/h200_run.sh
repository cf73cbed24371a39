#!/usr/bin/env bash
# One H200 call for the measurements the open issues owe on that card (needs_h200: the 12-layer K2.6 target takes
# ~110 GB): the K2.6-width engine bench at 12 layers and its per-kernel profile (issue 8), the MLA decode probe
# (issue 6), then the tree bench (issue 5) in the time left. Results are packed into $OUT/r.tgz after every step
# (a command cut at its limit still returns what it finished).
# Usage (repository root, on the GPU machine; set DDTREE_COMMIT where .git is stale): OUT=dir bash bench/h200_run.sh
set -u
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
export DDTREE_COMMIT=${DDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD
R=$(mktemp -d)/r
mkdir -p "$R/k26" "$R/tree"
pack() { tar czf "$OUT/r.tgz.tmp" -C "$(dirname "$R")" r && mv "$OUT/r.tgz.tmp" "$OUT/r.tgz"; }
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv,noheader
  python3 -c "import torch, cupy, numba; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__)"
} > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"; pack
q="-q -p no:cacheprovider --tb=short"
DDTREE_BENCH_OUT=$R/k26 timeout ${K26_TIMEOUT:-200} python3 -m pytest bench/test_bench_k26.py $q > "$R/k26/k26_bench.txt" 2>&1
el "k26 bench rc=$?"; tail -8 "$R/k26/k26_engine.md" 2>/dev/null; pack
timeout ${PROFILE_TIMEOUT:-140} python3 bench/engine_profile.py k26 12 --configs ar,64 --json "$R/k26/profile_k26_12.json" \
  > "$R/k26/profile_k26_12.txt" 2>&1
el "profile rc=$?"; grep "== .*verify" "$R/k26/profile_k26_12.txt"; pack
timeout ${MLA_TIMEOUT:-80} python3 bench/mla_decode_probe.py "$R/mla_decode_probe.json" > "$R/mla_decode_probe.txt" 2>&1
el "mla probe rc=$?"; tail -12 "$R/mla_decode_probe.txt"; pack
DDTREE_BENCH_OUT=$R/tree timeout $(( ${TOTAL:-585} - ($(date +%s) - T0) )) python3 -m pytest bench/test_bench_tree.py $q \
  > "$R/tree/tree_bench.txt" 2>&1
el "tree bench rc=$?"; cut -d'|' -f2-9 "$R"/tree/tree_*.md 2>/dev/null | tail -17; pack
