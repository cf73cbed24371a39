#!/usr/bin/env bash
# One GPU call: the drafter/greedy/router kernel conformance, the router GEMM's two paths (bench/router_ab.py), the engine's GPU conformance, then the same-card engine A/B
# against _ab_base/ (bench/engine_ab.sh prepare BASE first; carry _ab_base). Everything lands in /tmp/ekab and
# comes back as $OUT/ekab.tgz (the device returns at most 8 files); short tables are printed last.
#   OUT=dir DDTREE_COMMIT=hash bash bench/engine_kernels_ab.sh
# SKIP_AB=1: no engine A/B. MOE=1: also the MoE kernels' GPU conformance. PROFILE=1: also the per-kernel profile of
# the trained pair's stages (bench/engine_profile.py trained).
set -u
R=/tmp/ekab; rm -rf $R; mkdir -p $R
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
q="-q -p no:cacheprovider --tb=short"
save() { tar czf "$OUT/ekab.tgz" -C $R .; }             # after every step: a call cut at its limit keeps the rest
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${KERNEL_TIMEOUT:-150} python3 -m pytest conformance/test_draft_ops.py conformance/test_greedy.py \
    conformance/test_moe_kernels.py -k "draft or greedy or argmax or router" $q -rs > $R/kernel_tests.txt 2>&1
echo "kernel tests rc=$?"; tail -4 $R/kernel_tests.txt; save
timeout 60 python3 bench/router_ab.py --out $R/router_ab.json > $R/router_ab.txt 2>&1
echo "router A/B rc=$?"; save
timeout ${TEST_TIMEOUT:-200} python3 -m pytest conformance/test_engine.py -m gpu $q -rP > $R/engine_tests.txt 2>&1
rc=$?; echo "engine tests rc=$rc"; grep -E "cases equal|near-tie divergence\(s\)$|passed|failed|FAILED" $R/engine_tests.txt | tail -12
save
if [ "${MOE:-0}" = 1 ]; then
    timeout 200 python3 -m pytest conformance/test_moe_kernels.py -m gpu $q > $R/moe_tests.txt 2>&1
    echo "moe tests rc=$?"; tail -2 $R/moe_tests.txt; save
fi
if [ "${PROFILE:-0}" = 1 ]; then
    timeout 150 python3 bench/engine_profile.py trained --configs ar,16,64 > $R/profile_trained.txt 2>&1
    echo "profile rc=$?"; grep -E "^== " $R/profile_trained.txt; save
fi
if [ "${SKIP_AB:-0}" != 1 ]; then OUT=$R/ab bash bench/engine_ab.sh run; fi
save
cat $R/router_ab.txt
