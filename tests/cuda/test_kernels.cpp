// megatrain's own CUDA kernels (src/cuda/kernels.cu) against float64 host references: the CPU
// backend run in double on the very bf16 inputs the GPU sees (RMSNorm, rotary, attention,
// SwiGLU, embedding), or a direct double loop (cross-entropy, column sums, sum of squares);
// add and the casts must match host rounding bit for bit.
//
// Sizes sit off the fast paths on purpose: odd token counts (1, 7, 13, 67), rows that are not
// a multiple of 8 or pointers that are not 16-byte aligned (the scalar fallbacks), hidden sizes
// that are not powers of two, head_dim 64, 80, 128 (and 34, 256), GQA ratios 1, 2 and 7,
// vocabularies that are not a multiple of 8. Outputs are poisoned with NaN bit patterns before
// every launch, so an element a kernel forgets to write fails the comparison; every reduction
// runs twice and must repeat bit for bit.
//
// Tolerances: ||out - ref|| / ||ref|| within a few units of bf16 rounding (2^-8) where the
// output is bf16, 1e-5 where it is fp32 (statistics, losses, accumulators), 1e-12 for the
// double sum of squares.
//
// Label gpu: exits with 77 (CTest: skipped) when there is no CUDA device.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include "megatrain/backend/backend.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/backend/cuda/kernels.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/tensor.hpp"

using megatrain::bf16;
using megatrain::Shape;
using megatrain::View;
namespace mc = megatrain::cuda;
using Ref = megatrain::CpuBackend<double>;

namespace {

constexpr double kBf16Round = 1.0 / 256;           // bf16's unit roundoff, 2^-8
constexpr double kTolElementwise = 2 * kBf16Round;  // bf16 outputs of elementwise ops
constexpr double kTolReduced = 3 * kBf16Round;      // bf16 outputs of row reductions, attention
constexpr double kTolF32 = 1e-5;                    // fp32 outputs

/// The stream every test runs on.
cudaStream_t stream() {
  static const cudaStream_t s = [] {
    cudaStream_t r = nullptr;
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&r, cudaStreamNonBlocking));
    return r;
  }();
  return s;
}

void finish() { MT_CUDA_CHECK(cudaStreamSynchronize(stream())); }

/// n elements of T in device memory, `offset` elements past the start of an allocation (an
/// offset of 1 makes a 16-bit or 32-bit array misaligned for 16-byte accesses).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n, std::size_t offset = 0) : n_(n), offset_(offset) {
    MT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base_), std::max<std::size_t>(n + offset, 1) * sizeof(T)));
  }
  ~DeviceArray() { (void)cudaFree(base_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return base_ + offset_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n_);
    MT_CUDA_CHECK(cudaMemcpyAsync(get(), h.data(), bytes(), cudaMemcpyHostToDevice, stream()));
    finish();
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    MT_CUDA_CHECK(cudaMemcpyAsync(h.data(), get(), bytes(), cudaMemcpyDeviceToHost, stream()));
    finish();
    return h;
  }
  /// Every bit set: a NaN in bf16, fp32 and fp64 alike.
  void poison() { MT_CUDA_CHECK(cudaMemsetAsync(get(), 0xff, bytes(), stream())); }

 private:
  T* base_ = nullptr;
  std::size_t n_, offset_;
};

/// A kernel workspace of the size its *_workspace_bytes function asks for.
struct Workspace {
  DeviceArray<std::byte> mem;
  explicit Workspace(std::size_t bytes) : mem(bytes) {}
  void* get() const { return mem.get(); }
  std::size_t size() const { return mem.bytes(); }
};

std::vector<bf16> random_bf16(std::size_t n, std::mt19937& rng, float mean = 0.0f, float sd = 1.0f) {
  std::normal_distribution<float> dist(mean, sd);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16(dist(rng));
  return v;
}
std::vector<float> random_f32(std::size_t n, std::mt19937& rng, float sd = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}
std::vector<std::int32_t> random_ids(std::size_t n, std::int64_t V, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> dist(0, static_cast<std::int32_t>(V - 1));
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<float>(v[i]));
  return r;
}
std::vector<double> widen(const std::vector<double>& v) { return v; }

/// ||out - ref|| / ||ref||; infinite when out holds a NaN or infinity (an unwritten element).
template <class T>
double rel_err(const std::vector<T>& out, const std::vector<double>& ref) {
  REQUIRE(out.size() == ref.size());
  const std::vector<double> o = widen(out);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    if (!std::isfinite(o[i])) return std::numeric_limits<double>::infinity();
    num += (o[i] - ref[i]) * (o[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, std::numeric_limits<double>::min()));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
View<T> view(std::vector<std::remove_const_t<T>>& v, Shape shape) {
  return View<T>(std::span<T>(v.data(), v.size()), shape);
}

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

}  // namespace

// ---- elementwise ---------------------------------------------------------------------------------

