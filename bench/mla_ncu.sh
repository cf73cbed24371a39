#!/usr/bin/env bash
# Full ncu profiles of the MLA attention kernels (issue 6), for reading the stall reasons per SASS instruction
# offline. Usage (repository root, on the GPU machine): OUT=dir bash bench/mla_ncu.sh [config T:P]...
# (default: "auto 257:8192"). Per case writes $OUT/ncu_<config>_<T>_<P>.csv (the details page) and
# $OUT/sass_<config>_<T>_<P>.csv (stall samples per SASS instruction of the attention kernel; summarize with
# python bench/mla_ncu_top.py).
set -u
OUT=${OUT:-/tmp/mla_ncu}
mkdir -p "$OUT"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
cases=("$@"); [ ${#cases[@]} -eq 0 ] && cases=("auto 257:8192")
for c in "${cases[@]}"; do
  set -- $c; tag="$1_${2/:/_}"; rep="/tmp/mla_$tag"
  timeout ${NCU_TIMEOUT:-150} "$NCU" --kernel-name regex:'mla_wgmma|mla_mma' --launch-skip 3 --launch-count 1 \
    --set full --import-source no -f -o "$rep" python3 bench/mla_profile.py $1 $2 > "$OUT/ncu_run_$tag.log" 2>&1
  echo "ncu $tag rc=$?"
  "$NCU" -i "$rep.ncu-rep" --page details --csv > "$OUT/ncu_$tag.csv" 2>&1
  "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$tag.csv" 2>&1
  grep -E '"(Duration|Registers Per Thread|Executed Instructions|Issue Slots Busy|Compute \(SM\) Throughput)"' \
    "$OUT/ncu_$tag.csv" | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' | head -10
done
