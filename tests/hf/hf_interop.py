#!/usr/bin/env python3
"""megatrain <-> Hugging Face transformers interoperability check (CTest label hf_python).

For a tiny random LlamaForCausalLM (untied embeddings), a tiny Qwen3ForCausalLM (q/k norms, head_dim
wider than hidden / heads, untied), a tiny Phi3ForCausalLM (fused qkv_proj and gate_up_proj, a
pad_token_id), a tiny Gemma3ForCausalLM (sandwich (1 + w) norms, GeGLU, a sliding and a full
layer), a tiny GptOssForCausalLM (attention sinks, biased router and experts fused in the
checkpoint, clamped SwiGLU), the mixtures of experts Qwen3MoeForCausalLM (a sparse and a dense
layer), MixtralForCausalLM and OlmoeForCausalLM (their experts saved per expert), a tiny
Qwen2ForCausalLM (tied, q/k/v biases), and the hybrids Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and
Qwen3NextForCausalLM (Qwen3-Next on the CPU backend alone: CPU_ONLY), in float32 on the CPU:

  1. transformers saves the model with save_pretrained (safetensors);
  2. megatrain-train --model DIR --steps 0 (evaluate only) computes the loss on S+1 random
     tokens, which must equal transformers' loss on the same tokens (labels = input_ids):
     megatrain's window of S+1 tokens gives S inputs and their S next tokens, exactly the
     positions transformers' shifted loss covers. Tolerance: megatrain's CPU backend computes in
     fp32 (rel 1e-4); its CUDA backend in bf16 (rel 3e-2), checked too when --backend auto
     resolves to cuda;
  3. transformers saves the same model cast to bfloat16 (config.json then declares bfloat16 and
     every tensor is BF16); megatrain's loss on it equals transformers' on the same bf16 weights
     (computed in fp32: rel 1e-4; computed in bf16: rel 3e-2) and the fp32 model's (rel 3e-2);
  4. megatrain-train fine-tunes the model for a few steps and exports it (bf16 in one file, f32
     sharded: --shard-size small enough for several shards and model.safetensors.index.json);
     the export loads with AutoModelForCausalLM.from_pretrained (no missing, unexpected or
     mismatched weights) and transformers' loss on it equals megatrain's (evaluate only, on the
     same export) within the fp32 tolerance; the f32 export's loss also equals the validation
     loss megatrain reported at its last step. That fine-tuning changed the model is checked
     without relying on noise: every training window is the evaluation window itself, so the
     (training) loss must fall clearly, and the exported weights must differ from the saved ones
     by training steps (~lr per element with Adam), far more than bf16 rounding.

     Published multimodal folders: Gemma3ForConditionalGeneration exported as its language model,
     Qwen3_5ForConditionalGeneration (fixture qwen3_5_mm) as the whole model, its vision tower the
     folder's.

  5. rope scaling: for tiny models with linear, llama3 and yarn rope parameters (yarn with and
     without an explicit attention factor and betas), on a window twice the original context,
     megatrain's loss equals transformers' (which differs from the loss without the scaling).

The run is deterministic: the seed is fixed (--seed, or the environment variable
MEGATRAIN_HF_SEED, picks another).

Usage: hf_interop.py --megatrain PATH/megatrain-train [--work DIR] [--keep] [--no-auto-backend] [--seed N]
                    [--only NAME...]
Exit status: 0 pass, 1 fail, 77 skip (torch or transformers cannot be imported).
"""

import argparse
import copy
import glob
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