TEST_CASE("add and casts match host rounding bit for bit, on the vector and scalar paths") {
  std::mt19937 rng(1);
  for (std::int64_t n : {1, 7, 8, 1000, 4103}) {
    for (std::size_t offset : {0u, 1u}) {
      CAPTURE(n);
      CAPTURE(offset);
      const auto x = random_bf16(sz(n), rng), y = random_bf16(sz(n), rng);
      DeviceArray<bf16> dx(sz(n), offset), dy(sz(n), offset);
      dx.upload(x);
      dy.upload(y);
      mc::launch_add(dx.get(), dy.get(), n, stream());
      const auto sum = dy.download();
      for (std::size_t i = 0; i < sz(n); ++i)
        REQUIRE(sum[i] == bf16(static_cast<float>(x[i]) + static_cast<float>(y[i])));

      auto f = random_f32(sz(n), rng, 100.0f);
      // Specials: infinities, a value that rounds to infinity, a tie, subnormals, NaN.
      const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                3.4e38f, 1.00390625f, 1e-40f, -3e-39f, std::numeric_limits<float>::quiet_NaN()};
      for (std::size_t i = 0; i < std::size(specials) && i < f.size(); ++i) f[f.size() - 1 - i] = specials[i];
      DeviceArray<float> df(sz(n), offset), back(sz(n), offset);
      DeviceArray<bf16> db(sz(n), offset);
      df.upload(f);
      db.poison();
      mc::launch_cast(df.get(), db.get(), n, stream());
      const auto b = db.download();
      for (std::size_t i = 0; i < sz(n); ++i) {
        if (std::isnan(f[i])) REQUIRE(std::isnan(static_cast<float>(b[i])));
        else REQUIRE(b[i] == bf16(f[i]));
      }
      back.poison();
      mc::launch_cast(db.get(), back.get(), n, stream());
      const auto w = back.download();
      for (std::size_t i = 0; i < sz(n); ++i) {
        if (std::isnan(f[i])) REQUIRE(std::isnan(w[i]));
        else REQUIRE(w[i] == static_cast<float>(b[i]));
      }
    }
  }
}

TEST_CASE("swiglu, geglu (tanh GELU) and GPT-OSS's clamped swiglu forward and backward against the double reference") {
  std::mt19937 rng(2);
  Ref ref;
  for (const auto act : {megatrain::Activation::silu, megatrain::Activation::gelu_tanh, megatrain::Activation::clamped_swiglu})
  for (std::int64_t n : {1, 13, 1000, 4099}) {
    for (std::size_t offset : {0u, 1u}) {
      const int gelu = static_cast<int>(act);  // (the launchers' numbering of the activations)
      CAPTURE(gelu);
      CAPTURE(n);
      CAPTURE(offset);
      // (the clamped one's inputs spread past its clamps at +-7)
      const float spread = act == megatrain::Activation::clamped_swiglu ? 6.0f : 1.0f;
      const auto g = random_bf16(sz(n), rng, 0.0f, 2.0f * spread), u = random_bf16(sz(n), rng, 0.0f, spread),
                 dm = random_bf16(sz(n), rng);
      DeviceArray<bf16> d_g(sz(n), offset), d_u(sz(n), offset), d_dm(sz(n), offset), d_m(sz(n), offset),
          d_dg(sz(n), offset), d_du(sz(n), offset);
      d_g.upload(g);
      d_u.upload(u);
      d_dm.upload(dm);
      d_m.poison();
      d_dg.poison();
      d_du.poison();
      mc::launch_swiglu_forward(d_g.get(), d_u.get(), d_m.get(), n, stream(), gelu);
      mc::launch_swiglu_backward(d_g.get(), d_u.get(), d_dm.get(), d_dg.get(), d_du.get(), n, stream(), gelu);

      auto gd = widen(g), ud = widen(u), dmd = widen(dm);
      std::vector<double> m(sz(n)), dg(sz(n)), du(sz(n));
      const Shape s{n};
      ref.swiglu(view<const double>(gd, s), view<const double>(ud, s), view<double>(m, s), act);
      ref.swiglu_backward(view<const double>(gd, s), view<const double>(ud, s), view<const double>(dmd, s),
                          view<double>(dg, s), view<double>(du, s), act);
      const auto m_fwd = d_m.download(), dg_alone = d_dg.download(), du_alone = d_du.download();
      CHECK(rel_err(m_fwd, m) <= kTolElementwise);
      CHECK(rel_err(dg_alone, dg) <= kTolElementwise);
      CHECK(rel_err(du_alone, du) <= kTolElementwise);
      // the backward that makes m as well: m the forward's bits, dg and du unchanged
      d_m.poison();
      d_dg.poison();
      d_du.poison();
      mc::launch_swiglu_backward(d_g.get(), d_u.get(), d_dm.get(), d_dg.get(), d_du.get(), n, stream(), gelu, d_m.get());
      const auto m_bwd = d_m.download(), dg_with = d_dg.download(), du_with = d_du.download();
      CHECK(same_bits(m_bwd, m_fwd));
      CHECK(same_bits(dg_with, dg_alone));
      CHECK(same_bits(du_with, du_alone));
    }
  }
}

// ---- embedding -----------------------------------------------------------------------------------

TEST_CASE("embedding forward copies rows exactly, into the fp32 residual stream") {
  std::mt19937 rng(3);
  const std::int64_t V = 1001;
  for (std::int64_t M : {1, 7, 67}) {
    for (std::int64_t d : {72, 77, 200, 1000}) {
      for (std::size_t offset : {0u, 1u}) {
        CAPTURE(M);
        CAPTURE(d);
        CAPTURE(offset);
        const auto table = random_bf16(sz(V * d), rng);
        const auto ids = random_ids(sz(M), V, rng);
        DeviceArray<bf16> d_table(sz(V * d), offset);
        DeviceArray<float> d_out(sz(M * d));
        DeviceArray<std::int32_t> d_ids(sz(M));
        d_table.upload(table);
        d_ids.upload(ids);
        d_out.poison();
        mc::launch_embedding_forward(d_ids.get(), d_table.get(), d_out.get(), M, d, V, stream());
        const auto out = d_out.download();
        bool exact = true;
        for (std::int64_t t = 0; t < M; ++t)
          for (std::int64_t c = 0; c < d; ++c)
            exact = exact && out[sz(t * d + c)] == static_cast<float>(table[sz(ids[sz(t)] * d + c)]);
        CHECK(exact);
        // scaled (Gemma's sqrt(hidden)): the fp32 product, exactly
        const float scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
        d_out.poison();
        mc::launch_embedding_forward(d_ids.get(), d_table.get(), d_out.get(), M, d, V, stream(), scale);
        const auto scaled = d_out.download();
        for (std::int64_t t = 0; t < M; ++t)
          for (std::int64_t c = 0; c < d; ++c)
            exact = exact && scaled[sz(t * d + c)] == static_cast<float>(table[sz(ids[sz(t)] * d + c)]) * scale;
        CHECK(exact);
      }
    }
  }
}

