#!/usr/bin/env python3
"""Writes the model-family fixtures of tests/fixtures/<family>/ from transformers itself.

For each family, a tiny random model in float32 on the CPU (a fixed seed per family), saved with
save_pretrained (config.json, model.safetensors as transformers writes them), and reference.safetensors
beside it: the inputs (input_ids, labels with some -100), and transformers' outputs on them, the
mean cross-entropy over the labelled tokens (loss), the logits, and the gradient of that loss
with respect to every parameter ("grad." + the parameter's name). No label shift: labels[i] is
the target of position i, as megatrain's trainer takes them.

tests/model/test_families.cpp checks megatrain's CPU backend against these files in CI (where
there is no PyTorch); run this script again (on a machine with torch and transformers, e.g. the
GPU machine) only to change or add a family:

    python3 tests/hf/make_fixtures.py --out tests/fixtures [--only qwen3]

The hybrid families' fixtures (qwen3_5, qwen3_5_mm, qwen3_5_moe, qwen3_next) hold transformers'
computation in float64 (float64_family; made on the GPU machine on 2026-12-07 with transformers
5.17, their generation_config.json not kept; qwen3_5_mm's language model swapped for the copy's, as
AutoModel builds transformers' own). Two more are written but not read by megatrain yet
(issue 53): qwen3_5_moe_aux and qwen3_next_aux (the auxiliary loss as their routers record it);
neither is in tests/fixtures.
"""

import argparse
import json
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROWS, SEQ, VOCAB = 2, 11, 97
PAD = 5  # the pad_token_id of the fixtures that set one
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2)