from hf_seed import add_seed_option, resolve_seed

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
# Fine-tuning: TRAIN_STEPS AdamW steps at LR (cosine schedule, no warm-up at this length). Adam's
# first update moves every weight with a gradient by ~LR whatever the gradient's scale.
TRAIN_STEPS = 3
LR = 1e-3
# The training loss (on the evaluation window, which is every training window) must fall by at
# least this much (nats). The first-order drop of a sign-like Adam step is LR * sum|grad|.
MIN_TRAIN_LOSS_DROP = 0.3  # observed: 1.2 to 1.6
# An element "moved" when it differs from the saved model by more than MOVED_ABS and by more
# than MOVED_REL * |saved value|: 8 times the largest bf16 rounding error (2**-9 relative), so
# rounding alone never counts. At least MIN_MOVED_FRACTION of all elements must have moved.
MOVED_ABS = LR / 4
MOVED_REL = 8 * 2.0 ** -9
MIN_MOVED_FRACTION = 0.05  # observed: about 0.3
# The f32 export is sharded: at most this many bytes per shard (several shards for these models).
F32_SHARD_SIZE = "40KB"


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
    """(name, model) for the tiny architectures, float32, eval mode."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    llama = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    qwen = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **common))
    # Qwen3: q/k norms, head_dim 32 (q wider than the hidden size), untied
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(tie_word_embeddings=False, head_dim=32, **common))
    # Phi-3: q/k/v and gate/up fused in the checkpoint; a padding row (pad_token_id 3)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(tie_word_embeddings=False, pad_token_id=3, bos_token_id=None,
                                                                eos_token_id=None, original_max_position_embeddings=128,
                                                                **common))
    # Gemma 3: (1 + w) norms, four per block, GeGLU, scaled embeddings, query_pre_attn_scalar, a
    # sliding layer (window 8, its own rotary base) and a full one (scaled rotary); tied, padding row 3
    gemma3 = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=3,
        bos_token_id=None, eos_token_id=None, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        **common))
    # GPT-OSS: attention sinks, q/k/v/o biases, a sliding layer (window 8) and a full one, yarn; a
    # biased router over 4 experts (top 2), biased experts stacked and fused in the checkpoint,
    # the clamped SwiGLU
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        tie_word_embeddings=False, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=None, bos_token_id=None,
        eos_token_id=None, **common))
    # SmolLM3: every second layer without rotary (NoPE), tied
    smollm3 = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        tie_word_embeddings=True, no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        **common))
    # Mixtures of experts: Qwen3-MoE (layer 0 sparse, layer 1 dense: mlp_only_layers; renormalised
    # top 2 of 4), Mixtral (top 2 of 4) and OLMoE (whole-projection q/k norms, top 2 of 4 not
    # renormalised); transformers 5 stacks the experts in memory and saves them per expert
    moe = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    qwen3_moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[1], **moe, **common))
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                         **moe, **common))
    olmoe = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **moe, **common))
    # The hybrids (Qwen3-Next CPU_ONLY: the CUDA backend refuses its fused projections): Qwen3.5 (a
    # Gated DeltaNet layer, then a gated full-attention layer), Qwen3.5-MoE (both layers sparse, a
    # shared expert) and Qwen3-Next (fused projections; layer 1 dense)
    hybrid = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], **moe)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40)
    qwen3_5 = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hybrid, **common))
    qwen3_5_moe = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**experts, **hybrid, **common))
    qwen3_next = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(mlp_only_layers=[1], **experts, **hybrid,
                                                                                **common))
    make_models.gemma3_text = gemma3.config  # (the language model of check_gemma3_multimodal's)
    return [("llama", llama), ("qwen2", qwen), ("qwen3", qwen3), ("phi3", phi3), ("gemma3", gemma3),
            ("gpt_oss", gpt_oss), ("smollm3", smollm3), ("qwen3_moe", qwen3_moe), ("mixtral", mixtral),
            ("olmoe", olmoe), ("qwen3_5", qwen3_5), ("qwen3_5_moe", qwen3_5_moe), ("qwen3_next", qwen3_next)]


# The models the CUDA backend refuses so far (Qwen3-Next's fused linear-attention projections):
# checked on the CPU backend alone.
CPU_ONLY = {"qwen3_next"}


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


def state_fp32(model):
    """name -> float32 copy of every tensor of the model's state dict."""
    return {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}


def weight_changes(before, after):
    """(elements moved by more than rounding, elements compared, max |difference|, names of
    tensors that are missing or differ in shape)."""
    moved = total = 0
    max_diff = 0.0
    bad = []
    for name, a in before.items():
        b = after.get(name)
        if b is None or b.shape != a.shape:
            bad.append(name)
            continue
        diff = (b - a).abs()
        moved += int(((diff > MOVED_ABS) & (diff > MOVED_REL * a.abs())).sum())
        total += a.numel()
        max_diff = max(max_diff, float(diff.max()) if a.numel() else 0.0)
    return moved, total, max_diff, bad


