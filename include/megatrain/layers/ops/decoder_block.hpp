// The pre-norm decoder block of Llama, Mistral, Qwen and Phi-3:
//
//     h  = x + attention(rmsnorm(x))        SelfAttention (self_attention.hpp)
//     y  = h + mlp(rmsnorm(h))              SwiGluMlp (swiglu_mlp.hpp)
//
// and Gemma 3's, with the parts' outputs normalised too (ModelConfig::sandwich_norms; every norm
// (1 + w)):
//
//     h  = x + rmsnorm(attention(rmsnorm(x)))      input_layernorm, post_attention_layernorm
//     y  = h + rmsnorm(mlp(rmsnorm(h)))            pre_feedforward_layernorm, post_feedforward_layernorm
//
// (The post-norms read the parts' bf16 outputs and write bf16, which joins the fp32 residual
// stream, as transformers' Gemma3RMSNorm under autocast: output.type_as(input).)
//
// x, h and y are the residual stream (B::Res: fp32 on the CUDA backend): each part's output
// projection adds into it in one step (Backend::linear_add), and the norms read it and their
// gains at full precision, as PyTorch's autocast does; only the parts' inner activations are
// bf16. The gradient along the residual path is kept the same way.
//
// Backward (CarvedOp) recomputes the attention part from the block's input (the activation
// checkpoint), keeping its activations and h, then backpropagates through the parts in reverse,
// recomputing the MLP's activations a token block at a time on the way.
//
// Kept activations (KeepingLayerOp, where the trainer has room): the forward keeps h, the
// attention's q, k, v, output and log-sum-exp, and the MLP's gate and up projections of the
// whole chunk; the backward then runs no matrix product of the forward again, only the norms
// (SwiGLU's product m is made by its backward's pass, the same bits as the forward's).
//
// Mixture of experts (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS; ModelConfig::is_moe_layer): the MLP
// part is MoeMlp (router and experts) instead of SwiGluMlp, run a token block at a time like it;
// its activations are never kept (the backward recomputes them from h). It runs on backends that
// provide MoeMlp's primitives (MoeBackend: the CPU and CUDA backends); elsewhere such a block is
// refused.
//
// Token blocks (ChunkShape::token_block): the norms, the projections and the MLP run on blocks
// of that many tokens, so that their buffers (the MLP's are the largest: 6 x intermediate_size
// per token) are bounded by the block; only q, k, v, the attention output (and their
// gradients) and h span the whole chunk, since attention sees whole rows. One block (the
// default) is the whole chunk.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/layers/ops/moe_mlp.hpp"
#include "megatrain/layers/ops/self_attention.hpp"
#include "megatrain/layers/ops/swiglu_mlp.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class DecoderBlock : public CarvedOp<DecoderBlock> {
 public:
  DecoderBlock(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg),
        prefix_("model.layers." + std::to_string(layer) + "."),
        attn_(cfg, layer),
        mlp_(cfg, layer),
        moe_(cfg.is_moe_layer(layer) ? std::optional<MoeMlp>(MoeMlp(cfg, layer)) : std::nullopt),
        sandwich_(cfg.sandwich_norms()),
        offset_(cfg.norm_unit_offset() ? 1.0 : 0.0) {}

  static constexpr bool kResidualIO = true;  // (CarvedOp: x and y are the residual stream)

  template <class E>
  struct Weights {
    View<full_t<E>> input_norm;
    SelfAttention::Weights<E> attn;
    View<full_t<E>> post_norm;  ///< the MLP's input norm (Gemma 3: pre_feedforward_layernorm)
    SwiGluMlp::Weights<E> mlp;                    ///< a dense layer's
    View<full_t<E>> attn_out_norm, mlp_out_norm;  ///< sandwich norms only (Gemma 3)
    MoeMlp::Weights<E> moe;                       ///< a mixture-of-experts layer's
  };

  /// In slab order: input_layernorm, self_attn.*, post_attention_layernorm, mlp.*; Gemma 3:
  /// input_layernorm, self_attn.*, post_attention_layernorm, pre_feedforward_layernorm, mlp.*,
  /// post_feedforward_layernorm.
  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size;
    const bool unit = offset_ != 0;
    std::vector<ParamSpec> p{ParamSpec::norm(name("input_layernorm.weight"), d, unit)};
    for (auto& s : attn_.params()) p.push_back(std::move(s));
    p.push_back(ParamSpec::norm(name("post_attention_layernorm.weight"), d, unit));
    if (sandwich_) p.push_back(ParamSpec::norm(name("pre_feedforward_layernorm.weight"), d, unit));
    for (auto& s : moe_ ? moe_->params() : mlp_.params()) p.push_back(std::move(s));
    if (sandwich_) p.push_back(ParamSpec::norm(name("post_feedforward_layernorm.weight"), d, unit));
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    if (moe_) {
      Weights<E> w{p.full(name("input_layernorm.weight")), attn_.bind(p), p.full(name("post_attention_layernorm.weight")),
                   {}, {}, {}, moe_->bind(p)};
      return w;
    }
    if (sandwich_)
      return {p.full(name("input_layernorm.weight")), attn_.bind(p), p.full(name("pre_feedforward_layernorm.weight")),
              mlp_.bind(p), p.full(name("post_attention_layernorm.weight")),
              p.full(name("post_feedforward_layernorm.weight")), {}};
    return {p.full(name("input_layernorm.weight")), attn_.bind(p), p.full(name("post_attention_layernorm.weight")),
            mlp_.bind(p), {}, {}, {}};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::string& prefix() const { return prefix_; }
  const SelfAttention& attention() const { return attn_; }
  const SwiGluMlp& mlp() const { return mlp_; }
  /// The experts of a mixture-of-experts layer (none for a dense one).
  const std::optional<MoeMlp>& moe() const { return moe_; }

  /// The activations of one chunk: the attention's over the whole chunk and h (x2), and the
  /// token-wise parts' for one block of ChunkShape::block_tokens() tokens (forward and, with
  /// backward, backward buffers).
  template <class B>
  struct Acts {
    View<typename B::Act> n1, n2;  // a token block's
    View<typename B::Res> x2;      // h, the whole chunk's
    View<typename B::Acc> rstd1, rstd2;
    typename SelfAttention::template Acts<B> attn;
    typename SwiGluMlp::template Acts<B> mlp;  // a token block's (kept: g and u the whole chunk's)
    typename MoeMlp::template Acts<B> moe;     // a mixture-of-experts layer's, a token block's (never kept)
    View<typename B::Act> dn, dya;  // backward only: a norm's input gradient; dy, then dh, as activations
    // sandwich norms: the attention's projected output o and its norm's rstd (the whole chunk's,
    // with h), the MLP's output f and its rstd (a token block's; kept: the chunk's), a post-norm's
    // output (a block's), and (backward) a post-norm's input gradient
    View<typename B::Act> o, f, pn, dp;
    View<typename B::Acc> rstd_o, rstd_f;
    bool kept = false;              // h, the attention's and the MLP's g and u kept from the forward
  };

  // The scratch of one chunk, carved in one place so scratch_bytes() and the real runs agree;
  // with `kept`, what backprop() reads of the forward comes from there (CarvedOp).
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward, Arena* kept = nullptr) const {
    using A = typename B::Act;
    using C = typename B::Acc;
    const std::int64_t M = c.tokens(), T = c.block_tokens(), d = cfg_.hidden_size;
    Acts<B> a;
    a.kept = kept != nullptr;
    a.n1 = ar.alloc<A>({T, d});
    a.x2 = (kept ? *kept : ar).template alloc<typename B::Res>({M, d});
    a.n2 = ar.alloc<A>({T, d});
    a.rstd1 = ar.alloc<C>({T});
    a.rstd2 = ar.alloc<C>({T});
    a.attn = attn_.carve<B>(ar, c, with_backward, kept);
    if (moe_) a.moe = moe_->carve<B>(ar, T, with_backward);
    else a.mlp = mlp_.carve<B>(ar, ChunkShape{1, T}, with_backward, kept, M);
    if (with_backward) {
      a.dn = ar.alloc<A>({T, d});
      a.dya = ar.alloc<A>({T, d});
    }
    if (sandwich_) {
      Arena& chunk = kept ? *kept : ar;
      a.o = chunk.alloc<A>({M, d});
      a.rstd_o = chunk.alloc<C>({M});
      a.f = kept ? kept->alloc<A>({M, d}) : ar.alloc<A>({T, d});
      a.rstd_f = kept ? kept->alloc<C>({M}) : ar.alloc<C>({T});
      a.pn = ar.alloc<A>({T, d});
      if (with_backward) a.dp = ar.alloc<A>({T, d});
    }
    return a;
  }

  /// y = x + attention(rmsnorm(x)), then + mlp(rmsnorm(...)); keeps the attention's activations
  /// and h in a. The norms, projections and MLP run a token block at a time.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
           const Acts<B>& a, View<typename B::Res> y) const {
    run_kept(be, c, w, x, a);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      const auto n2 = token_rows(a.n2, 0, n);
      const auto h = cview(token_rows(a.x2, t0, n));
      be.rmsnorm(h, w.post_norm, cfg_.rms_norm_eps, n2, token_rows(a.rstd2, 0, n), offset_);
      if (moe_) {  // y = h + moe(n2)
        moe_run(be, w, cview(n2), moe_acts(a, n), h, token_rows(y, t0, n), router_rows(c.router, t0, n));
        return;
      }
      const auto m = mlp_acts(a, t0, n);
      mlp_.run_gated(be, ChunkShape{1, n}, w.mlp, cview(n2), m);
      if (!sandwich_) {
        be.linear_add(cview(m.m), w.mlp.down, w.mlp.down_bias, h, token_rows(y, t0, n));  // y = h + down(m)
        return;
      }
      const auto [f, rstd_f] = mlp_out(a, t0, n);  // y = h + norm(down(m))
      be.linear(cview(m.m), w.mlp.down, w.mlp.down_bias, f);
      be.head_rmsnorm(cview(f), w.mlp_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), rstd_f, offset_);
      be.residual_add(h, cview(token_rows(a.pn, 0, n)), token_rows(y, t0, n));
    });
  }

  /// The attention part: the whole chunk's attention activations and h = x + o_proj(attention(n1)).
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size,
             "decoder block: input {} is not [{} tokens, {}]", x.shape().str(), c.tokens(), cfg_.hidden_size);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      const auto n1 = token_rows(a.n1, 0, n);
      be.rmsnorm(token_rows(x, t0, n), w.input_norm, cfg_.rms_norm_eps, n1, token_rows(a.rstd1, 0, n), offset_);
      attn_.project(be, w.attn, cview(n1), a.attn, t0);
    });
    attn_.attend(be, c, a.attn, w.attn.sinks);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {  // h = x + o_proj(attention(n1))
      if (!sandwich_) {
        be.linear_add(cview(token_rows(a.attn.att, t0, n)), w.attn.o, w.attn.o_bias, token_rows(x, t0, n),
                      token_rows(a.x2, t0, n));
        return;
      }
      const auto o = token_rows(a.o, t0, n);  // h = x + norm(o_proj(...))
      be.linear(cview(token_rows(a.attn.att, t0, n)), w.attn.o, w.attn.o_bias, o);
      be.head_rmsnorm(cview(o), w.attn_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), token_rows(a.rstd_o, t0, n),
                      offset_);
      be.residual_add(token_rows(x, t0, n), cview(token_rows(a.pn, 0, n)), token_rows(a.x2, t0, n));
    });
  }

  /// After run_kept() on the same x: dx written, weight gradients added to g. The MLP part is
  /// recomputed a token block at a time (from h), as is the input norm.
  template <class B>
  void backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a, View<const typename B::Res> dy, View<typename B::Res> dx,
                const Weights<typename B::Acc>& g) const {
    // y = h + mlp(n2): dn2 from the MLP, then dh = dy + the norm's backward (into dx, and as
    // activations), then datt = o_proj's backward of dh
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      const auto n2 = token_rows(a.n2, 0, n), dn = token_rows(a.dn, 0, n), dya = token_rows(a.dya, 0, n);
      const auto rstd2 = token_rows(a.rstd2, 0, n);
      const auto h = cview(token_rows(a.x2, t0, n));
      be.rmsnorm(h, w.post_norm, cfg_.rms_norm_eps, n2, rstd2, offset_);
      be.convert(token_rows(dy, t0, n), dya);
      if (moe_) moe_backprop(be, w, cview(n2), moe_acts(a, n), cview(dya), dn, g, router_rows(c.router, t0, n));  // (recomputed from n2)
      else mlp_backprop(be, w, a, t0, n, cview(n2), cview(dya), dn, g);
      be.rmsnorm_backward(h, w.post_norm, cview(rstd2), cview(dn), token_rows(dy, t0, n), token_rows(dx, t0, n), dya,
                          g.post_norm, offset_);
      View<const typename B::Act> dout = cview(dya);  // the gradient of o_proj's output
      if (sandwich_) {
        const auto dp = token_rows(a.dp, 0, n);
        be.head_rmsnorm_backward(cview(token_rows(a.o, t0, n)), w.attn_out_norm, cview(token_rows(a.rstd_o, t0, n)),
                                 cview(dya), dp, g.attn_out_norm, offset_);
        dout = cview(dp);
      }
      be.linear_backward(cview(token_rows(a.attn.att, t0, n)), w.attn.o, dout, token_rows(a.attn.datt, t0, n), false,
                         g.attn.o, g.attn.o_bias);
    });
    // h = x + attention(n1): through the attention, then the projections and the norm, into dx
    attn_.attend_backward(be, c, a.attn, w.attn, g.attn.sinks);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      const auto n1 = token_rows(a.n1, 0, n), dn = token_rows(a.dn, 0, n), rstd1 = token_rows(a.rstd1, 0, n);
      const auto xs = token_rows(x, t0, n);
      if (a.kept || c.block_tokens() < c.tokens())  // (one block, recomputed: n1 and rstd1 are still the forward's)
        be.rmsnorm(xs, w.input_norm, cfg_.rms_norm_eps, n1, rstd1, offset_);
      attn_.project_backward(be, w.attn, cview(n1), a.attn, t0, dn, g.attn);
      const auto dxs = token_rows(dx, t0, n);
      be.rmsnorm_backward(xs, w.input_norm, cview(rstd1), cview(dn), View<const typename B::Res>(dxs), dxs,
                          View<typename B::Act>{}, g.input_norm, offset_);
    });
  }

 private:
  std::string name(const char* suffix) const { return prefix_ + suffix; }

  /// The dense MLP's part of backprop() for the token block [t0, t0 + n): dn (the gradient of its
  /// input n2) from dya (the gradient of the block's output), through the output norm first where
  /// the block has one; its activations recomputed from n2 unless kept.
  template <class B>
  void mlp_backprop(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t t0, std::int64_t n,
                    View<const typename B::Act> n2, View<const typename B::Act> dya, View<typename B::Act> dn,
                    const Weights<typename B::Acc>& g) const {
    const auto m = mlp_acts(a, t0, n);
    // (the backprop makes m from g and u; recomputed, the output norm needs m and f first)
    if (!a.kept && sandwich_) mlp_.run_gated(be, ChunkShape{1, n}, w.mlp, n2, m);
    else if (!a.kept) mlp_.run_kept(be, ChunkShape{1, n}, w.mlp, n2, m);
    View<const typename B::Act> dm = dya;  // the gradient of the MLP's output
    if (sandwich_) {  // through the MLP's output norm first (its input recomputed unless kept)
      const auto [f, rstd_f] = mlp_out(a, t0, n);
      const auto dp = token_rows(a.dp, 0, n);
      if (!a.kept) {
        be.linear(cview(m.m), w.mlp.down, w.mlp.down_bias, f);
        be.head_rmsnorm(cview(f), w.mlp_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), rstd_f, offset_);
      }
      be.head_rmsnorm_backward(cview(f), w.mlp_out_norm, cview(rstd_f), dya, dp, g.mlp_out_norm, offset_);
      dm = cview(dp);
    }
    mlp_.backprop(be, ChunkShape{1, n}, w.mlp, n2, m, dm, dn, g.mlp);
  }

  /// The routing statistics for the token block [t0, t0 + n): its rows of the tokens that count.
  static RouterStats router_rows(RouterStats r, std::int64_t t0, std::int64_t n) {
    if (!r.valid.is_null()) r.valid = token_rows(r.valid, t0, n);
    return r;
  }
  /// The experts' activations for a token block of n tokens (the first rows of the block's buffers).
  template <class B>
  typename MoeMlp::template Acts<B> moe_acts(const Acts<B>& a, std::int64_t n) const {
    return moe_->carve_rows<B>(a.moe, n);
  }
  template <class B>
  void moe_run(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
               const typename MoeMlp::template Acts<B>& m, View<const typename B::Res> h, View<typename B::Res> y,
               const RouterStats& stats) const {
    if constexpr (MoeBackend<B>) moe_->run(be, w.moe, x, m, h, y, stats);
    else MoeMlp::refuse_backend(cfg_, moe_->layer());
  }
  template <class B>
  void moe_backprop(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                    const typename MoeMlp::template Acts<B>& m, View<const typename B::Act> dy, View<typename B::Act> dx,
                    const Weights<typename B::Acc>& g, const RouterStats& stats) const {
    if constexpr (MoeBackend<B>) {
      moe_->run_kept(be, w.moe, x, m);
      moe_->backprop(be, w.moe, x, m, dy, dx, g.moe, stats);
    } else {
      MoeMlp::refuse_backend(cfg_, moe_->layer());
    }
  }
  /// The MLP's activations for the token block [t0, t0 + n): the first n rows of its buffers
  /// (kept: g and u span the chunk, their rows from t0).
  template <class B>
  typename SwiGluMlp::template Acts<B> mlp_acts(const Acts<B>& a, std::int64_t t0, std::int64_t n) const {
    auto m = a.mlp;
    for (auto* v : {&m.m, &m.dm, &m.dg, &m.du})
      if (!v->is_null()) *v = token_rows(*v, 0, n);
    for (auto* v : {&m.g, &m.u})
      if (!v->is_null()) *v = token_rows(*v, a.kept ? t0 : 0, n);
    return m;
  }

  /// The MLP's output f and its norm's rstd for the token block [t0, t0 + n) (sandwich norms):
  /// rows from t0 where kept for the chunk, else the block's buffers.
  template <class B>
  std::pair<View<typename B::Act>, View<typename B::Acc>> mlp_out(const Acts<B>& a, std::int64_t t0, std::int64_t n) const {
    const std::int64_t first = a.kept ? t0 : 0;
    return {token_rows(a.f, first, n), token_rows(a.rstd_f, first, n)};
  }

  ModelConfig cfg_;
  std::string prefix_;
  SelfAttention attn_;
  SwiGluMlp mlp_;
  std::optional<MoeMlp> moe_;  // the experts, on a mixture-of-experts layer (then mlp_ is unused)
  bool sandwich_;  // Gemma 3's post-attention and post-feedforward norms
  double offset_;  // every norm multiplies by (w + offset_): 1 for Gemma, else 0
};

}  // namespace megatrain
