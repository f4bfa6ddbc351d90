#!/usr/bin/env python3
"""PyTorch's matrix products at a decoder block's shapes, for comparison with megatrain's.

Usage: python3 bench/gemm_shapes.py [--tokens 32768] [--preset qwen2.5-1.5b ...]

For each projection of a block (q, k, o, gate, down; the fused q|k|v and gate|up for reference)
over `--tokens` rows, times torch.matmul in bf16 (random inputs, 20 back to back after 3 of warm-up)
forward (x W^T), input gradient (dy W) and weight gradient (dy^T x), and prints ms and TFLOP/s
per product and a block's sums (forward: q, k, v, o, gate, up, down; backward: the input and
weight gradients of each). docs/performance.md compares them with megatrain's kernels as Nsight
Compute times them (scripts/gpu_check.sh BIN OUT kernelclocks).
"""

import argparse

import torch

SHAPES = {  # hidden, intermediate, q_dim, kv_dim
    "qwen2.5-1.5b": (1536, 8960, 1536, 256),
    "qwen2.5-7b": (3584, 18944, 3584, 512),
}


def timed(f, flops, iters=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        f()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    return ms, flops / ms / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--preset", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    a = ap.parse_args()
    M = a.tokens
    for preset in a.preset:
        h, f, q, kv = SHAPES[preset]
        print(f"== {preset}: {M} tokens, bf16 (torch {torch.__version__}, {torch.cuda.get_device_name()})")
        rows = [("q", h, q, 1), ("k", h, kv, 2), ("o", q, h, 1), ("gate", h, f, 2), ("down", f, h, 1),
                ("q|k|v fused", h, q + 2 * kv, 0), ("gate|up fused", h, 2 * f, 0)]
        fwd = bwd = 0.0
        for name, K, N, count in rows:  # count: how many of the block's products have this shape
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            fl = 2 * M * N * K
            a_ = timed(lambda: x @ w.t(), fl)
            b_ = timed(lambda: dy @ w, fl)
            c_ = timed(lambda: dy.t() @ x, fl)
            fwd += count * a_[0]
            bwd += count * (b_[0] + c_[0])
            print(f"{name:14s} K={K:6d} N={N:6d}  forward {a_[0]:.3f} ms {a_[1]:4.0f} TFLOP/s | input gradient "
                  f"{b_[0]:.3f} ms {b_[1]:4.0f} | weight gradient {c_[0]:.3f} ms {c_[1]:4.0f}")
        print(f"a block's products: forward {fwd:.2f} ms, backward {bwd:.2f} ms")


if __name__ == "__main__":
    main()
