#!/usr/bin/env bash
# One GPU call: the norm/RoPE/latent-row and router kernel tests and the engine's GPU conformance, then the
# trained-pair bench on this checkout or, if a test failed, on _ab_base/ (`bash bench/engine_ab.sh prepare BASE`
# with BASE = the last code that passed on a GPU; carry _ab_base), so a call whose new code fails still yields a
# bench of tested code. Everything lands in /tmp/ecb and comes back as $OUT/ecb.tgz; short tables last.
#   OUT=dir DDTREE_COMMIT=hash bash bench/engine_check_bench.sh
set -u
R=/tmp/ecb; rm -rf $R; mkdir -p $R
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
q="-q -p no:cacheprovider --tb=short"
save() { tar czf "$OUT/ecb.tgz" -C $R .; }             # after every step: a call cut at its limit keeps the rest
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$PWD timeout ${KERNEL_TIMEOUT:-120} python3 -m pytest conformance/test_norm_rope.py \
    conformance/test_moe_kernels.py -k "norm or rope or latent or router" -m gpu $q -rs > $R/kernel_tests.txt 2>&1
k=$?; echo "kernel tests rc=$k"; tail -3 $R/kernel_tests.txt; save
PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-170} python3 -m pytest conformance/test_engine.py -m gpu $q -rP \
    > $R/engine_tests.txt 2>&1
e=$?; echo "engine tests rc=$e"; grep -E "cases equal|near-tie divergence\(s\)$|passed|failed|FAILED" $R/engine_tests.txt | tail -12
save
dir=$PWD; commit=${DDTREE_COMMIT:-unknown}
if [ $k != 0 ] || [ $e != 0 ]; then
    [ -f _ab_base/COMMIT ] || { echo "a test failed and there is no _ab_base/: no bench"; exit 1; }
    dir=$PWD/_ab_base; commit=$(cat _ab_base/COMMIT); echo "a test failed: the bench runs on $commit"
fi
(cd "$dir" && PYTHONPATH=$dir DDTREE_COMMIT=$commit DDTREE_BENCH_OUT=$R/bench \
    timeout ${BENCH_TIMEOUT:-320} python3 -m pytest bench/test_bench_engine.py $q -x > $R/bench.txt 2>&1
 echo "bench ($commit) rc=$?")
save
grep -E "^\| (ar|chain|ddtree) |^\| [1248] \|" $R/bench/engine_trained.md | cut -d'|' -f2-14