def families():
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(tie_word_embeddings=False, **COMMON)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **COMMON)),
        # head_dim 16 with hidden 32 and 4 heads: q is wider than the hidden size, as in Qwen3-0.6B
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(tie_word_embeddings=False, head_dim=16, **COMMON)),
        "qwen3_tied_bias": (t.Qwen3ForCausalLM, t.Qwen3Config(tie_word_embeddings=True, head_dim=8, attention_bias=True,
                                                              **COMMON)),
        # Phi-3: q/k/v and gate/up fused in the checkpoint; pad_token_id set (the embedding's
        # padding_idx: its row gets no gradient from the lookup), and the inputs hold that id
        "phi3": (t.Phi3ForCausalLM, t.Phi3Config(tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=None,
                                                 eos_token_id=None, original_max_position_embeddings=64, **COMMON)),
        # Phi-3's long-context variants: longrope, the sequence (11) longer than the original context
        # (8), so the long factors apply, and the attention factor sqrt(1 + ln 8 / ln 8)
        "phi3_longrope": (t.Phi3ForCausalLM, t.Phi3Config(
            tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            original_max_position_embeddings=8,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.5, 2.0],
                             "long_factor": [1.0, 1.9, 3.7, 9.5], "original_max_position_embeddings": 8},
            **COMMON)),
        # Phi-4-mini's rotary: on the first 3/4 of each head only (partial_rotary_factor 0.75: 6 of 8
        # dimensions), with longrope (factors for those 3 frequency pairs; the sequence of 11 longer
        # than the original context of 8); tied, as Phi-4-mini
        "phi3_partial": (t.Phi3ForCausalLM, t.Phi3Config(
            tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            original_max_position_embeddings=8, partial_rotary_factor=0.75,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.7],
                             "long_factor": [1.0, 2.3, 6.1], "original_max_position_embeddings": 8,
                             "partial_rotary_factor": 0.75},
            **COMMON)),
        # Gemma 3 (text): (1 + w) norms, four per block, q/k norms, GeGLU (tanh GELU), embeddings
        # times sqrt(hidden), the softmax scale from query_pre_attn_scalar (not head_dim), and
        # sliding-window layers (window 4 < the 11 tokens) beside a full one, each type with its
        # own rotary parameters (the full layers' scaled, as Gemma 3 4B and larger); tied, with a
        # padding id in the inputs
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(
            tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=12, sliding_window=4,
            pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **{**COMMON, "num_hidden_layers": 3})),
        # SmolLM3: Llama's block and biases (attention_bias, mlp_bias), the middle layer without
        # rotary (NoPE: no_rope_layers 0), rope_theta at SmolLM3Config's 2,000,000; tied, a padding id
        "smollm3": (t.SmolLM3ForCausalLM, t.SmolLM3Config(
            tie_word_embeddings=True, attention_bias=True, mlp_bias=True, no_rope_layers=[1, 0, 1],
            pad_token_id=PAD, bos_token_id=None, eos_token_id=None, **{**COMMON, "num_hidden_layers": 3})),
        # Mixtures of experts (dropless top-k routing; each layer's experts are saved per expert,
        # as on the Hub, and their gradients written under those names). Qwen3-MoE: per-head q/k
        # norms, the top-k weights renormalised, a dense layer among the sparse ones (mlp_only_layers)
        "qwen3_moe": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True, mlp_only_layers=[1], **{**COMMON, "num_hidden_layers": 3})),
        # ... with decoder_sparse_step 2 (every second layer sparse: 1 and 3) and mlp_only_layers [3]
        # (dense after all): one sparse layer, the second of four
        "qwen3_moe_step2": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3], **{**COMMON, "num_hidden_layers": 4})),
        # Mixtral: Mistral's attention, experts named w1/w3/w2 under block_sparse_moe, always renormalised
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(
            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **COMMON)),
        # OLMoE: q/k norms over the whole projections, top-k weights not renormalised, a padding id
        "olmoe": (t.OlmoeForCausalLM, t.OlmoeConfig(
            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, pad_token_id=PAD,
            bos_token_id=None, eos_token_id=None, **COMMON)),
        # The auxiliary load-balancing loss (output_router_logits): the loss is transformers' cross-
        # entropy plus router_aux_loss_coef times load_balancing_loss_func over all sparse layers'
        # router logits (a large coefficient, so that its gradient weighs in the comparison)
        "qwen3_moe_aux": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.5,
            **{**COMMON, "num_hidden_layers": 3})),
        # ... with right-padded rows and their attention mask, which leaves the padding out of the
        # auxiliary loss (the padded tokens have no label; attention is causal, so the mask changes
        # nothing else before the padding)
        "qwen3_moe_aux_mask": (t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.5,
            **{**COMMON, "num_hidden_layers": 3})),
        "mixtral_aux": (t.MixtralForCausalLM, t.MixtralConfig(
            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            output_router_logits=True, router_aux_loss_coef=0.3, **COMMON)),
        # (no padding id: its zero embedding row at a sequence's start makes every router logit 0
        # there, and torch.topk breaks exact ties in an unspecified order, which the counts would see)
        "olmoe_aux": (t.OlmoeForCausalLM, t.OlmoeConfig(
            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
            output_router_logits=True, router_aux_loss_coef=0.2, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, **COMMON)),
        # GPT-OSS: a sink logit per head, attention biases, sliding (window 4) and full layers, yarn
        # rotary (untruncated ramp) over all of them, a biased router whose top-k logits are
        # softmaxed, biased experts stacked and fused in the checkpoint (gate and up interleaved),
        # the clamped SwiGLU (gate_up_proj scaled up so that some values pass the clamps at +-7)
        "gpt_oss": (t.GptOssForCausalLM, t.GptOssConfig(
            tie_word_embeddings=False, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 16, "rope_theta": 150000.0},
            pad_token_id=None, bos_token_id=None, eos_token_id=None, **{**COMMON, "num_hidden_layers": 3})),
        # GPT-OSS as published: the experts' projections in MXFP4 blocks and scales (the reference
        # model holds transformers' dequantization of them), with the auxiliary loss
        "gpt_oss_mxfp4": (t.GptOssForCausalLM, t.GptOssConfig(
            tie_word_embeddings=False, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            output_router_logits=True, router_aux_loss_coef=0.2,
            pad_token_id=None, bos_token_id=None, eos_token_id=None, **{**COMMON, "intermediate_size": 32})),
    }


# The hybrid linear-attention families (Qwen3.5, Qwen3-Next): sequences of 70 tokens, longer than
# the delta rule's chunk of 64, so that the state crosses a chunk; Gated DeltaNet layers (2 key
# heads, 4 value heads: two value heads read each key head) between gated full-attention layers
# whose rotary turns half of each head. transformers runs its float32 PyTorch delta rule on the
# CPU (flash-linear-attention is not used there), the reference megatrain's CPU backend matches.
SEQ_OF = {"qwen3_5": 70, "qwen3_5_moe": 70, "qwen3_next": 70, "qwen3_next_aux": 70, "qwen3_5_moe_aux": 70, "qwen3_5_mm": 70}
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_conv_kernel_dim=4, head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              pad_token_id=None, bos_token_id=None, eos_token_id=None)


