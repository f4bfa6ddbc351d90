// The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral, OLMoE and GPT-OSS, as transformers
// computes it:
//
//     p       = softmax(router(x))                     in fp32, over the experts
//     S, w    = the top-k of p (and w / sum(w) where the family renormalises them)
//     y       = h + sum over j in S of  w_j * down_j(act(gate_j(x)) * up_j(x))
//               (+ sigmoid(shared_expert_gate(x)) * shared_expert(x) where the family has one)
//
// Dropless: every token goes to its k experts (none dropped, no capacity). The assignments are
// grouped by expert (stable: token order within an expert), each expert's projections run on its
// rows (Backend::grouped_linear), and the weighted outputs are summed per token in the order of
// the token's choices. The backward runs through the experts, through the routing weights
// (dw_j = <dy, expert_j's output>), the renormalisation and the softmax, and the router.
//
// Parameters, as the checkpoints on the Hub name them (transformers reads and writes these):
//   Qwen3-MoE, OLMoE: mlp.gate.weight [E, hidden], mlp.experts.<e>.{gate,up,down}_proj.weight
//   Mixtral:          block_sparse_moe.gate.weight, block_sparse_moe.experts.<e>.{w1,w3,w2}.weight
//   GPT-OSS:          mlp.router.{weight,bias}, mlp.experts.<e>.{gate,up,down}_proj.{weight,bias}
// in slab order router, every expert's gate, every expert's up, every expert's down (so that
// each kind is one contiguous stack), then GPT-OSS's biases likewise. GPT-OSS's checkpoints stack
// and fuse its experts (experts.gate_up_proj [E, hidden, 2 inter], gate and up interleaved;
// experts.down_proj [E, inter, hidden]; their biases): io::fused_tensors maps them onto these.
// Qwen3-Next, Qwen3.5-MoE: a shared expert (mlp.shared_expert.{gate,up,down}_proj.weight, a SwiGLU
// MLP of MoeConfig::shared_expert_size) every token passes through, its output scaled per token by
// sigmoid(mlp.shared_expert_gate.weight [1, hidden] . x) and added to the routed experts' sum.
// GPT-OSS: the router's logits have a bias, its top-k weights are the softmax of the top-k
// logits (the renormalised top-k of the softmax), each expert's projections a bias, and its
// activation is the clamped SwiGLU (ModelConfig::expert_act).
//
// No norm and no residual of its own: a block runs it as the channel mixer of the layers
// ModelConfig::is_moe_layer names (ComposedBlock), in place of the dense MLP. Its activations depend on the routing, so they are
// never kept: the backward recomputes them from the block's h.
//
// The auxiliary load-balancing loss (output_router_logits): a training step's forward adds each
// layer's assignments per expert and summed probabilities to the trainer's RouterStats
// (Backend::moe_record); the loss of a forward is moe_aux_loss() of those over all sparse layers,
// and its gradient, the same at every token of a layer (moe_aux_scale() x the counts), joins the
// routing weights' in moe_route_backward before the softmax's backward. Where RouterStats::valid
// flags the tokens that count (transformers' attention mask: padding does not), the statistics,
// the loss and its gradient are those tokens' alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/layers/param_binder.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/model/family.hpp"
#include "megatrain/model/param_spec.hpp"

