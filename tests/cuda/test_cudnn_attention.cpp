// CudnnAttention (cuDNN's fused flash attention through the graph API) against a float64 host
// reference of causal grouped-query attention: the output, the log-sum-exp and the three
// gradients, at sequence lengths around the kernels' tile edges (1, 13, 128, 1000), head_dim 64
// and 128, GQA ratios 1, 2 and 7, one and three rows. Also: dq/dk/dv are overwritten (they start
// as NaN), the deterministic backward repeats bit for bit, the atomic-dQ variant is as accurate,
// and shapes cuDNN cannot run are reported by supports() without an exception.
//
// Label gpu: exits with 77 (CTest: skipped) when there is no CUDA device or cuDNN cannot be
// loaded or initialised.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megatrain/backend/cuda/cudnn_attention.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/cudnn_check.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"

using megatrain::bf16;
using megatrain::cuda::AttentionDims;
using megatrain::cuda::CudnnAttention;

namespace {

/// A cuDNN handle and a stream, created on first use (main() has already skipped a machine
/// without a GPU); exits with 77 (skip) when cuDNN does not initialise.
struct Gpu {
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  Gpu() {
    const cudnnStatus_t cs = cudnnCreate(&handle);
    if (cs != CUDNN_STATUS_SUCCESS) {
      std::printf("skipped: cuDNN cannot be loaded or initialised (%s; libcudnn %zu)\n", cudnnGetErrorString(cs),
                  cudnnGetVersion());
      std::fflush(stdout);
      std::exit(77);
    }
    MT_CUDA_CHECK(cudaStreamCreate(&stream));
  }
  ~Gpu() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
    if (handle != nullptr) (void)cudnnDestroy(handle);
  }
  Gpu(const Gpu&) = delete;
  Gpu& operator=(const Gpu&) = delete;
};

Gpu& gpu() {
  static Gpu g;
  return g;
}

/// Device memory for n elements of T (cudaMalloc: 256-byte aligned), freed on destruction.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n) : n_(n) {
    MT_CUDA_CHECK(cudaMalloc(&p_, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceArray() { (void)cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  void upload(const std::vector<T>& h) {
    MT_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    MT_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  void poison() { MT_CUDA_CHECK(cudaMemset(p_, 0xff, n_ * sizeof(T))); }  // bf16 / fp32 NaN

 private:
  void* p_ = nullptr;
  std::size_t n_;
};

std::string name(const AttentionDims& d) {
  return "rows=" + std::to_string(d.rows) + " seq=" + std::to_string(d.seq) + " heads=" + std::to_string(d.heads) +
         " kv_heads=" + std::to_string(d.kv_heads) + " head_dim=" + std::to_string(d.head_dim);
}

/// Random bf16 values in [-1, 1) and the same values as doubles.
struct Input {
  std::vector<bf16> bits;
  std::vector<double> value;
};

Input random_input(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Input in{std::vector<bf16>(n), std::vector<double>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    in.bits[i] = bf16(u(rng));
    in.value[i] = static_cast<double>(static_cast<float>(in.bits[i]));
  }
  return in;
}

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

/// softmax(Q K^T / sqrt(D) + causal mask) V, its natural log-sum-exp, and the analytic gradients
/// (dS = P * (dP - rowsum(P * dP)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D), dV = P^T dO), in
/// float64, over BSHD layouts; query head h uses kv head h / (heads / kv_heads).
Reference reference(const AttentionDims& d, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout) {
  const std::int64_t B = d.rows, S = d.seq, H = d.heads, Hk = d.kv_heads, D = d.head_dim, group = H / Hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto at_q = [&](std::int64_t b, std::int64_t s, std::int64_t h) {
    return static_cast<std::size_t>(((b * S + s) * H + h) * D);
  };
  auto at_kv = [&](std::int64_t b, std::int64_t s, std::int64_t h) {
    return static_cast<std::size_t>(((b * S + s) * Hk + h) * D);
  };
  Reference r;
  r.out.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * H * S), 0.0);
  std::vector<double> p(static_cast<std::size_t>(S)), dp(static_cast<std::size_t>(S));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < S; ++i) {
        const double* qi = &q[at_q(b, i, h)];
        const double* doi = &dout[at_q(b, i, h)];
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j <= i; ++j) {
          const double* kj = &k[at_kv(b, j, hk)];
          double dot = 0;
          for (std::int64_t c = 0; c < D; ++c) dot += qi[c] * kj[c];
          p[static_cast<std::size_t>(j)] = dot * scale;
          mx = std::max(mx, dot * scale);
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(p[static_cast<std::size_t>(j)] - mx);
        const double lse = mx + std::log(sum);
        r.lse[static_cast<std::size_t>((b * H + h) * S + i)] = lse;
        double rowsum = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          double& pj = p[static_cast<std::size_t>(j)];
          pj = std::exp(pj - lse);
          const double* vj = &v[at_kv(b, j, hk)];
          double dot = 0;
          for (std::int64_t c = 0; c < D; ++c) {
            r.out[at_q(b, i, h) + static_cast<std::size_t>(c)] += pj * vj[c];
            dot += doi[c] * vj[c];
          }
          dp[static_cast<std::size_t>(j)] = dot;
          rowsum += pj * dot;
        }
        for (std::int64_t j = 0; j <= i; ++j) {
          const double pj = p[static_cast<std::size_t>(j)];
          const double ds = pj * (dp[static_cast<std::size_t>(j)] - rowsum);
          const double* kj = &k[at_kv(b, j, hk)];
          for (std::int64_t c = 0; c < D; ++c) {
            r.dq[at_q(b, i, h) + static_cast<std::size_t>(c)] += scale * ds * kj[c];
            r.dk[at_kv(b, j, hk) + static_cast<std::size_t>(c)] += scale * ds * qi[c];
            r.dv[at_kv(b, j, hk) + static_cast<std::size_t>(c)] += pj * doi[c];
          }
        }
      }
    }
  return r;
}