TEST_CASE("embedding backward sums repeated ids, deterministically") {
  std::mt19937 rng(4);
  Ref ref;
  struct Case {
    std::int64_t M, V, d;
  };
  // Small vocabularies force long runs of one id (longer than the kernel's batch of 8 rows).
  for (const Case c : {Case{1, 1001, 72}, Case{67, 13, 200}, Case{5000, 13, 72}, Case{300, 1001, 1000}, Case{67, 7, 77},
                       Case{2049, 1, 8}}) {
    CAPTURE(c.M);
    CAPTURE(c.V);
    CAPTURE(c.d);
    const auto ids = random_ids(sz(c.M), c.V, rng);
    const auto dy = random_f32(sz(c.M * c.d), rng);  // (the residual stream's gradient)
    const auto table0 = random_f32(sz(c.V * c.d), rng);
    DeviceArray<std::int32_t> d_ids(sz(c.M));
    DeviceArray<float> d_dy(sz(c.M * c.d));
    DeviceArray<float> d_table(sz(c.V * c.d));
    Workspace ws(mc::embedding_backward_workspace_bytes(c.M));
    d_ids.upload(ids);
    d_dy.upload(dy);

    std::vector<std::vector<float>> runs;
    for (int rep = 0; rep < 2; ++rep) {
      d_table.upload(table0);
      mc::launch_embedding_backward(d_ids.get(), d_dy.get(), d_table.get(), c.M, c.d, c.V, ws.get(), ws.size(), stream());
      runs.push_back(d_table.download());
    }
    CHECK(same_bits(runs[0], runs[1]));

    auto dyd = widen(dy);
    auto table = widen(table0);
    auto ids_copy = ids;
    ref.embedding_backward(view<const std::int32_t>(ids_copy, Shape{c.M}), view<const double>(dyd, Shape{c.M, c.d}),
                           view<double>(table, Shape{c.V, c.d}));
    CHECK(rel_err(runs[0], table) <= kTolF32);

    // A padding id (PyTorch's padding_idx): its row gets nothing, every other row the same sums.
    const std::int32_t skip = ids[0];
    d_table.upload(table0);
    mc::launch_embedding_backward(d_ids.get(), d_dy.get(), d_table.get(), c.M, c.d, c.V, ws.get(), ws.size(), stream(), skip);
    const auto skipped = d_table.download();
    auto table_skip = widen(table0);
    ref.embedding_backward(view<const std::int32_t>(ids_copy, Shape{c.M}), view<const double>(dyd, Shape{c.M, c.d}),
                           view<double>(table_skip, Shape{c.V, c.d}), skip);
    CHECK(rel_err(skipped, table_skip) <= kTolF32);
    bool untouched = true;
    for (std::int64_t k = 0; k < c.d; ++k)
      untouched = untouched && skipped[sz(skip * c.d + k)] == table0[sz(skip * c.d + k)];
    CHECK(untouched);

    // Scaled (Gemma's sqrt(hidden)): each row's gradient times the scale, the padding row skipped.
    const double scale = static_cast<float>(std::sqrt(1152.0));
    d_table.upload(table0);
    mc::launch_embedding_backward(d_ids.get(), d_dy.get(), d_table.get(), c.M, c.d, c.V, ws.get(), ws.size(), stream(), skip,
                                  static_cast<float>(scale));
    const auto scaled = d_table.download();
    auto table_scaled = widen(table0);
    ref.embedding_backward(view<const std::int32_t>(ids_copy, Shape{c.M}), view<const double>(dyd, Shape{c.M, c.d}),
                           view<double>(table_scaled, Shape{c.V, c.d}), skip, scale);
    CHECK(rel_err(scaled, table_scaled) <= kTolF32);
  }
}

// ---- RMSNorm -------------------------------------------------------------------------------------