namespace megatrain {

/// What a backend provides to run MoeMlp (the CPU and CUDA backends; cpu_backend.hpp states the
/// contracts).
template <class B>
concept MoeBackend = requires(B& be, View<const typename B::Act> x, View<typename B::Act> y,
                              View<typename B::Acc> acc, View<const typename B::Acc> cacc, View<std::int32_t> i32,
                              View<const std::int32_t> ci32, View<std::int64_t> i64, View<const std::int64_t> ci64,
                              std::span<const View<const typename B::Weight>> ws, std::span<const View<typename B::Acc>> gs,
                              View<const typename B::Res> r, View<typename B::Res> ry) {
  be.moe_route(x, std::int64_t{}, bool{}, acc, i32, acc, i32, i32, i64);
  be.moe_gather(x, ci32, std::int64_t{}, y);
  be.grouped_linear(x, ws, ci64, y, ws);                      // (then the experts' biases, if any)
  be.grouped_linear_backward(x, ws, x, y, bool{}, gs, ci64, gs);
  be.moe_combine(x, ci32, cacc, std::int64_t{}, r, ry);
  be.moe_combine_backward(x, x, ci32, cacc, std::int64_t{}, y, acc);
  be.moe_route_backward(cacc, ci32, cacc, cacc, std::int64_t{}, bool{}, ci64, double{}, View<const std::uint8_t>{}, y);
  be.moe_record(cacc, ci32, ci64, View<const std::uint8_t>{}, i64, View<double>{});
  be.moe_scatter_add(x, ci32, std::int64_t{}, y);
};

/// What a backend provides for a shared expert's gate: sigmoid_gate with one gate per row, which
/// it says it takes (kSigmoidGatePerGroup: a gate per group of features, not only per element).
template <class B>
concept SharedExpertBackend = requires(B& be, View<const typename B::Act> c, View<typename B::Act> m) {
  be.sigmoid_gate(c, c, m);
  be.sigmoid_gate_backward(c, c, c, m, m);
  requires B::kSigmoidGatePerGroup;
};

class MoeMlp {
 public:
  /// Layer `layer`'s experts and router (the layer must be one of ModelConfig::is_moe_layer's).
  MoeMlp(const ModelConfig& cfg, std::int64_t layer)
      : cfg_(cfg),
        prefix_("model.layers." + std::to_string(layer) + "." + std::string(cfg.moe_module()) + "."),
        layer_(layer),
        experts_(cfg.moe.num_experts),
        k_(cfg.moe.experts_per_token),
        inter_(cfg.moe.intermediate_size),
        biases_(cfg.moe.biases),
        shared_(cfg.moe.shared_expert_size) {
    MT_CHECK(cfg.is_moe_layer(layer), "layer {} of this {} model is a dense layer, not a mixture of experts", layer,
             cfg.architecture_name());
  }

  template <class E>
  struct Weights {
    View<E> router, router_bias;                          // (the bias: GPT-OSS's, else null)
    std::vector<View<E>> gate, up, down;                  // one per expert
    std::vector<View<E>> gate_bias, up_bias, down_bias;   // GPT-OSS: one per expert; else empty
    View<E> shared_gate, shared_up, shared_down, shared_expert_gate;  // the shared expert's, else null
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size;
    const auto sd = static_cast<float>(cfg_.initializer_range);
    std::vector<ParamSpec> p{ParamSpec::matrix(router_name("weight"), Shape{experts_, d}, sd)};
    p.reserve(static_cast<std::size_t>(2 + 6 * experts_));
    if (biases_) {  // (transformers initialises the router's bias like its weight)
      ParamSpec b = ParamSpec::bias(router_name("bias"), experts_);
      b.init = ParamInit::normal;
      b.init_std = sd;
      p.push_back(std::move(b));
    }
    for (int part = 0; part < 3; ++part)
      for (std::int64_t e = 0; e < experts_; ++e)
        p.push_back(ParamSpec::matrix(expert_name(e, part), part == 2 ? Shape{d, inter_} : Shape{inter_, d}, sd));
    if (biases_)
      for (int part = 0; part < 3; ++part)
        for (std::int64_t e = 0; e < experts_; ++e)
          p.push_back(ParamSpec::bias(expert_name(e, part, "bias"), part == 2 ? d : inter_));
    if (shared_ > 0) {
      for (int part = 0; part < 3; ++part)
        p.push_back(ParamSpec::matrix(shared_name(part), part == 2 ? Shape{d, shared_} : Shape{shared_, d}, sd));
      p.push_back(ParamSpec::matrix(prefix_ + "shared_expert_gate.weight", Shape{1, d}, sd));
    }
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    Weights<E> w;
    w.router = p(router_name("weight"));
    if (biases_) w.router_bias = p(router_name("bias"));
    for (auto* v : {&w.gate, &w.up, &w.down}) v->reserve(static_cast<std::size_t>(experts_));
    for (std::int64_t e = 0; e < experts_; ++e) {
      w.gate.push_back(p(expert_name(e, 0)));
      w.up.push_back(p(expert_name(e, 1)));
      w.down.push_back(p(expert_name(e, 2)));
      if (!biases_) continue;
      w.gate_bias.push_back(p(expert_name(e, 0, "bias")));
      w.up_bias.push_back(p(expert_name(e, 1, "bias")));
      w.down_bias.push_back(p(expert_name(e, 2, "bias")));
    }
    if (shared_ > 0) {
      w.shared_gate = p(shared_name(0));
      w.shared_up = p(shared_name(1));
      w.shared_down = p(shared_name(2));
      w.shared_expert_gate = p(prefix_ + "shared_expert_gate.weight");
    }
    return w;
  }

