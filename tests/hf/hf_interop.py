#!/usr/bin/env python3
"""megatrain <-> Hugging Face transformers interoperability check (CTest label hf_python).

For a tiny random LlamaForCausalLM (untied embeddings) and a tiny Qwen2ForCausalLM (tied,
q/k/v biases), in float32 on the CPU:

  1. transformers saves the model with save_pretrained (safetensors);
  2. megatrain-train --model DIR --steps 0 (evaluate only) computes the loss on S+1 random
     tokens, which must equal transformers' loss on the same tokens (labels = input_ids):
     megatrain's window of S+1 tokens gives S inputs and their S next tokens, exactly the
     positions transformers' shifted loss covers. Tolerance: megatrain's CPU backend computes in
     fp32 (rel 1e-4); its CUDA backend in bf16 (rel 3e-2), checked too when --backend auto
     resolves to cuda;
  3. megatrain-train fine-tunes the model for a few steps and exports it (bf16 and f32); the
     export loads with AutoModelForCausalLM.from_pretrained (no missing, unexpected or
     mismatched weights) and transformers' loss on it equals megatrain's (evaluate only, on the
     same export) within the fp32 tolerance; the f32 export's loss also equals the validation
     loss megatrain reported at its last step.

Usage: hf_interop.py --megatrain PATH/megatrain-train [--work DIR] [--keep] [--no-auto-backend]
Exit status: 0 pass, 1 fail, 77 skip (torch or transformers cannot be imported).
"""

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77
# Everything is local: never let transformers reach for the Hub (the test machines are offline).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch
    import transformers
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
except Exception as e:  # ImportError, or a broken install raising something else
    print(f"SKIP: torch and transformers are needed for this test ({type(e).__name__}: {e})")
    sys.exit(SKIP)

VOCAB = 200
SEQ = 32
FP32_RTOL = 1e-4
BF16_RTOL = 3e-2
ATOL = 1e-5


def transformers_version():
    parts = []
    for p in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def dtype_kwargs(dtype):
    # transformers 4.56 renamed from_pretrained's torch_dtype= to dtype= (the old name still works
    # in 5.x with a deprecation warning; older versions know only torch_dtype).
    return {"dtype": dtype} if transformers_version() >= (4, 56) else {"torch_dtype": dtype}


def make_models():
    """(name, model) for the two tiny architectures, float32, eval mode."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    llama = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    qwen = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **common))
    return [("llama", llama), ("qwen2", qwen)]


def perturb(model, gen):
    """Weights large enough that the loss is far from ln(vocab) and depends on every tensor (the
    default init of std 0.02 gives near-uniform predictions that would hide a wrong mapping)."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied tensors appear once
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
                else:  # norm weights
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))


