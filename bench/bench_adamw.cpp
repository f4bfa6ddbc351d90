// AdamW on the CPU at out-of-cache sizes (1 GiB per fp32 state array: 2^28 parameters), at one
// thread and at all threads, on the run-time-selected vector path (MEGATRAIN_SIMD=scalar|avx2|
// avx512 to force one). Rates: items/s = parameters/s; bytes/s counts the 30 bytes each
// parameter moves (reads g, p, m, v; writes p, m, v and the bf16 copy).
//
// BM_TrafficCeiling moves exactly the same bytes with trivial arithmetic: the memory-bound
// ceiling for this machine at the same thread count. adamw / ceiling is the fraction of that
// ceiling the optimizer reaches. bench/run_adamw.sh runs this and PyTorch's CPU AdamW (the peer)
// and prints the ratios.
#include <benchmark/benchmark.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>

#include <bit>
#include <cstdlib>
#include <memory>
#include <thread>

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

int thread_arg(const benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  return t > 0 ? t : static_cast<int>(std::thread::hardware_concurrency());
}

void set_rates(benchmark::State& state, std::int64_t n) {
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * 30);
  state.counters["threads"] = thread_arg(state);
  state.SetLabel(std::string(simd_level_name(active_simd_level())));
}

void BM_AdamW(benchmark::State& state) {
  auto& f = fixture();
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(thread_arg(state)));
  const auto& u = f.store->unit(0);
  const auto g = f.store->grad_slot(0);
  AdamWConfig cfg;
  std::int64_t step = 0;
  for (auto _ : state) adamw_step<float>(u, g, cfg, ++step, 1e-4);
  set_rates(state, u.numel());
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

void BM_TrafficCeiling(benchmark::State& state) {
  auto& f = fixture();
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(thread_arg(state)));
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
  set_rates(state, u.numel());
}

}  // namespace

BENCHMARK(BM_AdamW)->Arg(1)->Arg(0)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK(BM_TrafficCeiling)->Arg(1)->Arg(0)->ArgName("threads")->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK_MAIN();