def safetensors_dtypes(directory):
    """dtype -> number of tensors, over every .safetensors file in `directory` (header only)."""
    counts = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                counts[entry["dtype"]] = counts.get(entry["dtype"], 0) + 1
    return counts


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


def logits_difference(model, loaded, tokens):
    """Largest difference of two models' fp32 logits on `tokens`, and the largest logit."""
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        a, b = model(input_ids=ids).logits.float(), loaded(input_ids=ids).logits.float()
    return float((a - b).abs().max()), float(b.abs().max())


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
    saved = state_fp32(model)
    files = sorted(os.listdir(hf_dir))
    check.true(f"{name}: save_pretrained wrote safetensors", any(f.endswith(".safetensors") for f in files), str(files))
    tied = bool(model.config.tie_word_embeddings)

    # The evaluation window: S random tokens and the first of them again, so that the training
    # file below (those S tokens repeated) cuts into windows (S + 1 tokens at a stride of S) that
    # are all this very window.
    pattern = [rng.randrange(VOCAB) for _ in range(SEQ)]
    tokens = pattern + pattern[:1]
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
    before = res["val_loss"]  # megatrain's loss on the evaluation (and training) window, fp32

    # 1a. Exported as read (f32, no step): transformers loads it with the saved model's logits.
    exp0 = os.path.join(d, "export-untrained-f32")
    run([exe, "--model", hf_dir, "--steps", "0", "--eval-batches", "0", "--backend", "cpu", "--export", exp0,
         "--export-dtype", "f32"], f"exporting {name} untrained")
    loaded0, info0 = AutoModelForCausalLM.from_pretrained(exp0, output_loading_info=True, **dtype_kwargs(torch.float32))
    problems = loading_info_problems(info0, tied)
    check.true(f"{name}/untrained f32 export: from_pretrained loads every weight", not problems, "; ".join(problems))
    diff, scale = logits_difference(model, loaded0.eval(), tokens)
    check.true(f"{name}/untrained f32 export: transformers' logits are the saved model's", diff <= 1e-6 * scale,
               f"largest difference {diff:.3g} of logits up to {scale:.3g}")
    del loaded0

    # 1b. Prompt-masked examples (a token file with .mask and .idx beside it, as megatrain-tokenize
    # writes them), one per sequence and padded, against transformers with labels -100 on the
    # untrained tokens and the padding: PyTorch's cross_entropy(ignore_index=-100), the mean over
    # the labelled tokens of the batch. Lengths below, at and above a row of SEQ + 1 tokens.
    examples = []
    for length in (SEQ // 3, SEQ + 1, SEQ + 7):
        toks = [rng.randrange(VOCAB) for _ in range(length)]
        mask = [1 if rng.random() < 0.5 else 0 for _ in range(length)]
        mask[min(length, SEQ + 1) - 1] = 1
        examples.append((toks, mask))
    ex_bin = os.path.join(d, "examples.bin")
    ids = torch.zeros((len(examples), SEQ + 1), dtype=torch.long)
    labels = torch.full((len(examples), SEQ + 1), -100, dtype=torch.long)
    with open(ex_bin, "wb") as f, open(ex_bin + ".mask", "wb") as fm, open(ex_bin + ".idx", "wb") as fi:
        at = 0
        for r, (toks, mask) in enumerate(examples):
            f.write(struct.pack(f"<{len(toks)}H", *toks))
            fm.write(bytes(mask))
            fi.write(struct.pack("<q", at))
            at += len(toks)
            n = min(len(toks), SEQ + 1)
            ids[r, :n] = torch.tensor(toks[:n])
            labels[r, 1:n] = torch.tensor([t if m else -100 for t, m in zip(toks[1:n], mask[1:n])])
        fi.write(struct.pack("<q", at))
    with torch.no_grad():
        want_masked = float(model(input_ids=ids, labels=labels).loss)
    labelled = int((labels[:, 1:] != -100).sum())
    for backend in ["cpu"] + (["auto"] if auto_backend else []):
        r = run([exe, "--model", hf_dir, "--steps", "0", "--val-data", ex_bin, "--seq", str(SEQ), "--backend", backend],
                "evaluating prompt-masked examples")
        got = json.loads([l for l in r.stdout.splitlines() if l.strip().startswith("{")][-1])
        check.true(f"{name}: prompt-masked examples: {got['tokens']} labelled tokens, want {labelled}",
                   got["tokens"] == labelled and got["sequences"] == len(examples), str(got))
        check.close(f"{name}: megatrain ({got['backend']}, {got['compute_dtype']}) loss of prompt-masked examples vs "
                    f"transformers with labels -100", got["val_loss"], want_masked, tolerance(got["compute_dtype"]))

    # 2. transformers' model saved in bfloat16: config.json declares it, every tensor is BF16.
    bf16_dir = os.path.join(d, "hf-bf16")
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    model_bf16.eval()
    model_bf16.save_pretrained(bf16_dir)
    with open(os.path.join(bf16_dir, "config.json")) as f:
        cfg16 = json.load(f)
    declared = cfg16.get("dtype", cfg16.get("torch_dtype"))
    check.true(f"{name}/bfloat16 save: config.json declares bfloat16", declared == "bfloat16",
               f"dtype {cfg16.get('dtype')!r}, torch_dtype {cfg16.get('torch_dtype')!r}")
    stored = safetensors_dtypes(bf16_dir)
    check.true(f"{name}/bfloat16 save: every tensor is BF16", set(stored) == {"BF16"}, str(stored))
    del model_bf16
    # The references come from the saved directory, as a user would load it: in float32 (the BF16
    # weights widened exactly; casting the bf16 model back instead would keep its rotary inv_freq
    # buffer rounded to bf16, ~1e-4 off in the loss) and in bfloat16 (transformers computing in bf16).
    ref32, info32 = AutoModelForCausalLM.from_pretrained(bf16_dir, output_loading_info=True,
                                                         **dtype_kwargs(torch.float32))
    problems = loading_info_problems(info32, tied)
    check.true(f"{name}/bfloat16 save: from_pretrained loads it back", not problems, "; ".join(problems))
    want16_exact = hf_loss(ref32.eval(), tokens)
    del ref32
    want16_native = hf_loss(AutoModelForCausalLM.from_pretrained(bf16_dir, **dtype_kwargs(torch.bfloat16)).eval(), tokens)
    res16 = megatrain_eval(exe, bf16_dir, tokens_bin, "cpu")
    check.close(f"{name}/bfloat16 save: megatrain (cpu) vs transformers in fp32 on the bf16 weights",
                res16["val_loss"], want16_exact, tolerance(res16["compute_dtype"]))
    check.close(f"{name}/bfloat16 save: megatrain (cpu) vs transformers computing in bf16", res16["val_loss"],
                want16_native, BF16_RTOL)
    check.close(f"{name}/bfloat16 save: megatrain (cpu) vs the fp32 model's loss", res16["val_loss"], want, BF16_RTOL)
    if auto_backend:
        res16_auto = megatrain_eval(exe, bf16_dir, tokens_bin, "auto")
        if res16_auto["backend"] != "cpu":
            check.close(f"{name}/bfloat16 save: megatrain ({res16_auto['backend']}, {res16_auto['compute_dtype']}) vs "
                        f"transformers in fp32 on the bf16 weights", res16_auto["val_loss"], want16_exact,
                        tolerance(res16_auto["compute_dtype"]))

    # megatrain refuses the same weights under a config.json that declares another dtype, naming
    # the file and the tensor (by default: mixing dtypes must be asked for explicitly).
    mismatch_dir = os.path.join(d, "hf-bf16-declared-float32")
    shutil.copytree(bf16_dir, mismatch_dir)
    cfg16.pop("torch_dtype", None)
    cfg16["dtype"] = "float32"
    with open(os.path.join(mismatch_dir, "config.json"), "w") as f:
        json.dump(cfg16, f)
    cmd = [exe, "--model", mismatch_dir, "--steps", "0", "--val-data", tokens_bin, "--seq", str(SEQ), "--backend", "cpu"]
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    message = r.stdout + r.stderr
    expected = ("tensor 'model.embed_tokens.weight' in '" + os.path.join(mismatch_dir, "model.safetensors") +
                "' is stored as BF16 but config.json declares \"dtype\": \"float32\"")
    check.true(f"{name}/bfloat16 save declared float32: megatrain refuses it, naming file and tensor",
               r.returncode != 0 and expected in message, f"exit {r.returncode}: {message[-600:]}")

    # 3. Fine-tune in megatrain, export, read back with transformers. Every training window is
    # the evaluation window, so the validation loss megatrain reports is the training loss.
    train_bin = os.path.join(d, "train.bin")
    write_tokens(train_bin, pattern * 40 + pattern[:1])
    for export_dtype in ("bf16", "f32"):
        exp = os.path.join(d, f"export-{export_dtype}")
        out = os.path.join(d, f"run-{export_dtype}")
        sharded = export_dtype == "f32"
        run([exe, "--model", hf_dir, "--data", train_bin, "--val-data", tokens_bin, "--seq", str(SEQ), "--batch", "2",
             "--steps", str(TRAIN_STEPS), "--lr", str(LR), "--backend", "cpu", "--eval-every", "0", "--out", out,
             "--export", exp, "--export-dtype", export_dtype] + (["--shard-size", F32_SHARD_SIZE] if sharded else []),
            f"fine-tuning {name}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            final_val = json.loads(f.read().splitlines()[-1])["val_loss"]
        with open(os.path.join(exp, "config.json")) as f:
            cfg = json.load(f)
        torch_dtype = {"bf16": "bfloat16", "f32": "float32"}[export_dtype]
        check.true(f"{name}/{export_dtype}: config.json names the dtype",
                   cfg.get("torch_dtype") == torch_dtype and cfg.get("dtype") == torch_dtype, str(cfg))
        files = sorted(os.listdir(exp))
        shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
        if sharded:
            ok = len(shards) >= 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
            if ok:
                with open(os.path.join(exp, "model.safetensors.index.json")) as f:
                    ok = sorted(set(json.load(f)["weight_map"].values())) == shards
            check.true(f"{name}/{export_dtype}: the export is sharded ({F32_SHARD_SIZE}) with an index", ok, str(files))
        else:
            check.true(f"{name}/{export_dtype}: the export is one model.safetensors",
                       "model.safetensors" in files and not shards, str(files))

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
        # Fine-tuning changed the model: the training loss fell clearly, and the weights moved by
        # training steps, not by rounding.
        check.true(f"{name}/{export_dtype}: fine-tuning lowered the training loss",
                   mt_after["val_loss"] < before - MIN_TRAIN_LOSS_DROP,
                   f"{before:.6f} -> {mt_after['val_loss']:.6f} (must fall by more than {MIN_TRAIN_LOSS_DROP})")
        moved, total, max_diff, bad = weight_changes(saved, state_fp32(loaded))
        check.true(f"{name}/{export_dtype}: the export has every tensor of the saved model, same shapes", not bad,
                   str(bad))
        check.true(f"{name}/{export_dtype}: fine-tuning moved the weights by more than rounding",
                   total > 0 and moved >= MIN_MOVED_FRACTION * total,
                   f"{moved} of {total} elements moved (> {MOVED_ABS:g} and > {MOVED_REL:g} relative), "
                   f"largest change {max_diff:.3g}")
        if export_dtype == "f32":  # exact export: the loss megatrain reported at its last step
            check.close(f"{name}/f32: the export's loss vs megatrain's last validation loss", mt_after["val_loss"],
                        final_val, 1e-6, 1e-7)


def check_multimodal_exports(name, exe, d, hf_dir, model, load, pattern, want, check):
    """A multimodal folder's exports: untrained (f32), its logits on text are the folder's model's,
    to fp32 rounding; fine-tuned on text (f32), transformers' loss of the export is megatrain's.
    `load(dir, what)` loads an export, checking what the family's export must hold; `want` is the
    model's loss on the evaluation window (tokens.bin in `d`: `pattern` and its first token)."""
    tokens = pattern + pattern[:1]
    tokens_bin = os.path.join(d, "tokens.bin")
    exp = os.path.join(d, "export-untrained")
    run([exe, "--model", hf_dir, "--steps", "0", "--eval-batches", "0", "--backend", "cpu", "--export", exp,
         "--export-dtype", "f32"], f"exporting {name}")
    loaded = load(exp, "untrained f32 export")
    diff, scale = logits_difference(model, loaded, tokens)
    check.true(f"{name}/untrained f32 export: its logits on text are the folder's model's", diff <= 1e-5 * scale,
               f"largest difference {diff:.3g} of logits up to {scale:.3g}")
    train_bin = os.path.join(d, "train.bin")
    write_tokens(train_bin, pattern * 40 + pattern[:1])
    exp = os.path.join(d, "export-trained")
    run([exe, "--model", hf_dir, "--data", train_bin, "--val-data", tokens_bin, "--seq", str(SEQ), "--batch", "2",
         "--steps", str(TRAIN_STEPS), "--lr", str(LR), "--backend", "cpu", "--eval-every", "0", "--out",
         os.path.join(d, "run"), "--export", exp, "--export-dtype", "f32"], f"fine-tuning {name}")
    loaded = load(exp, "fine-tuned f32 export")
    after = megatrain_eval(exe, exp, tokens_bin, "cpu")
    check.close(f"{name}/fine-tuned f32 export: transformers vs megatrain loss", hf_loss(loaded, tokens),
                after["val_loss"], tolerance(after["compute_dtype"]))
    check.true(f"{name}: fine-tuning lowered the training loss", after["val_loss"] < want - MIN_TRAIN_LOSS_DROP,
               f"{want:.6f} -> {after['val_loss']:.6f}")


def check_gemma3_multimodal(exe, work, check, rng, gen):
    """Gemma 3 as the Hub publishes 4B and larger: Gemma3ForConditionalGeneration (the "gemma3"
    language model above, a tiny SigLIP vision tower and its projector). megatrain reads its
    language model (the loss on text equals transformers'), fine-tunes it on text, and exports a
    Gemma3ForCausalLM that transformers loads: exported untrained (f32), its logits are the
    multimodal model's on text; fine-tuned, transformers' loss of the export equals megatrain's."""
    name = "gemma3_multimodal"
    d = os.path.join(work, name)
    os.makedirs(d)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=make_models.gemma3_text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    perturb(model, gen)
    model.eval()
    hf_dir = os.path.join(d, "hf")
    model.save_pretrained(hf_dir)
    pattern = [rng.randrange(VOCAB) for _ in range(SEQ)]
    tokens = pattern + pattern[:1]
    tokens_bin = os.path.join(d, "tokens.bin")
    write_tokens(tokens_bin, tokens)
    want = hf_loss(model, tokens)
    res = megatrain_eval(exe, hf_dir, tokens_bin, "cpu")
    check.close(f"{name}: megatrain (cpu) loss of the multimodal model's language model on text", res["val_loss"], want,
                tolerance(res["compute_dtype"]))

    def load(directory, what):
        loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                            **dtype_kwargs(torch.float32))
        problems = loading_info_problems(info, True)
        check.true(f"{name}/{what}: from_pretrained loads every weight", not problems, "; ".join(problems))
        check.true(f"{name}/{what}: transformers loads Gemma3ForCausalLM", type(loaded).__name__ == "Gemma3ForCausalLM",
                   type(loaded).__name__)
        return loaded.eval()

    check_multimodal_exports(name, exe, d, hf_dir, model, load, pattern, want, check)


def check_qwen3_5_multimodal(exe, work, check, rng, gen):
    """Qwen3.5 as the Hub publishes it: Qwen3_5ForConditionalGeneration (fixture qwen3_5_mm, written
    by transformers, with a vision tower and multi-token-prediction tensors beside the language
    model). megatrain fine-tunes the language model on text and exports the whole model: transformers
    loads the export as Qwen3_5ForConditionalGeneration with every weight; its vision tower is the
    folder's, value for value; exported untrained (f32), its logits on text are the folder's; fine-tuned,
    transformers' loss of the export equals megatrain's."""
    name = "qwen3_5_multimodal"
    d = os.path.join(work, name)
    os.makedirs(d)
    hf_dir = os.path.join(d, "hf")
    shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "qwen3_5_mm"), hf_dir)
    cls = transformers.Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(hf_dir, **dtype_kwargs(torch.float32)).eval()
    vocab = model.config.text_config.vocab_size
    pattern = [rng.randrange(vocab) for _ in range(SEQ)]
    tokens = pattern + pattern[:1]
    tokens_bin = os.path.join(d, "tokens.bin")
    write_tokens(tokens_bin, tokens)
    want = hf_loss(model, tokens)
    visual = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("model.visual.")}

    def load(directory, what):
        loaded, info = cls.from_pretrained(directory, output_loading_info=True, **dtype_kwargs(torch.float32))
        problems = loading_info_problems(info, model.config.text_config.tie_word_embeddings)
        check.true(f"{name}/{what}: from_pretrained loads every weight", not problems, "; ".join(problems))
        state = loaded.state_dict()
        same = all(k in state and torch.equal(state[k], v) for k, v in visual.items())
        check.true(f"{name}/{what}: the vision tower is the folder's ({len(visual)} tensors)", same and len(visual) > 0)
        return loaded.eval()

    check_multimodal_exports(name, exe, d, hf_dir, model, load, pattern, want, check)


