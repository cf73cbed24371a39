"""Each GEMM stage alone per compiled kernel variant at K2.6 shapes: which (NT, U, XB, S) is fastest for gate/up
and for down at small T. Prints a table (device medians over fresh random routings, µs) and writes JSON.

    python bench/moe_stage_variants.py --tokens 1 2 4 8 --out DIR
"""
import argparse
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance"), HERE]
import optimized.moe as moe_k  # noqa: E402
from test_bench_moe import run_provenance  # noqa: E402
from test_moe_kernels import event_times, k26_random_layer, median, random_routes  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    layer = k26_random_layer("cuda")
    w = layer["weights"]
    rows = []
    for t in args.tokens:
        routes = random_routes(layer, t, args.reps)
        groups = [moe_k.group_tokens(i, w) for _, i, _ in routes]
        hs = [moe_k.gate_up(x, w, g) for (x, _, _), g in zip(routes, groups)]
        for v in moe_k.GEMM_VARIANTS:
            row = {"tokens": t, "variant": list(v)}
            for name, fns in (
                    ("gate_up", [(lambda x=x, g=g: moe_k.gate_up(x, w, g, v)) for (x, _, _), g in zip(routes, groups)]),
                    ("down", [(lambda h=h, g=g: moe_k.down(h, w, g, v)) for h, g in zip(hs, groups)])):
                fns[0]()
                row[name + "_us"] = median(event_times(fns)) * 1e6
            rows.append(row)
            print(f"T={t:4d} {str(tuple(v)):14s} gate_up {row['gate_up_us']:7.1f} us  down {row['down_us']:7.1f} us",
                  flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_stage_variants.json"), "w") as f:
            json.dump({"provenance": run_provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
