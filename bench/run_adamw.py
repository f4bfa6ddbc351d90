#!/usr/bin/env python3
"""Runs bench_adamw and its peers in one go and prints a table with ratios.

    python3 bench/run_adamw.py BUILD_DIR [--params N]

Peers, measured in the same run on the same arrays' size:
  - BM_TrafficCeiling ("traffic"): the same bytes moved with trivial arithmetic, compiler-
    vectorised for the same instruction set: a practical memory-bound reference for this
    machine (AdamW can beat it slightly: its bf16 stores bypass the cache);
  - PyTorch's CPU AdamW (fused=True, then foreach=True), fp32, when torch is importable.
    PyTorch moves 28 bytes per parameter (no bf16 copy); megatrain moves 30.
  - The reference figure of shared/DESIGN.md: 2.5 Gparam/s on a 16-core AVX-512 host.
"""
import argparse
import json
import os
import subprocess
import sys
import time

REFERENCE_GPARAMS = 2.5


def run_megatrain(build, params):
    env = dict(os.environ, MEGATRAIN_BENCH_PARAMS=str(params))
    out = subprocess.run([os.path.join(build, "bench", "bench_adamw"), "--benchmark_format=json",
                          "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true"],
                         env=env, check=True, capture_output=True, text=True).stdout
    rows = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        # run_name: "BM_AdamW/threads:1" or "BM_AdamW/threads:all_16" (without the aggregate's
        # suffix); the counters "params/s" and "tbb_threads" come with every row.
        name = b["run_name"].split("/")[0]
        rows[(name, int(b["tbb_threads"]))] = (b["params/s"] / 1e9, b.get("label", ""))
    return rows


def run_torch(params, threads, fused):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(params, generator=g) * 0.02)
    p.grad = torch.randn(params, generator=g) * 1e-3
    kw = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=1e-4, **kw)
    opt.step()  # allocates the states
    times = []
    deadline = time.perf_counter() + 2.0
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return params / times[len(times) // 2] / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--params", type=int, default=1 << 28)
    a = ap.parse_args()
    rows = run_megatrain(a.build, a.params)
    all_threads = max(t for (_, t) in rows)
    print(f"AdamW, {a.params} fp32 parameters ({a.params * 4 / 2**30:.2f} GiB per state array), Gparam/s")
    print(f"{'threads':>7} {'path':>7} {'megatrain':>10} {'traffic':>8} {'vs traf':>8} {'torch fused':>11} "
          f"{'torch foreach':>13} {'vs fused':>9} {'vs 2.5 ref':>10}")
    for t in sorted({t for (_, t) in rows}):
        mt, label = rows[("BM_AdamW", t)]
        ceil, _ = rows[("BM_TrafficCeiling", t)]
        fused = run_torch(a.params, t, True)
        foreach = run_torch(a.params, t, False)
        f = lambda x: f"{x:.3f}" if x is not None else "n/a"
        r = lambda x: f"{mt / x:.2f}x" if x else "n/a"
        print(f"{t:>7} {label:>7} {mt:>10.3f} {ceil:>8.3f} {mt / ceil:>7.0%} {f(fused):>11} {f(foreach):>13} "
              f"{r(fused):>9} {mt / REFERENCE_GPARAMS:>9.2f}x" + ("" if t == all_threads else "  (one thread)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
