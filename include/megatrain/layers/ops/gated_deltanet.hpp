// Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's linear_attention layers, as
// an op of its own (parameters model.layers.<layer>.linear_attn.*):
//
//     q|k|v = in_proj_qkv(x),  z = in_proj_z(x),  b = in_proj_b(x),  a = in_proj_a(x)
//     y     = out_proj(mix(q|k|v, z, a, b))
//
// where mix is the causal convolution with SiLU, the L2-normalised q and k, the decay and beta
// gates, the gated delta rule and the gated RMSNorm (backend/cpu/gated_deltanet_mix.hpp states
// each). Qwen3-Next stores the projections fused: in_proj_qkvz holds, for each key head, its q,
// k, and its value heads' v and z rows; in_proj_ba, for each key head, its value heads' b then a
// rows. The op multiplies by the fused weights as they are stored and gathers their outputs into
// the layout above (and scatters the gradients back), so a checkpoint loads and exports unchanged.
//
// The mixing runs on backends with LinearAttentionBackend's primitives: the CPU backend (the
// reference, HostLinearAttentionBackend) and the CUDA backend (DeviceLinearAttentionBackend: its
// own kernels, backend/cuda/gated_deltanet.hpp, which also gather the fused projections);
// elsewhere every phase refuses, naming the layer. No norm and no residual: a block adds them
// around it (ComposedBlock). Besides the phases of a block's token mixer (mixers.hpp),
// run(), run_kept() and backprop() make it a LayerOp of its own (CarvedOp).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/backend/cpu/gated_deltanet_mix.hpp"
#include "megatrain/backend/linear_attention.hpp"
#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

/// What a backend provides to run GatedDeltaNet's mixing: the CPU reference's, over host memory
/// of one element type (the CPU backend).
template <class B>
concept HostLinearAttentionBackend =
    !B::kDevice && std::same_as<typename B::Act, typename B::Weight> && std::same_as<typename B::Act, typename B::Acc> &&
    requires(B& be, const cpu::GatedDeltaNetMix<typename B::Act>& m, typename B::Act* p,
             const cpu::GatedDeltaNetMixGrads<typename B::Act>& g) {
      be.gated_deltanet_mix(m, p, p, p);
      be.gated_deltanet_mix_backward(m, p, p, p, g);
    };
/// ... or a device's, over views in its memory (the CUDA backend).
template <class B>
concept DeviceLinearAttentionBackend =
    B::kDevice && requires(B& be, const DeltaNetOperands<typename B::Act, typename B::Weight, full_t<typename B::Weight>>& m,
                           View<typename B::Act> x, View<const typename B::Act> cx, View<typename B::Acc> r,
                           View<const typename B::Acc> cr, const DeltaNetGradients<typename B::Act, typename B::Acc>& g) {
      be.gated_deltanet_mix(m, x, r, x);
      be.gated_deltanet_mix_backward(m, cx, cr, cx, g);
      be.deltanet_unfuse(m.shape, cx, cx, x, x, x, x);
      be.deltanet_fuse(m.shape, cx, cx, cx, cx, x, x);
    };
template <class B>
concept LinearAttentionBackend = HostLinearAttentionBackend<B> || DeviceLinearAttentionBackend<B>;
/// What a backend provides to decode with a cache (ChunkShape::decode): the CPU backend's step
/// over host memory, or a device's over views (the CUDA backend).
template <class B>
concept HostLinearAttentionDecodeBackend =
    HostLinearAttentionBackend<B> && requires(B& be, const cpu::GatedDeltaNetMix<typename B::Act>& m, const DecodeRows& d,
                                              typename B::Act* p) { be.gated_deltanet_decode(m, d, p, p, p); };
template <class B>
concept DeviceLinearAttentionDecodeBackend =
    DeviceLinearAttentionBackend<B> &&
    requires(B& be, const DeltaNetOperands<typename B::Act, typename B::Weight, full_t<typename B::Weight>>& m,
             const DecodeRows& d, View<typename B::Act> x, View<typename B::Acc> s) { be.gated_deltanet_decode(m, d, x, s, x); };
template <class B>
concept LinearAttentionDecodeBackend = HostLinearAttentionDecodeBackend<B> || DeviceLinearAttentionDecodeBackend<B>;