def hybrid_families():
    """Qwen3.5 dense and MoE (text-only ForCausalLM folders) and Qwen3-Next (its fused projections,
    its decoder_sparse_step), each with three layers: linear, full, linear."""
    t = transformers
    common = {**COMMON, "num_hidden_layers": 3, **LINEAR}
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20)
    return {
        "qwen3_5": (t.Qwen3_5ForCausalLM, t.Qwen3_5TextConfig(tie_word_embeddings=False, **common)),
        "qwen3_5_moe": (t.Qwen3_5MoeForCausalLM, t.Qwen3_5MoeTextConfig(tie_word_embeddings=False, **moe, **common)),
        "qwen3_5_moe_aux": (t.Qwen3_5MoeForCausalLM, t.Qwen3_5MoeTextConfig(tie_word_embeddings=False, output_router_logits=True,
                                                                           router_aux_loss_coef=0.1, **moe, **common)),
        "qwen3_next": (t.Qwen3NextForCausalLM, t.Qwen3NextConfig(tie_word_embeddings=False, norm_topk_prob=True,
                                                                 decoder_sparse_step=1, mlp_only_layers=[1], **moe,
                                                                 **common)),
        # (the auxiliary loss as the router records it: megatrain refuses it for Qwen3.5-MoE and
        # Qwen3-Next until these fixtures say whether transformers 5.17 records the logits or their softmax)
        "qwen3_next_aux": (t.Qwen3NextForCausalLM, t.Qwen3NextConfig(tie_word_embeddings=False, norm_topk_prob=True,
                                                                     output_router_logits=True, router_aux_loss_coef=0.1,
                                                                     decoder_sparse_step=1, mlp_only_layers=[1], **moe,
                                                                     **common)),
    }


def saved_grads(model, saved):
    """Every parameter's gradient under the name the saved checkpoint gives it: transformers 5 keeps
    a layer's experts as stacked tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) and saves them per expert, as the Hub's checkpoints hold them (Mixtral: w1, w3, w2
    under block_sparse_moe)."""
    out = {}
    mixtral = any(".block_sparse_moe." in k for k in saved)
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {"gate": "gate_proj", "up": "up_proj",
                                                                       "down": "down_proj"}
    for pname, p in model.named_parameters():
        g = p.grad.detach().float()
        if pname in saved:
            out[pname] = g
            continue
        if mixtral and pname.replace(".mlp.", ".block_sparse_moe.") in saved:
            out[pname.replace(".mlp.", ".block_sparse_moe.")] = g
            continue
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", pname)
        assert m, f"{pname} is neither saved nor a stacked expert tensor"
        prefix = m.group(1) + (".block_sparse_moe" if mixtral else ".mlp") + ".experts"
        for e in range(g.shape[0]):
            if m.group(2) == "gate_up_proj":
                inter = g.shape[1] // 2
                out[f"{prefix}.{e}.{names['gate']}.weight"] = g[e, :inter].contiguous()
                out[f"{prefix}.{e}.{names['up']}.weight"] = g[e, inter:].contiguous()
            else:
                out[f"{prefix}.{e}.{names['down']}.weight"] = g[e].contiguous()
    assert set(out) == set(saved) - {"lm_head.weight"} or set(out) == set(saved), sorted(set(saved) ^ set(out))
    return out


def mxfp4_experts(model, seed):
    """GPT-OSS's published layout: random MXFP4 blocks and scales for every layer's experts
    (gate_up_proj, down_proj), and the model's experts set to transformers' own dequantization of
    them (in float32). Returns {checkpoint name: uint8 tensor} for store_mxfp4."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(seed + 7)
    out = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if not (pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj")):
                continue
            E, rows, cols = p.shape  # [E, in, out]: blocks [E, out, in / 32, 16], scales [E, out, in / 32]
            blocks = torch.randint(0, 256, (E, cols, rows // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
            scales = torch.randint(121, 126, (E, cols, rows // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
            p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            out[pname + "_blocks"] = blocks.contiguous()
            out[pname + "_scales"] = scales.contiguous()
    return out


def store_mxfp4(d, blocks):
    """Rewrites the saved model.safetensors and config.json as the published GPT-OSS checkpoints
    hold them: the experts' projections as MXFP4 blocks and scales, quantization_config mxfp4."""
    from safetensors.torch import load_file
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    for k in blocks:
        if k.endswith("_blocks"):
            del tensors[k[: -len("_blocks")]]
    tensors.update(blocks)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def float64_family(cls):
    """The class `cls` from a copy of its own modeling module with every float32 cast made float64.

    transformers runs the hybrid families' linear attention (its chunked gated delta rule) and
    their norms in float32 whatever the model's dtype; in float32 that chunked form rounds the
    gradients by up to ~4e-5 of their size, more than the 1e-5 the fixtures are checked at. Their
    reference is therefore transformers' own code run in float64 on the same float32 weights (the
    copy differs from the module only in its casts), rounded to float32 when saved."""
    import importlib
    import inspect
    import types
    mod = importlib.import_module(cls.__module__)
    src = inspect.getsource(mod)
    src = re.sub(r"torch\.float(?![0-9])", "torch.float64", src)  # (torch.float is float32)
    src = src.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    import sys
    copy = types.ModuleType(mod.__name__ + "_float64")
    copy.__package__, copy.__file__ = mod.__package__, mod.__file__
    sys.modules[copy.__name__] = copy  # (make() imports load_balancing_loss_func from the model's module)
    exec(compile(src, mod.__file__, "exec"), copy.__dict__)
    return getattr(copy, cls.__name__)