TEST_CASE("rmsnorm of the fp32 residual stream with an fp32 gain, forward and backward, against the double reference") {
  std::mt19937 rng(5);
  Ref ref;
  const double eps = 1e-5;
  // 72..1000 with d % 8 == 0: vector path, a warp or 128 threads per row; 77 and 1100: scalar
  // path (1100 with 512 threads per row); 8200: vector path with 512 threads per row.
  for (std::int64_t M : {1, 7, 67}) {
    for (std::int64_t d : {72, 77, 200, 1000, 1100, 8200}) {
      CAPTURE(M);
      CAPTURE(d);
      const auto x = random_f32(sz(M * d), rng);
      std::vector<float> w = random_f32(sz(d), rng, 0.2f);
      for (auto& g : w) g += 1.0f;
      const auto dy = random_bf16(sz(M * d), rng);
      const auto dx0 = random_f32(sz(M * d), rng);
      const auto dw0 = random_f32(sz(d), rng);
      DeviceArray<bf16> d_y(sz(M * d)), d_dy(sz(M * d)), d_dx_act(sz(M * d));
      DeviceArray<float> d_x(sz(M * d)), d_w(sz(d)), d_dx(sz(M * d)), d_rstd(sz(M)), d_dw(sz(d));
      d_x.upload(x);
      d_w.upload(w);
      d_dy.upload(dy);

      // Forward, twice.
      std::vector<std::vector<bf16>> ys;
      std::vector<std::vector<float>> rs;
      for (int rep = 0; rep < 2; ++rep) {
        d_y.poison();
        d_rstd.poison();
        mc::launch_rmsnorm_forward(d_x.get(), d_w.get(), d_y.get(), d_rstd.get(), M, d, static_cast<float>(eps), stream());
        ys.push_back(d_y.download());
        rs.push_back(d_rstd.download());
      }
      CHECK(same_bits(ys[0], ys[1]));
      CHECK(same_bits(rs[0], rs[1]));
      auto xd = widen(x), wd = widen(w), dyd = widen(dy);
      std::vector<double> y(sz(M * d)), rstd(sz(M));
      ref.rmsnorm(view<const double>(xd, Shape{M, d}), view<const double>(wd, Shape{d}), eps, view<double>(y, Shape{M, d}),
                  view<double>(rstd, Shape{M}));
      CHECK(rel_err(ys[0], y) <= kTolReduced);
      CHECK(rel_err(rs[0], rstd) <= kTolF32);

      // Backward from the reference's rstd (rounded to fp32, as the GPU stores it): dx alone, and
      // dx = residual + gradient with the residual in place (dx itself), with dx's bf16 copy;
      // twice each.
      std::vector<float> rstd_f(sz(M));
      for (std::size_t i = 0; i < sz(M); ++i) rstd_f[i] = static_cast<float>(rstd[i]);
      d_rstd.upload(rstd_f);
      auto rstd_d = widen(rstd_f);
      Workspace ws(mc::rmsnorm_backward_workspace_bytes(M, d));
      for (bool accumulate : {false, true}) {
        CAPTURE(accumulate);
        std::vector<std::vector<float>> dxs, dws;
        std::vector<bf16> dx_act;
        for (int rep = 0; rep < 2; ++rep) {
          if (accumulate) d_dx.upload(dx0);
          else d_dx.poison();
          d_dx_act.poison();
          d_dw.upload(dw0);
          mc::launch_rmsnorm_backward(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), accumulate ? d_dx.get() : nullptr,
                                      d_dx.get(), d_dx_act.get(), d_dw.get(), M, d, ws.get(), ws.size(), stream());
          dxs.push_back(d_dx.download());
          dws.push_back(d_dw.download());
          dx_act = d_dx_act.download();
        }
        CHECK(same_bits(dxs[0], dxs[1]));
        CHECK(same_bits(dws[0], dws[1]));
        bool rounded = true;  // dx_act is dx rounded to bf16
        for (std::size_t i = 0; i < dx_act.size(); ++i) rounded = rounded && dx_act[i] == bf16(dxs[0][i]);
        CHECK(rounded);
        std::vector<double> dx = accumulate ? widen(dx0) : std::vector<double>(sz(M * d), 0.0);
        std::vector<double> dw = widen(dw0);
        ref.rmsnorm_backward(view<const double>(xd, Shape{M, d}), view<const double>(wd, Shape{d}),
                             view<const double>(rstd_d, Shape{M}), view<const double>(dyd, Shape{M, d}),
                             accumulate ? view<const double>(dx, Shape{M, d}) : View<const double>{},
                             view<double>(dx, Shape{M, d}), View<double>{}, view<double>(dw, Shape{d}));
        CHECK(rel_err(dxs[0], dx) <= kTolF32);
        CHECK(rel_err(dws[0], dw) <= kTolF32);
      }
    }
  }
}

TEST_CASE("head_rmsnorm of bf16 activation rows (Qwen3's q/k norms), forward and backward, against the double reference") {
  std::mt19937 rng(15);
  Ref ref;
  const double eps = 1e-6;
  // rows = tokens x heads; head_dim 128 (vector path, a warp per row), 64, 72, 256, and 30 (scalar).
  // offset 1: Gemma's (1 + w) norms, whose stored w is near 0
  for (const double off : {0.0, 1.0})
  for (std::int64_t M : {1, 37, 1000}) {
    for (std::int64_t d : {30, 64, 72, 128, 256}) {
      CAPTURE(off);
      CAPTURE(M);
      CAPTURE(d);
      auto x = random_bf16(sz(M * d), rng);
      std::vector<float> w = random_f32(sz(d), rng, 0.2f);
      for (auto& g : w) g += static_cast<float>(1.0 - off);
      auto dy = random_bf16(sz(M * d), rng);
      const auto dw0 = random_f32(sz(d), rng);
      DeviceArray<bf16> d_x(sz(M * d)), d_y(sz(M * d)), d_dy(sz(M * d)), d_dx(sz(M * d));
      DeviceArray<float> d_w(sz(d)), d_rstd(sz(M)), d_dw(sz(d));
      d_x.upload(x);
      d_w.upload(w);
      d_dy.upload(dy);
      d_y.poison();
      d_rstd.poison();
      mc::launch_head_rmsnorm_forward(d_x.get(), d_w.get(), d_y.get(), d_rstd.get(), M, d, static_cast<float>(eps), stream(),
                                      static_cast<float>(off));
      const auto y_got = d_y.download();
      const auto rstd_got = d_rstd.download();
      auto xd = widen(x), wd = widen(w), dyd = widen(dy);
      std::vector<double> y(sz(M * d)), rstd(sz(M));
      ref.rmsnorm(view<const double>(xd, Shape{M, d}), view<const double>(wd, Shape{d}), eps, view<double>(y, Shape{M, d}),
                  view<double>(rstd, Shape{M}), off);
      CHECK(rel_err(y_got, y) <= kTolReduced);
      CHECK(rel_err(rstd_got, rstd) <= kTolF32);
      // Backward from the reference's rstd as the GPU stores it (fp32); dx is bf16.
      std::vector<float> rstd_f(sz(M));
      for (std::size_t i = 0; i < sz(M); ++i) rstd_f[i] = static_cast<float>(rstd[i]);
      d_rstd.upload(rstd_f);
      auto rstd_d = widen(rstd_f);
      Workspace ws(mc::rmsnorm_backward_workspace_bytes(M, d));
      std::vector<std::vector<bf16>> dxs;
      std::vector<std::vector<float>> dws;
      for (int rep = 0; rep < 2; ++rep) {
        d_dx.poison();
        d_dw.upload(dw0);
        mc::launch_head_rmsnorm_backward(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), d_dx.get(), d_dw.get(), M, d, ws.get(),
                                         ws.size(), stream(), static_cast<float>(off));
        dxs.push_back(d_dx.download());
        dws.push_back(d_dw.download());
      }
      CHECK(same_bits(dxs[0], dxs[1]));
      CHECK(same_bits(dws[0], dws[1]));
      std::vector<double> dx(sz(M * d), 0.0), dw = widen(dw0);
      ref.rmsnorm_backward(view<const double>(xd, Shape{M, d}), view<const double>(wd, Shape{d}),
                           view<const double>(rstd_d, Shape{M}), view<const double>(dyd, Shape{M, d}), View<const double>{},
                           view<double>(dx, Shape{M, d}), View<double>{}, view<double>(dw, Shape{d}), off);
      CHECK(rel_err(dxs[0], dx) <= kTolReduced);  // (rounded to bf16)
      CHECK(rel_err(dws[0], dw) <= kTolF32);
    }
  }
}

