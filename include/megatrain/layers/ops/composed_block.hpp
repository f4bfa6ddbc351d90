// A pre-norm decoder block composed per layer of a token mixer and a channel mixer (mixers.hpp):
//
//     h  = x + token_mixer(rmsnorm(x))
//     y  = h + channel_mixer(rmsnorm(h))
//
// and, where the family normalises the parts' outputs too (ModelConfig::sandwich_norms: Gemma 3;
// every norm (1 + w)):
//
//     h  = x + rmsnorm(token_mixer(rmsnorm(x)))      input_layernorm, post_attention_layernorm
//     y  = h + rmsnorm(channel_mixer(rmsnorm(h)))    pre_feedforward_layernorm, post_feedforward_layernorm
//
// (The post-norms read the parts' bf16 outputs and write bf16, which joins the fp32 residual
// stream, as transformers' Gemma3RMSNorm under autocast: output.type_as(input).)
//
// ComposedBlock<std::variant<TokenMixers...>, std::variant<ChannelMixers...>> holds, for its
// layer, one of each: by default the first whose builds(config, layer) accepts the layer (from
// ModelConfig::layer_kind: config.json's layer_types, the experts' layers), or the two a factory
// gives (DecoderModel's block factory). DecoderBlock (decoder_block.hpp) is the block of the
// shipped families.
//
// x, h and y are the residual stream (B::Res: fp32 on the CUDA backend): each part's output
// projection adds into it in one step (Backend::linear_add), and the norms read it and their
// gains at full precision, as PyTorch's autocast does; only the parts' inner activations are
// bf16. The gradient along the residual path is kept the same way.
//
// Backward (CarvedOp) recomputes the token mixer from the block's input (the activation
// checkpoint), keeping its activations and h, then backpropagates through the parts in reverse,
// recomputing the channel mixer's activations a token block at a time on the way.
//
// Kept activations (KeepingLayerOp, where the trainer has room): the forward keeps h, the token
// mixer's activations and what the channel mixer keeps of the whole chunk (the dense MLP: its
// gate and up projections; a mixture of experts keeps none: its routing is recomputed); the
// backward then runs no matrix product of the forward again but those, only the norms.
//
// Token blocks (ChunkShape::token_block): the norms, the projections and the channel mixer run
// on blocks of that many tokens, so that their buffers (the MLP's are the largest: 6 x
// intermediate_size per token) are bounded by the block; only the token mixer's activations
// (and their gradients) and h span the whole chunk, since it mixes whole rows. One block (the
// default) is the whole chunk.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/carved_op.hpp"
#include "megatrain/layers/ops/mixers.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

template <class TokenMixers, class ChannelMixers>
class ComposedBlock;