def hf_loss(model, tokens):
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def write_tokens(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def run(cmd, what):
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{what}: megatrain-train exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


def megatrain_eval(exe, model_dir, tokens_bin, backend):
    r = run([exe, "--model", model_dir, "--steps", "0", "--val-data", tokens_bin, "--seq", str(SEQ),
             "--backend", backend], f"evaluating {model_dir}")
    lines = [l for l in r.stdout.splitlines() if l.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON result from megatrain-train:\n{r.stdout}\n{r.stderr}")
    res = json.loads(lines[-1])
    if res.get("tokens") != SEQ or res.get("sequences") != 1:
        raise RuntimeError(f"megatrain evaluated {res.get('sequences')} sequences / {res.get('tokens')} tokens, "
                           f"expected 1 / {SEQ}: {res}")
    return res


def tolerance(compute_dtype):
    return FP32_RTOL if compute_dtype == "float32" else BF16_RTOL


class Checker:
    def __init__(self):
        self.failures = []

    def close(self, what, got, want, rtol, atol=ATOL):
        ok = math.isfinite(got) and abs(got - want) <= atol + rtol * abs(want)
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {got:.8f} vs {want:.8f} (diff {abs(got - want):.3g}, "
              f"allowed {atol + rtol * abs(want):.3g})", flush=True)
        if not ok:
            self.failures.append(what)

    def true(self, what, cond, detail=""):
        print(f"{'ok  ' if cond else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
        if not cond:
            self.failures.append(what)


def loading_info_problems(info, tied):
    """Weights from_pretrained reported as missing, unexpected or mismatched."""
    problems = []
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = sorted(str(v) for v in (info.get(key) or []))
        if key == "missing_keys" and tied:
            vals = [v for v in vals if v != "lm_head.weight"]  # tied: it is the embedding
        if vals:
            problems.append(f"{key}: {vals}")
    return problems


def check_model(name, model, exe, work, check, rng, gen, auto_backend):
    d = os.path.join(work, name)
    os.makedirs(d)
    hf_dir = os.path.join(d, "hf")
    perturb(model, gen)
    model.eval()
    model.save_pretrained(hf_dir)
    files = sorted(os.listdir(hf_dir))
    check.true(f"{name}: save_pretrained wrote safetensors", any(f.endswith(".safetensors") for f in files), str(files))
    tied = bool(model.config.tie_word_embeddings)

    tokens = [rng.randrange(VOCAB) for _ in range(SEQ + 1)]
    tokens_bin = os.path.join(d, "tokens.bin")
    write_tokens(tokens_bin, tokens)
    want = hf_loss(model, tokens)
    check.true(f"{name}: the loss is informative", abs(want - math.log(VOCAB)) > 0.1,
               f"{want:.4f} vs ln(vocab) {math.log(VOCAB):.4f}")

    # 1. transformers' model read by megatrain.
    res = megatrain_eval(exe, hf_dir, tokens_bin, "cpu")
    check.true(f"{name}: megatrain --backend cpu computes in float32", res["backend"] == "cpu" and
               res["compute_dtype"] == "float32", str(res))
    check.close(f"{name}: megatrain (cpu) loss of the transformers model", res["val_loss"], want,
                tolerance(res["compute_dtype"]))
    if auto_backend:
        res_auto = megatrain_eval(exe, hf_dir, tokens_bin, "auto")
        if res_auto["backend"] != "cpu":
            check.close(f"{name}: megatrain ({res_auto['backend']}, {res_auto['compute_dtype']}) loss of the "
                        f"transformers model", res_auto["val_loss"], want, tolerance(res_auto["compute_dtype"]))
        else:
            print(f"note {name}: --backend auto chose the cpu (no GPU): nothing more to check", flush=True)

    # 2. Fine-tune in megatrain, export, read back with transformers.
    train_bin = os.path.join(d, "train.bin")
    write_tokens(train_bin, [rng.randrange(VOCAB) for _ in range(40 * (SEQ + 1))])
    for export_dtype in ("bf16", "f32"):
        exp = os.path.join(d, f"export-{export_dtype}")
        out = os.path.join(d, f"run-{export_dtype}")
        run([exe, "--model", hf_dir, "--data", train_bin, "--val-data", tokens_bin, "--seq", str(SEQ), "--batch", "2",
             "--steps", "3", "--lr", "1e-3", "--backend", "cpu", "--eval-every", "0", "--out", out, "--export", exp,
             "--export-dtype", export_dtype], f"fine-tuning {name}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            final_val = json.loads(f.read().splitlines()[-1])["val_loss"]
        with open(os.path.join(exp, "config.json")) as f:
            cfg = json.load(f)
        torch_dtype = {"bf16": "bfloat16", "f32": "float32"}[export_dtype]
        check.true(f"{name}/{export_dtype}: config.json names the dtype",
                   cfg.get("torch_dtype") == torch_dtype and cfg.get("dtype") == torch_dtype, str(cfg))

        loaded = AutoModelForCausalLM.from_pretrained(exp, output_loading_info=True, **dtype_kwargs(torch.float32))
        if isinstance(loaded, tuple):
            loaded, info = loaded
            problems = loading_info_problems(info, tied)
            check.true(f"{name}/{export_dtype}: from_pretrained loads every weight", not problems, "; ".join(problems))
        loaded.eval()
        check.true(f"{name}/{export_dtype}: transformers loads {type(model).__name__}",
                   type(loaded).__name__ == type(model).__name__, type(loaded).__name__)
        hf_after = hf_loss(loaded, tokens)
        mt_after = megatrain_eval(exe, exp, tokens_bin, "cpu")
        check.close(f"{name}/{export_dtype}: transformers vs megatrain loss of the export", hf_after,
                    mt_after["val_loss"], tolerance(mt_after["compute_dtype"]))
        check.true(f"{name}/{export_dtype}: fine-tuning changed the model", abs(hf_after - want) > 1e-3,
                   f"{want:.6f} -> {hf_after:.6f}")
        if export_dtype == "f32":  # exact export: the loss megatrain reported at its last step
            check.close(f"{name}/f32: the export's loss vs megatrain's last validation loss", mt_after["val_loss"],
                        final_val, 1e-6, 1e-7)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatrain", required=True, help="path of the megatrain-train program")
    ap.add_argument("--work", help="work directory (default: a fresh temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-auto-backend", action="store_true",
                    help="do not also evaluate with --backend auto (the GPU, in bf16, where there is one)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if not os.access(args.megatrain, os.X_OK):
        print(f"FAIL: '{args.megatrain}' is not an executable megatrain-train")
        return 1

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, seed {seed}", flush=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    work = args.work or tempfile.mkdtemp(prefix="megatrain-hf-")
    if args.work:
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    check = Checker()
    try:
        for name, model in make_models():
            check_model(name, model.to(torch.float32), args.megatrain, work, check, rng, gen, not args.no_auto_backend)
    except Exception as e:  # a crash is a failure with its story, not a skip
        import traceback
        traceback.print_exc()
        check.failures.append(f"exception: {e}")
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if check.failures:
        print(f"FAILED ({len(check.failures)}): " + "; ".join(check.failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
