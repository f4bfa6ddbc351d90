// The pre-norm decoder block of Llama, Mistral and Qwen2:
//
//     h  = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1))),  n1 = rmsnorm(x)
//     y  = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),                        n2 = rmsnorm(h)
//
// with grouped-query causal attention, optional q/k/v (and o, and MLP) biases from the config.
// Backward recomputes the forward from the block's input (the activation checkpoint).
#pragma once

#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class DecoderBlock {
 public:
  DecoderBlock(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg), prefix_("model.layers." + std::to_string(layer) + "."), inv_freq_(cfg.rope_inv_freq()) {
    cfg.validate();
    MT_CHECK(layer >= 0 && layer < cfg.num_hidden_layers, "layer {} out of range [0, {})", layer, cfg.num_hidden_layers);
  }

  template <class E>
  struct Weights {
    View<E> input_norm, q, k, v, o, q_bias, k_bias, v_bias, o_bias;
    View<E> post_norm, gate, up, down, gate_bias, up_bias, down_bias;
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size, f = cfg_.intermediate_size;
    const auto sd = static_cast<float>(cfg_.initializer_range);
    std::vector<ParamSpec> p{ParamSpec::norm(name("input_layernorm.weight"), d),
                             ParamSpec::matrix(name("self_attn.q_proj.weight"), Shape{cfg_.q_dim(), d}, sd),
                             ParamSpec::matrix(name("self_attn.k_proj.weight"), Shape{cfg_.kv_dim(), d}, sd),
                             ParamSpec::matrix(name("self_attn.v_proj.weight"), Shape{cfg_.kv_dim(), d}, sd),
                             ParamSpec::matrix(name("self_attn.o_proj.weight"), Shape{d, cfg_.q_dim()}, sd)};
    if (cfg_.qkv_bias) {
      p.push_back(ParamSpec::bias(name("self_attn.q_proj.bias"), cfg_.q_dim()));
      p.push_back(ParamSpec::bias(name("self_attn.k_proj.bias"), cfg_.kv_dim()));
      p.push_back(ParamSpec::bias(name("self_attn.v_proj.bias"), cfg_.kv_dim()));
    }
    if (cfg_.o_bias) p.push_back(ParamSpec::bias(name("self_attn.o_proj.bias"), d));
    p.push_back(ParamSpec::norm(name("post_attention_layernorm.weight"), d));
    p.push_back(ParamSpec::matrix(name("mlp.gate_proj.weight"), Shape{f, d}, sd));
    p.push_back(ParamSpec::matrix(name("mlp.up_proj.weight"), Shape{f, d}, sd));
    p.push_back(ParamSpec::matrix(name("mlp.down_proj.weight"), Shape{d, f}, sd));
    if (cfg_.mlp_bias) {
      p.push_back(ParamSpec::bias(name("mlp.gate_proj.bias"), f));
      p.push_back(ParamSpec::bias(name("mlp.up_proj.bias"), f));
      p.push_back(ParamSpec::bias(name("mlp.down_proj.bias"), d));
    }
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p(name("input_layernorm.weight")),        p(name("self_attn.q_proj.weight")),
            p(name("self_attn.k_proj.weight")),       p(name("self_attn.v_proj.weight")),
            p(name("self_attn.o_proj.weight")),       p.optional(name("self_attn.q_proj.bias")),
            p.optional(name("self_attn.k_proj.bias")), p.optional(name("self_attn.v_proj.bias")),
            p.optional(name("self_attn.o_proj.bias")), p(name("post_attention_layernorm.weight")),
            p(name("mlp.gate_proj.weight")),          p(name("mlp.up_proj.weight")),
            p(name("mlp.down_proj.weight")),          p.optional(name("mlp.gate_proj.bias")),
            p.optional(name("mlp.up_proj.bias")),     p.optional(name("mlp.down_proj.bias"))};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::string& prefix() const { return prefix_; }

  template <class B>
  std::size_t scratch_bytes(ChunkShape c) const {
    Arena measure;
    (void)carve<B>(measure, c, true);
    return measure.peak();
  }

  template <class B>
  void forward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
               View<typename B::Act> y, Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c, false);
    run_to_mlp(be, c, w, x, a);
    be.linear(cview(a.m), w.down, w.down_bias, y);  // y = down(m)
    be.add(cview(a.x2), y);                         // y += h
  }

  template <class B>
  void backward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c, true);
    run_to_mlp(be, c, w, x, a);  // recompute from the checkpoint
    // MLP: y = h + down(silu(gate(n2)) * up(n2))
    be.linear_backward(cview(a.m), w.down, dy, a.dm, false, g.down, g.down_bias);
    be.swiglu_backward(cview(a.g), cview(a.u), cview(a.dm), a.dg, a.du);
    be.linear_backward(cview(a.n2), w.gate, cview(a.dg), a.dn, false, g.gate, g.gate_bias);
    be.linear_backward(cview(a.n2), w.up, cview(a.du), a.dn, true, g.up, g.up_bias);
    be.copy(dy, a.dh);  // the residual path
    be.rmsnorm_backward(cview(a.x2), w.post_norm, cview(a.rstd2), cview(a.dn), a.dh, true, g.post_norm);
    // Attention: h = x + o(attn(...))
    be.linear_backward(cview(a.att), w.o, cview(a.dh), a.datt, false, g.o, g.o_bias);
    be.attention_backward(cview(a.q), cview(a.k), cview(a.v), cview(a.att), cview(a.lse), cview(a.datt), a.dq, a.dk,
                          a.dv, attention_shape(c));
    be.rope_backward(a.dq, cfg_.num_attention_heads, c.seq, std::span<const double>(inv_freq_));
    be.rope_backward(a.dk, cfg_.num_key_value_heads, c.seq, std::span<const double>(inv_freq_));
    be.linear_backward(cview(a.n1), w.q, cview(a.dq), a.dn, false, g.q, g.q_bias);
    be.linear_backward(cview(a.n1), w.k, cview(a.dk), a.dn, true, g.k, g.k_bias);
    be.linear_backward(cview(a.n1), w.v, cview(a.dv), a.dn, true, g.v, g.v_bias);
    be.copy(cview(a.dh), dx);
    be.rmsnorm_backward(x, w.input_norm, cview(a.rstd1), cview(a.dn), dx, true, g.input_norm);
  }

 private:
  template <class B>
  struct Acts {
    using A = typename B::Act;
    using C = typename B::Acc;
    View<A> n1, q, k, v, att, x2, n2, g, u, m;
    View<C> rstd1, rstd2, lse;
    View<A> dm, dg, du, dn, dh, datt, dq, dk, dv;  // backward only
  };

  template <class E>
  static View<const E> cview(View<E> v) {
    return v;
  }

  std::string name(const char* suffix) const { return prefix_ + suffix; }

  AttentionShape attention_shape(ChunkShape c) const {
    return {c.rows, c.seq, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim};
  }

  // The scratch of one chunk, carved in one place so scratch_bytes() and the real runs agree.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward) const {
    using A = typename B::Act;
    using C = typename B::Acc;
    const std::int64_t M = c.tokens(), d = cfg_.hidden_size, f = cfg_.intermediate_size;
    const std::int64_t qd = cfg_.q_dim(), kd = cfg_.kv_dim();
    Acts<B> a;
    a.n1 = ar.alloc<A>({M, d});
    a.q = ar.alloc<A>({M, qd});
    a.k = ar.alloc<A>({M, kd});
    a.v = ar.alloc<A>({M, kd});
    a.att = ar.alloc<A>({M, qd});
    a.x2 = ar.alloc<A>({M, d});
    a.n2 = ar.alloc<A>({M, d});
    a.g = ar.alloc<A>({M, f});
    a.u = ar.alloc<A>({M, f});
    a.m = ar.alloc<A>({M, f});
    a.rstd1 = ar.alloc<C>({M});
    a.rstd2 = ar.alloc<C>({M});
    a.lse = ar.alloc<C>({c.rows, cfg_.num_attention_heads, c.seq});
    if (with_backward) {
      a.dm = ar.alloc<A>({M, f});
      a.dg = ar.alloc<A>({M, f});
      a.du = ar.alloc<A>({M, f});
      a.dn = ar.alloc<A>({M, d});
      a.dh = ar.alloc<A>({M, d});
      a.datt = ar.alloc<A>({M, qd});
      a.dq = ar.alloc<A>({M, qd});
      a.dk = ar.alloc<A>({M, kd});
      a.dv = ar.alloc<A>({M, kd});
    }
    return a;
  }

  // Everything up to the MLP's product m (what backward needs); forward adds the down projection.
  template <class B>
  void run_to_mlp(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                  const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size,
             "decoder block: input {} is not [{} tokens, {}]", x.shape().str(), c.tokens(), cfg_.hidden_size);
    cfg_.check_sequence_length(c.seq);
    be.rmsnorm(x, w.input_norm, cfg_.rms_norm_eps, a.n1, a.rstd1);
    be.linear(cview(a.n1), w.q, w.q_bias, a.q);
    be.linear(cview(a.n1), w.k, w.k_bias, a.k);
    be.linear(cview(a.n1), w.v, w.v_bias, a.v);
    be.rope(a.q, cfg_.num_attention_heads, c.seq, std::span<const double>(inv_freq_));
    be.rope(a.k, cfg_.num_key_value_heads, c.seq, std::span<const double>(inv_freq_));
    be.attention(cview(a.q), cview(a.k), cview(a.v), a.att, a.lse, attention_shape(c));
    be.linear(cview(a.att), w.o, w.o_bias, a.x2);
    be.add(x, a.x2);
    be.rmsnorm(cview(a.x2), w.post_norm, cfg_.rms_norm_eps, a.n2, a.rstd2);
    be.linear(cview(a.n2), w.gate, w.gate_bias, a.g);
    be.linear(cview(a.n2), w.up, w.up_bias, a.u);
    be.swiglu(cview(a.g), cview(a.u), a.m);
  }

  ModelConfig cfg_;
  std::string prefix_;
  std::vector<double> inv_freq_;
};

}  // namespace megatrain
