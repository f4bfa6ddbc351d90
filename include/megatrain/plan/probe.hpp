// The probe: this machine's rates for the cost model (plan::MachineFigures), measured at a
// model's own shapes, once, and kept in a JSON file that megatrain-plan reads
// (`megatrain-plan --probe`, docs/planner.md).
//
//   gemm_tflops           a block's forward matrix products (q, k, v, o, gate, up, down) over a
//                         chunk of tokens, and the LM head's, weighted as a step runs them
//   attention_*_tflops    the backend's causal attention forward and backward at the model's
//                         heads and sequence length, FLOPs counted as the cost model counts them
//                         (2 T S q_dim forward, 2.5 times that backward)
//   hbm_gbs               an element-wise add over 1 GiB (bytes read and written)
//   h2d_gbs, d2h_gbs      pinned copies of ProbeOptions::copy_bytes each way; duplex_gbs both at once
//   adamw_gparams         the host optimizer's AdamW (all cores, the widest vector path) over
//                         ProbeOptions::adamw_params; adamw_dma_gparams the same while copies run
//                         both ways
// Each figure is the best of ProbeOptions::repeats timed runs after one warm-up.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/cpu_features.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/plan/cost_model.hpp"

namespace megatrain::plan {

struct ProbeOptions {
  std::int64_t tokens = 16384;               ///< tokens of a chunk for the matrix products and attention
  std::size_t copy_bytes = std::size_t{1} << 30;  ///< bytes of each PCIe copy
  std::size_t adamw_params = std::size_t{1} << 26;  ///< parameters of the AdamW run
  int repeats = 5;
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
  const std::int64_t S = std::min(seq, o.tokens), T = std::max<std::int64_t>(1, o.tokens / S) * S;
  const std::int64_t d = cfg.hidden_size, I = cfg.intermediate_size, qd = cfg.q_dim(), kd = cfg.kv_dim();
  const std::int64_t V = cfg.vocab_size;
  const std::int64_t widest = std::max({d, I, qd, kd});

  // Matrix products: a block's forward, and the head's
  {
    auto x = be.template alloc<A>(static_cast<std::size_t>(T * widest));
    auto y = be.template alloc<A>(static_cast<std::size_t>(T * std::max(widest, std::min<std::int64_t>(V, 32768))));
    auto w = be.template alloc<W>(static_cast<std::size_t>(std::max(widest * widest, std::min<std::int64_t>(V, 32768) * d)));
    const auto run = [&](std::int64_t in, std::int64_t out) {  // y[T, out] = x[T, in] W[out, in]^T
      const View<const A> xv(std::span<const A>(x.span()).first(static_cast<std::size_t>(T * in)), Shape{T, in});
      const View<const W> wv(std::span<const W>(w.span()).first(static_cast<std::size_t>(out * in)), Shape{out, in});
      const View<A> yv(y.span().first(static_cast<std::size_t>(T * out)), Shape{T, out});
      return detail::best_seconds(o.repeats, [&] { be.linear(xv, wv, View<const W>{}, yv); }, sync);
    };
    be.zero(compute, x.span());  // (the contents do not matter to the rates)
    be.zero(compute, w.span());
    double block_s = 0, block_flops = 0;
    for (const auto& [in, out] : {std::pair{d, qd}, std::pair{d, kd}, std::pair{d, kd}, std::pair{qd, d}, std::pair{d, I},
                                  std::pair{d, I}, std::pair{I, d}}) {
      block_s += run(in, out);
      block_flops += 2.0 * static_cast<double>(T) * static_cast<double>(in) * static_cast<double>(out);
    }
    // the head: the vocabulary in slices of at most 32,768 rows, as a whole head's share
    const std::int64_t vs = std::min<std::int64_t>(V, 32768);
    const double head_s = run(d, vs) * static_cast<double>(V) / static_cast<double>(vs);
    const double head_flops = 2.0 * static_cast<double>(T) * static_cast<double>(d) * static_cast<double>(V);
    const double L = static_cast<double>(cfg.num_hidden_layers);
    m.gemm_tflops = (L * block_flops + head_flops) / (L * block_s + head_s) / 1e12;
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
    for (auto* b : {&q, &k, &v, &dout}) be.zero(compute, b->span());
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
    std::thread copies([&] {
      while (!stop.load()) {
        h2d();
        d2h();
        up.synchronize();
        down.synchronize();
      }
    });
    const double s = detail::best_seconds(o.repeats, adamw, [] {});
    stop = true;
    copies.join();
    m.adamw_dma_gparams = static_cast<double>(n) / s / 1e9;
  }
  return m;
}

}  // namespace megatrain::plan