class GatedDeltaNet : public CarvedOp<GatedDeltaNet> {
 public:
  /// Layer `layer`'s linear attention, shaped by cfg.linear_attention; `fused`: Qwen3-Next's
  /// in_proj_qkvz and in_proj_ba (else Qwen3.5's four projections).
  GatedDeltaNet(const ModelConfig& cfg, std::int64_t layer)
      : la_(cfg.linear_attention), shape_(delta_net_shape(cfg)), d_(cfg.hidden_size), eps_(cfg.rms_norm_eps),
        std_(static_cast<float>(cfg.initializer_range)), layer_(layer),
        prefix_("model.layers." + std::to_string(layer) + ".linear_attn.") {
    la_.check("linear attention");
    MT_CHECK(d_ > 0 && layer >= 0 && layer < cfg.num_hidden_layers, "Gated DeltaNet: layer {} of {}, hidden size {}", layer,
             cfg.num_hidden_layers, d_);
  }

  static constexpr bool kResidualIO = false;  // (CarvedOp: x and y are activations)

  /// The layers of linear_attention type (config.json's layer_types).
  static bool builds(const ModelConfig& cfg, std::int64_t layer) {
    return cfg.layer_kind(layer).token_mixer == TokenMixerKind::linear_attention;
  }

  template <class E>
  struct Weights {
    View<E> qkv, z, b, a;  // Qwen3.5's; fused: qkv is in_proj_qkvz, b is in_proj_ba (z and a null)
    View<E> conv, out;
    View<full_t<E>> A_log, dt_bias, norm;
  };

  std::vector<ParamSpec> params() const {
    const std::int64_t cd = la_.conv_dim(), vd = la_.value_dim(), hv = la_.value_heads;
    std::vector<ParamSpec> p;
    if (la_.fused) {
      p.push_back(ParamSpec::matrix(name("in_proj_qkvz.weight"), Shape{cd + vd, d_}, std_));
      p.push_back(ParamSpec::matrix(name("in_proj_ba.weight"), Shape{2 * hv, d_}, std_));
    } else {
      p.push_back(ParamSpec::matrix(name("in_proj_qkv.weight"), Shape{cd, d_}, std_));
      p.push_back(ParamSpec::matrix(name("in_proj_z.weight"), Shape{vd, d_}, std_));
      p.push_back(ParamSpec::matrix(name("in_proj_b.weight"), Shape{hv, d_}, std_));
      p.push_back(ParamSpec::matrix(name("in_proj_a.weight"), Shape{hv, d_}, std_));
    }
    p.push_back(ParamSpec::matrix(name("conv1d.weight"), Shape{cd, 1, la_.conv_kernel}, std_));
    // A_log decayed and dt_bias not, as transformers' Trainer names them (a "bias" is not decayed)
    p.push_back({name("A_log"), Shape{hv}, ParamInit::a_log, 0.0f, true, true});
    p.push_back({name("dt_bias"), Shape{hv}, ParamInit::ones, 0.0f, false, true});
    p.push_back(ParamSpec::norm(name("norm.weight"), la_.value_head_dim));
    p.push_back(ParamSpec::matrix(name("out_proj.weight"), Shape{d_, vd}, std_));
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    Weights<E> w;
    if (la_.fused) {
      w.qkv = p(name("in_proj_qkvz.weight"));
      w.b = p(name("in_proj_ba.weight"));
    } else {
      w.qkv = p(name("in_proj_qkv.weight"));
      w.z = p(name("in_proj_z.weight"));
      w.b = p(name("in_proj_b.weight"));
      w.a = p(name("in_proj_a.weight"));
    }
    w.conv = p(name("conv1d.weight"));
    w.out = p(name("out_proj.weight"));
    w.A_log = p.full(name("A_log"));
    w.dt_bias = p.full(name("dt_bias"));
    w.norm = p.full(name("norm.weight"));
    return w;
  }

  std::int64_t hidden_size() const { return d_; }