  /// The activations of `T` tokens: the routing, and the experts' rows (T * k of them, grouped
  /// by expert), with backward buffers when asked.
  template <class B>
  struct Acts {
    using A = typename B::Act;
    using C = typename B::Acc;
    View<A> logits;                      // [T, E] the router's output
    View<C> probs, weights;              // [T, E] softmax; [T, k] the chosen experts' weights
    View<std::int32_t> experts;          // [T, k] the chosen experts, in top-k order
    View<std::int32_t> order, slot;      // [T * k]: row -> assignment (t * k + j), and back
    View<std::int64_t> offsets;          // [E + 1]: expert e's rows are [offsets[e], offsets[e + 1])
    View<A> xs, g, u, m, out;            // [T * k, hidden | inter]: the rows each expert reads and writes
    View<A> dout, dm, dg, du, dxs, dlogits;  // backward only
    View<C> dweights;                    // backward only: [T, k]
    // the shared expert's (null without one): [T, shared] gate, up, product; [T, hidden] its
    // output and that output gated; [T, 1] its gate's logit; and their gradients
    View<A> sg, su, sm, sout, sgated, sgate;
    View<A> dsout, dsm, dsg, dsu, dsgate;
  };

  template <class B>
  Acts<B> carve(Arena& ar, std::int64_t T, bool with_backward) const {
    using A = typename B::Act;
    using C = typename B::Acc;
    const std::int64_t d = cfg_.hidden_size, N = T * k_;
    Acts<B> a;
    a.logits = ar.alloc<A>({T, experts_});
    a.probs = ar.alloc<C>({T, experts_});
    a.weights = ar.alloc<C>({T, k_});
    a.experts = ar.alloc<std::int32_t>({T, k_});
    a.order = ar.alloc<std::int32_t>({N});
    a.slot = ar.alloc<std::int32_t>({N});
    a.offsets = ar.alloc<std::int64_t>({experts_ + 1});
    a.xs = ar.alloc<A>({N, d});
    a.g = ar.alloc<A>({N, inter_});
    a.u = ar.alloc<A>({N, inter_});
    a.m = ar.alloc<A>({N, inter_});
    a.out = ar.alloc<A>({N, d});
    if (with_backward) {
      a.dout = ar.alloc<A>({N, d});
      a.dm = ar.alloc<A>({N, inter_});
      a.dg = ar.alloc<A>({N, inter_});
      a.du = ar.alloc<A>({N, inter_});
      a.dxs = ar.alloc<A>({N, d});
      a.dlogits = ar.alloc<A>({T, experts_});
      a.dweights = ar.alloc<C>({T, k_});
    }
    if (shared_ > 0) {
      for (auto* v : {&a.sg, &a.su, &a.sm}) *v = ar.alloc<A>({T, shared_});
      a.sout = ar.alloc<A>({T, d});
      a.sgated = ar.alloc<A>({T, d});
      a.sgate = ar.alloc<A>({T, 1});
      if (with_backward) {
        a.dsout = ar.alloc<A>({T, d});
        for (auto* v : {&a.dsm, &a.dsg, &a.dsu}) *v = ar.alloc<A>({T, shared_});
        a.dsgate = ar.alloc<A>({T, 1});
      }
    }
    return a;
  }