// ---- rotary --------------------------------------------------------------------------------------

TEST_CASE("rope and its inverse against the double reference") {
  std::mt19937 rng(6);
  Ref ref;
  struct Case {
    std::int64_t rows, seq, heads, D;
    std::size_t offset;
    std::int64_t R = 0;  // rotated dimensions of a head (partial rotary, Phi-4-mini); 0: all D
  };
  for (const Case c : {Case{1, 1, 1, 64, 0}, Case{2, 7, 3, 80, 0}, Case{1, 13, 2, 128, 0}, Case{3, 5, 1, 6, 0},
                       Case{1, 67, 2, 256, 0}, Case{2, 7, 3, 64, 1}, Case{2, 9, 3, 128, 0, 96}, Case{1, 11, 2, 8, 0, 6},
                       Case{1, 5, 2, 64, 1, 48}}) {
    CAPTURE(c.rows);
    CAPTURE(c.seq);
    CAPTURE(c.heads);
    CAPTURE(c.D);
    CAPTURE(c.offset);
    CAPTURE(c.R);
    const std::int64_t M = c.rows * c.seq, n = M * c.heads * c.D, R = c.R > 0 ? c.R : c.D;
    mc::RopeFreqs freqs{};
    freqs.half = static_cast<int>(R / 2);
    std::vector<double> inv_freq(sz(R / 2));
    for (std::int64_t i = 0; i < R / 2; ++i) {
      freqs.inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(R)));
      inv_freq[sz(i)] = freqs.inv_freq[i];
    }
    const auto x = random_bf16(sz(n), rng);
    for (bool inverse : {false, true}) {
      CAPTURE(inverse);
      DeviceArray<bf16> d_x(sz(n), c.offset);
      d_x.upload(x);
      mc::launch_rope(d_x.get(), nullptr, M, c.heads, c.D, c.seq, freqs, inverse, stream());
      auto r = widen(x);
      const View<double> rv = view<double>(r, Shape{M, c.heads * c.D});
      if (inverse) ref.rope_backward(rv, c.heads, c.seq, inv_freq);
      else ref.rope(rv, c.heads, c.seq, inv_freq);
      const auto got = d_x.download();
      CHECK(rel_err(got, r) <= kTolElementwise);
      bool passed = true;  // the unrotated dimensions are left exactly as they were
      for (std::int64_t t = 0; t < M * c.heads; ++t)
        for (std::int64_t e = R; e < c.D; ++e) passed = passed && got[sz(t * c.D + e)] == x[sz(t * c.D + e)];
      CHECK(passed);
    }
  }
}

// ---- reductions ----------------------------------------------------------------------------------

TEST_CASE("column_sum adds fixed-order column sums, deterministically") {
  std::mt19937 rng(7);
  // 5000 rows: more rows than the kernel's 128 chunks of 32 (chunks grow instead).
  for (std::int64_t M : {1, 7, 67, 1000, 5000}) {
    for (std::int64_t N : {72, 77, 200, 1000}) {
      for (std::size_t offset : {0u, 1u}) {
        CAPTURE(M);
        CAPTURE(N);
        CAPTURE(offset);
        const auto x = random_bf16(sz(M * N), rng);
        const auto out0 = random_f32(sz(N), rng);
        DeviceArray<bf16> d_x(sz(M * N), offset);
        DeviceArray<float> d_out(sz(N));
        Workspace ws(mc::column_sum_workspace_bytes(M, N));
        d_x.upload(x);
        std::vector<std::vector<float>> runs;
        for (int rep = 0; rep < 2; ++rep) {
          d_out.upload(out0);
          mc::launch_column_sum(d_x.get(), d_out.get(), M, N, ws.get(), ws.size(), stream());
          runs.push_back(d_out.download());
        }
        CHECK(same_bits(runs[0], runs[1]));
        std::vector<double> ref = widen(out0);
        for (std::int64_t r = 0; r < M; ++r)
          for (std::int64_t c = 0; c < N; ++c) ref[sz(c)] += static_cast<double>(static_cast<float>(x[sz(r * N + c)]));
        CHECK(rel_err(runs[0], ref) <= kTolF32);
      }
    }
  }
}