double to_double(bf16 x) { return static_cast<double>(static_cast<float>(x)); }
double to_double(float x) { return static_cast<double>(x); }

/// ||got - ref|| <= rtol * ||ref|| + atol * sqrt(n) (a NaN anywhere fails).
template <class T>
void check_close(const char* what, const std::vector<T>& got, const std::vector<double>& ref, double rtol,
                 double atol) {
  REQUIRE(got.size() == ref.size());
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double e = to_double(got[i]) - ref[i];
    err += e * e;
    norm += ref[i] * ref[i];
  }
  err = std::sqrt(err);
  norm = std::sqrt(norm);
  const double bound = rtol * norm + atol * std::sqrt(static_cast<double>(ref.size()));
  INFO(what, ": ||got - ref|| = ", err, ", ||ref|| = ", norm, ", relative ", err / std::max(norm, 1e-300));
  CHECK(err <= bound);
}

constexpr double kBf16Rtol = 2e-2;  // bf16 outputs (8 significant bits, and P / dS rounded to bf16)
constexpr double kLseRtol = 1e-3;   // fp32 statistics
constexpr double kAtol = 1e-4;

/// Runs forward and backward at `d` on fresh random inputs and compares with the reference.
void run_and_check(CudnnAttention& attn, const AttentionDims& d, std::uint64_t seed) {
  Gpu& g = gpu();
  INFO(name(d));
  REQUIRE_MESSAGE(attn.supports(d), attn.unsupported_reason(d));
  MESSAGE(name(d), ": ", attn.plan_summary(d));

  const auto nq = static_cast<std::size_t>(d.rows * d.seq * d.heads * d.head_dim);
  const auto nkv = static_cast<std::size_t>(d.rows * d.seq * d.kv_heads * d.head_dim);
  const auto nlse = static_cast<std::size_t>(d.rows * d.heads * d.seq);
  std::mt19937_64 rng(seed);
  const Input q = random_input(nq, rng), k = random_input(nkv, rng), v = random_input(nkv, rng);
  const Input dout = random_input(nq, rng);
  const Reference ref = reference(d, q.value, k.value, v.value, dout.value);

  DeviceArray<bf16> q_dev(nq), k_dev(nkv), v_dev(nkv), dout_dev(nq), out(nq), dq(nq), dk(nkv), dv(nkv);
  DeviceArray<float> lse(nlse);
  q_dev.upload(q.bits);
  k_dev.upload(k.bits);
  v_dev.upload(v.bits);
  dout_dev.upload(dout.bits);
  out.poison();
  lse.poison();
  dq.poison();
  dk.poison();
  dv.poison();
  const std::size_t ws_bytes = std::max(attn.forward_workspace_bytes(d), attn.backward_workspace_bytes(d));
  DeviceArray<std::byte> ws(ws_bytes);

  attn.forward(q_dev.get(), k_dev.get(), v_dev.get(), out.get(), lse.get(), d, ws.get(), ws_bytes, g.stream);
  MT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  check_close("out", out.download(), ref.out, kBf16Rtol, kAtol);
  check_close("lse", lse.download(), ref.lse, kLseRtol, kAtol);

  attn.backward(q_dev.get(), k_dev.get(), v_dev.get(), out.get(), lse.get(), dout_dev.get(), dq.get(), dk.get(),
                dv.get(), d, ws.get(), ws_bytes, g.stream);
  MT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  check_close("dq", dq.download(), ref.dq, kBf16Rtol, kAtol);
  check_close("dk", dk.download(), ref.dk, kBf16Rtol, kAtol);
  check_close("dv", dv.download(), ref.dv, kBf16Rtol, kAtol);
}

