#!/usr/bin/env python3
"""The peer: PyTorch with the whole model on the GPU (bf16 weights and AdamW states), random tokens,
on the same shape and tokens per step as bench_train.

    python3 bench/peer_pytorch.py --preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 8 [--clip 1.0]

As strong as PyTorch is on the shape (the default; each choice can be fixed):
- each decoder layer compiled with torch.compile (--no-compile: eager);
- activation checkpointing of the fewest decoder layers that fit (--checkpoint-layers auto: none,
  then a quarter, half, three quarters, all of them, the first ones; or none, all, or a count);
- the fastest of PyTorch's scaled-dot-product attention kernels on this GPU (flash, cuDNN and
  memory-efficient, each timed on a step);
- the fewest micro-batches: the fastest of the whole batch in one forward/backward, halves,
  quarters and eighths, among those that fit (--micro 0; --micro N fixes it);
- fused AdamW, and with --clip PyTorch's clip_grad_norm_ (foreach) before it, as megatrain's
  exact mode does.
The configuration found is printed with the figures. `--no-compile --checkpoint-layers all` is the
peer of the measurements before 2026-12 (bench/results/).

Long sequences: the full logits tensor (tokens x vocabulary, upcast to fp32 by transformers' loss)
is what runs out of memory first, so where not even one sequence per pass fits with it, the peer
computes the loss as a strong PyTorch user would: the decoder's hidden states, then the LM head and
cross-entropy over chunks of --loss-chunk tokens, each chunk checkpointed (recomputed in the
backward), so only one chunk's logits exist at a time (the same loss: the mean over the shifted
labels). --loss-chunk N forces it; --attention NAME skips the trial of the others.

Prints tokens/s (mean over the steps after --skip) and peak GPU memory. Shapes come from the same
config.json fields megatrain's presets use (bench_train prints them with --print-config).
"""
import argparse
import json
import time

PRESETS = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen2.5-14b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    "gemma-3-4b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256, sliding_window=1024,
                       sliding_window_pattern=6, tie_word_embeddings=True),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          output_router_logits=False, tie_word_embeddings=False),
    # Qwen3.5's text models (model_type qwen3_5_text / qwen3_5_moe_text: Gated DeltaNet layers, every
    # fourth a gated full-attention layer; layer_types is filled in after any --layers cut)
    "qwen3.5-27b": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=5120,
                        intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=48,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                        max_position_embeddings=262144, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                        tie_word_embeddings=False),
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
                            rms_norm_eps=1e-6, output_router_logits=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                            tie_word_embeddings=False),
}
FULL_ATTENTION_INTERVAL = 4  # (the Qwen3.5 presets: layers 3, 7, 11, ... are full attention, as megatrain's presets)