TEST_CASE("sum_squares in double, deterministically") {
  std::mt19937 rng(8);
  for (std::int64_t n : {0, 1, 7, 1001, (1 << 20) + 3}) {
    for (std::size_t offset : {0u, 1u}) {
      CAPTURE(n);
      CAPTURE(offset);
      const auto x = random_f32(sz(n), rng, 3.0f);
      DeviceArray<float> d_x(sz(n), offset);
      DeviceArray<double> d_out(1);
      Workspace ws(mc::sum_squares_workspace_bytes(n));
      d_x.upload(x);
      std::vector<std::vector<double>> runs;
      for (int rep = 0; rep < 2; ++rep) {
        d_out.poison();
        mc::launch_sum_squares(d_x.get(), n, d_out.get(), ws.get(), ws.size(), stream());
        runs.push_back(d_out.download());
      }
      CHECK(same_bits(runs[0], runs[1]));
      double ref = 0;
      for (float v : x) ref += static_cast<double>(v) * static_cast<double>(v);
      if (n == 0) CHECK(runs[0][0] == 0.0);
      else CHECK(std::abs(runs[0][0] - ref) <= 1e-12 * ref);
    }
  }
}

// ---- cross-entropy -------------------------------------------------------------------------------

TEST_CASE("cross_entropy loss and dlogits against the double reference") {
  std::mt19937 rng(9);
  struct Case {
    std::int64_t n, V;
  };
  const float scale = 0.37f;
  // (Gemma 3's vocabulary of 262,208, Qwen's 151,936 over many rows; 150,001 is not a multiple of 4)
  for (const Case c : {Case{1, 1001}, Case{7, 1001}, Case{13, 4096}, Case{3, 150001}, Case{2, 150000}, Case{3, 262208},
                       Case{157, 151936}}) {
    CAPTURE(c.n);
    CAPTURE(c.V);
    const auto logits = random_f32(sz(c.n * c.V), rng, 3.0f);
    auto labels = random_ids(sz(c.n), c.V, rng);
    if (c.n > 1) labels[1] = megatrain::kIgnoreIndex;  // an ignored row: loss 0, no gradient
    DeviceArray<float> d_logits(sz(c.n * c.V)), d_loss(sz(c.n));
    DeviceArray<std::int32_t> d_labels(sz(c.n));
    DeviceArray<bf16> d_dl(sz(c.n * c.V));
    d_logits.upload(logits);
    d_labels.upload(labels);

    // Reference in double.
    std::vector<double> loss(sz(c.n)), dl(sz(c.n * c.V), 0.0);
    for (std::int64_t r = 0; r < c.n; ++r) {
      const float* z = logits.data() + r * c.V;
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (std::int64_t j = 0; j < c.V; ++j) mx = std::max(mx, static_cast<double>(z[j]));
      for (std::int64_t j = 0; j < c.V; ++j) sum += std::exp(static_cast<double>(z[j]) - mx);
      const double lse = mx + std::log(sum);
      const std::int32_t y = labels[sz(r)];
      if (y == megatrain::kIgnoreIndex) continue;
      loss[sz(r)] = lse - static_cast<double>(z[y]);
      for (std::int64_t j = 0; j < c.V; ++j)
        dl[sz(r * c.V + j)] = scale * (std::exp(static_cast<double>(z[j]) - lse) - (j == y ? 1.0 : 0.0));
    }

    std::vector<std::vector<float>> losses;
    std::vector<std::vector<bf16>> dls;
    for (int rep = 0; rep < 2; ++rep) {
      d_loss.poison();
      d_dl.poison();
      mc::launch_cross_entropy(d_logits.get(), d_labels.get(), d_loss.get(), d_dl.get(), scale, c.n, c.V, stream());
      losses.push_back(d_loss.download());
      dls.push_back(d_dl.download());
    }
    CHECK(same_bits(losses[0], losses[1]));
    CHECK(same_bits(dls[0], dls[1]));
    CHECK(rel_err(losses[0], loss) <= kTolF32);
    CHECK(rel_err(dls[0], dl) <= kTolElementwise);
    // The label entries dominate the norm above; the softmax part alone, without them:
    std::vector<bf16> soft_out;
    std::vector<double> soft_ref;
    for (std::int64_t r = 0; r < c.n; ++r)
      for (std::int64_t j = 0; j < c.V; ++j)
        if (j != labels[sz(r)]) {
          soft_out.push_back(dls[0][sz(r * c.V + j)]);
          soft_ref.push_back(dl[sz(r * c.V + j)]);
        }
    if (c.n > 1) {  // an ignored row is all zeros
      bool zeros = true;
      for (std::int64_t j = 0; j < c.V; ++j) zeros = zeros && static_cast<float>(dls[0][sz(c.V + j)]) == 0.0f;
      CHECK(zeros);
      CHECK(losses[0][1] == 0.0f);
    }
    CHECK(rel_err(soft_out, soft_ref) <= kTolElementwise);

    // Loss only (no dlogits): the same bits.
    d_loss.poison();
    mc::launch_cross_entropy(d_logits.get(), d_labels.get(), d_loss.get(), nullptr, scale, c.n, c.V, stream());
    CHECK(same_bits(d_loss.download(), losses[0]));

    // A weight per row (an objective's, train/objective.hpp), of either sign: each row's gradient
    // times its weight, the loss the same bits.
    std::uniform_real_distribution<float> uw(-2.0f, 2.0f);
    std::vector<float> weights(sz(c.n));
    for (auto& x : weights) x = uw(rng);
    DeviceArray<float> d_w(sz(c.n));
    d_w.upload(weights);
    d_loss.poison();
    d_dl.poison();
    mc::launch_cross_entropy(d_logits.get(), d_labels.get(), d_loss.get(), d_dl.get(), scale, d_w.get(), c.n, c.V, stream());
    CHECK(same_bits(d_loss.download(), losses[0]));
    std::vector<double> dlw(dl);
    for (std::size_t i = 0; i < dlw.size(); ++i) dlw[i] *= static_cast<double>(weights[i / sz(c.V)]);
    CHECK(rel_err(d_dl.download(), dlw) <= kTolElementwise);
  }
}