template <class... Tokens, class... Channels>
class ComposedBlock<std::variant<Tokens...>, std::variant<Channels...>>
    : public CarvedOp<ComposedBlock<std::variant<Tokens...>, std::variant<Channels...>>> {
  using Base = CarvedOp<ComposedBlock>;

 public:
  using TokenMixer = std::variant<Tokens...>;
  using ChannelMixer = std::variant<Channels...>;

  /// Layer `layer`'s block: its mixers the first of each list whose builds() accepts the layer.
  ComposedBlock(const ModelConfig& cfg, std::int64_t layer)
      : ComposedBlock(cfg, layer, build<TokenMixer>(cfg, layer), build<ChannelMixer>(cfg, layer)) {}
  /// Layer `layer`'s block of the mixers given.
  ComposedBlock(const ModelConfig& cfg, std::int64_t layer, TokenMixer token, ChannelMixer channel)
      : cfg_(cfg),
        prefix_("model.layers." + std::to_string(layer) + "."),
        token_(std::move(token)),
        channel_(std::move(channel)),
        sandwich_(cfg.sandwich_norms()),
        offset_(cfg.norm_unit_offset() ? 1.0 : 0.0) {
    const bool has_output = std::visit([](const auto& m) { return std::decay_t<decltype(m)>::kHasOutput; }, channel_);
    MT_CHECK(!sandwich_ || has_output, "{}'s layer {}: its channel mixer has no output of its own for the block's "
             "output norm (sandwich norms around a mixture of experts are not built)", cfg.architecture_name(), layer);
  }

  static constexpr bool kResidualIO = true;  // (CarvedOp: x and y are the residual stream)

  template <class E>
  struct Weights {
    View<full_t<E>> input_norm;
    std::variant<typename Tokens::template Weights<E>...> token;
    View<full_t<E>> post_norm;  ///< the channel mixer's input norm (Gemma 3: pre_feedforward_layernorm)
    std::variant<typename Channels::template Weights<E>...> channel;
    View<full_t<E>> token_out_norm, channel_out_norm;  ///< sandwich norms only (Gemma 3)
  };

  /// In slab order: input_layernorm, the token mixer's, post_attention_layernorm, the channel
  /// mixer's; Gemma 3: input_layernorm, the token mixer's, post_attention_layernorm,
  /// pre_feedforward_layernorm, the channel mixer's, post_feedforward_layernorm.
  std::vector<ParamSpec> params() const {
    const std::int64_t d = cfg_.hidden_size;
    const bool unit = offset_ != 0;
    std::vector<ParamSpec> p{ParamSpec::norm(name("input_layernorm.weight"), d, unit)};
    for (auto& s : std::visit([](const auto& m) { return m.params(); }, token_)) p.push_back(std::move(s));
    p.push_back(ParamSpec::norm(name("post_attention_layernorm.weight"), d, unit));
    if (sandwich_) p.push_back(ParamSpec::norm(name("pre_feedforward_layernorm.weight"), d, unit));
    for (auto& s : std::visit([](const auto& m) { return m.params(); }, channel_)) p.push_back(std::move(s));
    if (sandwich_) p.push_back(ParamSpec::norm(name("post_feedforward_layernorm.weight"), d, unit));
    return p;
  }

  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    Weights<E> w;
    w.input_norm = p.full(name("input_layernorm.weight"));
    w.token = std::visit([&](const auto& m) { return decltype(w.token)(in_place<decltype(m)>(), m.bind(p)); }, token_);
    w.channel = std::visit([&](const auto& m) { return decltype(w.channel)(in_place<decltype(m)>(), m.bind(p)); }, channel_);
    if (!sandwich_) {
      w.post_norm = p.full(name("post_attention_layernorm.weight"));
      return w;
    }
    w.token_out_norm = p.full(name("post_attention_layernorm.weight"));
    w.post_norm = p.full(name("pre_feedforward_layernorm.weight"));
    w.channel_out_norm = p.full(name("post_feedforward_layernorm.weight"));
    return w;
  }

  std::int64_t hidden_size() const { return cfg_.hidden_size; }
  const std::string& prefix() const { return prefix_; }
  /// This layer's token mixer and channel mixer.
  const TokenMixer& token_mixer() const { return token_; }
  const ChannelMixer& channel_mixer() const { return channel_; }

  /// Decoding with a cache (ChunkShape::decode): whether backend B decodes this layer (its token
  /// mixer keeps a cache there), and the bytes of the layer's cache for `rows` rows of up to
  /// `capacity` tokens.
  template <class B>
  bool decodes() const {
    return std::visit([](const auto& m) {
      if constexpr (requires { m.template decodes<B>(); }) return m.template decodes<B>();
      else return false;
    }, token_);
  }
  template <class B>
  std::size_t decode_cache_bytes(std::int64_t rows, std::int64_t capacity) const {
    return std::visit([&](const auto& m) -> std::size_t {
      Arena measure;
      if constexpr (requires { m.template carve_cache<B>(measure, rows, capacity); }) m.template carve_cache<B>(measure, rows, capacity);
      return measure.peak();
    }, token_);
  }

  /// The activations of one chunk: the token mixer's over the whole chunk and h (x2), and the
  /// token-wise parts' for one block of ChunkShape::block_tokens() tokens (forward and, with
  /// backward, backward buffers).
  template <class B>
  struct Acts {
    View<typename B::Act> n1, n2;  // a token block's
    View<typename B::Res> x2;      // h, the whole chunk's
    View<typename B::Acc> rstd1, rstd2;
    std::variant<typename Tokens::template Acts<B>...> token;      // the whole chunk's
    std::variant<typename Channels::template Acts<B>...> channel;  // a token block's (kept: the mixer's choice)
    View<typename B::Act> dn, dya;  // backward only: a norm's input gradient; dy, then dh, as activations
    // sandwich norms: the token mixer's projected output o and its norm's rstd (the whole chunk's,
    // with h), the channel mixer's output f and its rstd (a token block's; kept: the chunk's), a
    // post-norm's output (a block's), and (backward) a post-norm's input gradient
    View<typename B::Act> o, f, pn, dp;
    View<typename B::Acc> rstd_o, rstd_f;
    bool kept = false;  // h and the mixers' activations kept from the forward
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
    a.token = std::visit(
        [&](const auto& m) { return decltype(a.token)(in_place<decltype(m)>(), m.template carve<B>(ar, c, with_backward, kept)); },
        token_);
    a.channel = std::visit(
        [&](const auto& m) {
          return decltype(a.channel)(in_place<decltype(m)>(), m.template carve_block<B>(ar, c, with_backward, kept));
        },
        channel_);
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

  /// y = x + token_mixer(rmsnorm(x)), then + channel_mixer(rmsnorm(...)); keeps the token
  /// mixer's activations and h in a. The norms, projections and channel mixer run a token block
  /// at a time.
  template <class B>
  void run(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
           const Acts<B>& a, View<typename B::Res> y) const {
    run_kept(be, c, w, x, a);
    with_channel([&](const auto& m) {
      const auto& mw = part<decltype(m)>(w.channel);
      c.for_each_block([&](std::int64_t t0, std::int64_t n) {
        const auto n2 = token_rows(a.n2, 0, n);
        const auto h = cview(token_rows(a.x2, t0, n));
        be.rmsnorm(h, w.post_norm, cfg_.rms_norm_eps, n2, token_rows(a.rstd2, 0, n), offset_);
        const auto ma = m.block_rows(part<decltype(m)>(a.channel), t0, n);
        if (!sandwich_) {  // y = h + mixer(n2)
          m.mix_add(be, mw, cview(n2), ma, h, token_rows(y, t0, n), router_rows(c.router, t0, n));
          return;
        }
        const auto [f, rstd_f] = channel_out(a, t0, n);  // y = h + norm(mixer(n2))
        m.mix_out(be, mw, cview(n2), ma, f);
        be.head_rmsnorm(cview(f), w.channel_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), rstd_f, offset_);
        be.residual_add(h, cview(token_rows(a.pn, 0, n)), token_rows(y, t0, n));
      });
    });
  }

  /// The token mixer's part: its activations over the whole chunk and h = x + its output.
  template <class B>
  void run_kept(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a) const {
    // (checked where the block runs: the planner carves it for backends it only measures)
    static_assert((TokenMixerOp<Tokens, B> && ...), "a token mixer of this block lacks a phase (mixers.hpp)");
    static_assert((ChannelMixerOp<Channels, B> && ...), "a channel mixer of this block lacks a phase (mixers.hpp)");
    MT_CHECK(x.rank() == 2 && x.size(0) == c.tokens() && x.size(1) == cfg_.hidden_size,
             "decoder block: input {} is not [{} tokens, {}]", x.shape().str(), c.tokens(), cfg_.hidden_size);
    with_token([&](const auto& m) {
      const auto& mw = part<decltype(m)>(w.token);
      const auto& ma = part<decltype(m)>(a.token);
      c.for_each_block([&](std::int64_t t0, std::int64_t n) {
        const auto n1 = token_rows(a.n1, 0, n);
        be.rmsnorm(token_rows(x, t0, n), w.input_norm, cfg_.rms_norm_eps, n1, token_rows(a.rstd1, 0, n), offset_);
        m.project(be, mw, cview(n1), ma, t0);
      });
      m.mix(be, c, ma, mw);
      c.for_each_block([&](std::int64_t t0, std::int64_t n) {  // h = x + out(mixed)
        if (!sandwich_) {
          m.out_add(be, mw, ma, t0, token_rows(x, t0, n), token_rows(a.x2, t0, n));
          return;
        }
        const auto o = token_rows(a.o, t0, n);  // h = x + norm(out(mixed))
        m.out(be, mw, ma, t0, o);
        be.head_rmsnorm(cview(o), w.token_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), token_rows(a.rstd_o, t0, n),
                        offset_);
        be.residual_add(token_rows(x, t0, n), cview(token_rows(a.pn, 0, n)), token_rows(a.x2, t0, n));
      });
    });
  }

  /// After run_kept() on the same x: dx written, weight gradients added to g. The channel mixer
  /// is recomputed a token block at a time (from h), as is the input norm.
  template <class B>
  void backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                const Acts<B>& a, View<const typename B::Res> dy, View<typename B::Res> dx,
                const Weights<typename B::Acc>& g) const {
    // y = h + mixer(n2): dn2 from the channel mixer, then dh = dy + the norm's backward (into dx,
    // and as activations), then the token mixer's output gradient from dh
    c.for_each_block([&](std::int64_t t0, std::int64_t n) {
      const auto n2 = token_rows(a.n2, 0, n), dn = token_rows(a.dn, 0, n), dya = token_rows(a.dya, 0, n);
      const auto rstd2 = token_rows(a.rstd2, 0, n);
      const auto h = cview(token_rows(a.x2, t0, n));
      be.rmsnorm(h, w.post_norm, cfg_.rms_norm_eps, n2, rstd2, offset_);
      be.convert(token_rows(dy, t0, n), dya);
      channel_backprop(be, c, w, a, t0, n, cview(dya), g);
      be.rmsnorm_backward(h, w.post_norm, cview(rstd2), cview(dn), token_rows(dy, t0, n), token_rows(dx, t0, n), dya,
                          g.post_norm, offset_);
      View<const typename B::Act> dout = cview(dya);  // the gradient of the token mixer's output
      if (sandwich_) {
        const auto dp = token_rows(a.dp, 0, n);
        be.head_rmsnorm_backward(cview(token_rows(a.o, t0, n)), w.token_out_norm, cview(token_rows(a.rstd_o, t0, n)),
                                 cview(dya), dp, g.token_out_norm, offset_);
        dout = cview(dp);
      }
      with_token([&](const auto& m) {
        m.out_backward(be, part<decltype(m)>(w.token), part<decltype(m)>(a.token), t0, dout, part<decltype(m)>(g.token));
      });
    });
    // h = x + token_mixer(n1): through the mixing, then the projections and the norm, into dx
    with_token([&](const auto& m) {
      const auto& mw = part<decltype(m)>(w.token);
      const auto& ma = part<decltype(m)>(a.token);
      const auto& mg = part<decltype(m)>(g.token);
      m.mix_backward(be, c, ma, mw, mg);
      c.for_each_block([&](std::int64_t t0, std::int64_t n) {
        const auto n1 = token_rows(a.n1, 0, n), dn = token_rows(a.dn, 0, n), rstd1 = token_rows(a.rstd1, 0, n);
        const auto xs = token_rows(x, t0, n);
        if (a.kept || c.block_tokens() < c.tokens())  // (one block, recomputed: n1 and rstd1 are still the forward's)
          be.rmsnorm(xs, w.input_norm, cfg_.rms_norm_eps, n1, rstd1, offset_);
        m.project_backward(be, mw, cview(n1), ma, t0, dn, mg);
        const auto dxs = token_rows(dx, t0, n);
        be.rmsnorm_backward(xs, w.input_norm, cview(rstd1), cview(dn), View<const typename B::Res>(dxs), dxs,
                            View<typename B::Act>{}, g.input_norm, offset_);
      });
    });
  }

 private:
  using Base::cview;

  std::string name(const char* suffix) const { return prefix_ + suffix; }

  /// The channel mixer's part of backprop() for the token block [t0, t0 + n): a.dn (the gradient
  /// of its input n2) from dya (the gradient of the block's output), through the output norm
  /// first where the block has one; its activations recomputed from n2 unless kept.
  template <class B>
  void channel_backprop(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, const Acts<B>& a, std::int64_t t0,
                        std::int64_t n, View<const typename B::Act> dya, const Weights<typename B::Acc>& g) const {
    with_channel([&](const auto& m) {
      const auto& mw = part<decltype(m)>(w.channel);
      const auto& mg = part<decltype(m)>(g.channel);
      const auto ma = m.block_rows(part<decltype(m)>(a.channel), t0, n);
      const auto n2 = cview(token_rows(a.n2, 0, n));
      const auto dn = token_rows(a.dn, 0, n);
      const RouterStats stats = router_rows(c.router, t0, n);
      if (!sandwich_) {
        m.mix_backward(be, mw, n2, ma, dya, dn, mg, stats, !a.kept);
        return;
      }
      // through the output norm first (its input recomputed unless kept)
      const auto [f, rstd_f] = channel_out(a, t0, n);
      const auto dp = token_rows(a.dp, 0, n);
      if (!a.kept) {
        m.mix_out(be, mw, n2, ma, f);
        be.head_rmsnorm(cview(f), w.channel_out_norm, cfg_.rms_norm_eps, token_rows(a.pn, 0, n), rstd_f, offset_);
      }
      be.head_rmsnorm_backward(cview(f), w.channel_out_norm, cview(rstd_f), dya, dp, g.channel_out_norm, offset_);
      m.mix_backward(be, mw, n2, ma, cview(dp), dn, mg, stats, false);
    });
  }

  /// The routing statistics for the token block [t0, t0 + n): its rows of the tokens that count.
  static RouterStats router_rows(RouterStats r, std::int64_t t0, std::int64_t n) {
    if (!r.valid.is_null()) r.valid = token_rows(r.valid, t0, n);
    return r;
  }
  /// The channel mixer's output f and its norm's rstd for the token block [t0, t0 + n)
  /// (sandwich norms): rows from t0 where kept for the chunk, else the block's buffers.
  template <class B>
  std::pair<View<typename B::Act>, View<typename B::Acc>> channel_out(const Acts<B>& a, std::int64_t t0,
                                                                      std::int64_t n) const {
    const std::int64_t first = a.kept ? t0 : 0;
    return {token_rows(a.f, first, n), token_rows(a.rstd_f, first, n)};
  }

  // The mixer of this layer, visited; part<M>(v) is M's alternative of a variant that lists the
  // same mixers (its Weights, its Acts).
  template <class F>
  void with_token(F&& f) const {
    std::visit(f, token_);
  }
  template <class F>
  void with_channel(F&& f) const {
    std::visit(f, channel_);
  }
  template <class M, class... Ts>
  static constexpr std::size_t index_in() {
    constexpr bool same[] = {std::is_same_v<std::decay_t<M>, Ts>...};
    for (std::size_t i = 0; i < sizeof...(Ts); ++i)
      if (same[i]) return i;
    return sizeof...(Ts);
  }
  template <class M>
  static constexpr std::size_t index_of() {
    if constexpr ((std::is_same_v<std::decay_t<M>, Tokens> || ...)) return index_in<M, Tokens...>();
    else return index_in<M, Channels...>();
  }
  template <class M, class V>
  static decltype(auto) part(V& v) {
    return std::get<index_of<M>()>(v);
  }
  template <class M>
  static constexpr auto in_place() {
    return std::in_place_index<index_of<M>()>;
  }
  // The first mixer of V that builds layer `layer`.
  template <class V, std::size_t I = 0>
  static V build(const ModelConfig& cfg, std::int64_t layer) {
    if constexpr (I == std::variant_size_v<V>) {
      const LayerKind k = cfg.layer_kind(layer);
      MT_FAIL("{}'s layer {} ({}, {}): this block has no {} mixer that builds it", cfg.architecture_name(), layer,
              layer_type_name(k.token_mixer), channel_mixer_name(k.channel_mixer),
              std::is_same_v<V, TokenMixer> ? "token" : "channel");
    } else {
      using M = std::variant_alternative_t<I, V>;
      if (M::builds(cfg, layer)) return V(std::in_place_index<I>, M(cfg, layer));
      return build<V, I + 1>(cfg, layer);
    }
  }

  ModelConfig cfg_;
  std::string prefix_;
  TokenMixer token_;
  ChannelMixer channel_;
  bool sandwich_;  // Gemma 3's post-attention and post-feedforward norms
  double offset_;  // every norm multiplies by (w + offset_): 1 for Gemma, else 0
};

}  // namespace megatrain
