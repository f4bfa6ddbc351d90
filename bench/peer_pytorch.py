#!/usr/bin/env python3
"""The peer: PyTorch with the whole model on the GPU (bf16 weights and AdamW states), activation
checkpointing, random tokens, on the same shape and tokens per step as bench_train.

    python3 bench/peer_pytorch.py --preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 8

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
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8, help="sequences per forward/backward (gradient accumulation)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3)
    a = ap.parse_args()

    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**PRESETS[a.preset])
    cfg.use_cache = False
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    n = sum(p.numel() for p in model.parameters())
    tokens = a.batch * a.seq
    print(f"peer: PyTorch {torch.__version__}, transformers {transformers.__version__}, {a.preset}, {n / 1e9:.3f}B "
          f"parameters, {tokens} tokens per step ({a.batch} x {a.seq}, micro-batches of {a.micro})", flush=True)
    times = []
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in range(a.batch // a.micro):
            ids = torch.randint(0, cfg.vocab_size, (a.micro, a.seq), device="cuda")
            out = model(input_ids=ids, labels=ids)
            (out.loss / (a.batch // a.micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"peer step {step + 1}: {dt:.3f} s, {tokens / dt:.0f} tok/s", flush=True)
    measured = times[min(a.skip, len(times) - 1):]
    mean = sum(measured) / len(measured)
    print(json.dumps({"peer_tokens_per_s": tokens / mean, "peer_step_s": mean,
                      "peer_peak_gpu_bytes": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    main()
