#!/usr/bin/env python3
"""megatrain's bf16 GPU numerics against PyTorch's own bf16 autocast (CTest labels gpu, hf_python).

For small random Llama and Qwen2 models (grouped-query attention; tied and untied heads; Llama's
attention and MLP biases, Qwen2's q/k/v biases) saved with save_pretrained, three runs train the
same N steps on the same batch from the same weights, with the same update (AdamW, weight decay
on matrices only, constant learning rate, clip_grad_norm_ 1.0):

  fp32      PyTorch in float32 (the reference)
  autocast  PyTorch with torch.autocast(bfloat16): fp32 weights and optimizer, bf16 matrix products
  megatrain megatrain-train --model DIR --backend cuda (bf16 compute, fp32 masters and moments),
            exported in f32 at the end

and each run's distance from the reference is measured:
  - along the trajectory: the loss curve and the gradient norms (the mean relative difference
    over the steps), and each tensor's total update after N steps (||update - reference update||
    / ||reference update||: the median and the largest over tensors);
  - at fixed weights (the initial ones and the fp32 run's final ones): the loss and gradient norm
    each computes there (megatrain with a learning rate of 0), free of any trajectory's drift.
Each is the mean over --seeds seeds. Under Adam a trajectory's later steps drift apart
chaotically whatever the precision, so the trajectory measures are judged pooled over every
model and seed; the fixed-weight measures, deterministic, model by model. megatrain passes
where each is at most --ratio (1.2) times autocast's. The tables are printed either way;
--report FILE writes them (and every run's loss and norm series) as JSON.

Usage: numerics.py --megatrain PATH/megatrain-train [--work DIR] [--steps N] [--seeds N] [--seed N] [--report FILE]
Exit status: 0 pass, 1 fail, 77 skipped (no torch, transformers or CUDA GPU).
"""

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from hf_seed import add_seed_option, resolve_seed

SEQ, BATCH, VOCAB = 128, 8, 1024
LR, BETAS, EPS, WD, CLIP = 2e-3, (0.9, 0.95), 1e-8, 0.1, 1.0