def linear_attention_path():
    """Which Gated DeltaNet implementation transformers can take here: flash-linear-attention's
    kernels where that package is installed (or a Hub kernel, which needs the `kernels` package and
    a network), else its own PyTorch chunked delta rule and a PyTorch depthwise convolution."""
    import importlib.util
    from transformers.utils import is_flash_linear_attention_available
    fla = is_flash_linear_attention_available()
    hub = importlib.util.find_spec("kernels") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    return (f"Gated DeltaNet: {'flash-linear-attention' if fla else 'transformers own PyTorch chunked delta rule'} "
            f"(flash-linear-attention {'installed' if fla else 'not installed'}, the kernels package "
            f"{'installed' if hub else 'not installed'}), convolution: {'causal-conv1d' if conv else 'PyTorch conv1d'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=0,
                    help="sequences per forward/backward (gradient accumulation); 0: the whole batch if it fits, else halves")
    ap.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max norm before AdamW (0: none)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--loss-chunk", type=int, default=-1,
                    help="tokens per chunk of a chunked, checkpointed loss (0: transformers' full logits; -1: full logits "
                         "unless not even one sequence per pass fits, then 8192)")
    ap.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0: all)")
    ap.add_argument("--experts", default="grouped_mm",
                    help="transformers' experts implementation for a mixture of experts (grouped_mm: one grouped GEMM "
                         "per projection, its fastest on large batches)")
    ap.add_argument("--attention", choices=["flash", "cudnn", "efficient"], default=None,
                    help="the SDPA kernel to use (default: the fastest of the three on a trial step)")
    ap.add_argument("--no-compile", action="store_true", help="run the decoder layers eagerly (default: torch.compile each)")
    ap.add_argument("--checkpoint-layers", default="auto",
                    help="decoder layers (the first ones) whose activations are recomputed in the backward: auto (the "
                         "fewest that fit), none, all, or a count")
    a = ap.parse_args()

    import torch
    import transformers

    fields = dict(PRESETS[a.preset])
    if a.layers > 0:
        fields["num_hidden_layers"] = a.layers
    hybrid = "linear_num_value_heads" in fields
    if hybrid:
        fields["layer_types"] = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                                 for i in range(fields["num_hidden_layers"])]
    cfg = transformers.AutoConfig.for_model(**fields)
    cfg.use_cache = False
    moe = "num_experts" in fields
    extra = {"experts_implementation": a.experts} if moe else {}
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa", **extra)
    model.gradient_checkpointing_enable()
    model.train()
    layers = list(model.model.layers)
    if not a.no_compile:
        for layer in layers:
            layer.compile()  # (each decoder layer; the checkpointing wrapper stays outside the compiled code)

    def checkpoint_first(k):  # the first k decoder layers recompute their activations in the backward
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < k

    nl = len(layers)
    if a.checkpoint_layers == "auto":
        ks = sorted({0, nl // 4, nl // 2, 3 * nl // 4, nl})
    else:
        ks = [nl if a.checkpoint_layers == "all" else 0 if a.checkpoint_layers == "none" else int(a.checkpoint_layers)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n = sum(p.numel() for p in model.parameters())
    tokens = a.batch * a.seq
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    loss_chunk = max(a.loss_chunk, 0)

    def chunk_loss(h, y):
        return F.cross_entropy(model.lm_head(h).float(), y, reduction="sum")

    def loss_of(ids):
        if loss_chunk == 0:
            return model(input_ids=ids, labels=ids).loss
        h = model.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, cfg.hidden_size)
        y = ids[:, 1:].reshape(-1)
        total = sum(checkpoint(chunk_loss, h[i:i + loss_chunk], y[i:i + loss_chunk], use_reentrant=False)
                    for i in range(0, y.numel(), loss_chunk))
        return total / y.numel()

    def step(micro, backend):
        with sdpa_kernel([backend]):
            for _ in range(a.batch // micro):
                ids = torch.randint(0, cfg.vocab_size, (micro, a.seq), device="cuda")
                (loss_of(ids) / (a.batch // micro)).backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(micro, backend):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(micro, backend)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # The fastest attention kernel at the largest split where one runs, then the fastest split
    # with that kernel: the whole batch, half, a quarter (each timed on its second step: the
    # first pays for allocations and plans). A split that runs out of memory (also on the second
    # step, as a fragmented allocator can) is left out. None of these steps is measured.
    def attempt(micro, backend):
        try:
            timed(micro, backend)
            return timed(micro, backend)
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return None
        except RuntimeError as e:  # not available for this shape or GPU
            print(f"peer: {backend.name} not usable for passes of {micro} ({str(e).splitlines()[0][:80]})", flush=True)
            return None

    splits = [a.micro] if a.micro > 0 else [m for m in (a.batch, a.batch // 2, a.batch // 4, a.batch // 8)
                                            if m >= 1 and a.batch % m == 0]
    named = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    kernels = [named[a.attention]] if a.attention else list(named.values())
    trial = {}
    checkpoint_first(max(ks))  # (the kernel trial with the most recompute: it fits where anything does)
    while splits and not trial:
        for backend in kernels:
            t = attempt(splits[0], backend)
            if t is not None:
                trial[backend] = t
        if not trial:
            print(f"peer: passes of {splits[0]} do not fit{' (full logits)' if loss_chunk == 0 else ''}", flush=True)
            if len(splits) == 1 and loss_chunk == 0 and a.loss_chunk < 0:
                loss_chunk = 8192  # the full logits do not fit: the chunked loss (see the top of this file)
                print(f"peer: the loss in checkpointed chunks of {loss_chunk} tokens from here", flush=True)
                continue
            splits = splits[1:]
    if not trial:
        raise SystemExit(f"peer: not even passes of {splits[0] if splits else 1} sequence(s) fit on this GPU"
                         f"{f' (loss in chunks of {loss_chunk} tokens)' if loss_chunk else ''}")
    backend = min(trial, key=trial.get)
    # Then, at each split, the fewest checkpointed layers that fit; the fastest (split, layers) wins.
    split_times = {}
    for m in splits:
        for k in sorted(ks):
            checkpoint_first(k)
            t = attempt(m, backend)
            if t is not None:
                split_times[(m, k)] = t
                break
    micro, ckpt = min(split_times, key=split_times.get)
    checkpoint_first(ckpt)
    print(f"peer: PyTorch {torch.__version__}, transformers {transformers.__version__}, {a.preset}"
          f"{f' cut to {a.layers} layers' if a.layers else ''}{f', experts {a.experts}' if moe else ''}, {n / 1e9:.3f}B "
          f"parameters, {tokens} tokens per step ({a.batch} x {a.seq}, {a.batch // micro} pass(es) of {micro}), attention "
          f"{backend.name} (trial steps: {', '.join(f'{b.name} {t:.3f} s' for b, t in trial.items())}; passes of "
          f"{', '.join(f'{m} with {k} checkpointed layers: {t:.3f} s' for (m, k), t in split_times.items())}), "
          f"{f'{linear_attention_path()}, ' if hybrid else ''}"
          f"{'eager' if a.no_compile else 'torch.compile of each decoder layer'}, {ckpt} of {nl} layers checkpointed, "
          f"{f'loss in checkpointed chunks of {loss_chunk} tokens' if loss_chunk else 'full logits'}, fused AdamW"
          f"{f', clip_grad_norm_ {a.clip}' if a.clip > 0 else ''}", flush=True)
    times = []
    for i in range(a.steps):
        dt = timed(micro, backend)
        times.append(dt)
        print(f"peer step {i + 1}: {dt:.3f} s, {tokens / dt:.0f} tok/s", flush=True)
    measured = times[min(a.skip, len(times) - 1):]
    mean = sum(measured) / len(measured)
    print(json.dumps({"peer_tokens_per_s": tokens / mean, "peer_step_s": mean, "peer_micro": micro,
                      "peer_attention": backend.name, "peer_clip": a.clip, "peer_loss_chunk": loss_chunk,
                      "peer_compiled": not a.no_compile, "peer_checkpointed_layers": ckpt, "peer_layers": nl,
                      "peer_peak_gpu_bytes": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    main()