ROPE_CASES = [  # (architecture, rope parameters): positions past original_max_position_embeddings (16)
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.6,
               "beta_fast": 8.0, "beta_slow": 2.0}),
]


def check_rope_scaling(exe, work, check, rng, gen, auto_backend):
    """megatrain's loss equals transformers' for models with rope scaling (linear, llama3, yarn),
    on a window longer than the original context, and differs from the loss without it."""
    for k, (arch, rope) in enumerate(ROPE_CASES):
        name = f"rope-{k}-{rope['rope_type']}-{arch}"
        common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=arch == "qwen2")
        cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
        extra = {} if arch == "llama" else {"use_sliding_window": False}
        if transformers_version() >= (5, 0):
            cfg = cfg_cls(rope_parameters=dict(rope, rope_theta=100.0), **common, **extra)
            plain_cfg = cfg_cls(rope_parameters={"rope_type": "default", "rope_theta": 100.0}, **common, **extra)
        else:
            cfg = cfg_cls(rope_theta=100.0, rope_scaling=dict(rope), **common, **extra)
            plain_cfg = cfg_cls(rope_theta=100.0, **common, **extra)
        model = cls(cfg).to(torch.float32)
        perturb(model, gen)
        model.eval()
        d = os.path.join(work, name)
        hf_dir = os.path.join(d, "hf")
        os.makedirs(d)
        model.save_pretrained(hf_dir)
        tokens = [rng.randrange(VOCAB) for _ in range(SEQ + 1)]
        tokens_bin = os.path.join(d, "tokens.bin")
        write_tokens(tokens_bin, tokens)
        want = hf_loss(model, tokens)
        plain = cls(plain_cfg).to(torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.eval()
        check.true(f"{name}: the scaling changes transformers' loss", abs(hf_loss(plain, tokens) - want) > 3 * FP32_RTOL * want,
                   f"{hf_loss(plain, tokens):.6f} vs {want:.6f}")
        res = megatrain_eval(exe, hf_dir, tokens_bin, "cpu")
        check.close(f"{name}: megatrain (cpu) loss", res["val_loss"], want, FP32_RTOL)
        if auto_backend:
            res_auto = megatrain_eval(exe, hf_dir, tokens_bin, "auto")
            if res_auto["backend"] != "cpu":
                check.close(f"{name}: megatrain ({res_auto['backend']}) loss", res_auto["val_loss"], want,
                            tolerance(res_auto["compute_dtype"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatrain", required=True, help="path of the megatrain-train program")
    ap.add_argument("--work", help="work directory (default: a fresh temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-auto-backend", action="store_true",
                    help="do not also evaluate with --backend auto (the GPU, in bf16, where there is one)")
    ap.add_argument("--only", nargs="*", help="check only these models (of make_models' names)")
    add_seed_option(ap)
    args = ap.parse_args()
    if not os.access(args.megatrain, os.X_OK):
        print(f"FAIL: '{args.megatrain}' is not an executable megatrain-train")
        return 1

    try:
        seed = resolve_seed(args.seed)
    except ValueError as e:
        print(f"FAIL: {e}")
        return 1
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
            if not args.only or name in args.only:
                check_model(name, model.to(torch.float32), args.megatrain, work, check, rng, gen,
                            not args.no_auto_backend and name not in CPU_ONLY)
        if not args.only or "gemma3_multimodal" in args.only:
            check_gemma3_multimodal(args.megatrain, work, check, rng, gen)
        if not args.only or "qwen3_5_multimodal" in args.only:
            check_qwen3_5_multimodal(args.megatrain, work, check, rng, gen)
        if not args.only:
            check_rope_scaling(args.megatrain, work, check, rng, gen, not args.no_auto_backend)
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
