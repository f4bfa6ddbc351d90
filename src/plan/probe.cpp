// The probe's host side (plan/probe.hpp), compiled once: its timers, its random values, and the
// host's AdamW alone and beside the PCIe copies.
#include "megatrain/plan/probe.hpp"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "megatrain/core/cpu_features.hpp"
#include "megatrain/optim/adamw.hpp"

namespace megatrain::plan::detail {

double best_seconds(int repeats, const std::function<void()>& f, const std::function<void()>& sync) {
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

double sustained_seconds(double min_s, const std::function<void()>& f, const std::function<void()>& sync) {
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

void host_adamw(std::vector<float>& p, std::vector<float>& m, std::vector<float>& v, const std::vector<float>& g,
                std::vector<bf16>& out) {
  AdamWConfig cfg;
  const auto s = AdamWScalars<float>::make(cfg, 1, 1e-4, cfg.weight_decay, 1.0);
  const SimdLevel level = active_simd_level();
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, p.size(), megatrain::detail::kOptimBlock), [&](const auto& r) {
    megatrain::detail::adamw_f32(level, s, p.data() + r.begin(), m.data() + r.begin(), v.data() + r.begin(), g.data() + r.begin(),
              out.data() + r.begin(), r.size());
  });
}

std::vector<float> probe_noise() {
  std::vector<float> noise(std::size_t{1} << 22);
  std::uint64_t r = 0x9e3779b97f4a7c15ULL;
  for (float& f : noise) {
    r ^= r << 13;
    r ^= r >> 7;
    r ^= r << 17;
    f = static_cast<float>(static_cast<double>(r >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  return noise;
}

void probe_adamw(const ProbeOptions& o, double gb, const std::function<void()>& round_trip, MachineFigures& m) {
  const std::size_t n = o.adamw_params;
  std::vector<float> p(n, 0.5f), mm(n, 0.0f), vv(n, 0.0f), g(n, 1e-3f);
  std::vector<bf16> out(n);
  const auto adamw = [&] { host_adamw(p, mm, vv, g, out); };
  m.adamw_gparams = static_cast<double>(n) / best_seconds(o.repeats, adamw, [] {}) / 1e9;
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
      round_trip();
      std::lock_guard<std::mutex> lock(done_mutex);
      ++done_rounds;
      done_ns = now_ns();
    }
  });
  const double s = best_seconds(o.repeats, adamw, [] {});
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

}  // namespace megatrain::plan::detail
