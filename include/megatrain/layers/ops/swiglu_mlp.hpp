// The gated MLP of Llama, Mistral, Qwen and Phi-3 (SwiGLU) and Gemma 3 (GeGLU), as an op of its own:
//
//     y = down_proj(act(gate_proj(x)) * up_proj(x))      act: silu, or GELU's tanh approximation
//
// with optional biases (Llama's mlp_bias). No norm and no residual: a block adds those
// (ComposedBlock, whose channel mixer it is on the dense layers).
// Like SelfAttention, run(), run_kept() and backprop() work on activations the caller keeps
// (carve()); forward() and backward() come from CarvedOp.
#pragma once

#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class SwiGluMlp : public CarvedOp<SwiGluMlp> {
 public:
  /// Layer `layer`'s MLP: parameters model.layers.<layer>.mlp.*.
  SwiGluMlp(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg), prefix_("model.layers." + std::to_string(layer) + ".mlp.") {
    cfg.validate();
    MT_CHECK(layer >= 0 && layer < cfg.num_hidden_layers, "layer {} out of range [0, {})", layer, cfg.num_hidden_layers);
  }

  static constexpr bool kResidualIO = false;  // (CarvedOp: x and y are activations)

  template <class E>
  struct Weights {
    View<E> gate, up, down, gate_bias, up_bias, down_bias;
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size, f = cfg_.intermediate_size;
    const auto sd = static_cast<float>(cfg_.initializer_range);
    std::vector<ParamSpec> p{ParamSpec::matrix(name("gate_proj.weight"), Shape{f, d}, sd),
                             ParamSpec::matrix(name("up_proj.weight"), Shape{f, d}, sd),
                             ParamSpec::matrix(name("down_proj.weight"), Shape{d, f}, sd)};
    if (cfg_.mlp_bias) {
      p.push_back(ParamSpec::bias(name("gate_proj.bias"), f));
      p.push_back(ParamSpec::bias(name("up_proj.bias"), f));
      p.push_back(ParamSpec::bias(name("down_proj.bias"), d));
    }
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p(name("gate_proj.weight")),        p(name("up_proj.weight")),        p(name("down_proj.weight")),
            p.optional(name("gate_proj.bias")), p.optional(name("up_proj.bias")), p.optional(name("down_proj.bias"))};
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }

  /// The activations run() keeps for backprop() (and, with_backward, backprop()'s own buffers).
  template <class B>
  struct Acts {
    View<typename B::Act> g, u, m;
    View<typename B::Act> dm, dg, du;  // with_backward only
    bool kept = false;  // g and u were kept from the forward (backprop() makes m from them)
  };
  /// `kept`: where g and u are kept from forward to backward (CarvedOp), for `kept_tokens`
  /// tokens (0: the chunk's; a block keeps a whole chunk's and runs token blocks of c); none:
  /// the scratch arena.
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward, Arena* kept = nullptr, std::int64_t kept_tokens = 0) const {
    using A = typename B::Act;
    const std::int64_t M = c.tokens(), f = cfg_.intermediate_size;
    Arena& k = kept ? *kept : ar;
    const std::int64_t K = kept && kept_tokens > 0 ? kept_tokens : M;
    Acts<B> a;
    a.g = k.alloc<A>({K, f});
    a.u = k.alloc<A>({K, f});
    a.kept = kept != nullptr;
    a.m = ar.alloc<A>({M, f});
    if (with_backward) {
      a.dm = ar.alloc<A>({M, f});
      a.dg = ar.alloc<A>({M, f});
      a.du = ar.alloc<A>({M, f});
    }
    return a;
  }

  /// y = down(silu(gate(x)) * up(x)) (y is overwritten); keeps what backprop() needs in a.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
           const Acts<B>& a, View<typename B::Act> y) const {
    run_gated(be, c, w, x, a);
    be.linear(cview(a.m), w.down, w.down_bias, y);
  }

  /// run() up to the gated product a.m, without the down projection.
  template <class B>
  void run_gated(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                 const Acts<B>& a) const {
    run_kept(be, c, w, x, a);
    be.swiglu(cview(a.g), cview(a.u), a.m, cfg_.hidden_act);
  }

  /// What backprop() needs of the forward: the gate and up projections a.g and a.u of x
  /// (backprop() makes m from them).
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size, "MLP: input {} is not [{} tokens, {}]",
             x.shape().str(), c.tokens(), cfg_.hidden_size);
    be.linear(x, w.gate, w.gate_bias, a.g);
    be.linear(x, w.up, w.up_bias, a.u);
  }

  /// After run(), run_gated() or run_kept() on the same x: dx = dL/dx (overwritten) from dy, weight
  /// gradients added to g. The down projection's input gradient first, then one pass makes the
  /// gate's and up's gradients and m (the forward's bits, for the down projection's weight
  /// gradient: m is not read, so a kept or recomputed MLP needs no pass of its own for it).
  template <class B>
  void backprop(B& be, ChunkShape, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a, View<const typename B::Act> dy, View<typename B::Act> dx,
                const Weights<typename B::Acc>& g) const {
    be.linear_backward(cview(a.m), w.down, dy, a.dm, false, View<typename B::Acc>{}, View<typename B::Acc>{});
    be.swiglu_backward(cview(a.g), cview(a.u), cview(a.dm), a.dg, a.du, cfg_.hidden_act, a.m);
    be.linear_backward(cview(a.m), w.down, dy, View<typename B::Act>{}, false, g.down, g.down_bias);
    be.linear_backward(x, w.gate, cview(a.dg), dx, false, g.gate, g.gate_bias);
    be.linear_backward(x, w.up, cview(a.du), dx, true, g.up, g.up_bias);
  }

  // ---- as a block's channel mixer (channel_mixer.hpp), a token block at a time ----------------

  /// The channel mixer of the dense layers.
  static bool builds(const ModelConfig& cfg, std::int64_t layer) {
    return cfg.layer_kind(layer).channel_mixer == ChannelMixerKind::dense_mlp;
  }
  static constexpr bool kHasOutput = true;  // (mix_out: its output alone, for a block's output norm)
  /// The activations of token blocks of c.block_tokens() tokens; g and u kept for the whole
  /// chunk in `kept` where given.
  template <class B>
  Acts<B> carve_block(Arena& ar, ChunkShape c, bool with_backward, Arena* kept) const {
    return carve<B>(ar, ChunkShape{1, c.block_tokens()}, with_backward, kept, c.tokens());
  }
  /// The activations of the token block [t0, t0 + n): its rows of the block's buffers (kept: g
  /// and u span the chunk, their rows from t0).
  template <class B>
  Acts<B> block_rows(const Acts<B>& a, std::int64_t t0, std::int64_t n) const {
    auto m = a;
    for (auto* v : {&m.m, &m.dm, &m.dg, &m.du})
      if (!v->is_null()) *v = token_rows(*v, 0, n);
    for (auto* v : {&m.g, &m.u})
      if (!v->is_null()) *v = token_rows(*v, a.kept ? t0 : 0, n);
    return m;
  }
  /// y = h + down(act(gate(x)) * up(x)) for a token block.
  template <class B>
  void mix_add(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               View<const typename B::Res> h, View<typename B::Res> y, const RouterStats&) const {
    run_gated(be, ChunkShape{1, x.size(0)}, w, x, a);
    be.linear_add(cview(a.m), w.down, w.down_bias, h, y);
  }
  /// f = down(act(gate(x)) * up(x)) for a token block.
  template <class B>
  void mix_out(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               View<typename B::Act> f) const {
    run_gated(be, ChunkShape{1, x.size(0)}, w, x, a);
    be.linear(cview(a.m), w.down, w.down_bias, f);
  }
  /// dx (overwritten) from df, the gradient of the token block's output; weight gradients added
  /// to g. `recompute`: g and u made again from x first (neither kept nor made by mix_out()).
  template <class B>
  void mix_backward(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
                    View<const typename B::Act> df, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                    const RouterStats&, bool recompute) const {
    const ChunkShape c{1, x.size(0)};
    if (recompute) run_kept(be, c, w, x, a);
    backprop(be, c, w, x, a, df, dx, g);
  }

 private:
  std::string name(const char* suffix) const { return prefix_ + suffix; }

  ModelConfig cfg_;
  std::string prefix_;
};

}  // namespace megatrain