  /// Refuses linear-attention layer `layer` on a backend without LinearAttentionBackend's primitives.
  [[noreturn]] static void refuse_backend(std::int64_t layer) {
    MT_FAIL("layer {} is a linear-attention layer (Gated DeltaNet): this backend does not run it (--backend cpu or cuda)",
            layer);
  }
  /// Throws, before anything is allocated, where backend B cannot run cfg's linear-attention layers.
  template <class B>
  static void check_backend(const ModelConfig& cfg) {
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      if (!builds(cfg, l)) continue;
      if constexpr (!LinearAttentionBackend<B>) refuse_backend(l);
      if constexpr (DeviceLinearAttentionBackend<B>) {
        const auto& la = cfg.linear_attention;
        MT_CHECK(la.key_head_dim <= kDeltaRuleMaxKeyDim && la.conv_kernel <= kDeltaNetMaxTaps,
                 "layer {}: linear_key_head_dim {} (at most {}) or linear_conv_kernel_dim {} (at most {}) is beyond the GPU "
                 "kernels; train this model with --backend cpu", l, la.key_head_dim, kDeltaRuleMaxKeyDim, la.conv_kernel,
                 kDeltaNetMaxTaps);
      }
    }
  }

  template <class B>
  struct Acts {
    View<typename B::Act> mixed, z, b, a;  // the projections, the layout of the top comment
    View<typename B::Act> o, y;            // the delta rule's output, the gated norm's (out_proj's input)
    View<typename B::Acc> rstd;            // the gated norm's, each token's value heads
    View<typename B::Act> fused_qkvz, fused_ba;  // fused only: a token block's projections as stored
    View<typename B::Act> dmixed, dz, db, da, dy;  // with_backward only
  };
  /// `kept`: where what backprop() reads of the forward is kept (the projections, o, y, rstd).
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c, bool with_backward, Arena* kept = nullptr) const {
    using A = typename B::Act;
    const std::int64_t M = c.tokens(), n = c.block_tokens(), cd = la_.conv_dim(), vd = la_.value_dim(), hv = la_.value_heads;
    Arena& k = kept ? *kept : ar;
    Acts<B> a;
    a.mixed = k.alloc<A>({M, cd});
    a.z = k.alloc<A>({M, vd});
    a.b = k.alloc<A>({M, hv});
    a.a = k.alloc<A>({M, hv});
    a.o = k.alloc<A>({M, vd});
    a.y = k.alloc<A>({M, vd});
    a.rstd = k.alloc<typename B::Acc>({M * hv});
    if (la_.fused) {
      a.fused_qkvz = ar.alloc<A>({n, cd + vd});
      a.fused_ba = ar.alloc<A>({n, 2 * hv});
    }
    if (with_backward) {
      a.dmixed = ar.alloc<A>({M, cd});
      a.dz = ar.alloc<A>({M, vd});
      a.db = ar.alloc<A>({M, hv});
      a.da = ar.alloc<A>({M, hv});
      a.dy = ar.alloc<A>({M, vd});
    }
    return a;
  }

  /// y = out_proj(mixing of x) (y overwritten); keeps what backprop() needs in a.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
           const Acts<B>& a, View<typename B::Act> y) const {
    run_kept(be, c, w, x, a);
    out(be, w, a, 0, y);
  }
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a) const {
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == d_, "Gated DeltaNet: input {} is not [{} tokens, {}]",
             x.shape().str(), c.tokens(), d_);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) { project(be, w, token_rows(x, t0, n), a, t0); });
    mix(be, c, a, w);
  }
  /// After run() on the same x: dx (overwritten) from dy; the weights' gradients added to g.
  template <class B>
  void backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                const Acts<B>& a, View<const typename B::Act> dy, View<typename B::Act> dx,
                const Weights<typename B::Acc>& g) const {
    out_backward(be, w, a, 0, dy, g);
    mix_backward(be, c, a, w, g);
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      project_backward(be, w, token_rows(x, t0, n), a, t0, token_rows(dx, t0, n), g);
    });
  }

  // ---- as a block's token mixer (mixers.hpp)

  /// The projections of tokens [first, first + x.size(0)), in the layout of the top comment.
  template <class B>
  void project(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x, const Acts<B>& a,
               std::int64_t first) const {
    if constexpr (!LinearAttentionBackend<B>) {
      refuse();
    } else {
      const std::int64_t n = x.size(0);
      const View<const typename B::Weight> none{};
      if (!la_.fused) {
        be.linear(x, w.qkv, none, token_rows(a.mixed, first, n));
        be.linear(x, w.z, none, token_rows(a.z, first, n));
        be.linear(x, w.b, none, token_rows(a.b, first, n));
        be.linear(x, w.a, none, token_rows(a.a, first, n));
        return;
      }
      const auto qkvz = token_rows(a.fused_qkvz, 0, n), ba = token_rows(a.fused_ba, 0, n);
      be.linear(x, w.qkv, none, qkvz);
      be.linear(x, w.b, none, ba);
      if constexpr (B::kDevice) {
        be.deltanet_unfuse(shape_, cview(qkvz), cview(ba), token_rows(a.mixed, first, n), token_rows(a.z, first, n),
                           token_rows(a.b, first, n), token_rows(a.a, first, n));
        return;
      }
      for_each_fused(n, [&](std::int64_t t, std::int64_t from, Part part, std::int64_t to, std::int64_t len) {
        const auto* src = fused_at(qkvz, ba, part, t, from);
        std::copy(src, src + len, part_row(a, part, first + t, false) + to);
      });
    }
  }
  /// Decoding (ChunkShape::decode): each row's convolution taps and delta-rule state.
  template <class B>
  struct Cache {
    View<typename B::Act> taps;   // [rows * (conv_kernel - 1), conv_dim]
    View<typename B::Acc> state;  // [rows * value_heads * dk, dv]
  };
  template <class B>
  Cache<B> carve_cache(Arena& ar, std::int64_t rows, std::int64_t /*capacity: a state whatever the length*/) const {
    return {ar.alloc<typename B::Act>({rows * (la_.conv_kernel - 1), la_.conv_dim()}),
            ar.alloc<typename B::Acc>({rows * la_.value_heads * la_.key_head_dim, la_.value_head_dim})};
  }
  /// Whether backend B decodes this layer with a cache (else Trainer::decode_logits refuses it).
  template <class B>
  bool decodes() const {
    return LinearAttentionDecodeBackend<B> && decoding_enabled<B>();
  }

  /// The whole chunk's mixing: a.o, a.y and a.rstd from the projections. Decoding: each row's one
  /// token after the state its cache holds (a.y alone).
  template <class B>
  void mix(B& be, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w) const {
    if constexpr (!LinearAttentionBackend<B>) {
      refuse();
    } else if (c.decode.active()) {
      if constexpr (LinearAttentionDecodeBackend<B>) {
        MT_CHECK(c.seq == 1 && decodes<B>(), "{}: decoding takes one token a row, not {}, on a backend that decodes",
                 prefix_, c.seq);
        Arena ar(c.decode.cache);
        const Cache<B> cache = carve_cache<B>(ar, c.decode.rows, c.decode.capacity);
        if constexpr (DeviceLinearAttentionDecodeBackend<B>)
          be.gated_deltanet_decode(device_operands<B>(c, a, w), c.decode, cache.taps, cache.state, a.y);
        else
          be.gated_deltanet_decode(operands<B>(c, a, w, sequence_starts(c)), c.decode, cache.taps.data(), cache.state.data(),
                                   a.y.data());
      } else {
        MT_FAIL("{}: this backend has no linear attention over a cache (generation recomputes each prefix here)", prefix_);
      }
    } else {
      if constexpr (DeviceLinearAttentionBackend<B>) {
        be.gated_deltanet_mix(device_operands<B>(c, a, w), a.o, a.rstd, a.y);
      } else {
        const auto starts = sequence_starts(c);
        be.gated_deltanet_mix(operands<B>(c, a, w, starts), a.o.data(), a.rstd.data(), a.y.data());
      }
    }
  }
  /// h = x + out_proj(y) for tokens [first, first + x.size(0)).
  template <class B>
  void out_add(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
               View<const typename B::Res> x, View<typename B::Res> h) const {
    be.linear_add(cview(token_rows(a.y, first, x.size(0))), w.out, View<const typename B::Weight>{}, x, h);
  }
  /// o = out_proj(y) for tokens [first, first + o.size(0)).
  template <class B>
  void out(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
           View<typename B::Act> o) const {
    be.linear(cview(token_rows(a.y, first, o.size(0))), w.out, View<const typename B::Weight>{}, o);
  }
  /// From dout (out()'s gradient for rows from `first`): those rows of a.dy; out_proj's gradient
  /// added to g.
  template <class B>
  void out_backward(B& be, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t first,
                    View<const typename B::Act> dout, const Weights<typename B::Acc>& g) const {
    const std::int64_t n = dout.size(0);
    be.linear_backward(cview(token_rows(a.y, first, n)), w.out, dout, token_rows(a.dy, first, n), false, g.out,
                       View<typename B::Acc>{});
  }
  /// The mixing's backward over the whole chunk: the projections' gradients from a.dy; the
  /// convolution's, A_log's, dt_bias's and the norm's added to g.
  template <class B>
  void mix_backward(B& be, ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w,
                    const Weights<typename B::Acc>& g) const {
    if constexpr (!LinearAttentionBackend<B>) {
      refuse();
    } else {
      if constexpr (DeviceLinearAttentionBackend<B>) {
        be.gated_deltanet_mix_backward(device_operands<B>(c, a, w), cview(a.o), cview(a.rstd), cview(a.dy),
                                       {a.dmixed, a.dz, a.da, a.db, g.conv, g.A_log, g.dt_bias, g.norm});
      } else {
        const auto starts = sequence_starts(c);
        cpu::GatedDeltaNetMixGrads<typename B::Act> d{a.dmixed.data(), a.dz.data(),     a.da.data(),      a.db.data(),
                                                      g.conv.data(),   g.A_log.data(), g.dt_bias.data(), g.norm.data()};
        be.gated_deltanet_mix_backward(operands<B>(c, a, w, starts), a.o.data(), a.rstd.data(), a.dy.data(), d);
      }
    }
  }
  /// dx (overwritten) of tokens [first, first + x.size(0)); the projections' gradients added to g.
  template <class B>
  void project_backward(B& be, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                        const Acts<B>& a, std::int64_t first, View<typename B::Act> dx,
                        const Weights<typename B::Acc>& g) const {
    if constexpr (!LinearAttentionBackend<B>) {
      refuse();
    } else {
      const std::int64_t n = x.size(0);
      const View<typename B::Acc> none{};
      if (!la_.fused) {
        be.linear_backward(x, w.qkv, cview(token_rows(a.dmixed, first, n)), dx, false, g.qkv, none);
        be.linear_backward(x, w.z, cview(token_rows(a.dz, first, n)), dx, true, g.z, none);
        be.linear_backward(x, w.b, cview(token_rows(a.db, first, n)), dx, true, g.b, none);
        be.linear_backward(x, w.a, cview(token_rows(a.da, first, n)), dx, true, g.a, none);
        return;
      }
      const auto qkvz = token_rows(a.fused_qkvz, 0, n), ba = token_rows(a.fused_ba, 0, n);
      if constexpr (B::kDevice) {
        be.deltanet_fuse(shape_, cview(token_rows(a.dmixed, first, n)), cview(token_rows(a.dz, first, n)),
                         cview(token_rows(a.db, first, n)), cview(token_rows(a.da, first, n)), qkvz, ba);
      } else {
        for_each_fused(n, [&](std::int64_t t, std::int64_t from, Part part, std::int64_t to, std::int64_t len) {
          const auto* src = part_row(a, part, first + t, true) + to;
          std::copy(src, src + len, fused_at(qkvz, ba, part, t, from));
        });
      }
      be.linear_backward(x, w.qkv, cview(qkvz), dx, false, g.qkv, none);
      be.linear_backward(x, w.b, cview(ba), dx, true, g.b, none);
    }
  }

 private:
  enum class Part { q, k, v, z, b, a };

  std::string name(const char* suffix) const { return prefix_ + suffix; }
  [[noreturn]] void refuse() const { refuse_backend(layer_); }

  /// Qwen3-Next's fused rows, each key head's in turn: f(t, offset in the fused row, part,
  /// offset in that part's row of the unfused layout, length) for every run of elements of
  /// token t of a block of n.
  template <class F>
  void for_each_fused(std::int64_t n, F&& f) const {
    const std::int64_t dk = la_.key_head_dim, r = la_.value_heads / la_.key_heads, rv = r * la_.value_head_dim;
    const std::int64_t per_head = 2 * dk + 2 * rv;
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t h = 0; h < la_.key_heads; ++h) {
        const std::int64_t at = h * per_head;
        f(t, at, Part::q, h * dk, dk);
        f(t, at + dk, Part::k, h * dk, dk);
        f(t, at + 2 * dk, Part::v, h * rv, rv);
        f(t, at + 2 * dk + rv, Part::z, h * rv, rv);
        f(t, 2 * h * r, Part::b, h * r, r);
        f(t, 2 * h * r + r, Part::a, h * r, r);
      }
  }
  /// Where `part` of token t starts in the unfused layout (q, k and v share mixed's rows).
  template <class B>
  typename B::Act* part_row(const Acts<B>& a, Part part, std::int64_t t, bool grad) const {
    const std::int64_t kd = la_.key_dim(), cd = la_.conv_dim(), vd = la_.value_dim(), hv = la_.value_heads;
    switch (part) {
      case Part::q: return (grad ? a.dmixed : a.mixed).data() + t * cd;
      case Part::k: return (grad ? a.dmixed : a.mixed).data() + t * cd + kd;
      case Part::v: return (grad ? a.dmixed : a.mixed).data() + t * cd + 2 * kd;
      case Part::z: return (grad ? a.dz : a.z).data() + t * vd;
      case Part::b: return (grad ? a.db : a.b).data() + t * hv;
      case Part::a: return (grad ? a.da : a.a).data() + t * hv;
    }
    return nullptr;
  }
  /// Where `part` of token t of a block starts in the fused projections' rows, from `from`.
  template <class A>
  static A* fused_at(View<A> qkvz, View<A> ba, Part part, std::int64_t t, std::int64_t from) {
    return part == Part::b || part == Part::a ? ba.data() + t * ba.size(1) + from : qkvz.data() + t * qkvz.size(1) + from;
  }

  /// The sequences' starts from 0 and the chunk's end: each row one sequence, or the packed ones.
  static std::vector<std::int32_t> sequence_starts(ChunkShape c) {
    std::vector<std::int32_t> s;
    if (c.packed.empty()) {
      for (std::int64_t r = 0; r <= c.rows; ++r) s.push_back(static_cast<std::int32_t>(r * c.seq));
    } else {
      for (const std::int32_t v : c.packed.host_starts) s.push_back(v - c.packed.host_starts.front());
    }
    return s;
  }
  template <class B>
  DeltaNetOperands<typename B::Act, typename B::Weight, full_t<typename B::Weight>> device_operands(
      ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w) const {
    DeltaNetOperands<typename B::Act, typename B::Weight, full_t<typename B::Weight>> m;
    m.shape = shape_;
    m.chunk = c;
    m.mixed = cview(a.mixed);
    m.z = cview(a.z);
    m.a = cview(a.a);
    m.b = cview(a.b);
    m.conv = w.conv;
    m.A_log = w.A_log;
    m.dt_bias = w.dt_bias;
    m.norm = w.norm;
    return m;
  }
  template <class B>
  cpu::GatedDeltaNetMix<typename B::Act> operands(ChunkShape c, const Acts<B>& a, const Weights<const typename B::Weight>& w,
                                                  const std::vector<std::int32_t>& starts) const {
    MT_CHECK(!starts.empty() && starts.back() == c.tokens(), "Gated DeltaNet: the sequences end at {}, not the chunk's {} tokens",
             starts.empty() ? 0 : starts.back(), c.tokens());
    cpu::GatedDeltaNetMix<typename B::Act> m;
    m.key_heads = la_.key_heads;
    m.value_heads = la_.value_heads;
    m.dk = la_.key_head_dim;
    m.dv = la_.value_head_dim;
    m.taps = la_.conv_kernel;
    m.norm_eps = eps_;
    m.starts = starts;
    m.mixed = a.mixed.data();
    m.z = a.z.data();
    m.a = a.a.data();
    m.b = a.b.data();
    m.conv = w.conv.data();
    m.A_log = w.A_log.data();
    m.dt_bias = w.dt_bias.data();
    m.norm = w.norm.data();
    return m;
  }

  LinearAttentionConfig la_;
  DeltaNetShape shape_;
  std::int64_t d_;
  double eps_;
  float std_;
  std::int64_t layer_;
  std::string prefix_;
};

}  // namespace megatrain
