// A GPT-2 block written as a user's own layer op: what it takes to plug a new kind of layer
// into megatrain (see docs/layers.md, "Writing your own op").
//
//     h = x + c_proj(attention(c_attn(ln_1(x))))          causal multi-head self-attention
//     y = h + mlp.c_proj(gelu(mlp.c_fc(ln_2(h))))          GELU, tanh approximation (as GPT-2)
//
// LayerNorm (with weight and bias) and GELU are not backend primitives, so this op computes them
// itself with plain loops over host views, forward and backward; everything else (the linear
// layers, attention, residual adds, copies) goes through the backend. Being host loops, the op
// runs on backends whose views live in host memory (B::kDevice false: CpuBackend<float> and
// CpuBackend<double>), which its member templates require.
//
// Like every op it is stateless: backward recomputes the forward from the block's input, and the
// weights come in through Weights<E> views bound to whatever buffer holds them.
//
// Parameters are named as in the original GPT-2 checkpoint ("h.{layer}.ln_1.weight",
// "h.{layer}.attn.c_attn.weight", ...), with one difference: every matrix has nn.Linear's
// [out, in] shape, while GPT-2's checkpoints store their Conv1D weights as [in, out]; importing
// one means transposing the four matrices of each block.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/config.hpp"

namespace example {

using megatrain::Arena;
using megatrain::ArenaScope;
using megatrain::ChunkShape;
using megatrain::ParamBinder;
using megatrain::ParamSpec;
using megatrain::Shape;
using megatrain::View;

struct Gpt2Options {
  double layer_norm_epsilon = 1e-5;  ///< GPT-2's layer_norm_epsilon
  std::string prefix = "h.";         ///< parameter names are prefix + "{layer}." + "ln_1.weight", ...
};

class Gpt2Block {
 public:
  /// Takes hidden_size, num_attention_heads, intermediate_size (GPT-2's n_inner, 4 x hidden) and
  /// initializer_range from `cfg`. GPT-2 attention has as many key/value heads as query heads.
  Gpt2Block(const megatrain::ModelConfig& cfg, std::int64_t layer, Gpt2Options opt = {})
      : cfg_(cfg), eps_(opt.layer_norm_epsilon), prefix_(opt.prefix + std::to_string(layer) + ".") {
    cfg.validate();
    MT_CHECK(layer >= 0 && layer < cfg.num_hidden_layers, "layer {} out of range [0, {})", layer, cfg.num_hidden_layers);
    MT_CHECK(cfg.num_key_value_heads == cfg.num_attention_heads,
             "a GPT-2 block has as many key/value heads as query heads ({}), not {}", cfg.num_attention_heads,
             cfg.num_key_value_heads);
    MT_CHECK(cfg.q_dim() == cfg.hidden_size, "a GPT-2 block needs num_attention_heads x head_dim = hidden_size ({} x {} != {})",
             cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size);
    MT_CHECK(eps_ > 0 && std::isfinite(eps_), "layer_norm_epsilon must be > 0 (got {})", eps_);
  }

  /// One view per tensor; c_attn is q, k and v stacked ([3 x hidden, hidden]), as in GPT-2.
  template <class E>
  struct Weights {
    View<E> ln_1_weight, ln_1_bias, c_attn_weight, c_attn_bias, attn_proj_weight, attn_proj_bias;
    View<E> ln_2_weight, ln_2_bias, c_fc_weight, c_fc_bias, mlp_proj_weight, mlp_proj_bias;
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size, f = cfg_.intermediate_size;
    const auto sd = static_cast<float>(cfg_.initializer_range);
    // GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2 n_layer).
    const auto sd_proj = static_cast<float>(cfg_.initializer_range / std::sqrt(2.0 * static_cast<double>(cfg_.num_hidden_layers)));
    return {ParamSpec::norm(name("ln_1.weight"), d),
            ParamSpec::bias(name("ln_1.bias"), d),
            ParamSpec::matrix(name("attn.c_attn.weight"), Shape{3 * d, d}, sd),
            ParamSpec::bias(name("attn.c_attn.bias"), 3 * d),
            ParamSpec::matrix(name("attn.c_proj.weight"), Shape{d, d}, sd_proj),
            ParamSpec::bias(name("attn.c_proj.bias"), d),
            ParamSpec::norm(name("ln_2.weight"), d),
            ParamSpec::bias(name("ln_2.bias"), d),
            ParamSpec::matrix(name("mlp.c_fc.weight"), Shape{f, d}, sd),
            ParamSpec::bias(name("mlp.c_fc.bias"), f),
            ParamSpec::matrix(name("mlp.c_proj.weight"), Shape{d, f}, sd_proj),
            ParamSpec::bias(name("mlp.c_proj.bias"), d)};
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p(name("ln_1.weight")),      p(name("ln_1.bias")),      p(name("attn.c_attn.weight")),
            p(name("attn.c_attn.bias")), p(name("attn.c_proj.weight")), p(name("attn.c_proj.bias")),
            p(name("ln_2.weight")),      p(name("ln_2.bias")),      p(name("mlp.c_fc.weight")),
            p(name("mlp.c_fc.bias")),    p(name("mlp.c_proj.weight")), p(name("mlp.c_proj.bias"))};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::string& prefix() const { return prefix_; }

