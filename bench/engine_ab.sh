#!/usr/bin/env bash
# Engine A/B in one GPU call, same card: the trained-pair bench and the engine speed tests on a base tree and on
# this checkout, one after the other. Timings from different calls or cards are not comparable (the device may
# hand out an H100 or an H200), so a change's effect is measured against its base here.
#
#   bash bench/engine_ab.sh prepare BASE_COMMIT     # here: the base tree into _ab_base/ (git-ignored)
#   OUT=dir bash bench/engine_ab.sh run             # on the GPU machine (the device's `carry` must name _ab_base)
#   OUT=dir bash bench/engine_ab.sh k26             # the K2.6-width bench (bench/test_bench_k26.py) instead
#
# `run` writes $OUT/{base,new}/{bench.txt,engine_trained.{json,md,png},speed.txt} and prints both tables' tokens/s
# and the speed tests' ratio lines; `k26` writes $OUT/{base,new}/{k26.txt,k26_engine.{json,md,png}} and prints both
# verify / floor tables.
set -u
q="-q -p no:cacheprovider --tb=short"

# Runs function $1 in the base tree, then in this checkout (cwd = the tree; $side, $dir, $commit set; $OUT/$side made).
both_sides() {
    OUT=${OUT:-/tmp/engine_ab}
    [ -f _ab_base/COMMIT ] || { echo "no _ab_base/: run 'bench/engine_ab.sh prepare BASE' first and carry it"; exit 2; }
    export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1
    nvidia-smi --query-gpu=name --format=csv,noheader
    for side in base new; do
        dir=$PWD; commit=${DDTREE_COMMIT:-unknown}
        [ $side = base ] && dir=$PWD/_ab_base && commit=$(cat _ab_base/COMMIT)
        mkdir -p "$OUT/$side"
        (cd "$dir" && "$1")
    done
}

engine_side() {
    PYTHONPATH=$dir DDTREE_COMMIT=$commit DDTREE_BENCH_OUT=$OUT/$side \
        timeout ${BENCH_TIMEOUT:-200} python3 -m pytest bench/test_bench_engine.py $q -x > "$OUT/$side/bench.txt" 2>&1
    echo "$side ($commit) bench rc=$?"
    PYTHONPATH=$dir timeout ${SPEED_TIMEOUT:-200} python3 -m pytest conformance/test_engine_speed.py $q -s -rx \
        > "$OUT/$side/speed.txt" 2>&1
    echo "$side speed rc=$?"; grep -E "tokens/s:|ratio [0-9]" "$OUT/$side/speed.txt"
}

k26_side() {
    PYTHONPATH=$dir DDTREE_COMMIT=$commit DDTREE_BENCH_OUT=$OUT/$side \
        timeout ${K26_TIMEOUT:-150} python3 -m pytest bench/test_bench_k26.py $q > "$OUT/$side/k26.txt" 2>&1
    echo "$side ($commit) k26 bench rc=$?"
}

case "${1:-}" in
prepare)
    base=${2:?usage: bench/engine_ab.sh prepare BASE_COMMIT}
    cd "$(dirname "$0")/.." && rm -rf _ab_base && mkdir _ab_base
    git archive "$base" optimized reference conformance fixtures bench/conftest.py bench/test_bench_engine.py \
        bench/test_bench_k26.py pyproject.toml | tar -x -C _ab_base
    git rev-parse --short=12 "$base" > _ab_base/COMMIT
    du -sh _ab_base ;;
run)
    both_sides engine_side
    for side in base new; do
        echo "$side"; grep -E "^\| (ar|chain|ddtree) " "$OUT/$side/engine_trained.md" | cut -d'|' -f2-7
    done ;;
k26)
    both_sides k26_side
    for side in base new; do echo "$side"; grep -E "^\| (ar|ddtree) " "$OUT/$side/k26_engine.md"; done ;;
*)  echo "usage: bench/engine_ab.sh prepare BASE_COMMIT | run | k26"; exit 2 ;;
esac
