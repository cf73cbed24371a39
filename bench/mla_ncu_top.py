"""Summary of an ncu source page (bench/mla_ncu.sh's sass_*.csv): stall samples by reason over the kernel, then
the SASS instructions with the most samples, with their two largest stall reasons.

    python bench/mla_ncu_top.py sass_auto_257_8192.csv [top N, default 30]
"""
from __future__ import annotations

import csv
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    with open(argv[0], newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or "Warp Stall Sampling (All Samples)" not in rows[1]:
        raise SystemExit(f"{argv[0]}: not an ncu '--page source --csv --print-source sass' export")
    hdr, data = rows[1], rows[2:]
    col = hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, i: int(r[i] or 0)  # noqa: E731
    total = sum(num(r, col) for r in data)
    print(f"{rows[0][1]}: {len(data)} SASS instructions, {total} stall samples")
    by_reason = sorted(((sum(num(r, i) for r in data), hdr[i][6:]) for i in reasons), reverse=True)
    print("  " + ", ".join(f"{name} {n / total:.1%}" for n, name in by_reason[:8]))
    top = sorted(range(len(data)), key=lambda k: -num(data[k], col))[:int(argv[1]) if len(argv) > 1 else 30]
    for k in sorted(top):
        r = data[k]
        two = sorted(((num(r, i), hdr[i][6:]) for i in reasons), reverse=True)[:2]
        print(f"  {k:5d} {r[1].strip()[:64]:64s} {num(r, col):6d}  " + ", ".join(f"{name} {n}" for n, name in two))


if __name__ == "__main__":
    main(sys.argv[1:])
