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

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/cpu_features.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/layers/layer_template.hpp"
#include "megatrain/layers/ops/decoder_block.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/plan/cost_model.hpp"

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
inline double best_seconds(int repeats, const std::function<void()>& f, const std::function<void()>& sync) {
  f();
  sync();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    sync();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

/// Seconds per run of f, run back to back for at least `min_s` after one warm-up (the GPU's
/// clocks as a whole step holds them, not a short burst's); `sync` ends the runs.
inline double sustained_seconds(double min_s, const std::function<void()>& f, const std::function<void()>& sync) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  sync();
  const double once = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int n = std::clamp(static_cast<int>(std::ceil(min_s / std::max(once, 1e-6))), 3, 1000);
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  sync();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
}

/// The host AdamW over n parameters (fp32 master, m, v, gradient; bf16 copy out), all cores.
inline void host_adamw(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v, const std::vector<float>& g,
                       std::vector<bf16>& out) {
  AdamWConfig cfg;
  const auto s = AdamWScalars<float>::make(cfg, 1, 1e-4, cfg.weight_decay, 1.0);
  const SimdLevel level = active_simd_level();
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, p.size(), megatrain::detail::kOptimBlock), [&](const auto& r) {
    megatrain::detail::adamw_f32(level, s, p.data() + r.begin(), m.data() + r.begin(), v.data() + r.begin(), g.data() + r.begin(),
              out.data() + r.begin(), r.size());
  });
}
}  // namespace detail

