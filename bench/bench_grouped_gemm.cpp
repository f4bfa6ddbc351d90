// The experts' grouped products of a mixture-of-experts layer: megatrain's kernels (one launch
// per product, the row offsets read on the device) against cuBLAS on the same routing, timed
// with CUDA events, with the largest difference between the two printed beside the times.
// cuBLAS's way needs the row counts on the host (a synchronisation per routing, not counted here):
// cublasGemmGroupedBatchedEx where it takes the types (the forward and input gradient, bf16
// results), else one cublasGemmEx per expert with rows (the weight gradient: bf16 x bf16 ->
// fp32, which cuBLAS 13's grouped GEMM refuses).
//
//   bench_grouped_gemm [--tokens 16384] [--reps 20]
// Shapes: the experts of Qwen3-30B-A3B, GPT-OSS-120B and Mixtral 8x7B (hidden, expert
// intermediate, experts, per token); the gate/up product is [2 x intermediate, hidden] as one.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "megatrain/backend/cuda/kernels.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/dtype.hpp"

namespace {

using megatrain::bf16;

struct Shape {
  const char* name;
  std::int64_t hidden, inter, experts, top_k;
};

/// n values of N(0, scale^2) on the device: 1M drawn on the host, repeated (a product's operands
/// need not be all distinct to time it; the repeats start at varying offsets of the draw).
template <class T>
T* device_random(std::size_t n, float scale, std::mt19937& rng) {
  constexpr std::size_t kDrawn = std::size_t{1} << 20;
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<T> h(kDrawn);
  for (auto& v : h) v = T(nd(rng));
  T* d = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
  std::uniform_int_distribution<std::size_t> start(0, kDrawn / 2);
  for (std::size_t at = 0; at < n;) {
    const std::size_t s = start(rng), len = std::min(n - at, kDrawn - s);
    MT_CUDA_CHECK(cudaMemcpy(d + at, h.data() + s, len * sizeof(T), cudaMemcpyHostToDevice));
    at += len;
  }
  return d;
}

/// The first min(n, 16M) elements, as floats.
template <class T>
std::vector<float> to_host(const T* d, std::size_t n) {
  n = std::min(n, std::size_t{1} << 24);
  std::vector<T> h(n);
  MT_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = static_cast<float>(h[i]);
  return f;
}

/// max |a - b| / max |b|
double difference(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    m = std::max(m, static_cast<double>(std::abs(b[i])));
  }
  return m > 0 ? d / m : d;
}

