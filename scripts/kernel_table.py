#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of kernel durations (scripts/gpu_check.sh ... kernels).

Usage: kernel_table.py NCU_CSV [--last-step]
Input: `ncu --metrics gpu__time_duration.sum --csv --print-units base ...` output. Prints the
time per kind of kernel (matrix products, attention, megatrain's own kernels by name) and the
kernels that take the most time, as Markdown tables. --last-step: only the kernels from the last
embedding lookup on (the last step of a run of several, e.g. after the first step's tuning).
"""

import collections
import csv
import re
import sys


def kind(name):
    if re.search(r"nvjet|gemm|cutlass|splitKreduce", name):
        return "matrix products (cuBLASLt)"
    if re.search(r"sdpa|fmha|cudnn", name):
        return "attention (cuDNN)"
    m = re.search(r"megatrain::(?:<unnamed>::)?(\w+)", name)
    if m:
        k = m.group(1)
        op = re.search(r"megatrain::(?:<unnamed>::)?(\w+Op)\b", name[m.end():])
        return "megatrain: " + (op.group(1) if k == "map_kernel" and op else k)
    if "cub::" in name:
        return "cub (embedding backward sort)"
    return "other: " + name[:50]


def main():
    lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
    rows = list(csv.reader(lines))
    head = rows[0]
    ki, vi = head.index("Kernel Name"), head.index("Metric Value")
    if "--last-step" in sys.argv[2:]:
        starts = [i for i, r in enumerate(rows) if i > 0 and "embedding_forward_kernel" in r[ki]]
        rows = [head] + rows[starts[-1]:] if starts else rows
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for r in rows[1:]:
        ns = float(r[vi].replace(",", ""))
        k = kind(r[ki])
        by_kind[k][0] += 1
        by_kind[k][1] += ns
        short = re.sub(r"\(.*", "", r[ki])[:90]
        by_name[short][0] += 1
        by_name[short][1] += ns
    total = sum(v[1] for v in by_kind.values())
    print(f"{sum(v[0] for v in by_kind.values())} kernels, {total / 1e6:.2f} ms in all\n")
    print("| kind | launches | ms | share |\n| --- | --- | --- | --- |")
    for k, (n, ns) in sorted(by_kind.items(), key=lambda x: -x[1][1]):
        print(f"| {k} | {n} | {ns / 1e6:.2f} | {100 * ns / total:.1f}% |")
    print("\n| kernel | launches | ms | share |\n| --- | --- | --- | --- |")
    for k, (n, ns) in sorted(by_name.items(), key=lambda x: -x[1][1])[:15]:
        print(f"| `{k}` | {n} | {ns / 1e6:.2f} | {100 * ns / total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
