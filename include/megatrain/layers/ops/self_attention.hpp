// Causal self-attention of Llama, Mistral, Qwen2 and Qwen3, as an op of its own:
//
//     y = o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))
//
// and with Qwen3's q/k norms (ModelConfig::qk_norm), each head RMS-normalised over head_dim
// with its own gain (q_norm.weight, k_norm.weight; fp32 like every norm gain) before the rotation:
//
//     y = o_proj(attention(rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x))), v_proj(x)))
//
// Gemma 3 adds (1 + w) q/k norms, its own softmax scale (query_pre_attn_scalar) and per-layer
// attention: a sliding layer sees the last sliding_window keys and has its own rotary parameters
// (ModelConfig::attention_window, rope_for_layer).
//
// SmolLM3's NoPE layers (ModelConfig::rotary_layer) rotate neither q nor k.
//
// Qwen3.5 and Qwen3-Next gate the attention's output (ModelConfig::attention_output_gate): q_proj
// gives each head head_dim query values then head_dim gate inputs, and o_proj reads
// attention * sigmoid(gate). The gate runs on backends with GatedAttentionBackend's primitives
// (the CPU and CUDA backends); elsewhere it is refused.
//
// GPT-OSS adds a learned sink per head (self_attn.sinks, ModelConfig::attention_sinks): a logit
// in every query's softmax that takes probability and carries no value; its sliding and full
// layers share one rotary table.
//
// grouped-query heads (num_key_value_heads divides num_attention_heads), head_dim from the
// config, rotary embeddings rotating halves (Hugging Face's Llama convention), optional q/k/v
// biases (Qwen2, Llama's attention_bias) and o bias (Llama's attention_bias). No norm and no
// residual: a block adds those around it (ComposedBlock, whose token mixer it is on the full and
// sliding attention layers); a user's own block can use it the same way.
//
// Besides the LayerOp interface (forward, backward; from CarvedOp), run(), run_kept() and
// backprop() work on activations a caller keeps (carve()), so a block recomputes its whole
// forward once and backpropagates through its parts without running them twice.
#pragma once

#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

/// What a backend provides for the attention's output gate (the CPU and CUDA backends).
template <class B>
concept GatedAttentionBackend = requires(B& be, View<const typename B::Act> c, View<typename B::Act> m) {
  be.split_halves(c, std::int64_t{}, m, m);
  be.merge_halves(c, c, std::int64_t{}, m);
  be.sigmoid_gate(c, c, m);
  be.sigmoid_gate_backward(c, c, c, m, m);
};

/// What a backend provides to decode with a KV cache (ChunkShape::decode; the CPU and CUDA backends).
template <class B>
concept AttentionDecodeBackend = requires(B& be, View<const typename B::Act> c, View<typename B::Act> m, const DecodeRows& d,
                                          const AttentionShape& s, View<const typename B::Acc> sinks) {
  be.attention_decode(c, c, c, m, m, d, m, s, sinks);
};

class SelfAttention : public CarvedOp<SelfAttention> {
 public:
  /// Layer `layer`'s attention: parameters model.layers.<layer>.self_attn.*.
  SelfAttention(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg.rope_for_layer(layer)),  // (this layer's rotary parameters in rope_theta / rope_scaling)
        prefix_("model.layers." + std::to_string(layer) + ".self_attn."),
        inv_freq_(cfg_.rope_inv_freq()),
        inv_freq_long_(cfg_.rope_inv_freq(cfg_.rope_scaling.original_max_position_embeddings + 1)),
        rope_scale_(cfg_.rope_attention_scaling()),
        window_(cfg.attention_window(layer)),
        rotary_(cfg.rotary_layer(layer)),
        softmax_scale_(cfg.query_pre_attn_scalar ? cfg.attention_scale() : 0.0),
        norm_offset_(cfg.norm_unit_offset() ? 1.0 : 0.0),
        gated_(cfg.attention_output_gate()) {
    cfg.validate();
    MT_CHECK(layer >= 0 && layer < cfg.num_hidden_layers, "layer {} out of range [0, {})", layer, cfg.num_hidden_layers);
  }

  static constexpr bool kResidualIO = false;  // (CarvedOp: x and y are activations)