  /// The views of a for its first n tokens (a carved for a token block of at least n).
  template <class B>
  Acts<B> carve_rows(const Acts<B>& a, std::int64_t n) const {
    Acts<B> r = a;
    const auto rows = [](auto& v, std::int64_t count) {
      if (!v.is_null()) v = token_rows(v, 0, count);
    };
    for (auto* v : {&r.logits, &r.dlogits}) rows(*v, n);
    for (auto* v : {&r.probs, &r.weights, &r.dweights}) rows(*v, n);
    rows(r.experts, n);
    for (auto* v : {&r.order, &r.slot}) rows(*v, n * k_);
    for (auto* v : {&r.xs, &r.g, &r.u, &r.m, &r.out, &r.dout, &r.dm, &r.dg, &r.du, &r.dxs}) rows(*v, n * k_);
    for (auto* v : {&r.sg, &r.su, &r.sm, &r.sout, &r.sgated, &r.sgate, &r.dsout, &r.dsm, &r.dsg, &r.dsu, &r.dsgate})
      rows(*v, n);
    return r;
  }

  /// Routing and the experts' outputs for the tokens x ([T, hidden]), kept in a (what backprop()
  /// reads), without summing them into the residual stream.
  template <class B>
  void run_kept(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a) const {
    be.linear(x, w.router, w.router_bias, a.logits);
    be.moe_route(cv(a.logits), k_, cfg_.moe.norm_topk_prob, a.probs, a.experts, a.weights, a.order, a.slot, a.offsets);
    be.moe_gather(x, cv(a.order), k_, a.xs);
    be.grouped_linear(cv(a.xs), cspan(w.gate), cv(a.offsets), a.g, cspan(w.gate_bias));
    be.grouped_linear(cv(a.xs), cspan(w.up), cv(a.offsets), a.u, cspan(w.up_bias));
    be.swiglu(cv(a.g), cv(a.u), a.m, cfg_.expert_act());
    be.grouped_linear(cv(a.m), cspan(w.down), cv(a.offsets), a.out, cspan(w.down_bias));
    if (shared_ > 0) {
      if constexpr (SharedExpertBackend<B>) {
        be.linear(x, w.shared_gate, {}, a.sg);
        be.linear(x, w.shared_up, {}, a.su);
        be.swiglu(cv(a.sg), cv(a.su), a.sm, cfg_.hidden_act);
        be.linear(cv(a.sm), w.shared_down, {}, a.sout);
        be.linear(x, w.shared_expert_gate, {}, a.sgate);
        be.sigmoid_gate(cv(a.sout), cv(a.sgate), a.sgated);
      } else {
        refuse_shared_expert(cfg_, layer_);
      }
    }
  }

  /// y = h + the weighted sum of the token's experts' outputs; the routing added to `stats`
  /// where its counts are given (a forward the trainer records: not a recompute).
  template <class B>
  void run(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
           View<const typename B::Res> h, View<typename B::Res> y, const RouterStats& stats = {}) const {
    run_kept(be, w, x, a);
    if (!stats.counts.is_null())
      be.moe_record(cv(a.probs), cv(a.experts), cv(a.offsets), stats.valid, stats.counts, stats.probs);
    be.moe_combine(cv(a.out), cv(a.slot), cv(a.weights), k_, h, y);
    if (shared_ > 0) be.residual_add(cv(y), cv(a.sgated), y);  // (the routed sum, then the shared expert's)
  }

