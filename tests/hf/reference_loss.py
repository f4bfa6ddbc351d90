#!/usr/bin/env python3
"""megatrain reads Hugging Face directories the way transformers does (CTest label hf; python3 only).

Writes small random Llama (tied and untied, with attention/MLP biases), Qwen2 (q/k/v biases) and
Mistral model directories by hand (config.json + model.safetensors, F32 or BF16 weights), and
checks that `megatrain-train --model DIR --steps 0` gives the loss of a plain-Python transcription
of transformers' forward pass (LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM: RMSNorm,
rotate-half rotary embeddings, grouped-query causal attention, SwiGLU MLP, mean cross-entropy of
the next token), computed in double precision. Weights are large enough that the loss is far
from ln(vocab), so a transposed or misnamed tensor cannot pass. Needs no third-party module: it is
the transformers check that runs everywhere (hf_interop.py runs transformers itself).

The run is deterministic: the seed is fixed (--seed, or the environment variable
MEGATRAIN_HF_SEED, picks another).

Usage: reference_loss.py --megatrain PATH/megatrain-train [--work DIR] [--seed N]
Exit status: 0 pass, 1 fail.
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

from hf_seed import add_seed_option, resolve_seed

RTOL = 1e-5  # megatrain's CPU backend computes in fp32; the reference in double


def bf16_round(x):
    """x rounded to bfloat16 (nearest, ties to even), as a Python float."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def write_safetensors(path, tensors, dtype):
    """tensors: name -> (shape, flat values). Values must already be representable in `dtype`."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (shape, values) in tensors.items():
        if dtype == "F32":
            blob = struct.pack(f"<{len(values)}f", *values)
        else:  # BF16: the upper half of each float's bits
            blob = b"".join(struct.pack("<f", v)[2:] for v in values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def matvec(w, x):
    return [sum(a * b for a, b in zip(row, x)) for row in w]


def add(*vs):
    return [sum(t) for t in zip(*vs)]


def rmsnorm(x, w, eps):
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * r * wi for v, wi in zip(x, w)]


class Model:
    """A random model of the given architecture, its config.json and tensors."""

    def __init__(self, arch, tied, bias, theta, dtype, rng):
        self.arch, self.tied, self.dtype = arch, tied, dtype
        self.d, self.heads, self.kv, self.ffn, self.vocab, self.layers, self.eps = 64, 4, 2, 96, 200, 2, 1e-6
        self.hd = self.d // self.heads
        self.theta = theta
        self.config = {"architectures": [arch], "hidden_size": self.d, "intermediate_size": self.ffn,
                       "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                       "num_key_value_heads": self.kv, "vocab_size": self.vocab, "rms_norm_eps": self.eps,
                       "tie_word_embeddings": tied, "max_position_embeddings": 256, "hidden_act": "silu",
                       "torch_dtype": "float32" if dtype == "F32" else "bfloat16"}
        # transformers 5 writes rope_parameters; 4.x rope_theta at the top level: use both spellings.
        if arch == "Qwen2ForCausalLM":
            self.config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
        else:
            self.config["rope_theta"] = theta
        if arch == "LlamaForCausalLM":
            self.config["attention_bias"] = bias
            self.config["mlp_bias"] = bias
        if arch == "MistralForCausalLM":
            self.config["sliding_window"] = None
        self.tensors, self.rng = {}, rng
        qkv_bias = bias or arch == "Qwen2ForCausalLM"
        other_bias = bias and arch == "LlamaForCausalLM"
        d, f = self.d, self.ffn
        self.embed = self.matrix("model.embed_tokens.weight", self.vocab, d, gain=math.sqrt(d))
        self.blocks = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            b = {"ln1": self.vector(p + "input_layernorm.weight", d, 1.0, 0.3),
                 "q": self.matrix(p + "self_attn.q_proj.weight", self.heads * self.hd, d),
                 "k": self.matrix(p + "self_attn.k_proj.weight", self.kv * self.hd, d),
                 "v": self.matrix(p + "self_attn.v_proj.weight", self.kv * self.hd, d),
                 "o": self.matrix(p + "self_attn.o_proj.weight", d, self.heads * self.hd),
                 "ln2": self.vector(p + "post_attention_layernorm.weight", d, 1.0, 0.3),
                 "gate": self.matrix(p + "mlp.gate_proj.weight", f, d),
                 "up": self.matrix(p + "mlp.up_proj.weight", f, d),
                 "down": self.matrix(p + "mlp.down_proj.weight", d, f)}
            zero = lambda n: [0.0] * n
            b["qb"] = self.vector(p + "self_attn.q_proj.bias", self.heads * self.hd) if qkv_bias else zero(self.heads * self.hd)
            b["kb"] = self.vector(p + "self_attn.k_proj.bias", self.kv * self.hd) if qkv_bias else zero(self.kv * self.hd)
            b["vb"] = self.vector(p + "self_attn.v_proj.bias", self.kv * self.hd) if qkv_bias else zero(self.kv * self.hd)
            b["ob"] = self.vector(p + "self_attn.o_proj.bias", d) if other_bias else zero(d)
            b["gb"] = self.vector(p + "mlp.gate_proj.bias", f) if other_bias else zero(f)
            b["ub"] = self.vector(p + "mlp.up_proj.bias", f) if other_bias else zero(f)
            b["db"] = self.vector(p + "mlp.down_proj.bias", d) if other_bias else zero(d)
            self.blocks.append(b)
        self.norm = self.vector("model.norm.weight", d, 1.0, 0.3)
        # An untied head gets a large gain so that the logits spread well beyond O(1) and the loss lands
        # several nats above ln(vocab) for every seed (gain 1.5 left it within 0.5 nats now and then).
        self.head = self.embed if tied else self.matrix("lm_head.weight", self.vocab, d, gain=4.0)

    def value(self, x):
        return bf16_round(x) if self.dtype == "BF16" else struct.unpack("<f", struct.pack("<f", x))[0]

    def matrix(self, name, rows, cols, gain=1.5):
        sd = gain / math.sqrt(cols)
        w = [[self.value(self.rng.gauss(0.0, sd)) for _ in range(cols)] for _ in range(rows)]
        self.tensors[name] = ([rows, cols], [v for r in w for v in r])
        return w

    def vector(self, name, n, mean=0.0, sd=0.2):
        v = [self.value(mean + self.rng.gauss(0.0, sd)) for _ in range(n)]
        self.tensors[name] = ([n], v)
        return v

    def write(self, path):
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config, f, indent=2)
        write_safetensors(os.path.join(path, "model.safetensors"), self.tensors, self.dtype)

    def rope(self, rows, nheads):
        half = self.hd // 2
        inv = [1.0 / self.theta ** (2 * i / self.hd) for i in range(half)]
        out = []
        for pos, r in enumerate(rows):
            o = []
            for h in range(nheads):
                x = r[h * self.hd:(h + 1) * self.hd]
                for i in range(self.hd):
                    ang = inv[i % half] * pos
                    rotated = -x[i + half] if i < half else x[i - half]  # rotate_half
                    o.append(x[i] * math.cos(ang) + rotated * math.sin(ang))
            out.append(o)
        return out

    def loss(self, tokens, trained=None):
        """transformers' loss with labels = input_ids on tokens (S + 1 of them: S predictions).
        With `trained` (a flag per token), the labels of untrained tokens are -100: then the sum
        of the labelled tokens' losses and their count."""
        seq = len(tokens) - 1
        x = [list(self.embed[t]) for t in tokens[:seq]]
        group = self.heads // self.kv
        for b in self.blocks:
            h = [rmsnorm(r, b["ln1"], self.eps) for r in x]
            q = self.rope([add(matvec(b["q"], r), b["qb"]) for r in h], self.heads)
            k = self.rope([add(matvec(b["k"], r), b["kb"]) for r in h], self.kv)
            v = [add(matvec(b["v"], r), b["vb"]) for r in h]
            attn = []
            for t in range(seq):
                o = []
                for hq in range(self.heads):
                    hk = hq // group  # repeat_kv
                    qs = q[t][hq * self.hd:(hq + 1) * self.hd]
                    scores = [sum(a * c for a, c in zip(qs, k[j][hk * self.hd:(hk + 1) * self.hd])) / math.sqrt(self.hd)
                              for j in range(t + 1)]
                    top = max(scores)
                    e = [math.exp(s - top) for s in scores]
                    z = sum(e)
                    o += [sum(e[j] / z * v[j][hk * self.hd + i] for j in range(t + 1)) for i in range(self.hd)]
                attn.append(o)
            x = [add(r, matvec(b["o"], a), b["ob"]) for r, a in zip(x, attn)]
            for i, r in enumerate(x):
                n = rmsnorm(r, b["ln2"], self.eps)
                g, u = add(matvec(b["gate"], n), b["gb"]), add(matvec(b["up"], n), b["ub"])
                act = [gi / (1.0 + math.exp(-gi)) * ui for gi, ui in zip(g, u)]  # silu(gate) * up
                x[i] = add(r, matvec(b["down"], act), b["db"])
        total, count = 0.0, 0
        for t in range(seq):
            if trained is not None and not trained[t + 1]:
                continue  # label -100: ignored by cross_entropy
            z = matvec(self.head, rmsnorm(x[t], self.norm, self.eps))
            top = max(z)
            total += top + math.log(sum(math.exp(v - top) for v in z)) - z[tokens[t + 1]]
            count += 1
        return (total, count) if trained is not None else total / seq


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatrain", required=True)
    ap.add_argument("--work")
    add_seed_option(ap)
    args = ap.parse_args()
    try:
        seed = resolve_seed(args.seed)
    except ValueError as e:
        print(f"FAIL: {e}")
        return 1
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    work = args.work or tempfile.mkdtemp(prefix="megatrain-hfref-")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cases = [("LlamaForCausalLM", False, False, 10000.0, "F32"),
             ("LlamaForCausalLM", True, True, 500000.0, "BF16"),
             ("Qwen2ForCausalLM", True, False, 1000000.0, "BF16"),
             ("Qwen2ForCausalLM", False, False, 10000.0, "F32"),
             ("MistralForCausalLM", False, False, 10000.0, "F32")]
    failures = []
    try:
        for n, (arch, tied, bias, theta, dtype) in enumerate(cases):
            what = f"{arch} tied={tied} bias={bias} rope_theta={theta:g} {dtype}"
            model = Model(arch, tied, bias, theta, dtype, rng)
            path = os.path.join(work, f"model{n}")
            model.write(path)
            seq = 21  # not a multiple of anything in particular
            tokens = [rng.randrange(model.vocab) for _ in range(seq + 1)]
            with open(os.path.join(path, "tokens.bin"), "wb") as f:
                f.write(struct.pack(f"<{len(tokens)}H", *tokens))
            want = model.loss(tokens)
            r = subprocess.run([args.megatrain, "--model", path, "--steps", "0", "--val-data",
                                os.path.join(path, "tokens.bin"), "--seq", str(seq), "--backend", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
            if r.returncode != 0:
                print(f"FAIL {what}: megatrain-train exited {r.returncode}\n{r.stdout}{r.stderr}")
                failures.append(what)
                continue
            got = json.loads(r.stdout.strip().splitlines()[-1])
            informative = abs(want - math.log(model.vocab)) > 0.5
            ok = informative and got["tokens"] == seq and abs(got["val_loss"] - want) <= RTOL * abs(want)
            print(f"{'ok  ' if ok else 'FAIL'} {what}: megatrain {got['val_loss']:.8f}, reference {want:.8f} "
                  f"(rel {abs(got['val_loss'] - want) / abs(want):.2e}; ln(vocab) {math.log(model.vocab):.3f})",
                  flush=True)
            if not ok:
                failures.append(what)
            if n == 0:
                # Prompt-masked examples (a token file with .mask and .idx beside it, as
                # megatrain-tokenize writes them): one example per sequence, padded; the loss is
                # transformers' with labels -100 on untrained tokens, the mean over all labelled
                # tokens of all the examples. Lengths: shorter than the row, exactly a row (seq + 1)
                # and longer (cut at seq + 1).
                examples, total, count = [], 0.0, 0
                for length in (7, seq + 1, seq + 9, 12):
                    toks = [rng.randrange(model.vocab) for _ in range(length)]
                    mask = [1 if rng.random() < 0.5 else 0 for _ in range(length)]
                    mask[min(length, seq + 1) - 1] = 1  # a trained label within the row
                    examples.append((toks, mask))
                    t, c = model.loss(toks[:seq + 1], mask[:seq + 1])
                    total, count = total + t, count + c
                want = total / count
                ex = os.path.join(path, "examples.bin")
                with open(ex, "wb") as f, open(ex + ".mask", "wb") as fm, open(ex + ".idx", "wb") as fi:
                    at = 0
                    for toks, mask in examples:
                        f.write(struct.pack(f"<{len(toks)}H", *toks))
                        fm.write(bytes(mask))
                        fi.write(struct.pack("<q", at))
                        at += len(toks)
                    fi.write(struct.pack("<q", at))
                r = subprocess.run([args.megatrain, "--model", path, "--steps", "0", "--val-data", ex, "--seq", str(seq),
                                    "--backend", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   timeout=300)
                label = f"{what}, prompt-masked examples"
                if r.returncode != 0:
                    print(f"FAIL {label}: megatrain-train exited {r.returncode}\n{r.stdout}{r.stderr}")
                    failures.append(label)
                    continue
                got = json.loads(r.stdout.strip().splitlines()[-1])
                ok = got["tokens"] == count and abs(got["val_loss"] - want) <= RTOL * abs(want)
                print(f"{'ok  ' if ok else 'FAIL'} {label}: megatrain {got['val_loss']:.8f} over {got['tokens']} labels, "
                      f"reference {want:.8f} over {count}", flush=True)
                if not ok:
                    failures.append(label)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"FAILED: {'; '.join(failures)}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
