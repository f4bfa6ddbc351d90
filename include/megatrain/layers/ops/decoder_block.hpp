// The pre-norm decoder block of Llama, Mistral and Qwen2:
//
//     h  = x + attention(rmsnorm(x))        SelfAttention (self_attention.hpp)
//     y  = h + mlp(rmsnorm(h))              SwiGluMlp (swiglu_mlp.hpp)
//
// x, h and y are the residual stream (B::Res: fp32 on the CUDA backend): each part's output
// projection adds into it in one step (Backend::linear_add), and the norms read it and their
// gains at full precision, as PyTorch's autocast does; only the parts' inner activations are
// bf16. The gradient along the residual path is kept the same way.
//
// Backward (CarvedOp) recomputes the forward from the block's input (the activation checkpoint)
// once, keeping every part's activations, then backpropagates through the parts in reverse.
#pragma once

#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/layers/ops/self_attention.hpp"
#include "megatrain/layers/ops/swiglu_mlp.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class DecoderBlock : public CarvedOp<DecoderBlock> {
 public:
  DecoderBlock(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg), prefix_("model.layers." + std::to_string(layer) + "."), attn_(cfg, layer), mlp_(cfg, layer) {}

  static constexpr bool kResidualIO = true;  // (CarvedOp: x and y are the residual stream)

  template <class E>
  struct Weights {
    View<full_t<E>> input_norm;
    SelfAttention::Weights<E> attn;
    View<full_t<E>> post_norm;
    SwiGluMlp::Weights<E> mlp;
  };

  /// In slab order: input_layernorm, self_attn.*, post_attention_layernorm, mlp.*.
  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size;
    std::vector<ParamSpec> p{ParamSpec::norm(name("input_layernorm.weight"), d)};
    for (auto& s : attn_.params()) p.push_back(std::move(s));
    p.push_back(ParamSpec::norm(name("post_attention_layernorm.weight"), d));
    for (auto& s : mlp_.params()) p.push_back(std::move(s));
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p.full(name("input_layernorm.weight")), attn_.bind(p), p.full(name("post_attention_layernorm.weight")),
            mlp_.bind(p)};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::string& prefix() const { return prefix_; }
  const SelfAttention& attention() const { return attn_; }
  const SwiGluMlp& mlp() const { return mlp_; }

  /// The activations of one chunk (forward and, with_backward, backward buffers).
  template <class B>
  struct Acts {
    View<typename B::Act> n1, n2;
    View<typename B::Res> x2;  // h
    View<typename B::Acc> rstd1, rstd2;
    typename SelfAttention::template Acts<B> attn;
    typename SwiGluMlp::template Acts<B> mlp;
    View<typename B::Act> dn, dya;  // backward only: a norm's input gradient; dy, then dh, as activations
    View<typename B::Res> dh;       // backward only
  };

  // The scratch of one chunk, carved in one place so scratch_bytes() and the real runs agree.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward) const {
    using A = typename B::Act;
    using C = typename B::Acc;
    const std::int64_t M = c.tokens(), d = cfg_.hidden_size;
    Acts<B> a;
    a.n1 = ar.alloc<A>({M, d});
    a.x2 = ar.alloc<typename B::Res>({M, d});
    a.n2 = ar.alloc<A>({M, d});
    a.rstd1 = ar.alloc<C>({M});
    a.rstd2 = ar.alloc<C>({M});
    a.attn = attn_.carve<B>(ar, c, with_backward);
    a.mlp = mlp_.carve<B>(ar, c, with_backward);
    if (with_backward) {
      a.dn = ar.alloc<A>({M, d});
      a.dya = ar.alloc<A>({M, d});
      a.dh = ar.alloc<typename B::Res>({M, d});
    }
    return a;
  }

  /// y = x + attention(rmsnorm(x)), then + mlp(rmsnorm(...)); keeps the activations in a.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
           const Acts<B>& a, View<typename B::Res> y) const {
    run_kept(be, c, w, x, a);
    be.linear_add(cview(a.mlp.m), w.mlp.down, w.mlp.down_bias, cview(a.x2), y);  // y = h + down(m)
  }

  /// Everything up to the MLP's product m (what backprop() needs).
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size,
             "decoder block: input {} is not [{} tokens, {}]", x.shape().str(), c.tokens(), cfg_.hidden_size);
    be.rmsnorm(x, w.input_norm, cfg_.rms_norm_eps, a.n1, a.rstd1);
    attn_.run_kept(be, c, w.attn, cview(a.n1), a.attn);
    be.linear_add(cview(a.attn.att), w.attn.o, w.attn.o_bias, x, a.x2);  // h = x + o_proj(attention(n1))
    be.rmsnorm(cview(a.x2), w.post_norm, cfg_.rms_norm_eps, a.n2, a.rstd2);
    mlp_.run_kept(be, c, w.mlp, cview(a.n2), a.mlp);
  }

  /// After run_kept() on the same x: dx written, weight gradients added to g.
  template <class B>
  void backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a, View<const typename B::Res> dy, View<typename B::Res> dx,
                const Weights<typename B::Acc>& g) const {
    // y = h + mlp(n2): dn2 from the MLP, then dh = dy + the norm's backward (and dh as activations)
    be.convert(dy, a.dya);
    mlp_.backprop(be, c, w.mlp, cview(a.n2), a.mlp, cview(a.dya), a.dn, g.mlp);
    be.rmsnorm_backward(cview(a.x2), w.post_norm, cview(a.rstd2), cview(a.dn), dy, a.dh, a.dya, g.post_norm);
    // h = x + attention(n1): the same, into dx
    attn_.backprop(be, c, w.attn, cview(a.n1), a.attn, cview(a.dya), a.dn, g.attn);
    be.rmsnorm_backward(x, w.input_norm, cview(a.rstd1), cview(a.dn), cview(a.dh), dx, View<typename B::Act>{},
                        g.input_norm);
  }

 private:
  std::string name(const char* suffix) const { return prefix_ + suffix; }

  ModelConfig cfg_;
  std::string prefix_;
  SelfAttention attn_;
  SwiGluMlp mlp_;
};

}  // namespace megatrain
