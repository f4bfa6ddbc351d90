#!/usr/bin/env python3
"""The several-GPU peer (issue 19): PyTorch FSDP2 with CPUOffloadPolicy, the stand-in for the
MegaTrain paper's DeepSpeed ZeRO-3 offload (not installable on the GPU machines), one process per
GPU, on the same shape and tokens per GPU as bench/data_parallel.py.

    python3 -m torch.distributed.run --nproc-per-node 2 bench/peer_fsdp2.py --preset qwen2.5-1.5b \
        --batch-per-gpu 32 --seq 1024 --steps 5 [--clip 1.0]

As strong as FSDP2 offload is here: every decoder layer and the root sharded (`fully_shard`), the
parameters, gradients and AdamW states in host memory (pinned where that fits the host: PyTorch's
pinned allocator rounds each tensor up to a power of two, which at 14B does not fit 256 GiB;
--pin-memory), bf16 compute with fp32 gradient
reduction (`MixedPrecisionPolicy`), activation checkpointing, sdpa attention, AdamW on the CPU
(fused where this PyTorch has it, else foreach), clip_grad_norm_ before it with --clip (exact, as
megatrain's default); the batch in one forward/backward a GPU, else in halves, quarters (the first
that fits). Prints, on rank 0, the tokens/s over all GPUs (mean over the steps after --skip), and a
JSON line last.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_pytorch import PRESETS  # noqa: E402  (the same shapes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0: all)")
    ap.add_argument("--batch-per-gpu", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--pin-memory", choices=("auto", "true", "false"), default="auto",
                    help="CPUOffloadPolicy(pin_memory=...); auto: pinned where the pinned parameters and gradients "
                         "(PyTorch's pinned allocator rounds each to a power of two) and the moments of every process "
                         "of this host fit its available memory, else pageable")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("cpu:gloo,cuda:nccl")  # (offloaded: the norm of CPU tensors is reduced over gloo)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    fields = dict(PRESETS[a.preset])
    if a.layers > 0:
        fields["num_hidden_layers"] = a.layers
    cfg = transformers.AutoConfig.for_model(**fields)
    cfg.use_cache = False
    torch.manual_seed(0)
    # Built on the meta device and sharded before any memory is taken, so that each rank
    # materialises only its shard in host memory (a whole fp32 model a rank would not fit the
    # host at 14B), then initialised in place as transformers would (normal(0, 0.02) matrices,
    # unit norm gains, zero biases).
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pin = a.pin_memory == "true"
    if a.pin_memory == "auto":  # (the strongest that fits: pinned copies are faster, but rounded up)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        need = 0
        for p in model.parameters():  # (each rank's shard: dim 0 split evenly; fp32 parameter and gradient pinned, m and v not)
            rows = -(-p.shape[0] // world) if p.dim() > 0 else 1
            numel = rows * (p.numel() // max(p.shape[0], 1) if p.dim() > 0 else 1)
            need += 2 * (1 << max(4 * numel - 1, 1).bit_length()) + 8 * numel
        avail = 0
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        pin = need * local_world <= 0.9 * avail
        if rank == 0:
            print(f"peer: pinned offload would need {need * local_world / 2**30:.1f} GiB on this host of "
                  f"{avail / 2**30:.1f} GiB available: pin_memory={pin}", flush=True)
    off = CPUOffloadPolicy(pin_memory=pin)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if name.endswith("bias"):
                local.zero_()
            elif p.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, cfg.initializer_range)
        # (the rotary inverse frequencies, buffers left empty by to_empty: from a fresh module)
        fresh = type(model.model.rotary_emb)(config=cfg, device="cpu")
        for name, b in fresh.named_buffers():
            getattr(model.model.rotary_emb, name).copy_(b)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        fused = True
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        fused = False
    n = sum(p.numel() for p in model.parameters())

    def step(micro):
        for _ in range(a.batch_per_gpu // micro):
            ids = torch.randint(0, cfg.vocab_size, (micro, a.seq), device="cuda")
            (model(input_ids=ids, labels=ids).loss / (a.batch_per_gpu // micro)).backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(micro):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step(micro)
        torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    micro = a.batch_per_gpu
    times = []
    while True:
        try:
            ok = torch.tensor([1], device="cuda")
            times = [timed(micro)]
        except torch.OutOfMemoryError:
            ok = torch.tensor([0], device="cuda")
            torch.cuda.empty_cache()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # (every rank splits alike)
        if ok.item() == 1:
            break
        micro //= 2
        if micro == 0:
            raise SystemExit("FSDP2 offload: not even one sequence a GPU fits")
    for _ in range(a.steps - 1):
        times.append(timed(micro))
    kept = times[a.skip:] if len(times) > a.skip else times
    tokens = world * a.batch_per_gpu * a.seq
    tps = tokens * len(kept) / sum(kept)
    if rank == 0:
        print(f"peer: PyTorch {torch.__version__} FSDP2 + CPUOffloadPolicy(pin_memory={pin}) on {world} GPUs, {a.preset} ({n} parameters), "
              f"{a.batch_per_gpu} x {a.seq} tokens a GPU in passes of {micro}, AdamW on the CPU "
              f"({'fused' if fused else 'foreach'}), clip {a.clip}: steps {[round(t, 3) for t in times]} s, "
              f"{tps:.0f} tok/s, peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        print(json.dumps({"peer_tokens_per_s": tps, "parameters": n, "gpus": world, "micro": micro, "steps_s": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
