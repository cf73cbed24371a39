#!/usr/bin/env bash
# Full ncu profiles of the tree kernels (issue 5) for reading stall reasons per SASS instruction offline.
# Usage (repository root, on the GPU machine): OUT=dir bash bench/tree_ncu.sh [L budget kind]...
# (default: "15 16 draftlike" and "15 256 draftlike"; NCU_SKIP / NCU_COUNT: the launches skipped and profiled, default
# 6 / 3, the third build of a budget <= 256; above 256 a build is 4 launches: 8 / 4). Per case writes
# $OUT/ncu_<L>_<B>_<kind>.txt (the details page of every profiled kernel) and $OUT/sass_<L>_<B>_<kind>.csv (stall
# samples per SASS instruction, all kernels).
set -u
OUT=${OUT:-/tmp/tree_ncu}
mkdir -p "$OUT"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
cases=("$@"); [ ${#cases[@]} -eq 0 ] && cases=("15 16 draftlike" "15 256 draftlike")
for c in "${cases[@]}"; do
  set -- $c; tag="$1_$2_$3"; rep="/tmp/tree_$tag"
  timeout ${NCU_TIMEOUT:-150} "$NCU" --kernel-name regex:'topk|beam|segment' --launch-skip ${NCU_SKIP:-6} \
    --launch-count ${NCU_COUNT:-3} --set full \
    --import-source no -f -o "$rep" python3 bench/tree_profile.py $1 $2 $3 > "$OUT/ncu_run_$tag.log" 2>&1
  echo "ncu $tag rc=$?"
  "$NCU" -i "$rep.ncu-rep" --page details --csv > "$OUT/ncu_$tag.csv" 2>&1
  "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$tag.csv" 2>&1
  grep -E '"(Duration|Registers Per Thread|Achieved Occupancy|Executed Instructions)"' "$OUT/ncu_$tag.csv" \
    | awk -F'","' '{print $5, $(NF-2), $NF}' | sed 's/"//g' | head -20
done
