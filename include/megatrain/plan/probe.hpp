// The probe: this machine's rates for the cost model (plan::MachineFigures), measured at a
// model's own shapes, once, and kept in a JSON file that megatrain-plan reads
// (`megatrain-plan --probe`, docs/planner.md).
//
//   gemm_tflops           the matrix products' rate inside a step: a whole decoder block forward
//                         and backward (activations kept, as the trainer runs it) over a chunk
//                         of tokens, less what the cost model gives its attention and
//                         element-wise passes, with the LM head's products (the head as the
//                         trainer runs it, less the cost model's loss pass) weighted as a step
//                         runs them; the products alone where the block cannot say
//   moe_gemm_tflops       a mixture of experts' grouped products: a sparse block forward and
//                         backward, less the cost model's other terms of it, over the active
//                         experts' FLOPs (8 x: they are recomputed); only for a model with experts
//   attention_*_tflops    the backend's causal attention forward and backward at the model's
//                         heads and sequence length, FLOPs counted as the cost model counts them
//                         (2 T S q_dim forward, 2.5 times that backward)
//   delta_rule_*_tflops   Gated DeltaNet's mixing (convolution, norms, gates, the chunked delta
//                         rule, the gated norm) forward and backward at the model's linear-attention
//                         shape and sequence length, FLOPs counted as the cost model counts the
//                         delta rule's (mixing_span); only for a model with such layers
//   hbm_gbs               an element-wise add over 1 GiB (bytes read and written)
//   h2d_gbs, d2h_gbs      pinned copies of ProbeOptions::copy_bytes each way; duplex_gbs both at once
//   adamw_gparams         the host optimizer's AdamW (all cores, the widest vector path) over
//                         ProbeOptions::adamw_params; adamw_dma_gparams the same while copies run
//                         both ways, and pass_copies_gbs what those copies move meanwhile (both
//                         ways, in total: the host's memory serves both)
// Each figure is the best of ProbeOptions::repeats timed runs after one warm-up, but the block's
// and the head's: those run back to back for a while (sustained_seconds), as a step runs them
// (the GPU's clocks drop under a long load); and pass_copies_gbs: copies counted over at least
// ProbeOptions::pass_seconds of AdamW.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/backend/linear_attention.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/layers/layer_template.hpp"
#include "megatrain/layers/ops/decoder_block.hpp"
#include "megatrain/layers/ops/gated_deltanet.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/cost_model.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/plan/mixer_cost.hpp"

#if MEGATRAIN_HAS_CUDA
namespace megatrain {
class CudaBackend;  // (probe_machine<CudaBackend> is compiled once: see the end of this file)
}  // namespace megatrain
#endif

namespace megatrain::plan {

struct ProbeOptions {
  std::int64_t tokens = 16384;               ///< tokens of a chunk for the matrix products and attention
  std::size_t copy_bytes = std::size_t{1} << 30;  ///< bytes of each PCIe copy
  std::size_t adamw_params = std::size_t{1} << 26;  ///< parameters of the AdamW run
  int repeats = 5;
  double pass_seconds = 1.0;  ///< how long AdamW runs beside the copies for pass_copies_gbs
};

namespace detail {
/// Best (shortest) seconds of `repeats` runs of f after one warm-up; `sync` ends each run.
double best_seconds(int repeats, const std::function<void()>& f, const std::function<void()>& sync);

/// Seconds per run of f, run back to back for at least `min_s` after one warm-up (the GPU's
/// clocks as a whole step holds them, not a short burst's); `sync` ends the runs.
double sustained_seconds(double min_s, const std::function<void()>& f, const std::function<void()>& sync);

/// The host AdamW over n parameters (fp32 master, m, v, gradient; bf16 copy out), all cores.
void host_adamw(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v, const std::vector<float>& g,
                std::vector<bf16>& out);

/// 4M random values in [-1, 1), the same every probe (products of zeros run faster than a step's:
/// the GPU's clocks rise).
std::vector<float> probe_noise();

/// The host's AdamW (o.adamw_params), alone and while `round_trip` (pinned copies of `gb` GB each
/// way, completed) runs again and again on another thread: adamw_gparams, adamw_dma_gparams and
/// pass_copies_gbs of `m`.
void probe_adamw(const ProbeOptions& o, double gb, const std::function<void()>& round_trip, MachineFigures& m);

/// What the parts of probe_machine share: the backend and its compute executor, the shapes it
/// measures at, and random values to fill buffers with.
template <class B>
struct MachineProbe {
  MachineProbe(B& backend, const ModelConfig& config, std::int64_t seq, const ProbeOptions& options)
      : be(backend), cfg(config), o(options), compute(backend.make_executor(B::Role::compute)), noise(probe_noise()),
        S(std::min(seq, options.tokens)), T(std::max<std::int64_t>(1, options.tokens / S) * S), d(config.hidden_size),
        I(config.intermediate_size), qd(config.q_dim()), kd(config.kv_dim()), V(config.vocab_size),
        widest(std::max({d, I, qd, kd})) {}