/// Measures this machine's rates on `be` (a backend with a device) at the shapes of `cfg` with
/// sequences of `seq` tokens. `name` labels the figures (e.g. the GPU's name).
template <class B>
MachineFigures probe_machine(B& be, const ModelConfig& cfg, std::int64_t seq, std::string name, const ProbeOptions& o = {}) {
  static_assert(B::kDevice, "the probe measures a machine with a GPU (a backend with device memory)");
  using A = typename B::Act;
  using W = typename B::Weight;
  MT_CHECK(seq > 0 && o.tokens > 0 && o.repeats > 0, "probe: sequence length, tokens and repeats must be > 0");
  MachineFigures m;
  m.name = std::move(name);
  const auto sync = [&] { be.synchronize(); };
  auto compute = be.make_executor(B::Role::compute);
  // Random values in [-1, 1) (products of zeros run faster than a step's: the GPU's clocks rise),
  // tiled from 4M host values
  std::vector<float> noise(std::size_t{1} << 22);
  {
    std::uint64_t r = 0x9e3779b97f4a7c15ULL;
    for (float& f : noise) {
      r ^= r << 13;
      r ^= r >> 7;
      r ^= r << 17;
      f = static_cast<float>(static_cast<double>(r >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
  }
  const auto randomize = [&](auto& buf) {
    using E = std::remove_reference_t<decltype(buf.span()[0])>;
    std::vector<E> tile(noise.size());
    for (std::size_t i = 0; i < tile.size(); ++i) tile[i] = static_cast<E>(noise[i] * 0.05f);
    const auto dst = buf.span();
    for (std::size_t at = 0; at < dst.size(); at += tile.size()) {
      const std::size_t k = std::min(tile.size(), dst.size() - at);
      be.upload(compute, std::span<const E>(tile).first(k), dst.subspan(at, k));
      be.synchronize();  // (the tile is pageable and reused)
    }
  };
  const std::int64_t S = std::min(seq, o.tokens), T = std::max<std::int64_t>(1, o.tokens / S) * S;
  const std::int64_t d = cfg.hidden_size, I = cfg.intermediate_size, qd = cfg.q_dim(), kd = cfg.kv_dim();
  const std::int64_t V = cfg.vocab_size;
  const std::int64_t widest = std::max({d, I, qd, kd});

  double block_gemm_flops = 0, head_gemm_s = 0, head_gemm_flops = 0;
  // Matrix products: a block's forward, and the head's
  {
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
      return detail::best_seconds(o.repeats, fwd, sync) + detail::best_seconds(o.repeats, bwd, sync);
    };
    randomize(x);
    randomize(w);
    be.zero(compute, dw.span());
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
    const double L = static_cast<double>(cfg.num_hidden_layers);
    m.gemm_tflops = (L * block_flops + head_flops) / (L * block_s + head_s) / 1e12;
    block_gemm_flops = block_flops;
    head_gemm_s = head_s;
    head_gemm_flops = head_flops;
  }
  // Attention at the model's heads and this sequence length
  {
    const AttentionShape as{T / S, S, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, {}};
    if constexpr (requires { typename B::WorkspacePlan; }) {
      WorkspacePlan wp;
      wp.max_tokens = T;
      wp.max_width = widest;
      wp.vocab = V;
      wp.attention.push_back({as.rows, as.seq, as.heads, as.kv_heads, as.head_dim});
      be.prepare(wp);
    }
    auto q = be.template alloc<A>(static_cast<std::size_t>(T * qd)), out = be.template alloc<A>(static_cast<std::size_t>(T * qd));
    auto dout = be.template alloc<A>(static_cast<std::size_t>(T * qd)), dq = be.template alloc<A>(static_cast<std::size_t>(T * qd));
    auto k = be.template alloc<A>(static_cast<std::size_t>(T * kd)), v = be.template alloc<A>(static_cast<std::size_t>(T * kd));
    auto dk = be.template alloc<A>(static_cast<std::size_t>(T * kd)), dv = be.template alloc<A>(static_cast<std::size_t>(T * kd));
    auto lse = be.template alloc<typename B::Acc>(static_cast<std::size_t>(T * cfg.num_attention_heads));
    for (auto* b : {&q, &k, &v, &dout}) randomize(*b);
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
    const double fwd_s = detail::best_seconds(
        o.repeats, [&] { be.attention(cv(q, T, qd), cv(k, T, kd), cv(v, T, kd), mv(out, T, qd), lv, as); }, sync);
    const double bwd_s = detail::best_seconds(
        o.repeats,
        [&] {
          be.attention_backward(cv(q, T, qd), cv(k, T, kd), cv(v, T, kd), cv(out, T, qd),
                                View<const typename B::Acc>(lv), cv(dout, T, qd), mv(dq, T, qd), mv(dk, T, kd),
                                mv(dv, T, kd), as);
        },
        sync);
    m.attention_fwd_tflops = fwd_flops / fwd_s / 1e12;
    m.attention_bwd_tflops = 2.5 * fwd_flops / bwd_s / 1e12;
  }
  // Device memory: y += x over 1 GiB of bf16 each
  {
    const std::size_t n = (std::size_t{1} << 30) / sizeof(A);
    auto a = be.template alloc<A>(n), b = be.template alloc<A>(n);
    be.zero(compute, a.span());
    be.zero(compute, b.span());
    const auto N = static_cast<std::int64_t>(n);
    const double s = detail::best_seconds(
        o.repeats, [&] { be.add(View<const A>(std::span<const A>(a.span()), Shape{N}), View<A>(b.span(), Shape{N})); }, sync);
    m.hbm_gbs = 3.0 * static_cast<double>(n * sizeof(A)) / s / 1e9;
  }
  // The head as a step runs it (Backend::lm_head_loss: the logits in blocks, fp32, the loss and
  // both products back), sustained: its products' time is what remains after the cost model's
  // loss pass over the logits (kLossBytesPerLogit at hbm_gbs)
  {
    auto h = be.template alloc<A>(static_cast<std::size_t>(T * d)), dh = be.template alloc<A>(static_cast<std::size_t>(T * d));
    auto wh = be.template alloc<W>(static_cast<std::size_t>(V * d));
    auto dwh = be.template alloc<typename B::Acc>(static_cast<std::size_t>(V * d));
    auto labels = be.template alloc<std::int32_t>(static_cast<std::size_t>(T));
    auto loss = be.template alloc<typename B::Acc>(static_cast<std::size_t>(T));
    randomize(h);
    randomize(wh);
    be.zero(compute, labels.span());
    be.zero(compute, dwh.span());
    const double head_s = detail::sustained_seconds(
        0.3,
        [&] {
          be.lm_head_loss(View<const A>(std::span<const A>(h.span()), Shape{T, d}),
                          View<const W>(std::span<const W>(wh.span()), Shape{V, d}),
                          View<const std::int32_t>(std::span<const std::int32_t>(labels.span()), Shape{T}),
                          1.0 / static_cast<double>(T), View<typename B::Acc>(loss.span(), Shape{T}),
                          View<A>(dh.span(), Shape{T, d}), View<typename B::Acc>(dwh.span(), Shape{V, d}));
        },
        sync);
    const double loss_s = kLossBytesPerLogit * static_cast<double>(T) * static_cast<double>(V) / (m.hbm_gbs * 1e9);
    if (head_s - loss_s > 0.5 * head_s) head_gemm_s = head_s - loss_s;
  }
  // A whole decoder block forward and backward, as the trainer runs it (activations kept): the
  // matrix products alone run faster than inside a step, so their rate is the one that makes the
  // cost model's block time (matrix products + attention + element-wise passes) the measured one
  if constexpr (keeps_activations<B, DecoderBlock>) {
    using R = typename B::Res;
    const ChunkShape c{T / S, S};
    const auto tn = static_cast<std::size_t>(T * d);
    auto x = be.template alloc<R>(tn), y = be.template alloc<R>(tn), dy = be.template alloc<R>(tn), dx = be.template alloc<R>(tn);
    for (auto* b : {&x, &dy}) randomize(*b);
    const View<const R> xv(std::span<const R>(x.span()), Shape{T, d}), dyv(std::span<const R>(dy.span()), Shape{T, d});
    // block `layer`'s forward and backward, sustained; and its parameters
    const auto time_block = [&](std::int64_t layer, double& params) {
      const LayerTemplate<DecoderBlock> blk(DecoderBlock(cfg, layer));
      const auto n = static_cast<std::size_t>(blk.layout().numel()), nf = static_cast<std::size_t>(blk.full_layout().numel());
      params = static_cast<double>(n + nf);
      auto wb = be.template alloc<W>(n);
      auto gb = be.template alloc<float>(std::max<std::size_t>(nf, 1));
      auto acc = be.template alloc<typename B::Acc>(n);
      randomize(wb);
      randomize(gb);
      be.zero(compute, acc.span());
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
      return detail::sustained_seconds(
          0.5,
          [&] {
            Arena kept_fwd(kept_mem.span()), kept_bwd(kept_mem.span());
            blk.op().forward_keep(be, c, w, xv, View<R>(y.span(), Shape{T, d}), kept_fwd, scratch);
            blk.op().backward_kept(be, c, w, xv, dyv, View<R>(dx.span(), Shape{T, d}), g, kept_bwd, scratch);
          },
          sync);
    };
    // the cost model's other terms of block `layer` (predict_step's attention and element-wise bytes)
    const double att_fwd = 2.0 * static_cast<double>(T) * static_cast<double>(S) * static_cast<double>(qd);
    const auto other_s = [&](std::int64_t layer) {
      return att_fwd / (m.attention_fwd_tflops * 1e12) + 2.5 * att_fwd / (m.attention_bwd_tflops * 1e12) +
             static_cast<double>(T) * block_elementwise_bytes(cfg, layer) / (m.hbm_gbs * 1e9);
    };
    std::int64_t dense = -1, sparse = -1;
    for (std::int64_t l = cfg.num_hidden_layers - 1; l >= 0; --l) (cfg.is_moe_layer(l) ? sparse : dense) = l;
    if (dense >= 0) {  // the matrix products' rate that makes the cost model's dense block the measured one
      double params = 0;
      const double block_s = time_block(dense, params);
      const double gemm_s = block_s - other_s(dense);
      if (gemm_s > 0.25 * block_s) {  // (else the products are too small a part to say their rate)
        const double L = static_cast<double>(cfg.num_hidden_layers);
        m.gemm_tflops = (L * block_gemm_flops + head_gemm_flops) / (L * gemm_s + head_gemm_s) / 1e12;
      }
    }
    if (sparse >= 0) {  // the experts' rate that makes the cost model's sparse block the measured one
      double params = 0;
      const double block_s = time_block(sparse, params);
      const double k = static_cast<double>(cfg.moe.experts_per_token), E = static_cast<double>(cfg.moe.num_experts);
      const double expert = 3.0 * static_cast<double>(d) * static_cast<double>(cfg.moe.intermediate_size);
      const double Tt = static_cast<double>(T);
      // (kept: the attention's products 6 x, the experts' 8 x, as predict_step counts them)
      const double dense_s = 6.0 * (params - E * expert) * Tt / (m.gemm_tflops * 1e12);
      const double expert_s = block_s - other_s(sparse) - dense_s;
      if (expert_s > 0.25 * block_s) m.moe_gemm_tflops = 8.0 * k * expert * Tt / expert_s / 1e12;
    }
  }
  // PCIe: pinned copies each way, then both at once
  const std::size_t cb = o.copy_bytes / 4 * 4;
  HostBuffer up_host = HostBuffer::allocate(cb), down_host = HostBuffer::allocate(cb);
  auto up_dev = be.template alloc<float>(cb / 4), down_dev = be.template alloc<float>(cb / 4);
  const auto up_src = up_host.template as<float>(0, cb / 4), down_dst = down_host.template as<float>(0, cb / 4);
  std::fill(up_src.begin(), up_src.end(), 1.0f);
  be.zero(compute, down_dev.span());
  be.synchronize();
  auto up = be.make_executor(B::Role::upload), down = be.make_executor(B::Role::download);
  const auto h2d = [&] { be.upload(up, std::span<const float>(up_src), up_dev.span()); };
  const auto d2h = [&] { be.download(down, std::span<const float>(down_dev.span()), down_dst); };
  const double gb = static_cast<double>(cb) / 1e9;
  m.h2d_gbs = gb / detail::best_seconds(o.repeats, h2d, [&] { up.synchronize(); });
  m.d2h_gbs = gb / detail::best_seconds(o.repeats, d2h, [&] { down.synchronize(); });
  m.duplex_gbs = 2 * gb / detail::best_seconds(
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
  {
    const std::size_t n = o.adamw_params;
    std::vector<float> p(n, 0.5f), mm(n, 0.0f), vv(n, 0.0f), g(n, 1e-3f);
    std::vector<bf16> out(n);
    const auto adamw = [&] { detail::host_adamw(p, mm, vv, g, out); };
    m.adamw_gparams = static_cast<double>(n) / detail::best_seconds(o.repeats, adamw, [] {}) / 1e9;
    std::atomic<bool> stop{false};
    // (rounds of copies both ways completed, and when the last one completed)
    std::mutex done_mutex;
    std::int64_t done_rounds = 0, done_ns = 0;
    const auto now_ns = [] {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
    const auto done = [&] {
      std::lock_guard<std::mutex> lock(done_mutex);
      return std::pair{done_rounds, done_ns};
    };
    std::thread copies([&] {
      while (!stop.load()) {
        h2d();
        d2h();
        up.synchronize();
        down.synchronize();
        std::lock_guard<std::mutex> lock(done_mutex);
        ++done_rounds;
        done_ns = now_ns();
      }
    });
    const double s = detail::best_seconds(o.repeats, adamw, [] {});
    // What the copies move while AdamW runs back to back (the AdamW pass beside a forward: the
    // host's memory serves both): the rounds completed between a completion and the first one
    // at least pass_seconds later, within 30 s (a link that slow keeps the reference figure).
    const std::int64_t start = now_ns(), limit = 30'000'000'000;
    const std::int64_t first = done().first;
    while (done().first == first && now_ns() - start < limit) adamw();
    const auto [r0, t0] = done();
    while ((done().second - t0 < static_cast<std::int64_t>(o.pass_seconds * 1e9) || done().first - r0 < 2) &&
           now_ns() - start < limit)
      adamw();
    const auto [r1, t1] = done();
    stop = true;
    copies.join();
    m.adamw_dma_gparams = static_cast<double>(n) / s / 1e9;
    if (r0 > 0 && r1 - r0 >= 1 && t1 > t0) m.pass_copies_gbs = static_cast<double>(r1 - r0) * 2 * gb / (static_cast<double>(t1 - t0) / 1e9);
  }
  return m;
}

}  // namespace megatrain::plan