// ---- attention -----------------------------------------------------------------------------------

TEST_CASE("attention forward and backward against the double reference") {
  std::mt19937 rng(10);
  Ref ref;
  // rows, seq, heads, kv_heads, head_dim: GQA ratios 1, 2, 7; head_dim 64, 80, 128 (and 34,
  // which pads to 36, and 256, the largest); sequences shorter than, equal to and spanning tiles.
  const megatrain::AttentionShape cases[] = {{1, 1, 1, 1, 64},  {2, 7, 2, 1, 64},   {1, 13, 7, 1, 80},
                                             {1, 67, 4, 2, 128}, {2, 33, 2, 2, 80},  {1, 40, 2, 1, 256},
                                             {1, 29, 3, 3, 34},  {1, 100, 14, 2, 64}, {1, 32, 2, 2, 128},
                                             // Gemma 3: a sliding window (shorter than a tile, several tiles, the
                                             // whole sequence) and a softmax scale of its own
                                             {2, 70, 4, 2, 64, {}, 0.0, 5},   {1, 130, 2, 1, 128, {}, 0.1, 40},
                                             {1, 37, 2, 2, 256, {}, 1.0 / 16, 37}, {1, 45, 3, 1, 80, {}, 0.07, 0}};
  for (const bool with_sinks : {false, true})  // (GPT-OSS's sinks: a logit per head in every softmax)
  for (const auto& s : cases) {
    CAPTURE(with_sinks);
    CAPTURE(s.window);
    CAPTURE(s.scale);
    CAPTURE(s.rows);
    CAPTURE(s.seq);
    CAPTURE(s.heads);
    CAPTURE(s.kv_heads);
    CAPTURE(s.head_dim);
    const std::int64_t M = s.rows * s.seq, nq = M * s.heads * s.head_dim, nk = M * s.kv_heads * s.head_dim,
                       nl = s.rows * s.heads * s.seq;
    mc::AttentionDims dims{s.rows, s.seq, s.heads, s.kv_heads, s.head_dim};
    dims.scale = s.scale;
    dims.window = s.window;
    const auto q = random_bf16(sz(nq), rng), k = random_bf16(sz(nk), rng), v = random_bf16(sz(nk), rng),
               dout = random_bf16(sz(nq), rng);
    DeviceArray<bf16> d_q(sz(nq)), d_k(sz(nk)), d_v(sz(nk)), d_out(sz(nq)), d_dout(sz(nq)), d_dq(sz(nq)), d_dk(sz(nk)),
        d_dv(sz(nk));
    DeviceArray<float> d_lse(sz(nl));
    d_q.upload(q);
    d_k.upload(k);
    d_v.upload(v);
    d_dout.upload(dout);
    std::vector<float> sinks(sz(s.heads)), dsinks0(sz(s.heads));
    for (auto& x : sinks) x = std::normal_distribution<float>(0.0f, 1.5f)(rng);
    for (auto& x : dsinks0) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    DeviceArray<float> d_sinks(sz(s.heads)), d_dsinks(sz(s.heads));
    d_sinks.upload(sinks);
    const float* sk_ptr = with_sinks ? d_sinks.get() : nullptr;

    // Forward, twice.
    std::vector<std::vector<bf16>> outs;
    std::vector<std::vector<float>> lses;
    for (int rep = 0; rep < 2; ++rep) {
      d_out.poison();
      d_lse.poison();
      mc::launch_attention_forward(d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(), dims, stream(), nullptr, sk_ptr);
      outs.push_back(d_out.download());
      lses.push_back(d_lse.download());
    }
    CHECK(same_bits(outs[0], outs[1]));
    CHECK(same_bits(lses[0], lses[1]));
    auto qd = widen(q), kd = widen(k), vd = widen(v), dod = widen(dout);
    std::vector<double> out(sz(nq)), lse(sz(nl));
    const Shape sq{M, s.heads * s.head_dim}, sk{M, s.kv_heads * s.head_dim}, sl{s.rows, s.heads, s.seq}, sh{s.heads};
    auto sinksd = widen(sinks);
    const auto ref_sinks = with_sinks ? view<const double>(sinksd, sh) : megatrain::View<const double>{};
    ref.attention(view<const double>(qd, sq), view<const double>(kd, sk), view<const double>(vd, sk), view<double>(out, sq),
                  view<double>(lse, sl), s, ref_sinks);
    CHECK(rel_err(outs[0], out) <= kTolReduced);
    CHECK(rel_err(lses[0], lse) <= kTolF32);

    // Backward from the GPU's own out and lse (the reference gets the same values), twice.
    Workspace ws(mc::attention_backward_workspace_bytes(dims));
    std::vector<std::vector<bf16>> dqs, dks, dvs;
    std::vector<std::vector<float>> dsinkss;
    for (int rep = 0; rep < 2; ++rep) {
      d_dq.poison();
      d_dk.poison();
      d_dv.poison();
      d_dsinks.upload(dsinks0);
      mc::launch_attention_backward(d_q.get(), d_k.get(), d_v.get(), d_out.get(), d_lse.get(), d_dout.get(), d_dq.get(),
                                    d_dk.get(), d_dv.get(), dims, ws.get(), ws.size(), stream(), nullptr, sk_ptr,
                                    with_sinks ? d_dsinks.get() : nullptr);
      dqs.push_back(d_dq.download());
      dks.push_back(d_dk.download());
      dvs.push_back(d_dv.download());
      dsinkss.push_back(d_dsinks.download());
    }
    CHECK(same_bits(dsinkss[0], dsinkss[1]));
    CHECK(same_bits(dqs[0], dqs[1]));
    CHECK(same_bits(dks[0], dks[1]));
    CHECK(same_bits(dvs[0], dvs[1]));
    auto outd = widen(outs[0]), lsed = widen(lses[0]);
    std::vector<double> dq(sz(nq)), dk(sz(nk)), dv(sz(nk)), dsd(sz(s.heads), 0.0);
    ref.attention_backward(view<const double>(qd, sq), view<const double>(kd, sk), view<const double>(vd, sk),
                           view<const double>(outd, sq), view<const double>(lsed, sl), view<const double>(dod, sq),
                           view<double>(dq, sq), view<double>(dk, sk), view<double>(dv, sk), s, ref_sinks,
                           with_sinks ? view<double>(dsd, sh) : megatrain::View<double>{});
    if (with_sinks) {  // the increment of dsinks, against the reference's (it started at 0)
      std::vector<double> inc(sz(s.heads));
      for (std::size_t h = 0; h < inc.size(); ++h) inc[h] = static_cast<double>(dsinkss[0][h]) - dsinks0[h];
      CHECK(rel_err(inc, dsd) <= kTolReduced);
    }
    CHECK(rel_err(dqs[0], dq) <= kTolReduced);
    CHECK(rel_err(dks[0], dk) <= kTolReduced);
    CHECK(rel_err(dvs[0], dv) <= kTolReduced);
  }
}