  /// Fills `buf` with the noise, scaled to [-0.05, 0.05), tiled from host values.
  template <class Buf>
  void randomize(Buf& buf) {
    using E = std::remove_reference_t<decltype(buf.span()[0])>;
    std::vector<E> tile(noise.size());
    for (std::size_t i = 0; i < tile.size(); ++i) tile[i] = static_cast<E>(noise[i] * 0.05f);
    const auto dst = buf.span();
    for (std::size_t at = 0; at < dst.size(); at += tile.size()) {
      const std::size_t k = std::min(tile.size(), dst.size() - at);
      be.upload(compute, std::span<const E>(tile).first(k), dst.subspan(at, k));
      be.synchronize();  // (the tile is pageable and reused)
    }
  }

  B& be;
  const ModelConfig& cfg;
  const ProbeOptions& o;
  typename B::Executor compute;
  std::vector<float> noise;
  std::int64_t S, T;  ///< tokens of a sequence and of a chunk (whole sequences)
  std::int64_t d, I, qd, kd, V, widest;
};

/// The matrix products' figures that the head's and the block's parts refine gemm_tflops with.
struct GemmProbe {
  double block_flops = 0;  ///< a block's products, forward and backward
  double head_s = 0, head_flops = 0;  ///< the head's, forward and backward
};

/// Matrix products: a block's forward and backward at its shapes, and the head's; gemm_tflops.
template <class B>
GemmProbe probe_gemm(MachineProbe<B>& p, MachineFigures& m) {
  using A = typename B::Act;
  using W = typename B::Weight;
  auto& be = p.be;
  const ProbeOptions& o = p.o;
  const std::int64_t T = p.T, d = p.d, I = p.I, qd = p.qd, kd = p.kd, V = p.V, widest = p.widest;
  const auto sync = [&] { be.synchronize(); };
  auto x = be.template alloc<A>(static_cast<std::size_t>(T * widest));
  auto y = be.template alloc<A>(static_cast<std::size_t>(T * std::max(widest, std::min<std::int64_t>(V, 32768))));
  const std::size_t wn = static_cast<std::size_t>(std::max(widest * widest, std::min<std::int64_t>(V, 32768) * d));
  auto w = be.template alloc<W>(wn);
  auto dw = be.template alloc<typename B::Acc>(wn);
  // forward y[T, out] = x[T, in] W[out, in]^T, then its backward (dx, and dW accumulated in
  // fp32: twice the forward's FLOPs), as a step runs them
  // (`time`: the best of o.repeats forward and backward each; else one call of each)
  const auto run = [&](std::int64_t in, std::int64_t out, bool time) {
    const View<const A> xv(std::span<const A>(x.span()).first(static_cast<std::size_t>(T * in)), Shape{T, in});
    const View<A> dxv(x.span().first(static_cast<std::size_t>(T * in)), Shape{T, in});
    const View<const W> wv(std::span<const W>(w.span()).first(static_cast<std::size_t>(out * in)), Shape{out, in});
    const View<A> yv(y.span().first(static_cast<std::size_t>(T * out)), Shape{T, out});
    const View<typename B::Acc> dwv(dw.span().first(static_cast<std::size_t>(out * in)), Shape{out, in});
    const auto fwd = [&] { be.linear(xv, wv, View<const W>{}, yv); };
    const auto bwd = [&] { be.linear_backward(xv, wv, View<const A>(yv), dxv, false, dwv, View<typename B::Acc>{}); };
    if (!time) {
      fwd();
      bwd();
      return 0.0;
    }
    return best_seconds(o.repeats, fwd, sync) + best_seconds(o.repeats, bwd, sync);
  };
  p.randomize(x);
  p.randomize(w);
  be.zero(p.compute, dw.span());
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{d, qd}, {d, kd}, {d, kd}, {qd, d}, {d, I}, {d, I}, {I, d}};
  const std::int64_t vs = std::min<std::int64_t>(V, 32768);  // the head's slice of the vocabulary (below)
  // A backend that tunes its products (CudaBackendOptions::gemm_tuning) tries its candidates
  // first, as a step does, and keeps each shape's fastest: the rates are the tuned step's.
  if constexpr (requires { be.end_gemm_tuning(); }) {
    for (int i = 0; i < 40; ++i) {
      for (const auto& [in, out] : shapes) run(in, out, false);
      run(d, vs, false);
    }
    sync();
    be.end_gemm_tuning();
  }
  double block_s = 0, block_flops = 0;
  for (const auto& [in, out] : shapes) {
    block_s += run(in, out, true);
    block_flops += 6.0 * static_cast<double>(T) * static_cast<double>(in) * static_cast<double>(out);
  }
  // the head: the vocabulary in slices of at most 32,768 rows, as a whole head's share
  const double head_s = run(d, vs, true) * static_cast<double>(V) / static_cast<double>(vs);
  const double head_flops = 6.0 * static_cast<double>(T) * static_cast<double>(d) * static_cast<double>(V);
  const double L = static_cast<double>(p.cfg.num_hidden_layers);
  m.gemm_tflops = (L * block_flops + head_flops) / (L * block_s + head_s) / 1e12;
  return {block_flops, head_s, head_flops};
}

/// Attention at the model's heads and this sequence length: attention_fwd_tflops, attention_bwd_tflops.
template <class B>
void probe_attention(MachineProbe<B>& p, MachineFigures& m) {
  using A = typename B::Act;
  auto& be = p.be;
  const ModelConfig& cfg = p.cfg;
  const std::int64_t S = p.S, T = p.T, qd = p.qd, kd = p.kd;
  const auto sync = [&] { be.synchronize(); };
  const AttentionShape as{T / S, S, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, {}};
  if constexpr (requires { typename B::WorkspacePlan; }) {
    WorkspacePlan wp;
    wp.max_tokens = T;
    wp.max_width = p.widest;
    wp.vocab = p.V;
    wp.attention.push_back({as.rows, as.seq, as.heads, as.kv_heads, as.head_dim});
    be.prepare(wp);
  }
  auto q = be.template alloc<A>(static_cast<std::size_t>(T * qd)), out = be.template alloc<A>(static_cast<std::size_t>(T * qd));
  auto dout = be.template alloc<A>(static_cast<std::size_t>(T * qd)), dq = be.template alloc<A>(static_cast<std::size_t>(T * qd));
  auto k = be.template alloc<A>(static_cast<std::size_t>(T * kd)), v = be.template alloc<A>(static_cast<std::size_t>(T * kd));
  auto dk = be.template alloc<A>(static_cast<std::size_t>(T * kd)), dv = be.template alloc<A>(static_cast<std::size_t>(T * kd));
  auto lse = be.template alloc<typename B::Acc>(static_cast<std::size_t>(T * cfg.num_attention_heads));
  for (auto* b : {&q, &k, &v, &dout}) p.randomize(*b);
  const auto cv = [](auto& b, std::int64_t n, std::int64_t w) {
    using E = std::remove_reference_t<decltype(b.span()[0])>;
    return View<const E>(std::span<const E>(b.span()), Shape{n, w});
  };
  const auto mv = [](auto& b, std::int64_t n, std::int64_t w) {
    using E = std::remove_reference_t<decltype(b.span()[0])>;
    return View<E>(b.span(), Shape{n, w});
  };
  const View<typename B::Acc> lv(lse.span(), Shape{as.rows, cfg.num_attention_heads, S});
  const double fwd_flops = 2.0 * static_cast<double>(T) * static_cast<double>(S) * static_cast<double>(qd);
  const double fwd_s = best_seconds(
      p.o.repeats, [&] { be.attention(cv(q, T, qd), cv(k, T, kd), cv(v, T, kd), mv(out, T, qd), lv, as); }, sync);
  const double bwd_s = best_seconds(
      p.o.repeats,
      [&] {
        be.attention_backward(cv(q, T, qd), cv(k, T, kd), cv(v, T, kd), cv(out, T, qd),
                              View<const typename B::Acc>(lv), cv(dout, T, qd), mv(dq, T, qd), mv(dk, T, kd),
                              mv(dv, T, kd), as);
      },
      sync);
  m.attention_fwd_tflops = fwd_flops / fwd_s / 1e12;
  m.attention_bwd_tflops = 2.5 * fwd_flops / bwd_s / 1e12;
}

/// Gated DeltaNet's mixing at the model's linear-attention shape and this sequence length:
/// delta_rule_fwd_tflops, delta_rule_bwd_tflops (a model without such layers keeps the defaults).
template <class B>
void probe_linear_attention(MachineProbe<B>& p, MachineFigures& m) {
  if constexpr (DeviceLinearAttentionBackend<B>) {
    using A = typename B::Act;
    using W = typename B::Weight;
    using F = full_t<W>;
    using Acc = typename B::Acc;
    const ModelConfig& cfg = p.cfg;
    std::int64_t layer = -1;
    for (std::int64_t l = cfg.num_hidden_layers - 1; l >= 0; --l)
      if (cfg.layer_kind(l).token_mixer == TokenMixerKind::linear_attention) layer = l;
    if (layer < 0) return;
    auto& be = p.be;
    const auto& la = cfg.linear_attention;
    const std::int64_t T = p.T, cd = la.conv_dim(), vd = la.value_dim(), hv = la.value_heads;
    const auto n = [](std::int64_t a, std::int64_t b = 1) { return static_cast<std::size_t>(a * b); };
    auto mixed = be.template alloc<A>(n(T, cd)), z = be.template alloc<A>(n(T, vd)), a = be.template alloc<A>(n(T, hv));
    auto b = be.template alloc<A>(n(T, hv)), o = be.template alloc<A>(n(T, vd)), y = be.template alloc<A>(n(T, vd));
    auto dy = be.template alloc<A>(n(T, vd)), dmixed = be.template alloc<A>(n(T, cd)), dz = be.template alloc<A>(n(T, vd));
    auto da = be.template alloc<A>(n(T, hv)), db = be.template alloc<A>(n(T, hv));
    auto rstd = be.template alloc<Acc>(n(T, hv));
    auto conv = be.template alloc<W>(n(cd, la.conv_kernel));
    auto A_log = be.template alloc<F>(n(hv)), dt_bias = be.template alloc<F>(n(hv)), norm = be.template alloc<F>(n(la.value_head_dim));
    auto dconv = be.template alloc<Acc>(n(cd, la.conv_kernel)), dA_log = be.template alloc<Acc>(n(hv));
    auto ddt_bias = be.template alloc<Acc>(n(hv)), dnorm = be.template alloc<Acc>(n(la.value_head_dim));
    for (auto* buf : {&mixed, &z, &a, &b, &dy}) p.randomize(*buf);
    p.randomize(conv);
    for (auto* buf : {&A_log, &dt_bias, &norm}) p.randomize(*buf);
    const auto cv = [](auto& buf, Shape s) {
      using E = std::remove_reference_t<decltype(buf.span()[0])>;
      return View<const E>(std::span<const E>(buf.span()), s);
    };
    const auto mv = [](auto& buf, Shape s) { return View<std::remove_reference_t<decltype(buf.span()[0])>>(buf.span(), s); };
    const auto c = [](auto& buf) {
      using E = std::remove_reference_t<decltype(buf.span()[0])>;
      return std::span<const E>(buf.span());
    };
    const auto ops = delta_net_operands<A, W, F>(delta_net_shape(cfg), ChunkShape{T / p.S, p.S}, c(mixed), c(z), c(a), c(b),
                                                 c(conv), c(A_log), c(dt_bias), c(norm));
    const DeltaNetGradients<A, Acc> g{mv(dmixed, Shape{T, cd}), mv(dz, Shape{T, vd}), mv(da, Shape{T, hv}),
                                      mv(db, Shape{T, hv}),     mv(dconv, Shape{cd, 1, la.conv_kernel}),
                                      mv(dA_log, Shape{hv}),   mv(ddt_bias, Shape{hv}), mv(dnorm, Shape{la.value_head_dim})};
    const auto sync = [&] { be.synchronize(); };
    const double fwd_s = best_seconds(
        p.o.repeats, [&] { be.gated_deltanet_mix(ops, mv(o, Shape{T, vd}), mv(rstd, Shape{T * hv}), mv(y, Shape{T, vd})); },
        sync);
    const double bwd_s = best_seconds(
        p.o.repeats,
        [&] { be.gated_deltanet_mix_backward(ops, cv(o, Shape{T, vd}), cv(rstd, Shape{T * hv}), cv(dy, Shape{T, vd}), g); },
        sync);
    const double fwd_flops = 2.0 * static_cast<double>(T) * static_cast<double>(p.qd) *
                             mixing_span(cfg, layer, static_cast<double>(p.S));
    m.delta_rule_fwd_tflops = fwd_flops / fwd_s / 1e12;
    m.delta_rule_bwd_tflops = 2.5 * fwd_flops / bwd_s / 1e12;
  }
}

/// Device memory: y += x over 1 GiB of activations each; hbm_gbs.
template <class B>
void probe_hbm(MachineProbe<B>& p, MachineFigures& m) {
  using A = typename B::Act;
  auto& be = p.be;
  const std::size_t n = (std::size_t{1} << 30) / sizeof(A);
  auto a = be.template alloc<A>(n), b = be.template alloc<A>(n);
  be.zero(p.compute, a.span());
  be.zero(p.compute, b.span());
  const auto N = static_cast<std::int64_t>(n);
  const double s = best_seconds(
      p.o.repeats, [&] { be.add(View<const A>(std::span<const A>(a.span()), Shape{N}), View<A>(b.span(), Shape{N})); },
      [&] { be.synchronize(); });
  m.hbm_gbs = 3.0 * static_cast<double>(n * sizeof(A)) / s / 1e9;
}

/// The head as a step runs it (Backend::lm_head_loss: the logits in blocks, fp32, the loss and
/// both products back), sustained: its products' time (`g.head_s`) is what remains after the
/// cost model's loss pass over the logits (kLossBytesPerLogit at hbm_gbs).
template <class B>
void probe_head(MachineProbe<B>& p, const MachineFigures& m, GemmProbe& g) {
  using A = typename B::Act;
  using W = typename B::Weight;
  auto& be = p.be;
  const std::int64_t T = p.T, d = p.d, V = p.V;
  auto h = be.template alloc<A>(static_cast<std::size_t>(T * d)), dh = be.template alloc<A>(static_cast<std::size_t>(T * d));
  auto wh = be.template alloc<W>(static_cast<std::size_t>(V * d));
  auto dwh = be.template alloc<typename B::Acc>(static_cast<std::size_t>(V * d));
  auto labels = be.template alloc<std::int32_t>(static_cast<std::size_t>(T));
  auto loss = be.template alloc<typename B::Acc>(static_cast<std::size_t>(T));
  p.randomize(h);
  p.randomize(wh);
  be.zero(p.compute, labels.span());
  be.zero(p.compute, dwh.span());
  const double head_s = sustained_seconds(
      0.3,
      [&] {
        be.lm_head_loss(View<const A>(std::span<const A>(h.span()), Shape{T, d}),
                        View<const W>(std::span<const W>(wh.span()), Shape{V, d}),
                        View<const std::int32_t>(std::span<const std::int32_t>(labels.span()), Shape{T}),
                        1.0 / static_cast<double>(T), View<const typename B::Acc>{}, View<typename B::Acc>(loss.span(), Shape{T}),
                        View<A>(dh.span(), Shape{T, d}), View<typename B::Acc>(dwh.span(), Shape{V, d}));
      },
      [&] { be.synchronize(); });
  const double loss_s = kLossBytesPerLogit * static_cast<double>(T) * static_cast<double>(V) / (m.hbm_gbs * 1e9);
  if (head_s - loss_s > 0.5 * head_s) g.head_s = head_s - loss_s;
}

/// Decoder block `layer` forward and backward as the trainer runs it (activations kept),
/// sustained, over x and dy into y and dx; `params` gets its parameters (its weights and the full
/// precision ones).
template <class B>
double time_block(MachineProbe<B>& p, std::int64_t layer, double& params, View<const typename B::Res> xv,
                  View<const typename B::Res> dyv, View<typename B::Res> yv, View<typename B::Res> dxv) {
  using W = typename B::Weight;
  auto& be = p.be;
  const ChunkShape c{p.T / p.S, p.S};
  const LayerTemplate<DecoderBlock> blk(DecoderBlock(p.cfg, layer));
  const auto n = static_cast<std::size_t>(blk.layout().numel()), nf = static_cast<std::size_t>(blk.full_layout().numel());
  params = static_cast<double>(n + nf);
  auto wb = be.template alloc<W>(n);
  auto gb = be.template alloc<float>(std::max<std::size_t>(nf, 1));
  auto acc = be.template alloc<typename B::Acc>(n);
  p.randomize(wb);
  p.randomize(gb);
  be.zero(p.compute, acc.span());
  Arena measure;
  blk.op().template reserve_kept<B>(measure, c);
  auto kept_mem = be.template alloc<std::byte>(measure.peak());
  auto scratch_mem = be.template alloc<std::byte>(blk.op().template kept_scratch_bytes<B>(c));
  Arena scratch(scratch_mem.span());
  const auto w = [&] {
    const std::span<const W> ws(wb.span());
    if constexpr (!std::is_same_v<full_t<W>, W>)
      return blk.bind(ws, typename ParamBinder<const W>::FullSlab{&blk.full_layout(), std::span<const float>(gb.span())});
    else
      return blk.bind(ws);
  }();
  const auto g = blk.bind(acc.span());
  return sustained_seconds(
      0.5,
      [&] {
        Arena kept_fwd(kept_mem.span()), kept_bwd(kept_mem.span());
        blk.op().forward_keep(be, c, w, xv, yv, kept_fwd, scratch);
        blk.op().backward_kept(be, c, w, xv, dyv, dxv, g, kept_bwd, scratch);
      },
      [&] { be.synchronize(); });
}

/// A whole decoder block forward and backward, as the trainer runs it (activations kept): the
/// matrix products alone run faster than inside a step, so their rate is the one that makes the
/// cost model's block time (matrix products + attention + element-wise passes) the measured one;
/// gemm_tflops from a dense block, moe_gemm_tflops from a sparse one.
template <class B>
void probe_blocks(MachineProbe<B>& p, const GemmProbe& g, MachineFigures& m) {
  using R = typename B::Res;
  auto& be = p.be;
  const ModelConfig& cfg = p.cfg;
  const std::int64_t S = p.S, T = p.T, d = p.d, qd = p.qd;
  const auto tn = static_cast<std::size_t>(T * d);
  auto x = be.template alloc<R>(tn), y = be.template alloc<R>(tn), dy = be.template alloc<R>(tn), dx = be.template alloc<R>(tn);
  for (auto* b : {&x, &dy}) p.randomize(*b);
  const View<const R> xv(std::span<const R>(x.span()), Shape{T, d}), dyv(std::span<const R>(dy.span()), Shape{T, d});
  // block `layer`'s forward and backward, sustained; and its parameters
  const auto block_s_of = [&](std::int64_t layer, double& params) {
    return time_block(p, layer, params, xv, dyv, View<R>(y.span(), Shape{T, d}), View<R>(dx.span(), Shape{T, d}));
  };
  // the cost model's other terms of block `layer` (predict_step's mixing and element-wise bytes)
  const auto other_s = [&](std::int64_t layer) {
    const double mix_fwd = 2.0 * static_cast<double>(T) * static_cast<double>(qd) * mixing_span(cfg, layer, static_cast<double>(S));
    const bool linear = cfg.layer_kind(layer).token_mixer == TokenMixerKind::linear_attention;
    return mix_fwd / ((linear ? m.delta_rule_fwd_tflops : m.attention_fwd_tflops) * 1e12) +
           2.5 * mix_fwd / ((linear ? m.delta_rule_bwd_tflops : m.attention_bwd_tflops) * 1e12) +
           static_cast<double>(T) * block_elementwise_bytes(cfg, layer) / (m.hbm_gbs * 1e9);
  };
  std::int64_t dense = -1, sparse = -1;
  for (std::int64_t l = cfg.num_hidden_layers - 1; l >= 0; --l) (cfg.is_moe_layer(l) ? sparse : dense) = l;
  if (dense >= 0) {  // the matrix products' rate that makes the cost model's dense block the measured one
    double params = 0;
    const double block_s = block_s_of(dense, params);
    const double gemm_s = block_s - other_s(dense);
    if (gemm_s > 0.25 * block_s) {  // (else the products are too small a part to say their rate)
      const double L = static_cast<double>(cfg.num_hidden_layers);
      m.gemm_tflops = (L * g.block_flops + g.head_flops) / (L * gemm_s + g.head_s) / 1e12;
    }
  }
  if (sparse >= 0) {  // the experts' rate that makes the cost model's sparse block the measured one
    double params = 0;
    const double block_s = block_s_of(sparse, params);
    const double k = static_cast<double>(cfg.moe.experts_per_token), E = static_cast<double>(cfg.moe.num_experts);
    const double expert = 3.0 * static_cast<double>(d) * static_cast<double>(cfg.moe.intermediate_size);
    const double shared = cfg.moe.shared_expert_size > 0 ? static_cast<double>(cfg.moe.shared_expert_params(d)) : 0;
    const double Tt = static_cast<double>(T);
    // (kept: the attention's products 6 x, the experts' (a shared one's too) 8 x, as predict_step counts them)
    const double dense_s = 6.0 * (params - E * expert - shared) * Tt / (m.gemm_tflops * 1e12);
    const double expert_s = block_s - other_s(sparse) - dense_s;
    if (expert_s > 0.25 * block_s) m.moe_gemm_tflops = 8.0 * (k * expert + shared) * Tt / expert_s / 1e12;
  }
}

/// PCIe: pinned copies of o.copy_bytes each way, then both at once (h2d_gbs, d2h_gbs,
/// duplex_gbs); then the host's AdamW beside them (probe_adamw).
template <class B>
void probe_copies(MachineProbe<B>& p, MachineFigures& m) {
  auto& be = p.be;
  const ProbeOptions& o = p.o;
  const std::size_t cb = o.copy_bytes / 4 * 4;
  HostBuffer up_host = HostBuffer::allocate(cb), down_host = HostBuffer::allocate(cb);
  auto up_dev = be.template alloc<float>(cb / 4), down_dev = be.template alloc<float>(cb / 4);
  const auto up_src = up_host.template as<float>(0, cb / 4), down_dst = down_host.template as<float>(0, cb / 4);
  std::fill(up_src.begin(), up_src.end(), 1.0f);
  be.zero(p.compute, down_dev.span());
  be.synchronize();
  auto up = be.make_executor(B::Role::upload), down = be.make_executor(B::Role::download);
  const auto h2d = [&] { be.upload(up, std::span<const float>(up_src), up_dev.span()); };
  const auto d2h = [&] { be.download(down, std::span<const float>(down_dev.span()), down_dst); };
  const double gb = static_cast<double>(cb) / 1e9;
  m.h2d_gbs = gb / best_seconds(o.repeats, h2d, [&] { up.synchronize(); });
  m.d2h_gbs = gb / best_seconds(o.repeats, d2h, [&] { down.synchronize(); });
  m.duplex_gbs = 2 * gb / best_seconds(
                              o.repeats,
                              [&] {
                                h2d();
                                d2h();
                              },
                              [&] {
                                up.synchronize();
                                down.synchronize();
                              });
  // The host's AdamW, alone and while copies run both ways
  probe_adamw(o, gb,
              [&] {
                h2d();
                d2h();
                up.synchronize();
                down.synchronize();
              },
              m);
}
}  // namespace detail