const std::vector<AttentionDims> kShapes = {
    // rows, seq, heads, kv_heads, head_dim
    {1, 1, 2, 2, 64},      // one token: softmax of a single score
    {3, 1, 7, 1, 128},     // one token per row, GQA 7
    {3, 13, 4, 2, 64},     // below one tile, GQA 2
    {1, 13, 14, 2, 128},   // GQA 7
    {3, 128, 4, 4, 128},   // exactly one 128 tile, no GQA
    {3, 128, 7, 1, 64},    // GQA 7 (multi-query)
    {1, 1000, 4, 2, 128},  // not a multiple of 64 or 128, GQA 2
    {3, 1000, 2, 2, 64},   // three long rows, no GQA
};

}  // namespace

TEST_CASE("cudnn attention: forward and backward match the float64 reference") {
  CudnnAttention attn(gpu().handle);
  MESSAGE("libcudnn ", CudnnAttention::runtime_version(), " (built with ", CUDNN_VERSION, ")");
  std::uint64_t seed = 1;
  for (const AttentionDims& d : kShapes) run_and_check(attn, d, seed++);
  CHECK(attn.cached_plans() == kShapes.size());
  CHECK(attn.supports(kShapes.front()));  // cached: no rebuild
  CHECK(attn.cached_plans() == kShapes.size());
}

TEST_CASE("cudnn attention: the atomic-dQ backward matches the reference too") {
  CudnnAttention attn(gpu().handle, /*deterministic_backward=*/false);
  run_and_check(attn, {3, 13, 4, 2, 64}, 101);
  run_and_check(attn, {1, 1000, 4, 2, 128}, 102);
}