template <class F>
double time_ms(cudaStream_t s, int reps, F&& f) {
  f();  // warm-up
  cudaEvent_t a, b;
  MT_CUDA_CHECK(cudaEventCreate(&a));
  MT_CUDA_CHECK(cudaEventCreate(&b));
  MT_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) f();
  MT_CUDA_CHECK(cudaEventRecord(b, s));
  MT_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return static_cast<double>(ms) / reps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatrain's grouped expert products against cuBLAS"};
  std::int64_t tokens = 16384;
  int reps = 20;
  app.add_option("--tokens", tokens, "tokens in the block (rows = tokens x experts per token)");
  app.add_option("--reps", reps, "timed repetitions");
  CLI11_PARSE(app, argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  const Shape shapes[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8}, {"gpt-oss-120b", 2880, 2880, 128, 4},
                          {"mixtral-8x7b", 4096, 14336, 8, 2}};
  cudaStream_t s;
  MT_CUDA_CHECK(cudaStreamCreate(&s));
  cublasHandle_t h;
  MT_CUDA_CHECK(cublasCreate(&h));
  MT_CUDA_CHECK(cublasSetStream(h, s));
  std::mt19937 rng(7);
  std::printf("| shape | product | [N, K] | rows | megatrain ms | TFLOP/s | cuBLAS ms | TFLOP/s | cuBLAS way | ratio | max diff |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes) {
    const std::int64_t E = sh.experts, R = tokens * sh.top_k;
    // A routing: each of the R assignments to an expert drawn with skewed odds (some experts
    // get several times the mean, a few none), the rows grouped by expert.
    std::vector<double> odds(static_cast<std::size_t>(E));
    std::exponential_distribution<double> ex(1.0);
    for (auto& o : odds) o = ex(rng);
    if (E > 8) odds[1] = odds[static_cast<std::size_t>(E - 1)] = 0.0;  // experts without rows
    std::discrete_distribution<std::int64_t> pick(odds.begin(), odds.end());
    std::vector<std::int64_t> counts(static_cast<std::size_t>(E)), offsets(static_cast<std::size_t>(E + 1));
    for (std::int64_t r = 0; r < R; ++r) ++counts[static_cast<std::size_t>(pick(rng))];
    for (std::int64_t e = 0; e < E; ++e) offsets[static_cast<std::size_t>(e + 1)] = offsets[static_cast<std::size_t>(e)] + counts[static_cast<std::size_t>(e)];
    std::int64_t* doff = nullptr;
    MT_CUDA_CHECK(cudaMalloc(&doff, offsets.size() * sizeof(std::int64_t)));
    MT_CUDA_CHECK(cudaMemcpy(doff, offsets.data(), offsets.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice));

    struct Product {
      const char* name;
      std::int64_t N, K;
    };
    const Product products[] = {{"gate+up", 2 * sh.inter, sh.hidden}, {"down", sh.hidden, sh.inter}};
    for (const Product& p : products) {
      const std::int64_t N = p.N, K = p.K;
      const auto sz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
      bf16* w = device_random<bf16>(sz(E * N * K), 0.02f, rng);
      bf16* x = device_random<bf16>(sz(R * K), 1.0f, rng);
      bf16* dy = device_random<bf16>(sz(R * N), 1.0f, rng);
      bf16 *y1, *y2, *dx1, *dx2;
      float *dw1, *dw2;
      MT_CUDA_CHECK(cudaMalloc(&y1, sz(R * N) * 2));
      MT_CUDA_CHECK(cudaMalloc(&y2, sz(R * N) * 2));
      MT_CUDA_CHECK(cudaMalloc(&dx1, sz(R * K) * 2));
      MT_CUDA_CHECK(cudaMalloc(&dx2, sz(R * K) * 2));
      MT_CUDA_CHECK(cudaMalloc(&dw1, sz(E * N * K) * 4));
      MT_CUDA_CHECK(cudaMalloc(&dw2, sz(E * N * K) * 4));
      std::vector<const bf16*> wp(sz(E));
      std::vector<float*> g1(sz(E)), g2(sz(E));
      for (std::int64_t e = 0; e < E; ++e) {
        wp[sz(e)] = w + e * N * K;
        g1[sz(e)] = dw1 + e * N * K;
        g2[sz(e)] = dw2 + e * N * K;
      }
      // cuBLAS, column-major: the transposes of megatrain's row-major products (as cuda/gemm.cpp)
      const float one = 1.0f, zero = 0.0f;
      std::vector<std::int64_t> used;
      for (std::int64_t e = 0; e < E; ++e)
        if (counts[sz(e)] > 0) used.push_back(e);
      const auto G = static_cast<std::int64_t>(used.size());
      void** parr = nullptr;
      MT_CUDA_CHECK(cudaMalloc(&parr, sz(3 * G) * sizeof(void*)));
      auto grouped = [&](bool forward, bf16* out) {
        std::vector<void*> ptr(sz(3 * G));
        std::vector<std::int64_t> m(sz(G)), n(sz(G)), k(sz(G)), lda(sz(G)), ldb(sz(G)), ldc(sz(G)), one_each(sz(G), 1);
        for (std::int64_t i = 0; i < G; ++i) {
          const std::int64_t e = used[sz(i)], r0 = offsets[sz(e)];
          ptr[sz(i)] = const_cast<bf16*>(wp[sz(e)]);
          ptr[sz(G + i)] = forward ? x + r0 * K : dy + r0 * N;
          ptr[sz(2 * G + i)] = forward ? out + r0 * N : out + r0 * K;
          m[sz(i)] = forward ? N : K, n[sz(i)] = counts[sz(e)], k[sz(i)] = forward ? K : N;
          lda[sz(i)] = K, ldb[sz(i)] = forward ? K : N, ldc[sz(i)] = forward ? N : K;
        }
        MT_CUDA_CHECK(cudaMemcpyAsync(parr, ptr.data(), ptr.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
        const std::vector<cublasOperation_t> ta(sz(G), forward ? CUBLAS_OP_T : CUBLAS_OP_N), tb(sz(G), CUBLAS_OP_N);
        const std::vector<float> alpha(sz(G), 1.0f), beta(sz(G), 0.0f);
        return cublasGemmGroupedBatchedEx_64(h, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), parr,
                                             CUDA_R_16BF, lda.data(), parr + G, CUDA_R_16BF, ldb.data(), beta.data(),
                                             parr + 2 * G, CUDA_R_16BF, ldc.data(), G, one_each.data(), CUBLAS_COMPUTE_32F);
      };
      auto per_expert = [&](int which) {
        for (const std::int64_t e : used) {
          const std::int64_t r0 = offsets[sz(e)], rows = counts[sz(e)];
          if (which == 0)
            MT_CUDA_CHECK(cublasGemmEx_64(h, CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &one, wp[sz(e)], CUDA_R_16BF, K, x + r0 * K,
                                          CUDA_R_16BF, K, &zero, y2 + r0 * N, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          else if (which == 1)
            MT_CUDA_CHECK(cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_N, K, rows, N, &one, wp[sz(e)], CUDA_R_16BF, K, dy + r0 * N,
                                          CUDA_R_16BF, N, &zero, dx2 + r0 * K, CUDA_R_16BF, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          else
            MT_CUDA_CHECK(cublasGemmEx_64(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, rows, &one, x + r0 * K, CUDA_R_16BF, K, dy + r0 * N,
                                          CUDA_R_16BF, N, &one, g2[sz(e)], CUDA_R_32F, K, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      };
      const double flops = 2.0 * static_cast<double>(R) * static_cast<double>(N) * static_cast<double>(K);
      for (int which = 0; which < 3; ++which) {
        static constexpr const char* kNames[] = {"forward", "input grad", "weight grad"};
        double ours = 0, theirs = 0;
        const char* way = "GEMM per expert";
        MT_CUDA_CHECK(cudaMemsetAsync(dw1, 0, sz(E * N * K) * 4, s));
        MT_CUDA_CHECK(cudaMemsetAsync(dw2, 0, sz(E * N * K) * 4, s));
        if (which == 0) {
          ours = time_ms(s, reps, [&] { megatrain::cuda::launch_grouped_forward(x, wp, y1, doff, R, N, K, s); });
          theirs = time_ms(s, reps, [&] { per_expert(0); });
          if (grouped(true, y2) == CUBLAS_STATUS_SUCCESS) {
            const double g = time_ms(s, reps, [&] { MT_CUDA_CHECK(grouped(true, y2)); });
            if (g < theirs) theirs = g, way = "grouped GEMM";
          }
        } else if (which == 1) {
          ours = time_ms(s, reps, [&] { megatrain::cuda::launch_grouped_input_grad(dy, wp, dx1, false, doff, R, N, K, s); });
          theirs = time_ms(s, reps, [&] { per_expert(1); });
          if (grouped(false, dx2) == CUBLAS_STATUS_SUCCESS) {
            const double g = time_ms(s, reps, [&] { MT_CUDA_CHECK(grouped(false, dx2)); });
            if (g < theirs) theirs = g, way = "grouped GEMM";
          }
        } else {
          // once each for the comparison, then timed (the sums grow; the times do not depend on them)
          megatrain::cuda::launch_grouped_weight_grad(dy, x, g1, doff, R, N, K, s);
          per_expert(2);
          MT_CUDA_CHECK(cudaStreamSynchronize(s));
        }
        MT_CUDA_CHECK(cudaStreamSynchronize(s));
        double diff = 0;
        if (which == 0) diff = difference(to_host(y1, sz(R * N)), to_host(y2, sz(R * N)));
        else if (which == 1) diff = difference(to_host(dx1, sz(R * K)), to_host(dx2, sz(R * K)));
        else {
          diff = difference(to_host(dw1, sz(E * N * K)), to_host(dw2, sz(E * N * K)));
          ours = time_ms(s, reps, [&] { megatrain::cuda::launch_grouped_weight_grad(dy, x, g1, doff, R, N, K, s); });
          theirs = time_ms(s, reps, [&] { per_expert(2); });
        }
        std::printf("| %s | %s %s | [%lld, %lld] | %lld | %.3f | %.0f | %.3f | %.0f | %s | %.2fx | %.1e |\n", sh.name, p.name,
                    kNames[which], static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(R), ours,
                    flops / ours / 1e9, theirs, flops / theirs / 1e9, way, theirs / ours, diff);
      }
      for (void* q : {static_cast<void*>(w), static_cast<void*>(x), static_cast<void*>(dy), static_cast<void*>(y1),
                      static_cast<void*>(y2), static_cast<void*>(dx1), static_cast<void*>(dx2), static_cast<void*>(dw1),
                      static_cast<void*>(dw2), static_cast<void*>(parr)})
        MT_CUDA_CHECK(cudaFree(q));
    }
    MT_CUDA_CHECK(cudaFree(doff));
  }
  (void)cublasDestroy(h);
  (void)cudaStreamDestroy(s);
  return 0;
}
