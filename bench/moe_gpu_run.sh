#!/usr/bin/env bash
# One GPU call for the INT4 MoE (issue 7): SASS check, conformance (CPU + GPU + speed), the K2.6 bench.
# Usage (repository root, on the GPU machine): OUT=dir bash bench/moe_gpu_run.sh [extra bench args]
# Writes $OUT/{sass.txt,pytest.txt,bench.txt,moe_int4.json,moe_int4.md,moe_int4.png}; prints short tails.
set -u
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"

# SASS of the gate/up variant (1,4,4,1): HMMA present, 128-bit weight loads, no local memory.
if nvcc -arch=sm_90 -cubin -DMOE_NVCC_CHECK -o /tmp/moe_int4.cubin optimized/kernels/moe_int4.cu; then
  cuobjdump -sass /tmp/moe_int4.cubin > "$OUT/sass.txt" 2>&1
  awk '/Function : _Z13moe_int4_gemmILi1ELi4ELi4ELi1ELi0E/{f=1;next} /Function :/{f=0} f' "$OUT/sass.txt" \
    | grep -oE '\b(HMMA[.0-9A-Z]*|LDG[.0-9A-Z_]*|LOP3[.A-Z]*|HADD2[.A-Z0-9_]*|HMUL2[.A-Z0-9_]*|HFMA2[.A-Z0-9_]*|LDL|STL|PRMT)\b' \
    | sort | uniq -c | tr '\n' ';'
  echo
fi

timeout ${TEST_TIMEOUT:-170} python3 -m pytest conformance/test_moe_kernels.py -q --tb=short -p no:cacheprovider \
  -rfsP --durations=5 > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error|error" "$OUT/pytest.txt" | tail -25
grep -E "^T=[0-9]+: " "$OUT/pytest.txt" | head -5

timeout ${BENCH_TIMEOUT:-150} python3 bench/test_bench_moe.py --out "$OUT" "$@" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?"; grep -vE '^\{' "$OUT/bench.txt" | tail -60