TEST_CASE("cudnn attention: a deterministic backward beyond the workspace limit takes atomic dQ, linear in the tokens") {
  // Its dP buffer grows with the square of the sequence: with a 1 MiB limit, 2 x 512 tokens of 8
  // heads already exceed it, and the backward falls back to atomic dQ (still correct).
  CudnnAttention limited(gpu().handle, true, std::size_t{1} << 20);
  CudnnAttention unlimited(gpu().handle);
  const AttentionDims d{2, 512, 8, 2, 128};
  REQUIRE(limited.supports(d));
  REQUIRE(unlimited.supports(d));
  MESSAGE("unlimited: ", unlimited.plan_summary(d));
  MESSAGE("1 MiB limit: ", limited.plan_summary(d));
  CHECK(unlimited.backward_is_deterministic(d));
  CHECK_FALSE(limited.backward_is_deterministic(d));
  run_and_check(limited, d, 103);
  // atomic dQ's workspace is linear in the tokens: twice the sequence, about twice the bytes
  const AttentionDims d2{2, 1024, 8, 2, 128};
  REQUIRE(limited.supports(d2));
  const double ratio = static_cast<double>(limited.backward_workspace_bytes(d2)) / static_cast<double>(limited.backward_workspace_bytes(d));
  MESSAGE("atomic dQ workspace, 1024 vs 512 tokens: ", ratio, "x");
  CHECK(ratio < 2.5);
}

TEST_CASE("cudnn attention: the deterministic backward repeats bit for bit") {
  Gpu& g = gpu();
  CudnnAttention attn(g.handle);
  const AttentionDims d{2, 512, 8, 2, 128};
  REQUIRE_MESSAGE(attn.supports(d), attn.unsupported_reason(d));
  MESSAGE(attn.plan_summary(d));
  MESSAGE("backward_is_deterministic: ", attn.backward_is_deterministic(d));
  const auto nq = static_cast<std::size_t>(d.rows * d.seq * d.heads * d.head_dim);
  const auto nkv = static_cast<std::size_t>(d.rows * d.seq * d.kv_heads * d.head_dim);
  std::mt19937_64 rng(7);
  DeviceArray<bf16> q(nq), k(nkv), v(nkv), dout(nq), out(nq), dq(nq), dk(nkv), dv(nkv);
  DeviceArray<float> lse(static_cast<std::size_t>(d.rows * d.heads * d.seq));
  q.upload(random_input(nq, rng).bits);
  k.upload(random_input(nkv, rng).bits);
  v.upload(random_input(nkv, rng).bits);
  dout.upload(random_input(nq, rng).bits);
  const std::size_t ws_bytes = std::max(attn.forward_workspace_bytes(d), attn.backward_workspace_bytes(d));
  DeviceArray<std::byte> ws(ws_bytes);
  attn.forward(q.get(), k.get(), v.get(), out.get(), lse.get(), d, ws.get(), ws_bytes, g.stream);

  auto grads = [&] {
    attn.backward(q.get(), k.get(), v.get(), out.get(), lse.get(), dout.get(), dq.get(), dk.get(), dv.get(), d,
                  ws.get(), ws_bytes, g.stream);
    MT_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    std::vector<std::uint16_t> bits;
    for (const auto& part : {dq.download(), dk.download(), dv.download()})
      for (bf16 x : part) bits.push_back(x.bits);
    return bits;
  };
  const auto first = grads();
  const auto second = grads();
  CHECK(first == second);
}

TEST_CASE("cudnn attention: unsupported shapes are reported, not thrown; invalid dims throw") {
  CudnnAttention attn(gpu().handle);
  const AttentionDims absurd{1, 16, 2, 2, 1000};
  bool supported = true;
  CHECK_NOTHROW(supported = attn.supports(absurd));
  CHECK_FALSE(supported);
  CHECK_FALSE(attn.unsupported_reason(absurd).empty());
  CHECK_THROWS_AS(attn.forward_workspace_bytes(absurd), megatrain::Error);

  const AttentionDims odd_head_dim{1, 16, 2, 2, 12};
  CHECK_NOTHROW(supported = attn.supports(odd_head_dim));
  CHECK_FALSE(supported);

  CHECK_THROWS_AS(attn.supports(AttentionDims{1, 16, 3, 2, 64}), megatrain::Error);  // heads % kv_heads != 0
  CHECK_THROWS_AS(attn.supports(AttentionDims{0, 16, 2, 2, 64}), megatrain::Error);
}