/// Measures this machine's rates on `be` (a backend with a device) at the shapes of `cfg` with
/// sequences of `seq` tokens. `name` labels the figures (e.g. the GPU's name). Compiled once for
/// the CUDA backend (src/plan/probe_cuda.cpp).
template <class B>
MachineFigures probe_machine(B& be, const ModelConfig& cfg, std::int64_t seq, std::string name, const ProbeOptions& o = {}) {
  static_assert(B::kDevice, "the probe measures a machine with a GPU (a backend with device memory)");
  MT_CHECK(seq > 0 && o.tokens > 0 && o.repeats > 0, "probe: sequence length, tokens and repeats must be > 0");
  MachineFigures m;
  m.name = std::move(name);
  detail::MachineProbe<B> p(be, cfg, seq, o);
  detail::GemmProbe g = detail::probe_gemm(p, m);
  detail::probe_attention(p, m);
  detail::probe_linear_attention(p, m);
  detail::probe_hbm(p, m);
  detail::probe_head(p, m, g);
  if constexpr (keeps_activations<B, DecoderBlock>) detail::probe_blocks(p, g, m);
  detail::probe_copies(p, m);
  return m;
}

#if MEGATRAIN_HAS_CUDA
extern template MachineFigures probe_machine<CudaBackend>(CudaBackend&, const ModelConfig&, std::int64_t, std::string,
                                                          const ProbeOptions&);
#endif

}  // namespace megatrain::plan