  /// After run_kept() on the same x: dx (overwritten) from dy, the gradient of the MoE's output;
  /// the router's and the experts' gradients added to g; with `stats.aux_counts`, the gradient
  /// of the auxiliary load-balancing loss too.
  template <class B>
  void backprop(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                const RouterStats& stats = {}) const {
    be.moe_combine_backward(dy, cv(a.out), cv(a.slot), cv(a.weights), k_, a.dout, a.dweights);
    be.grouped_linear_backward(cv(a.m), cspan(w.down), cv(a.dout), a.dm, false, span(g.down), cv(a.offsets),
                               span(g.down_bias));
    be.swiglu_backward(cv(a.g), cv(a.u), cv(a.dm), a.dg, a.du, cfg_.expert_act());
    be.grouped_linear_backward(cv(a.xs), cspan(w.gate), cv(a.dg), a.dxs, false, span(g.gate), cv(a.offsets),
                               span(g.gate_bias));
    be.grouped_linear_backward(cv(a.xs), cspan(w.up), cv(a.du), a.dxs, true, span(g.up), cv(a.offsets), span(g.up_bias));
    be.moe_route_backward(cv(a.probs), cv(a.experts), cv(a.weights), cv(a.dweights), k_, cfg_.moe.norm_topk_prob,
                          stats.aux_counts, stats.aux_scale, stats.valid, a.dlogits);
    be.linear_backward(x, w.router, cv(a.dlogits), dx, false, g.router, g.router_bias);
    be.moe_scatter_add(cv(a.dxs), cv(a.slot), k_, dx);
    if (shared_ > 0) {
      if constexpr (SharedExpertBackend<B>) {
        be.sigmoid_gate_backward(cv(a.sout), cv(a.sgate), dy, a.dsout, a.dsgate);
        be.linear_backward(x, w.shared_expert_gate, cv(a.dsgate), dx, true, g.shared_expert_gate, {});
        be.linear_backward(cv(a.sm), w.shared_down, cv(a.dsout), a.dsm, false, g.shared_down, {});
        be.swiglu_backward(cv(a.sg), cv(a.su), cv(a.dsm), a.dsg, a.dsu, cfg_.hidden_act);
        be.linear_backward(x, w.shared_gate, cv(a.dsg), dx, true, g.shared_gate, {});
        be.linear_backward(x, w.shared_up, cv(a.dsu), dx, true, g.shared_up, {});
      } else {
        refuse_shared_expert(cfg_, layer_);
      }
    }
  }

  // ---- as a block's channel mixer (channel_mixer.hpp), a token block at a time ----------------

  /// The channel mixer of the sparse layers.
  static bool builds(const ModelConfig& cfg, std::int64_t layer) {
    return cfg.layer_kind(layer).channel_mixer == ChannelMixerKind::experts;
  }
  static constexpr bool kHasOutput = false;  // (its output is summed into the residual stream as it is made)
  /// The activations of token blocks of c.block_tokens() tokens (never kept: they depend on the
  /// routing; the backward recomputes them).
  template <class B>
  Acts<B> carve_block(Arena& ar, ChunkShape c, bool with_backward, Arena*) const {
    return carve<B>(ar, c.block_tokens(), with_backward);
  }
  /// The activations of a token block of n tokens (the first rows of the block's buffers).
  template <class B>
  Acts<B> block_rows(const Acts<B>& a, std::int64_t, std::int64_t n) const {
    return carve_rows<B>(a, n);
  }
  /// y = h + the token block's experts' outputs; the routing added to `stats` (run()).
  template <class B>
  void mix_add(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               View<const typename B::Res> h, View<typename B::Res> y, const RouterStats& stats) const {
    if constexpr (MoeBackend<B>) run(be, w, x, a, h, y, stats);
    else refuse_backend(cfg_, layer_);
  }
  template <class B>
  void mix_out(B&, const Weights<const typename B::Weight>&, View<const typename B::Act>, const Acts<B>&,
               View<typename B::Act>) const {
    MT_FAIL("{}'s layer {}: a mixture of experts has no output of its own before the residual stream (no block norms "
            "it)", cfg_.architecture_name(), layer_);
  }
  /// dx (overwritten) from df, the gradient of the token block's output; the routing and the
  /// experts' activations always recomputed from x first (never kept).
  template <class B>
  void mix_backward(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
                    View<const typename B::Act> df, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                    const RouterStats& stats, bool) const {
    if constexpr (MoeBackend<B>) {
      run_kept(be, w, x, a);
      backprop(be, w, x, a, df, dx, g, stats);
    } else {
      refuse_backend(cfg_, layer_);
    }
  }

  std::int64_t layer() const { return layer_; }
  std::int64_t experts() const { return experts_; }