  template <class E>
  struct Weights {
    View<E> q, k, v, o, q_bias, k_bias, v_bias, o_bias;
    View<full_t<E>> q_norm, k_norm;  // qk_norm only
    View<full_t<E>> sinks;           // attention_sinks only: [heads]
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size;
    const auto sd = static_cast<float>(cfg_.initializer_range);
    const std::int64_t qp = (gated_ ? 2 : 1) * cfg_.q_dim();  // (gated: each head's query, then its gate)
    std::vector<ParamSpec> p{ParamSpec::matrix(name("q_proj.weight"), Shape{qp, d}, sd),
                             ParamSpec::matrix(name("k_proj.weight"), Shape{cfg_.kv_dim(), d}, sd),
                             ParamSpec::matrix(name("v_proj.weight"), Shape{cfg_.kv_dim(), d}, sd),
                             ParamSpec::matrix(name("o_proj.weight"), Shape{d, cfg_.q_dim()}, sd)};
    if (cfg_.qkv_bias) {
      p.push_back(ParamSpec::bias(name("q_proj.bias"), qp));
      p.push_back(ParamSpec::bias(name("k_proj.bias"), cfg_.kv_dim()));
      p.push_back(ParamSpec::bias(name("v_proj.bias"), cfg_.kv_dim()));
    }
    if (cfg_.o_bias) p.push_back(ParamSpec::bias(name("o_proj.bias"), d));
    if (cfg_.qk_norm()) {
      const bool full = cfg_.qk_norm_full();  // (OLMoE: over the whole projection)
      p.push_back(ParamSpec::norm(name("q_norm.weight"), full ? cfg_.q_dim() : cfg_.head_dim, norm_offset_ != 0));
      p.push_back(ParamSpec::norm(name("k_norm.weight"), full ? cfg_.kv_dim() : cfg_.head_dim, norm_offset_ != 0));
    }
    if (cfg_.attention_sinks()) {  // (decayed, as transformers' Trainer decays it; read in fp32 like a gain)
      ParamSpec sinks = ParamSpec::matrix(name("sinks"), Shape{cfg_.num_attention_heads}, sd);
      sinks.full_precision = true;
      p.push_back(std::move(sinks));
    }
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    const bool qk = cfg_.qk_norm();
    return {p(name("q_proj.weight")),
            p(name("k_proj.weight")),
            p(name("v_proj.weight")),
            p(name("o_proj.weight")),
            p.optional(name("q_proj.bias")),
            p.optional(name("k_proj.bias")),
            p.optional(name("v_proj.bias")),
            p.optional(name("o_proj.bias")),
            qk ? p.full(name("q_norm.weight")) : View<full_t<E>>{},
            qk ? p.full(name("k_norm.weight")) : View<full_t<E>>{},
            cfg_.attention_sinks() ? p.full(name("sinks")) : View<full_t<E>>{}};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }

  /// The activations run() keeps for backprop() (and, with_backward, backprop()'s own buffers).
  template <class B>
  struct Acts {
    View<typename B::Act> q, k, v, att;
    View<typename B::Acc> lse;
    View<typename B::Act> datt, dq, dk, dv;  // with_backward only
    // qk_norm only: the projections before their norm and the norms' rstd (kept like q and k),
    // and the projections' gradients (with_backward)
    View<typename B::Act> q_pre, k_pre;
    View<typename B::Acc> rstd_q, rstd_k;
    View<typename B::Act> dq_pre, dk_pre;
    // the output gate only: its inputs and the gated output (kept), a token block's whole q_proj
    // output, and their gradients (with_backward)
    View<typename B::Act> gate, gated, qg;
    View<typename B::Act> dgate, dgated, dqg;
    /// Kept with q/k norms: q and k are not kept but made again from q_pre and k_pre by
    /// attend_backward() (the same element-wise kernels on the same bits).
    bool remake_qk = false;
  };
  /// `kept`: where the activations backprop() reads (q, k, v, att, lse; with q/k norms q_pre,
  /// k_pre and their rstd instead of q and k) are kept from forward to backward (CarvedOp); none:
  /// the scratch arena.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward, Arena* kept = nullptr) const {
    using A = typename B::Act;
    const std::int64_t M = c.tokens(), qd = cfg_.q_dim(), kd = cfg_.kv_dim();
    Arena& k = kept ? *kept : ar;
    Acts<B> a;
    a.remake_qk = kept && cfg_.qk_norm();
    Arena& qk = a.remake_qk ? ar : k;
    a.q = qk.alloc<A>({M, qd});
    a.k = qk.alloc<A>({M, kd});
    a.v = k.alloc<A>({M, kd});
    a.att = k.alloc<A>({M, qd});
    a.lse = k.alloc<typename B::Acc>({c.rows, cfg_.num_attention_heads, c.seq});
    if (cfg_.qk_norm()) {
      a.q_pre = k.alloc<A>({M, qd});
      a.k_pre = k.alloc<A>({M, kd});
      a.rstd_q = k.alloc<typename B::Acc>({M * norm_rows(cfg_.num_attention_heads)});
      a.rstd_k = k.alloc<typename B::Acc>({M * norm_rows(cfg_.num_key_value_heads)});
    }
    if (gated_) {
      a.gate = k.alloc<A>({M, qd});
      a.gated = k.alloc<A>({M, qd});
      a.qg = ar.alloc<A>({c.block_tokens(), 2 * qd});
    }
    if (with_backward && gated_) {
      a.dgate = ar.alloc<A>({M, qd});
      a.dgated = ar.alloc<A>({M, qd});
      a.dqg = ar.alloc<A>({c.block_tokens(), 2 * qd});
    }
    if (with_backward) {
      a.datt = ar.alloc<A>({M, qd});
      a.dq = ar.alloc<A>({M, qd});
      a.dk = ar.alloc<A>({M, kd});
      a.dv = ar.alloc<A>({M, kd});
      if (cfg_.qk_norm()) {
        a.dq_pre = ar.alloc<A>({M, qd});
        a.dk_pre = ar.alloc<A>({M, kd});
      }
    }
    return a;
  }

  /// y = attention output projected by o_proj (y is overwritten); keeps what backprop() needs in a.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
           const Acts<B>& a, View<typename B::Act> y) const {
    run_kept(be, c, w, x, a);
    be.linear(cview(gated_ ? a.gated : a.att), w.o, w.o_bias, y);
  }

  /// run() up to the attention output a.att (what backprop() needs), without the projection.
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size,
             "self-attention: input {} is not [{} tokens, {}]", x.shape().str(), c.tokens(), cfg_.hidden_size);
    if (gated_)  // (q_proj's output is split a token block at a time: a.qg holds one block)
      c.for_each_block([&](std::int64_t t0, std::int64_t n) { project(be, w, token_rows(x, t0, n), a, t0); });
    else
      project(be, w, x, a, 0);
    mix(be, c, a, w);
  }

  /// After run() on the same x: dx = dL/dx (overwritten) from dy, weight gradients added to g.
  template <class B>
  void backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a, View<const typename B::Act> dy, View<typename B::Act> dx,
                const Weights<typename B::Acc>& g) const {
    be.linear_backward(cview(gated_ ? a.gated : a.att), w.o, dy, gated_ ? a.dgated : a.datt, false, g.o, g.o_bias);
    mix_backward(be, c, a, w, g);
    if (gated_)
      c.for_each_block([&](std::int64_t t0, std::int64_t n) {
        project_backward(be, w, token_rows(x, t0, n), a, t0, token_rows(dx, t0, n), g);
      });
    else
      project_backward(be, w, x, a, 0, dx, g);
  }

  // ---- as a block's token mixer (token_mixer.hpp): the pieces of run_kept() and backprop(), for
  // a block that runs the token-wise ones (the projections) a block of tokens at a time, and the
  // attention over whole rows.

  /// The token mixer of every layer: full attention, or attention within a sliding window.
  static bool builds(const ModelConfig& cfg, std::int64_t layer) {
    const TokenMixerKind k = cfg.layer_kind(layer).token_mixer;
    return k == TokenMixerKind::full_attention || k == TokenMixerKind::sliding_attention;
  }
  /// The whole chunk's attention output a.att from its projections (project() of every token).
  template <class B>
  void mix(B& be, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w) const {
    attend(be, c, a, w.sinks);
    if (gated_) gate_ops(be, [&](auto& g) { g.sigmoid_gate(cview(a.att), cview(a.gate), a.gated); });
  }
  /// h = x + o_proj(attention output) for tokens [first, first + x.size(0)).
  template <class B>
  void out_add(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
               View<const typename B::Res> x, View<typename B::Res> h) const {
    be.linear_add(cview(token_rows(gated_ ? a.gated : a.att, first, x.size(0))), w.o, w.o_bias, x, h);
  }
  /// o = o_proj(attention output) for tokens [first, first + o.size(0)).
  template <class B>
  void out(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
           View<typename B::Act> o) const {
    be.linear(cview(token_rows(gated_ ? a.gated : a.att, first, o.size(0))), w.o, w.o_bias, o);
  }
  /// From dout (the gradient of out()'s rows from `first`): those rows of a.datt; o_proj's
  /// gradients added to g.
  template <class B>
  void out_backward(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
                    View<const typename B::Act> dout, const Weights<typename B::Acc>& g) const {
    const std::int64_t n = dout.size(0);
    be.linear_backward(cview(token_rows(gated_ ? a.gated : a.att, first, n)), w.o, dout,
                       token_rows(gated_ ? a.dgated : a.datt, first, n), false, g.o, g.o_bias);
  }
  /// mix()'s backward over the whole chunk: a.dq, a.dk, a.dv from a.datt; the sinks' gradient
  /// added to g.
  template <class B>
  void mix_backward(B& be, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w,
                    const Weights<typename B::Acc>& g) const {
    if (gated_)
      gate_ops(be, [&](auto& b) { b.sigmoid_gate_backward(cview(a.att), cview(a.gate), cview(a.dgated), a.datt, a.dgate); });
    attend_backward(be, c, a, w, g.sinks);
  }

  /// q, k and v of tokens [first, first + x.size(0)) of the chunk, from their input x (q and k
  /// normalised per head where the family has q/k norms).
  template <class B>
  void project(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               std::int64_t first) const {
    const std::int64_t n = x.size(0), H = norm_rows(cfg_.num_attention_heads), KV = norm_rows(cfg_.num_key_value_heads);
    if (gated_) {  // q_proj's output split into each head's query and gate
      const auto q = token_rows(cfg_.qk_norm() ? a.q_pre : a.q, first, n), qg = token_rows(a.qg, 0, n);
      be.linear(x, w.q, w.q_bias, qg);
      gate_ops(be, [&](auto& g) { g.split_halves(cview(qg), cfg_.head_dim, q, token_rows(a.gate, first, n)); });
    }
    if (cfg_.qk_norm()) {
      if (!gated_) be.linear(x, w.q, w.q_bias, token_rows(a.q_pre, first, n));
      be.linear(x, w.k, w.k_bias, token_rows(a.k_pre, first, n));
      be.head_rmsnorm(cview(heads(token_rows(a.q_pre, first, n))), w.q_norm, cfg_.rms_norm_eps,
                      heads(token_rows(a.q, first, n)), token_rows(a.rstd_q, first * H, n * H), norm_offset_);
      be.head_rmsnorm(cview(heads(token_rows(a.k_pre, first, n))), w.k_norm, cfg_.rms_norm_eps,
                      heads(token_rows(a.k, first, n)), token_rows(a.rstd_k, first * KV, n * KV), norm_offset_);
    } else {
      if (!gated_) be.linear(x, w.q, w.q_bias, token_rows(a.q, first, n));
      be.linear(x, w.k, w.k_bias, token_rows(a.k, first, n));
    }
    be.linear(x, w.v, w.v_bias, token_rows(a.v, first, n));
  }
  /// Decoding (ChunkShape::decode): each row's keys and values, capacity tokens of them.
  template <class B>
  struct Cache {
    View<typename B::Act> k, v;  // [rows * capacity, kv_dim]
  };
  template <class B>
  Cache<B> carve_cache(Arena& ar, std::int64_t rows, std::int64_t capacity) const {
    return {ar.alloc<typename B::Act>({rows * capacity, cfg_.kv_dim()}), ar.alloc<typename B::Act>({rows * capacity, cfg_.kv_dim()})};
  }
  /// Whether backend B decodes this layer with a cache (else Trainer::decode_logits refuses it).
  template <class B>
  bool decodes() const {
    // (the GPU's kernel: head_dim a multiple of 32, at most 256)
    const bool dims = !B::kDevice || (cfg_.head_dim % 32 == 0 && cfg_.head_dim <= 256);
    return AttentionDecodeBackend<B> && decoding_enabled<B>() && dims && cfg_.rope_scaling.type != RopeScaling::Type::longrope;
  }

  /// Rotary embeddings of q and k, then attention: a.att and a.lse of the whole chunk (`sinks`:
  /// the heads' sink logits, GPT-OSS's; null for the other families). Decoding: each row's one
  /// token at its position, attending to its cache.
  template <class B>
  void attend(B& be, ChunkShape c, const Acts<B>& a, View<const typename B::Acc> sinks) const {
    if (c.decode.active()) return attend_cached(be, c, a, sinks);
    cfg_.check_sequence_length(c.seq);
    if (rotary_) {
      const auto f = freqs(c);
      be.rope(a.q, cfg_.num_attention_heads, c.seq, f, c.packed.positions, rope_scale_);
      be.rope(a.k, cfg_.num_key_value_heads, c.seq, f, c.packed.positions, rope_scale_);
    }
    be.attention(cview(a.q), cview(a.k), cview(a.v), a.att, a.lse, shape(c), sinks);
  }
  /// attend() of one token a row at c.decode's positions: its key and value into the cache, its
  /// query over the cached ones.
  template <class B>
  void attend_cached(B& be, ChunkShape c, const Acts<B>& a, View<const typename B::Acc> sinks) const {
    if constexpr (!AttentionDecodeBackend<B>) {
      MT_FAIL("{}: this backend has no attention over a KV cache (generation recomputes each prefix here)", prefix_);
    } else {
      const DecodeRows& d = c.decode;
      MT_CHECK(c.seq == 1 && decodes<B>(), "{}: decoding takes one token a row (not {}), and no longrope scaling", prefix_,
               c.seq);
      cfg_.check_sequence_length(d.capacity);
      if (rotary_) {
        be.rope(a.q, cfg_.num_attention_heads, 1, std::span<const double>(inv_freq_), d.positions, rope_scale_);
        be.rope(a.k, cfg_.num_key_value_heads, 1, std::span<const double>(inv_freq_), d.positions, rope_scale_);
      }
      Arena ar(d.cache);
      const Cache<B> cache = carve_cache<B>(ar, d.rows, d.capacity);
      AttentionShape s = shape(c);
      s.window = window_;
      be.attention_decode(cview(a.q), cview(a.k), cview(a.v), cache.k, cache.v, d, a.att, s, sinks);
    }
  }
  /// From a.datt (the gradient of a.att): a.dq, a.dk, a.dv, the rotations undone; the sinks'
  /// gradient added to dsinks (where the family has sinks). (a.remake_qk: q and k made again
  /// first, from the kept q_pre and k_pre, as project() and attend() made them.)
  template <class B>
  void attend_backward(B& be, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w,
                       View<typename B::Acc> dsinks) const {
    if (a.remake_qk) {
      be.head_rmsnorm(cview(heads(a.q_pre)), w.q_norm, cfg_.rms_norm_eps, heads(a.q), a.rstd_q, norm_offset_);
      be.head_rmsnorm(cview(heads(a.k_pre)), w.k_norm, cfg_.rms_norm_eps, heads(a.k), a.rstd_k, norm_offset_);
      if (rotary_) {
        const auto f = freqs(c);
        be.rope(a.q, cfg_.num_attention_heads, c.seq, f, c.packed.positions, rope_scale_);
        be.rope(a.k, cfg_.num_key_value_heads, c.seq, f, c.packed.positions, rope_scale_);
      }
    }
    be.attention_backward(cview(a.q), cview(a.k), cview(a.v), cview(a.att), cview(a.lse), cview(a.datt), a.dq, a.dk,
                          a.dv, shape(c), w.sinks, dsinks);
    if (!rotary_) return;
    const auto f = freqs(c);
    be.rope_backward(a.dq, cfg_.num_attention_heads, c.seq, f, c.packed.positions, rope_scale_);
    be.rope_backward(a.dk, cfg_.num_key_value_heads, c.seq, f, c.packed.positions, rope_scale_);
  }
  /// dx (overwritten) of tokens [first, first + x.size(0)) from a.dq, a.dk, a.dv; the
  /// projections' weight gradients added to g.
  template <class B>
  void project_backward(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                        const Acts<B>& a, std::int64_t first, View<typename B::Act> dx,
                        const Weights<typename B::Acc>& g) const {
    const std::int64_t n = x.size(0), H = norm_rows(cfg_.num_attention_heads), KV = norm_rows(cfg_.num_key_value_heads);
    auto dq = token_rows(a.dq, first, n), dk = token_rows(a.dk, first, n);
    if (cfg_.qk_norm()) {  // through the norms first: the projections' own gradients
      be.head_rmsnorm_backward(cview(heads(token_rows(a.q_pre, first, n))), w.q_norm,
                               cview(token_rows(a.rstd_q, first * H, n * H)), cview(heads(dq)),
                               heads(token_rows(a.dq_pre, first, n)), g.q_norm, norm_offset_);
      be.head_rmsnorm_backward(cview(heads(token_rows(a.k_pre, first, n))), w.k_norm,
                               cview(token_rows(a.rstd_k, first * KV, n * KV)), cview(heads(dk)),
                               heads(token_rows(a.dk_pre, first, n)), g.k_norm, norm_offset_);
      dq = token_rows(a.dq_pre, first, n);
      dk = token_rows(a.dk_pre, first, n);
    }
    if (gated_) {  // each head's query gradient and gate gradient, as q_proj's output holds them
      const auto dqg = token_rows(a.dqg, 0, n);
      gate_ops(be, [&](auto& b) { b.merge_halves(cview(dq), cview(token_rows(a.dgate, first, n)), cfg_.head_dim, dqg); });
      dq = dqg;
    }
    be.linear_backward(x, w.q, cview(dq), dx, false, g.q, g.q_bias);
    be.linear_backward(x, w.k, cview(dk), dx, true, g.k, g.k_bias);
    be.linear_backward(x, w.v, cview(token_rows(a.dv, first, n)), dx, true, g.v, g.v_bias);
  }

 private:
  std::string name(const char* suffix) const { return prefix_ + suffix; }
  /// f(be) where the backend has the output gate's primitives; refused elsewhere.
  template <class B, class F>
  void gate_ops(B& be, F&& f) const {
    if constexpr (GatedAttentionBackend<B>) f(be);
    else MT_FAIL("{}: the attention's output gate (Qwen3.5, Qwen3-Next) needs the backend's gate primitives "
                 "(GatedAttentionBackend: the CPU and CUDA backends have them)", prefix_);
  }
  /// [tokens, heads * head_dim] as [tokens * heads, head_dim]: one row per head (the q/k norms';
  /// OLMoE's norm the whole projection: one row per token).
  template <class E>
  View<E> heads(View<E> v) const {
    if (cfg_.qk_norm_full()) return v;
    return View<E>(v.span(), Shape{v.numel() / cfg_.head_dim, cfg_.head_dim});
  }
  /// The q/k norms' rows per token for `heads` heads.
  std::int64_t norm_rows(std::int64_t heads) const { return cfg_.qk_norm_full() ? 1 : heads; }
  /// The rotary frequencies for this chunk: longrope's long ones where its sequences are longer
  /// than the original context (transformers decides by the longest position of the forward:
  /// with packed rows that is the batch's longest example, which a chunk does not see).
  std::span<const double> freqs(ChunkShape c) const {
    if (cfg_.rope_scaling.type != RopeScaling::Type::longrope) return inv_freq_;
    MT_CHECK(c.packed.empty(), "longrope rotary scaling with packed rows is not supported: train this model without --pack");
    return c.seq > cfg_.rope_scaling.original_max_position_embeddings ? std::span<const double>(inv_freq_long_)
                                                                      : std::span<const double>(inv_freq_);
  }
  AttentionShape shape(ChunkShape c) const {
    // (a window as long as the rows changes nothing: full attention, which cuDNN runs)
    return {c.rows, c.seq, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim, c.packed, softmax_scale_,
            window_ < c.seq ? window_ : 0};
  }

  ModelConfig cfg_;
  std::string prefix_;
  std::vector<double> inv_freq_, inv_freq_long_;  // (long: longrope's for long sequences; else the same)
  double rope_scale_;  // the rotary cos/sin scale (yarn's attention factor)
  std::int64_t window_;   // keys a query sees (Gemma 3's sliding layers); 0: all before it
  bool rotary_;           // q and k rotated (all but SmolLM3's NoPE layers)
  double softmax_scale_;  // 0: 1 / sqrt(head_dim)
  double norm_offset_;    // the q/k norms multiply by (w + offset): 1 for Gemma, else 0
  bool gated_;            // o_proj reads attention * sigmoid(gate), the gate from q_proj (Qwen3.5, Qwen3-Next)
};

}  // namespace megatrain