CASES = [
    # name, architecture, config fields
    ("llama-gqa-tied", "LlamaForCausalLM", dict(model_type="llama", tie_word_embeddings=True)),
    ("llama-gqa-untied-biases", "LlamaForCausalLM",
     dict(model_type="llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    ("qwen2-gqa-tied", "Qwen2ForCausalLM", dict(model_type="qwen2", tie_word_embeddings=True)),
    ("qwen2-gqa-untied", "Qwen2ForCausalLM", dict(model_type="qwen2", tie_word_embeddings=False)),
]


def skip(why):
    print(f"SKIP: {why}", flush=True)
    sys.exit(77)


def markov_tokens(n, rng):
    """n tokens of a random sparse Markov chain: a pattern a small model learns within a few steps."""
    succ = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(VOCAB)]
    t, out = rng.randrange(VOCAB), []
    for _ in range(n):
        out.append(t)
        t = succ[t][rng.randrange(4)] if rng.random() < 0.9 else rng.randrange(VOCAB)
    return out


def write_tokens(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def read_safetensors_f32(directory):
    """name -> list of floats, from every .safetensors file of an f32 export (no third-party module)."""
    import torch

    out = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for k, v in header.items():
            if k == "__metadata__":
                continue
            assert v["dtype"] == "F32", f"{k}: {v['dtype']}"
            a, b = v["data_offsets"]
            out[k] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(v["shape"]).clone()
    return out


def train_torch(model, ids, labels, steps, autocast):
    """N steps of AdamW (decay on matrices) with clip_grad_norm_; returns losses, norms, final state."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                            betas=BETAS, eps=EPS, foreach=False)
    losses, norms = [], []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        # As transformers' loss does: the logits in float32, the mean over every labelled token.
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def mean_rel(xs, refs):
    return sum(abs(a - b) / abs(b) for a, b in zip(xs, refs)) / len(refs)


def distances(run, ref, before, names):
    # Over the steps: the mean relative difference (a trajectory's later steps drift apart
    # chaotically under Adam, whatever the precision; the mean over steps and seeds is stable).
    loss = mean_rel(run["loss"], ref["loss"])
    norm = mean_rel(run["norm"], ref["norm"])
    per = []
    for k in names:
        du, dr = run["state"][k] - before[k], ref["state"][k] - before[k]
        per.append(float((du - dr).norm() / dr.norm().clamp_min(1e-30)))
    per.sort()
    return {"loss": loss, "grad_norm": norm, "update_median": per[len(per) // 2], "update_max": per[-1],
            "loss_fixed": mean_rel(run["loss_fixed"], ref["loss_fixed"]),
            "grad_norm_fixed": mean_rel(run["norm_fixed"], ref["norm_fixed"])}


def loss_and_norm(model, ids, labels, autocast):
    """The loss and gradient norm at the model's weights, without a step."""
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return float(loss), norm


MEASURES = ("loss", "grad_norm", "update_median", "update_max", "loss_fixed", "grad_norm_fixed")


def round_lookup_to_bf16(model):
    """Diagnostic: make PyTorch read the embedding table's rows in bf16, as megatrain's lookup
    does (its residual stream is fp32 from there on, as autocast's)."""
    import torch

    def round_out(module, inputs, output):
        return output.to(torch.bfloat16).to(output.dtype)

    model.model.embed_tokens.register_forward_hook(round_out)


def run_case(args, work, name, arch, extra, seed, kinds):
    """One model and seed: the fp32 reference and each kind of run; their distances and series."""
    import random

    import torch
    import transformers

    rng = random.Random(seed)
    d = os.path.join(work, f"{name}-{seed}")
    os.makedirs(d)
    tokens = markov_tokens(BATCH * SEQ + 1, rng)
    train_bin, val_bin = os.path.join(d, "train.bin"), os.path.join(d, "val.bin")
    write_tokens(train_bin, tokens)  # BATCH windows: every step trains on all of them
    write_tokens(val_bin, tokens[: SEQ + 1])
    windows = [tokens[i * SEQ: i * SEQ + SEQ + 1] for i in range(BATCH)]
    ids = torch.tensor([w[:SEQ] for w in windows], device="cuda")
    labels = torch.tensor([w[1:] for w in windows], device="cuda")

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        architectures=[arch], hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
        **extra)
    cfg.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # biases start at zero in transformers: give them values to train from
        for k, p in model.named_parameters():
            if k.endswith(".bias"):
                p.normal_(0.0, 0.02)
    hf_dir = os.path.join(d, "hf")
    model.save_pretrained(hf_dir)
    before = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    names = [k for k, _ in model.named_parameters()]  # (a tied head appears once)
    def load(directory, label):
        m = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="sdpa").cuda().train()
        if label == "autocast_bf16_lookup":
            round_lookup_to_bf16(m)
        return m

    runs = {}
    for label in ["fp32"] + [k for k in kinds if k != "megatrain"]:
        m = load(hf_dir, label)
        losses, norms, state = train_torch(m, ids, labels, args.steps, label != "fp32")
        runs[label] = {"loss": losses, "norm": norms, "state": state}
        if label == "fp32":  # the reference's weights after N steps: where the fixed-weight measures look too
            m.save_pretrained(os.path.join(d, "hf-trained"))
        del m
    # At fixed weights (the start and the fp32 run's end): the loss and gradient norm each
    # precision computes there, free of any trajectory's drift.
    trained = os.path.join(d, "hf-trained")
    for label in ["fp32"] + [k for k in kinds if k != "megatrain"]:
        fixed = [loss_and_norm(load(w, label), ids, labels, label != "fp32") for w in (hf_dir, trained)]
        runs[label]["loss_fixed"] = [x[0] for x in fixed]
        runs[label]["norm_fixed"] = [x[1] for x in fixed]
    def megatrain(model_dir, out, steps, lr, export=None):
        cmd = [args.megatrain, "--model", model_dir, "--data", train_bin, "--val-data", val_bin, "--seq", str(SEQ),
               "--batch", str(BATCH), "--steps", str(steps), "--lr", str(lr), "--schedule", "constant",
               "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]), "--eps", str(EPS), "--weight-decay", str(WD),
               "--clip", str(CLIP), "--clip-mode", "exact", "--eval-every", "0", "--eval-batches", "1", "--backend",
               "cuda", "--out", out] + (["--export", export, "--export-dtype", "f32"] if export else [])
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
        if r.returncode != 0:
            print(r.stdout)
            print(f"FAIL {name}: megatrain-train exited {r.returncode}")
            raise SystemExit(1)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]

    exp = os.path.join(d, "export")
    metrics = megatrain(hf_dir, os.path.join(d, "run"), args.steps, LR, exp)
    at_end = megatrain(trained, os.path.join(d, "run-fixed"), 1, 0.0)[0]  # lr 0: the loss and norm at those weights
    runs["megatrain"] = {"loss": [m["loss"] for m in metrics], "norm": [m["grad_norm"] for m in metrics],
                         "state": read_safetensors_f32(exp), "loss_fixed": [metrics[0]["loss"], at_end["loss"]],
                         "norm_fixed": [metrics[0]["grad_norm"], at_end["grad_norm"]]}
    return {"seed": seed, "distances": {k: distances(runs[k], runs["fp32"], before, names) for k in kinds},
            "series": {k: {"loss": v["loss"], "grad_norm": v["norm"]} for k, v in runs.items() if "loss" in v}}


