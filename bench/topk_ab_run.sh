#!/usr/bin/env bash
# One GPU call for a top-K change (issue 5): this tree's tree GPU conformance, then bench/topk_probe.py on earlier
# trees and on this one in the same call (same card, same process conditions), then on this tree the tree bench, ncu
# profiles of the tree kernels and the engine GPU conformance, each in the time left. Results are packed into $OUT/r.tgz after
# every step (a call cut at its limit still returns what it finished).
# Earlier trees: `git archive` copies under .ab/<name>/ (list .ab/ in .git/info/exclude and carry it), e.g.
#   for nc in base:d91139d mid:4d65d24; do mkdir -p .ab/${nc%%:*}; git archive ${nc#*:} optimized reference \
#     conformance bench/*.py | tar x -C .ab/${nc%%:*}; echo ${nc#*:} > .ab/${nc%%:*}/COMMIT; done
# (each probe JSON's meta.commit is the checkout's; gpu.txt names the commit of each earlier tree from its COMMIT)
# Usage (repository root, on the GPU machine; set DDTREE_COMMIT where .git is stale): OUT=dir bash bench/topk_ab_run.sh
# (TREE_K: the tree tests' -k expression, default gpu; NCU_CASE: "L budget kind" for ncu, default "15 16 normal";
# TOTAL, TEST_TIMEOUT (default 300: the tree GPU conformance with its JIT compiles, run 22), PROBE_TIMEOUT: seconds)
set -u
OUT=${OUT:-/tmp/topk_ab}
mkdir -p "$OUT"
export DDTREE_COMMIT=${DDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1
R=$(mktemp -d)/r
mkdir -p "$R"
pack() { tar czf "$OUT/r.tgz.tmp" -C "$(dirname "$R")" r && mv "$OUT/r.tgz.tmp" "$OUT/r.tgz"; }
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${TOTAL:-580} - ($(date +%s) - T0) )); }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv,noheader
  python3 -c "import torch, cupy, numba; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__)"
  echo "commit $DDTREE_COMMIT; earlier trees: $(for d in .ab/*/; do [ -d "$d" ] && echo -n "$(basename "$d")=$(cat "$d/COMMIT" 2>/dev/null || echo ?) "; done)"
} > "$R/gpu.txt" 2>&1
cat "$R/gpu.txt"; pack
q="-q -p no:cacheprovider --tb=short"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest conformance/test_tree_numba.py -k "${TREE_K:-gpu}" $q -rP > "$R/tree_tests.txt" 2>&1
el "tree conformance rc=$?"; grep -E "passed|failed|FAILED" "$R/tree_tests.txt" | tail -4; pack
for d in .ab/* .; do
  [ -d "$d/optimized" ] || continue
  name=$([ "$d" = . ] && echo new || basename "$d")
  (cd "$d" && timeout ${PROBE_TIMEOUT:-100} python3 bench/topk_probe.py --out "$R/probe_$name.json" > "$R/probe_$name.txt" 2>&1)
  el "probe $name rc=$?"; pack
done
[ "$(left)" -gt 30 ] && DDTREE_BENCH_OUT=$R timeout $(( $(left) > 170 ? 170 : $(left) )) python3 -m pytest \
  bench/test_bench_tree.py $q > "$R/tree_bench.txt" 2>&1; el "tree bench rc=$?"; pack
[ "$(left)" -gt 60 ] && NCU_TIMEOUT=$(( $(left) > 100 ? 70 : $(left) - 30 )) OUT=$R bash bench/tree_ncu.sh "${NCU_CASE:-15 16 normal}" \
  > "$R/ncu.txt" 2>&1 && el "ncu done"; pack
[ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 -m pytest conformance/test_engine.py -m gpu $q -rP \
  > "$R/engine_tests.txt" 2>&1; el "engine conformance rc=$?"; pack
grep -E "passed|failed|FAILED|near-tie divergence" "$R/engine_tests.txt" 2>/dev/null | tail -4
for f in "$R"/probe_*.txt; do echo "== $f"; tail -8 "$f"; done
cut -d'|' -f2-9 "$R"/tree_*.md 2>/dev/null | tail -17
