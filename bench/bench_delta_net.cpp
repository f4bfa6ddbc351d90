// Gated DeltaNet's mixing on the GPU (backend/cuda/gated_deltanet.hpp): the forward and the
// backward of one linear-attention layer's mixing, timed with CUDA events after a warm-up, on
// the heads of published Qwen3.5 models, in rows of a few lengths. Prints milliseconds, tokens
// per second, the workspace, and the delta rule's TFLOP/s by the nominal count below.
//
// Nominal FLOPs of the delta rule a token and value head (dk = dv = d, chunk C): the forward's
// K S, Q S and state update (3 products of 2 d^2) and its chunk matrices (K K^T and Q K^T
// halved, the substitution and M delta: 2 C d + C d); the backward counts 2.5 times the forward
// (it recomputes the forward's states, walks the state's gradient, and takes q, k, g and beta).
//
//   bench_delta_net [--reps 10] [--cases 5]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "megatrain/backend/cuda/gated_deltanet.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/dtype.hpp"

namespace {

using megatrain::bf16;
using megatrain::DeltaNetShape;

struct Case {
  const char* name;
  DeltaNetShape shape;
  std::int64_t rows, seq;
};

/// n values of N(mean, scale^2) on the device: 1M drawn on the host, repeated from varying offsets.
template <class T>
T* device_random(std::size_t n, float scale, float mean, std::mt19937& rng) {
  constexpr std::size_t kDrawn = std::size_t{1} << 20;
  std::normal_distribution<float> nd(mean, scale);
  std::vector<T> h(std::min(n, kDrawn));
  for (auto& v : h) v = T(nd(rng));
  T* d = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
  std::uniform_int_distribution<std::size_t> start(0, h.size() / 2);
  for (std::size_t at = 0; at < n;) {
    const std::size_t s = at == 0 ? 0 : start(rng), len = std::min(n - at, h.size() - s);
    MT_CUDA_CHECK(cudaMemcpy(d + at, h.data() + s, len * sizeof(T), cudaMemcpyHostToDevice));
    at += len;
  }
  return d;
}
template <class T>
T* device_zeros(std::size_t n) {
  T* d = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
  MT_CUDA_CHECK(cudaMemset(d, 0, n * sizeof(T)));
  return d;
}

double nominal_forward_flops(const DeltaNetShape& s, std::int64_t tokens) {
  const double d = static_cast<double>(s.dk), C = static_cast<double>(megatrain::kDeltaRuleChunk);
  return static_cast<double>(tokens) * static_cast<double>(s.value_heads) * (6 * d * d + 3 * C * d);
}

void run(const Case& c, int reps) {
  const DeltaNetShape& s = c.shape;
  const std::int64_t T = c.rows * c.seq, cd = s.conv_dim(), vd = s.value_dim(), Hv = s.value_heads;
  std::mt19937 rng(11);
  const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  megatrain::cuda::DeltaNetInputs in{device_random<bf16>(n(T * cd), 1.0f, 0.0f, rng), device_random<bf16>(n(T * vd), 1.0f, 0.0f, rng),
                                     device_random<bf16>(n(T * Hv), 1.0f, 0.0f, rng), device_random<bf16>(n(T * Hv), 1.0f, 0.0f, rng),
                                     device_random<bf16>(n(cd * s.taps), 0.5f, 0.0f, rng),
                                     device_random<float>(n(Hv), 0.5f, 1.0f, rng), device_random<float>(n(Hv), 0.3f, 1.0f, rng),
                                     device_random<float>(n(s.dv), 0.1f, 1.0f, rng)};
  bf16 *o = device_zeros<bf16>(n(T * vd)), *y = device_zeros<bf16>(n(T * vd));
  bf16* dy = device_random<bf16>(n(T * vd), 1.0f, 0.0f, rng);
  float* rstd = device_zeros<float>(n(T * Hv));
  megatrain::cuda::DeltaNetGrads g{device_zeros<bf16>(n(T * cd)), device_zeros<bf16>(n(T * vd)), device_zeros<bf16>(n(T * Hv)),
                                   device_zeros<bf16>(n(T * Hv)),  device_zeros<float>(n(cd * s.taps)), device_zeros<float>(n(Hv)),
                                   device_zeros<float>(n(Hv)),     device_zeros<float>(n(s.dv))};
  megatrain::cuda::DeltaNetSequences q;
  q.tokens = T;
  q.count = c.rows;
  q.seq = c.seq;
  const std::size_t bytes = megatrain::delta_net_workspace_bytes(s, T, q.count, true);
  void* ws = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&ws, bytes));
  cudaStream_t st = nullptr;
  MT_CUDA_CHECK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1, e2;
  MT_CUDA_CHECK(cudaEventCreate(&e0));
  MT_CUDA_CHECK(cudaEventCreate(&e1));
  MT_CUDA_CHECK(cudaEventCreate(&e2));
  float fwd = 0, bwd = 0;
  for (int r = -1; r < reps; ++r) {  // (r = -1: the warm-up)
    MT_CUDA_CHECK(cudaEventRecord(e0, st));
    megatrain::cuda::launch_delta_net_forward(s, q, in, o, rstd, y, ws, bytes, st);
    MT_CUDA_CHECK(cudaEventRecord(e1, st));
    megatrain::cuda::launch_delta_net_backward(s, q, in, o, rstd, dy, g, ws, bytes, st);
    MT_CUDA_CHECK(cudaEventRecord(e2, st));
    MT_CUDA_CHECK(cudaEventSynchronize(e2));
    float a = 0, b = 0;
    MT_CUDA_CHECK(cudaEventElapsedTime(&a, e0, e1));
    MT_CUDA_CHECK(cudaEventElapsedTime(&b, e1, e2));
    if (r >= 0) {
      fwd += a / static_cast<float>(reps);
      bwd += b / static_cast<float>(reps);
    }
  }
  const double flops = nominal_forward_flops(s, T);
  std::printf("| %s | %lld x %lld | %.2f | %.2f | %.0f | %.1f | %.1f | %.2f |\n", c.name, static_cast<long long>(c.rows),
              static_cast<long long>(c.seq), fwd, bwd, static_cast<double>(T) / ((fwd + bwd) * 1e-3), flops / (fwd * 1e9),
              2.5 * flops / (bwd * 1e9), static_cast<double>(bytes) / 1073741824.0);
  std::fflush(stdout);
  for (void* p : {static_cast<void*>(const_cast<bf16*>(in.mixed)), static_cast<void*>(const_cast<bf16*>(in.z)),
                  static_cast<void*>(const_cast<bf16*>(in.a)), static_cast<void*>(const_cast<bf16*>(in.b)),
                  static_cast<void*>(const_cast<bf16*>(in.conv)), static_cast<void*>(const_cast<float*>(in.A_log)),
                  static_cast<void*>(const_cast<float*>(in.dt_bias)), static_cast<void*>(const_cast<float*>(in.norm)),
                  static_cast<void*>(o), static_cast<void*>(y), static_cast<void*>(dy), static_cast<void*>(rstd),
                  static_cast<void*>(g.mixed), static_cast<void*>(g.z), static_cast<void*>(g.a), static_cast<void*>(g.b),
                  static_cast<void*>(g.conv), static_cast<void*>(g.A_log), static_cast<void*>(g.dt_bias),
                  static_cast<void*>(g.norm), ws})
    MT_CUDA_CHECK(cudaFree(p));
  MT_CUDA_CHECK(cudaStreamDestroy(st));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_delta_net: Gated DeltaNet's mixing on the GPU, forward and backward"};
  int reps = 10;
  std::size_t cases = 5;
  app.add_option("--reps", reps, "Timed repetitions after one warm-up")->capture_default_str();
  app.add_option("--cases", cases, "Run the first N cases of the table")->capture_default_str()->check(CLI::Range(1, 5));
  CLI11_PARSE(app, argc, argv);
  const DeltaNetShape q27{16, 48, 128, 128, 4, 1e-6}, q2{16, 16, 128, 128, 4, 1e-6};
  std::printf("| heads | rows x seq | forward ms | backward ms | tokens/s | forward TFLOP/s | backward TFLOP/s | workspace GiB |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  const Case all[] = {{"Qwen3.5-27B (16 / 48)", q27, 8, 4096}, {"Qwen3.5-27B (16 / 48)", q27, 1, 32768},
                      {"Qwen3.5-2B (16 / 16)", q2, 8, 4096}, {"Qwen3.5-2B (16 / 16)", q2, 1, 131072},
                      {"Qwen3.5-2B (16 / 16)", q2, 1, 1048576}};
  for (std::size_t i = 0; i < cases; ++i) run(all[i], reps);
  return 0;
}