  /// Refuses `cfg`'s mixture-of-experts layer `layer` on a backend without MoeBackend's primitives.
  [[noreturn]] static void refuse_backend(const ModelConfig& cfg, std::int64_t layer) {
    MT_FAIL("{}'s mixture-of-experts layers (layer {} is one) need a backend with the experts' routing and grouped "
            "products (MoeBackend: the CPU and CUDA backends have them); this one has not", cfg.architecture_name(), layer);
  }
  std::int64_t experts_per_token() const { return k_; }

  /// Refuses `cfg`'s shared expert (layer `layer`'s) on a backend without SharedExpertBackend's gate.
  [[noreturn]] static void refuse_shared_expert(const ModelConfig& cfg, std::int64_t layer) {
    MT_FAIL("{}'s mixture-of-experts layers (layer {} is one) have a shared expert with a sigmoid gate per token: that "
            "needs a backend with SharedExpertBackend's gate (the CPU and CUDA backends)", cfg.architecture_name(), layer);
  }

 private:
  /// part 0: gate, 1: up, 2: down, under the family's names.
  std::string expert_name(std::int64_t e, int part, const char* what = "weight") const {
    const char* projection = cfg_.block().expert_projections[static_cast<std::size_t>(part)];
    return prefix_ + "experts." + std::to_string(e) + "." + projection + "." + what;
  }
  /// The shared expert's projections (part 0: gate, 1: up, 2: down).
  std::string shared_name(int part) const {
    static constexpr const char* kNames[] = {"gate_proj", "up_proj", "down_proj"};
    return prefix_ + "shared_expert." + kNames[part] + ".weight";
  }
  /// The router's parameter: mlp.gate.<what> (the family's names: GPT-OSS's mlp.router.<what>).
  std::string router_name(const char* what) const {
    return prefix_ + cfg_.block().router + "." + what;
  }
  template <class E>
  static View<const E> cv(View<E> v) {
    return v;
  }
  template <class E>
  static std::span<const View<const E>> cspan(const std::vector<View<E>>& v)
    requires std::is_const_v<E>
  {
    return {v.data(), v.size()};
  }
  template <class E>
  static std::span<const View<E>> span(const std::vector<View<E>>& v) {
    return {v.data(), v.size()};
  }

  ModelConfig cfg_;
  std::string prefix_;
  std::int64_t layer_, experts_, k_, inter_;
  bool biases_;  // GPT-OSS: the router and every expert projection have a bias
  std::int64_t shared_;  // the shared expert's intermediate size; 0: none
};

/// The auxiliary load-balancing loss as transformers' load_balancing_loss_func computes it over
/// one forward of `tokens` tokens (those its attention mask keeps: every token without one; the
/// statistics then counted those alone, RouterStats::valid), from the recorded statistics
/// of its `layers` sparse layers (RouterStats, [layers, E] each): with C_e the assignments to
/// expert e and P_e its probabilities summed over the layers and tokens, and R = layers x tokens
/// rows, E x sum_e (C_e / R) (P_e / R).
inline double moe_aux_loss(std::span<const std::int64_t> counts, std::span<const double> probs, std::int64_t layers,
                           std::int64_t experts, std::int64_t tokens) {
  const double rows = static_cast<double>(layers) * static_cast<double>(tokens);
  if (rows == 0) return 0.0;  // (no token counts: transformers would divide by zero; nothing to balance)
  double s = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    std::int64_t c = 0;
    double p = 0;
    for (std::int64_t l = 0; l < layers; ++l) {
      c += counts[static_cast<std::size_t>(l * experts + e)];
      p += probs[static_cast<std::size_t>(l * experts + e)];
    }
    s += static_cast<double>(c) / rows * (p / rows);
  }
  return static_cast<double>(experts) * s;
}
/// RouterStats::aux_scale for `weight` x router_aux_loss_coef x that loss in the step's objective:
/// its gradient at a token's probability of expert e is weight x coef x E x C_e / R^2.
inline double moe_aux_scale(double coef, double weight, std::int64_t layers, std::int64_t experts, std::int64_t tokens) {
  const double rows = static_cast<double>(layers) * static_cast<double>(tokens);
  if (rows == 0) return 0.0;
  return weight * coef * static_cast<double>(experts) / (rows * rows);
}

}  // namespace megatrain