  template <class B>
    requires(!B::kDevice)
  std::size_t scratch_bytes(ChunkShape c) const {
    Arena measure;
    (void)carve<B>(measure, c, true);
    return measure.peak();
  }

  template <class B>
    requires(!B::kDevice)
  void forward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
               View<typename B::Act> y, Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c, false);
    run_to_mlp(be, c, w, x, a);
    be.linear(cview(a.act), w.mlp_proj_weight, w.mlp_proj_bias, y);  // y = mlp.c_proj(gelu(...))
    be.add(cview(a.h), y);                                           // y += h
  }

  template <class B>
    requires(!B::kDevice)
  void backward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c, true);
    const std::int64_t d = cfg_.hidden_size;
    run_to_mlp(be, c, w, x, a);  // recompute from the checkpoint
    // MLP: y = h + c_proj(gelu(c_fc(n2)))
    be.linear_backward(cview(a.act), w.mlp_proj_weight, dy, a.dact, false, g.mlp_proj_weight, g.mlp_proj_bias);
    gelu_backward(cview(a.fc), a.dact);  // dact becomes d(c_fc output), in place
    be.linear_backward(cview(a.n2), w.c_fc_weight, cview(a.dact), a.dn, false, g.c_fc_weight, g.c_fc_bias);
    be.copy(dy, a.dh);  // the residual path
    layer_norm_backward(cview(a.h), w.ln_2_weight, cview(a.mean2), cview(a.rstd2), cview(a.dn), a.dh, g.ln_2_weight,
                        g.ln_2_bias);
    // Attention: h = x + c_proj(attention(q, k, v)), [q k v] = c_attn(n1)
    be.linear_backward(cview(a.att), w.attn_proj_weight, cview(a.dh), a.datt, false, g.attn_proj_weight,
                       g.attn_proj_bias);
    be.attention_backward(cview(a.q), cview(a.k), cview(a.v), cview(a.att), cview(a.lse), cview(a.datt), a.dq, a.dk,
                          a.dv, attention_shape(c));
    const View<typename B::Act> dqkv[3] = {a.dq, a.dk, a.dv};
    for (std::int64_t i = 0; i < 3; ++i)  // the three slices of the fused projection
      be.linear_backward(cview(a.n1), rows(w.c_attn_weight, i * d, d), cview(dqkv[i]), a.dn, i > 0,
                         rows(g.c_attn_weight, i * d, d), rows(g.c_attn_bias, i * d, d));
    be.copy(cview(a.dh), dx);
    layer_norm_backward(x, w.ln_1_weight, cview(a.mean1), cview(a.rstd1), cview(a.dn), dx, g.ln_1_weight, g.ln_1_bias);
  }

 private:
  static constexpr double kSqrt2OverPi = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double kGeluCubic = 0.044715;

  template <class B>
  struct Acts {
    using A = typename B::Act;
    using C = typename B::Acc;
    View<A> n1, q, k, v, att, h, n2, fc, act;
    View<C> mean1, rstd1, mean2, rstd2, lse;
    View<A> dact, dn, dh, datt, dq, dk, dv;  // backward only
  };

  template <class E>
  static View<const E> cview(View<E> v) {
    return v;
  }

  /// Rows [first, first + count) of a contiguous matrix, or elements of a vector.
  template <class E>
  static View<E> rows(View<E> m, std::int64_t first, std::int64_t count) {
    return megatrain::token_rows(m, first, count);
  }

  std::string name(const char* suffix) const { return prefix_ + suffix; }

  megatrain::AttentionShape attention_shape(ChunkShape c) const {
    return {c.rows, c.seq, cfg_.num_attention_heads, cfg_.num_attention_heads, cfg_.head_dim, c.packed};
  }

  // The scratch of one chunk, carved in one place so scratch_bytes() and the real runs agree.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward) const {
    using A = typename B::Act;
    using C = typename B::Acc;
    const std::int64_t M = c.tokens(), d = cfg_.hidden_size, f = cfg_.intermediate_size;
    Acts<B> a;
    for (View<A>* v : {&a.n1, &a.q, &a.k, &a.v, &a.att, &a.h, &a.n2}) *v = ar.alloc<A>({M, d});
    a.fc = ar.alloc<A>({M, f});
    a.act = ar.alloc<A>({M, f});
    for (View<C>* v : {&a.mean1, &a.rstd1, &a.mean2, &a.rstd2}) *v = ar.alloc<C>({M});
    a.lse = ar.alloc<C>({c.rows, cfg_.num_attention_heads, c.seq});
    if (with_backward) {
      a.dact = ar.alloc<A>({M, f});
      for (View<A>* v : {&a.dn, &a.dh, &a.datt, &a.dq, &a.dk, &a.dv}) *v = ar.alloc<A>({M, d});
    }
    return a;
  }

  // Everything up to the MLP's activation (what backward needs); forward adds the last projection.
  template <class B>
  void run_to_mlp(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                  const Acts<B>& a) const {
    const std::int64_t d = cfg_.hidden_size;
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == d, "GPT-2 block: input {} is not [{} tokens, {}]",
             x.shape().str(), c.tokens(), d);
    cfg_.check_sequence_length(c.seq);
    layer_norm(x, w.ln_1_weight, w.ln_1_bias, a.n1, a.mean1, a.rstd1);
    const View<typename B::Act> qkv[3] = {a.q, a.k, a.v};
    for (std::int64_t i = 0; i < 3; ++i)
      be.linear(cview(a.n1), rows(w.c_attn_weight, i * d, d), rows(w.c_attn_bias, i * d, d), qkv[i]);
    be.attention(cview(a.q), cview(a.k), cview(a.v), a.att, a.lse, attention_shape(c));
    be.linear(cview(a.att), w.attn_proj_weight, w.attn_proj_bias, a.h);
    be.add(x, a.h);
    layer_norm(cview(a.h), w.ln_2_weight, w.ln_2_bias, a.n2, a.mean2, a.rstd2);
    be.linear(cview(a.n2), w.c_fc_weight, w.c_fc_bias, a.fc);
    gelu(cview(a.fc), a.act);
  }

  // ---- the op's own kernels: plain loops over host views ---------------------------------------

  /// y = (x - mean) * rstd * weight + bias, row by row; keeps mean and rstd = 1/sqrt(var + eps).
  template <class A, class W, class C>
  void layer_norm(View<const A> x, View<const W> weight, View<const W> bias, View<A> y, View<C> mean,
                  View<C> rstd) const {
    const std::int64_t M = x.size(0), d = x.size(1);
    for (std::int64_t r = 0; r < M; ++r) {
      double s = 0, ss = 0;
      for (std::int64_t i = 0; i < d; ++i) s += static_cast<double>(x(r, i));
      const double mu = s / static_cast<double>(d);
      for (std::int64_t i = 0; i < d; ++i) ss += (static_cast<double>(x(r, i)) - mu) * (static_cast<double>(x(r, i)) - mu);
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps_);
      mean(r) = static_cast<C>(mu);
      rstd(r) = static_cast<C>(inv);
      for (std::int64_t i = 0; i < d; ++i)
        y(r, i) = static_cast<A>((static_cast<double>(x(r, i)) - mu) * inv * static_cast<double>(weight(i)) +
                                 static_cast<double>(bias(i)));
    }
  }

  /// dx += d(layer_norm)/dx . dy; dweight += sum_r dy * xhat; dbias += sum_r dy.
  template <class A, class W, class C>
  static void layer_norm_backward(View<const A> x, View<const W> weight, View<const C> mean, View<const C> rstd,
                                  View<const A> dy, View<A> dx, View<C> dweight, View<C> dbias) {
    const std::int64_t M = x.size(0), d = x.size(1);
    std::vector<double> xhat(static_cast<std::size_t>(d)), gy(static_cast<std::size_t>(d));
    for (std::int64_t r = 0; r < M; ++r) {
      const double mu = static_cast<double>(mean(r)), inv = static_cast<double>(rstd(r));
      double mean_gy = 0, mean_gy_xhat = 0;
      for (std::int64_t i = 0; i < d; ++i) {
        const auto k = static_cast<std::size_t>(i);
        xhat[k] = (static_cast<double>(x(r, i)) - mu) * inv;
        gy[k] = static_cast<double>(dy(r, i)) * static_cast<double>(weight(i));
        mean_gy += gy[k];
        mean_gy_xhat += gy[k] * xhat[k];
        dweight(i) = static_cast<C>(static_cast<double>(dweight(i)) + static_cast<double>(dy(r, i)) * xhat[k]);
        dbias(i) = static_cast<C>(static_cast<double>(dbias(i)) + static_cast<double>(dy(r, i)));
      }
      mean_gy /= static_cast<double>(d);
      mean_gy_xhat /= static_cast<double>(d);
      for (std::int64_t i = 0; i < d; ++i) {
        const auto k = static_cast<std::size_t>(i);
        dx(r, i) = static_cast<A>(static_cast<double>(dx(r, i)) + inv * (gy[k] - mean_gy - xhat[k] * mean_gy_xhat));
      }
    }
  }

  /// GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  template <class A>
  static void gelu(View<const A> x, View<A> y) {
    const auto xs = x.span();
    const auto ys = y.span();
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double v = static_cast<double>(xs[i]);
      ys[i] = static_cast<A>(0.5 * v * (1 + std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v))));
    }
  }

  /// g *= gelu'(x), in place.
  template <class A>
  static void gelu_backward(View<const A> x, View<A> g) {
    const auto xs = x.span();
    const auto gs = g.span();
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double v = static_cast<double>(xs[i]);
      const double t = std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
      const double dgelu = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kSqrt2OverPi * (1 + 3 * kGeluCubic * v * v);
      gs[i] = static_cast<A>(static_cast<double>(gs[i]) * dgelu);
    }
  }

  megatrain::ModelConfig cfg_;
  double eps_;
  std::string prefix_;
};

}  // namespace example