def judge(dist, kinds, judged, ratio, label):
    """Prints a table of distances from fp32 (one column per kind of run, then megatrain's over
    autocast's); returns a failure line for each measure in `judged` beyond `ratio`."""
    print("| distance from fp32 | " + " | ".join(kinds) + " | megatrain / autocast |\n|" + " --- |" * (len(kinds) + 2))
    failures = []
    for m in MEASURES:
        a, g = dist["autocast"][m], dist["megatrain"][m]
        print(f"| {m} | " + " | ".join(f"{dist[k][m]:.3e}" for k in kinds) + f" | {g / a:.2f} |")
        if m in judged and g > ratio * a:
            failures.append(f"{label} {m}: megatrain {g:.3e} > {ratio} x autocast {a:.3e}")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatrain", required=True)
    ap.add_argument("--work")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ratio", type=float, default=1.2)
    ap.add_argument("--seeds", type=int, default=8, help="runs per model (seed, seed + 1, ...): distances are averaged")
    ap.add_argument("--diagnose", action="store_true",
                    help="also run autocast with its embedding lookup rounded to bf16 (as megatrain's is)")
    ap.add_argument("--report")
    add_seed_option(ap)
    args = ap.parse_args()
    seed = resolve_seed(args.seed)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        skip(f"torch or transformers cannot be imported ({e})")
    if not torch.cuda.is_available():
        skip("no CUDA GPU")
    work = args.work or tempfile.mkdtemp(prefix="megatrain-numerics-")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # The trajectory measures: a trajectory's later steps drift apart chaotically under Adam
    # whatever the precision, so they are judged pooled (the mean over every model and seed);
    # the fixed-weight measures are deterministic and judged model by model.
    trajectory, fixed = ("loss", "grad_norm", "update_median", "update_max"), ("loss_fixed", "grad_norm_fixed")
    report, failures, seeds = {}, [], [seed + k for k in range(args.seeds)]
    kinds = ["autocast", "megatrain"] + (["autocast_bf16_lookup"] if args.diagnose else [])
    for name, arch, extra in CASES:
        per_seed = [run_case(args, work, name, arch, extra, sd, kinds) for sd in seeds]
        mean = {k: {m: sum(p["distances"][k][m] for p in per_seed) / len(per_seed) for m in MEASURES} for k in kinds}
        report[name] = {"mean": mean, "seeds": per_seed}
        fp = per_seed[0]["series"]["fp32"]
        print(f"\n{name}: {args.steps} steps, loss {fp['loss'][0]:.3f} -> {fp['loss'][-1]:.3f} (fp32, seed {seeds[0]}); "
              f"distances from fp32, the mean over {len(seeds)} seeds")
        failures += judge(mean, kinds, fixed, args.ratio, name)
    pooled = {k: {m: sum(report[n]["mean"][k][m] for n, _, _ in CASES) / len(CASES) for m in MEASURES} for k in kinds}
    report["pooled"] = pooled
    print(f"\npooled over the {len(CASES)} models and {len(seeds)} seeds")
    failures += judge(pooled, kinds, trajectory, args.ratio, "pooled")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        return 1
    print(f"\nall measures within {args.ratio} x autocast's distance (mean over {len(seeds)} seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