// ---- argument checks -----------------------------------------------------------------------------

// ---- optimizer ----------------------------------------------------------------------------------

TEST_CASE("adamw is bit for bit the host optimizer (fp32 state, bf16 weights), on the vector and scalar paths") {
  std::mt19937 rng(9);
  for (std::int64_t n : {1, 7, 8, 1000, 4103, 1 << 16}) {
    for (std::size_t offset : {0u, 1u}) {
      CAPTURE(n);
      CAPTURE(offset);
      // A trained state: moments of the gradients' scale, v > 0, a few elements tiny or zero.
      auto p = random_f32(sz(n), rng, 0.05f), g = random_f32(sz(n), rng, 1e-3f), m = random_f32(sz(n), rng, 1e-4f);
      std::vector<float> v(sz(n));
      for (auto& x : v) x = std::fabs(random_f32(1, rng, 1e-6f)[0]);
      for (std::size_t i = 0; i < sz(n); i += 97) {
        g[i] = 0.0f;
        v[i] = 0.0f;
        m[i] = 0.0f;
      }
      megatrain::AdamWConfig cfg;
      cfg.weight_decay = 0.1;
      for (const std::int64_t step : {1, 7, 1000}) {
        CAPTURE(step);
        const auto s = megatrain::AdamWScalars<float>::make(cfg, step, 3e-4, cfg.weight_decay, 0.37);
        DeviceArray<float> dp(sz(n), offset), dm(sz(n), offset), dv(sz(n), offset), dg(sz(n), offset);
        DeviceArray<bf16> dw(sz(n), offset);
        dp.upload(p);
        dm.upload(m);
        dv.upload(v);
        dg.upload(g);
        dw.poison();
        const mc::AdamWArgs a{s.decay, s.one_minus_b1, s.beta2, s.one_minus_b2, s.bc2_sqrt, s.eps, s.step_size, s.grad_scale};
        mc::launch_adamw(a, dp.get(), dm.get(), dv.get(), dg.get(), dw.get(), n, stream());
        // The host optimizer on the widest vector path this CPU has.
        std::vector<float> hp = p, hm = m, hv = v;
        std::vector<bf16> hw(sz(n));
        megatrain::detail::adamw_f32(megatrain::active_simd_level(), s, hp.data(), hm.data(), hv.data(), g.data(), hw.data(), sz(n));
        CHECK(same_bits(dp.download(), hp));
        CHECK(same_bits(dm.download(), hm));
        CHECK(same_bits(dv.download(), hv));
        CHECK(same_bits(dw.download(), hw));
        p = hp;
        m = hm;
        v = hv;
      }
    }
  }
}

TEST_CASE("launchers reject bad arguments on the host, before launching") {
  DeviceArray<bf16> buf(4096);
  DeviceArray<float> fbuf(4096);
  // head_dim odd, or above 256
  for (std::int64_t D : {7, 258}) {
    const mc::AttentionDims dims{1, 4, 2, 1, D};
    CHECK_THROWS_AS(mc::launch_attention_forward(buf.get(), buf.get(), buf.get(), buf.get(), fbuf.get(), dims, stream()),
                    megatrain::Error);
  }
  // heads not a multiple of kv_heads
  CHECK_THROWS_AS(mc::attention_backward_workspace_bytes(mc::AttentionDims{1, 4, 3, 2, 64}), megatrain::Error);
  // more rotary frequencies than head_dim / 2, or none (fewer is partial rotary, valid)
  mc::RopeFreqs freqs{};
  for (int n_freqs : {40, 0}) {
    freqs.half = n_freqs;
    CHECK_THROWS_AS(mc::launch_rope(buf.get(), nullptr, 4, 1, 64, 4, freqs, false, stream()), megatrain::Error);
  }
  // a workspace smaller than asked for
  const std::size_t need = mc::column_sum_workspace_bytes(64, 64);
  DeviceArray<std::byte> small(need - 1);
  CHECK_THROWS_AS(mc::launch_column_sum(buf.get(), fbuf.get(), 64, 64, small.get(), need - 1, stream()), megatrain::Error);
  finish();
}