def make(name, cls, cfg, out):
    seed = sum(map(ord, name))
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # Random gains and biases too (they start at 1 and 0), so that their gradients are tested
    # at general values.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
            if (pname.endswith("gate.weight") or pname.endswith("router.weight")) and p.dim() == 2:
                p.copy_(0.3 * torch.randn_like(p))  # a router: choices spread, not too sharp (a sharp softmax
                                                    # makes its backward ill-conditioned)
            if pname.endswith("experts.gate_up_proj_bias") or pname.endswith("experts.down_proj_bias"):
                p.add_(0.3 * torch.randn_like(p))  # (GPT-OSS's stacked expert biases start at 0 too)
            if pname.endswith("experts.gate_up_proj") and "mxfp4" not in name:
                p.mul_(4.0)  # GPT-OSS: gate and up values beyond its clamps at +-7
        if "mxfp4" in name:
            mxfp4_blocks = mxfp4_experts(model, seed)
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    if "mxfp4" in name:
        store_mxfp4(d, mxfp4_blocks)
    gen = torch.Generator().manual_seed(seed + 1)
    seq = SEQ_OF.get(name, SEQ)
    ids = torch.randint(0, VOCAB, (ROWS, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, seq), generator=gen)
    labels[torch.rand((ROWS, seq), generator=gen) < 0.2] = -100
    if cfg.pad_token_id is not None:
        ids[:, ::3] = cfg.pad_token_id  # the padding row is looked up, and must get no gradient from it
    mask = None
    if name.endswith("_mask"):  # the first row whole, the second with 4 tokens of padding
        mask = torch.ones((ROWS, SEQ), dtype=torch.long)
        mask[1, SEQ - 4:] = 0
        labels[mask == 0] = -100
    if name in SEQ_OF:  # (a hybrid family: its reference in float64, float64_family)
        model32 = model
        model = float64_family(cls)(cfg).double().eval()
        model.load_state_dict({k: v.double() for k, v in model32.state_dict().items()})
        if hasattr(model, "set_experts_implementation"):  # (torch's grouped_mm takes no float64)
            model.set_experts_implementation("eager")
    model.zero_grad()
    aux_on = bool(getattr(cfg, "output_router_logits", False))
    extra_in = {"attention_mask": mask} if mask is not None else {}
    out = model(input_ids=ids, output_router_logits=True, **extra_in) if aux_on else model(input_ids=ids, **extra_in)
    logits = out.logits.float() if out.logits.dtype != torch.float64 else out.logits  # (float64: a hybrid's)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    extra = {}
    if aux_on:  # as the family's forward adds it when given labels (without an attention mask: every token)
        module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
        k = cfg.num_experts_per_tok
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        aux = module.load_balancing_loss_func(out.router_logits, experts, k, mask)
        loss = loss + cfg.router_aux_loss_coef * aux.to(loss.device)
        extra["aux_loss"] = aux.detach().float().reshape(1).contiguous()
    loss.backward()
    if mask is not None:
        extra["attention_mask"] = mask.to(torch.int32).contiguous()
    ref = {"input_ids": ids.to(torch.int32).contiguous(), "labels": labels.to(torch.int32).contiguous(),
           "loss": loss.detach().float().reshape(1).contiguous(), "logits": logits.detach().float().contiguous(), **extra}
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    if "mxfp4" in name:  # (the gradients under the unquantized names, which the blocks stand for)
        saved = {k[: -len("_blocks")] for k in saved if k.endswith("_blocks")} | {
            k for k in saved if not k.endswith("_blocks") and not k.endswith("_scales")}
    for pname, g in saved_grads(model, saved).items():
        ref["grad." + pname] = g.contiguous()
    save_file(ref, os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: {cls.__name__}, loss {loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters -> {d}")


def perturbed_and_saved(model, name, out):
    """A multimodal model's gains and biases moved off their initial values (as make() does), saved
    in out/name; returns the folder."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    return d


def text_reference(model, name, seed, seq, pad=None):
    """transformers' outputs on text alone (no image) and the gradients of the language model's
    parameters under their text model's names (model.language_model.X as model.X; lm_head.weight
    where untied); written to name's reference.safetensors."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (ROWS, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, seq), generator=gen)
    labels[torch.rand((ROWS, seq), generator=gen) < 0.2] = -100
    if pad is not None:
        ids[:, ::3] = pad
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    ref = {"input_ids": ids.to(torch.int32).contiguous(), "labels": labels.to(torch.int32).contiguous(),
           "loss": loss.detach().float().reshape(1).contiguous(), "logits": logits.detach().float().contiguous()}
    for pname, p in model.named_parameters():
        m = re.fullmatch(r"model\.language_model\.(.*)", pname)
        if pname == "lm_head.weight":
            ref["grad.lm_head.weight"] = p.grad.detach().float().contiguous()
        elif m is None:
            assert p.grad is None or not p.grad.any(), f"{pname}: a gradient outside the language model"
        else:
            ref["grad.model." + m.group(1)] = p.grad.detach().float().contiguous()
    return ref, loss


def save_reference(name, d, ref, loss, model):
    save_file(ref, os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: loss {loss.item():.6f}, {sum(p.numel() for p in model.parameters())} parameters -> {d}")


def make_gemma3_mm(out):
    """Gemma 3 as the Hub publishes 4B and larger: Gemma3ForConditionalGeneration, the language
    model of the "gemma3" fixture with a tiny SigLIP vision tower and its projector. megatrain
    trains the language model on text; the reference is transformers' on text alone (no image),
    the gradients of the language model's parameters under their text model's names."""
    name = "gemma3_mm"
    seed = sum(map(ord, name))
    torch.manual_seed(seed)
    text = families()["gemma3"][1]
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    d = perturbed_and_saved(model, name, out)
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        saved = sorted(f.keys())
    print(f"{name}: saved tensor names (first 6 of {len(saved)}): {saved[:6]}")
    ref, loss = text_reference(model, name, seed, SEQ, pad=PAD)
    save_reference(name, d, ref, loss, model)


def make_qwen3_5_mm(out):
    """Qwen3.5 as the Hub publishes it: Qwen3_5ForConditionalGeneration, the language model of the
    "qwen3_5" fixture under model.language_model., a tiny vision tower under model.visual., and
    multi-token-prediction tensors (mtp.*) that transformers does not load but the published
    folders hold: megatrain trains the language model and must write the rest back unchanged. The
    reference is transformers' on text alone."""
    name = "qwen3_5_mm"
    seed = sum(map(ord, name))
    torch.manual_seed(seed)
    text = hybrid_families()["qwen3_5"][1]
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                                              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                              num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    d = perturbed_and_saved(model, name, out)
    family = float64_family(transformers.Qwen3_5ForConditionalGeneration)
    model64 = family(cfg)
    # (its language model is built through AutoModel, which finds transformers' own class, float32
    # casts and all: the float64 copy's instead)
    model64.model.language_model = getattr(sys.modules[family.__module__], "Qwen3_5TextModel")(cfg.text_config)
    model64 = model64.double().eval()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model = model64
    from safetensors.torch import load_file
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 2)
    for mtp, shape in {"mtp.fc.weight": (32, 64), "mtp.norm.weight": (32,), "mtp.pre_fc_norm_embedding.weight": (32,),
                       "mtp.pre_fc_norm_hidden.weight": (32,), "mtp.layers.0.mlp.up_proj.weight": (56, 32)}.items():
        tensors[mtp] = torch.randn(shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    print(f"{name}: saved tensor names (first 6 of {len(tensors)}): {sorted(tensors)[:6]}")
    ref, loss = text_reference(model, name, seed, SEQ_OF[name])
    save_reference(name, d, ref, loss, model)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    for name, (cls, cfg) in {**families(), **hybrid_families()}.items():
        if a.only and name not in a.only:
            continue
        make(name, cls, cfg, a.out)
    if not a.only or "gemma3_mm" in a.only:
        make_gemma3_mm(a.out)
    if not a.only or "qwen3_5_mm" in a.only:
        make_qwen3_5_mm(a.out)


if __name__ == "__main__":
    main()
