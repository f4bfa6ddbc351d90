// AdamW on the CPU at out-of-cache sizes (1 GiB per fp32 state array: 2^28 parameters; set
// MEGATRAIN_BENCH_PARAMS=N for another size), at one thread (BM_AdamW/threads:1) and at all the
// machine's hardware threads (BM_AdamW/threads:all_N, N the count), on the run-time-selected
// vector path (MEGATRAIN_SIMD=scalar|avx2|avx512 to force one; the label names it). Rates, as
// counters: "params/s" (parameters updated per second) and "bytes/s" (kBytesPerParam = 30
// bytes moved per parameter: reads g, p, m, v, 16 B; writes p, m, v, 12 B, and the bf16 copy,
// 2 B).
//
// BM_TrafficCeiling moves exactly the same bytes with trivial arithmetic: the memory-bound
// ceiling for this machine at the same thread count. adamw / ceiling is the fraction of that
// ceiling the optimizer reaches. bench/run_adamw.py runs this and PyTorch's CPU AdamW (the
// peer) and prints the ratios.
#include <benchmark/benchmark.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "megatrain/optim/adamw.hpp"

using namespace megatrain;

namespace {

std::int64_t bench_params() {
  if (const char* e = std::getenv("MEGATRAIN_BENCH_PARAMS")) return std::atoll(e);
  return std::int64_t{1} << 28;  // 1 GiB per fp32 array
}

struct Fixture {
  std::unique_ptr<HostParamStore<float>> store;
  Fixture() {
    StoreOptions o;
    o.grad_ring_slots = 1;
    o.pinning = Pinning::never;
    const std::int64_t n = bench_params();
    store = std::make_unique<HostParamStore<float>>(
        std::vector<UnitSpec>{{"unit", {ParamSpec::matrix("w", Shape{n / 1024, 1024})}}}, o);
    auto g = store->grad_slot(0);
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, g.size()), [&](const auto& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i)
        g[i] = static_cast<float>(1e-3 * detail::normal_sample(99, i));
    });
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

constexpr std::int64_t kBytesPerParam = 30;

int all_threads() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

void set_rates(benchmark::State& state, std::int64_t n, int threads) {
  const auto params = static_cast<double>(state.iterations()) * static_cast<double>(n);
  state.counters["params/s"] = benchmark::Counter(params, benchmark::Counter::kIsRate);
  state.counters["bytes/s"] = benchmark::Counter(params * kBytesPerParam, benchmark::Counter::kIsRate);
  state.counters["tbb_threads"] = threads;
  state.SetLabel(std::string(simd_level_name(active_simd_level())));
}

void BM_AdamW(benchmark::State& state, int threads) {
  auto& f = fixture();
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));
  const auto& u = f.store->unit(0);
  const auto g = f.store->grad_slot(0);
  AdamWConfig cfg;
  std::int64_t step = 0;
  for (auto _ : state) adamw_step<float>(u, g, cfg, ++step, 1e-4);
  set_rates(state, u.numel(), threads);
}

// Same bytes as AdamW, trivial arithmetic, vectorised for the same instruction set.
template <class F>
void traffic_pass(float* __restrict p, float* __restrict m, float* __restrict v, std::uint16_t* __restrict out,
                  const float* __restrict g, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float pn = p[i] + gi;
    p[i] = pn;
    m[i] += gi;
    v[i] += gi;
    out[i] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(pn) >> 16);
  }
}
__attribute__((target("avx512f,avx512bw,avx512vl,prefer-vector-width=512"))) void traffic_avx512(
    float* __restrict p, float* __restrict m, float* __restrict v, std::uint16_t* __restrict out,
    const float* __restrict g, std::size_t n) {
  traffic_pass<struct Avx512>(p, m, v, out, g, n);
}
__attribute__((target("avx2"))) void traffic_avx2(float* __restrict p, float* __restrict m, float* __restrict v,
                                                   std::uint16_t* __restrict out, const float* __restrict g,
                                                   std::size_t n) {
  traffic_pass<struct Avx2>(p, m, v, out, g, n);
}

void BM_TrafficCeiling(benchmark::State& state, int threads) {
  auto& f = fixture();
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));
  const auto& u = f.store->unit(0);
  float* p = u.master().data();
  float* m = u.adam_m().data();
  float* v = u.adam_v().data();
  auto* out = reinterpret_cast<std::uint16_t*>(u.compute().data());
  const float* g = f.store->grad_slot(0).data();
  const auto n = static_cast<std::size_t>(u.numel());
  const SimdLevel level = active_simd_level();
  for (auto _ : state) {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, detail::kOptimBlock), [&](const auto& r) {
      const std::size_t b = r.begin(), len = r.size();
      if (level == SimdLevel::avx512) traffic_avx512(p + b, m + b, v + b, out + b, g + b, len);
      else if (level == SimdLevel::avx2) traffic_avx2(p + b, m + b, v + b, out + b, g + b, len);
      else traffic_pass<void>(p + b, m + b, v + b, out + b, g + b, len);
    });
  }
  set_rates(state, u.numel(), threads);
}

// Registered by hand so that the all-threads case carries its name and count:
// BM_AdamW/threads:1 and BM_AdamW/threads:all_16 on a 16-thread machine.
void register_benchmarks() {
  std::vector<int> counts = {1};
  if (all_threads() > 1) counts.push_back(all_threads());
  for (const auto& [name, fn] : {std::pair{"BM_AdamW", &BM_AdamW}, std::pair{"BM_TrafficCeiling", &BM_TrafficCeiling}}) {
    for (int t : counts) {
      const std::string full = std::string(name) + "/threads:" + (t == 1 ? "1" : "all_" + std::to_string(t));
      benchmark::RegisterBenchmark(full.c_str(), fn, t)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
