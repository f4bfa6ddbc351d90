// Decoding with caches on the GPU (backend/cuda/decode.hpp) against the CPU reference run in
// double on the very bf16 inputs the GPU sees: the attention of one token a row over its cached
// keys and values (grouped-query heads, head_dim 64 and 256, a sliding window, sinks), and Gated
// DeltaNet's step (conv taps and fp32 state), rows at different positions, one of them at 0 (a
// new sequence: its cache is read as zeros). The caches the kernels update must equal the
// reference's (keys, values and taps bit for bit; the state within fp32 rounding).
//
// CudaBackend::kDecodes says whether the trainer decodes with these kernels (true since this test
// passed on an H100); the last case checks generation on the GPU either way against the CPU
// trainer's tokens.
//
// Label gpu: exits with 77 (CTest: skipped) when there is no CUDA device.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/backend/linear_attention.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/generate/generator.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "megatrain/train/cuda_trainer.hpp"

using namespace megatrain;

namespace {

constexpr double kBf16Round = 1.0 / 256;

/// Host values rounded to bf16, as the GPU holds them, and their doubles.
struct Bf16Values {
  std::vector<bf16> b;
  std::vector<double> d;
  Bf16Values(std::mt19937& g, std::size_t n, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    for (std::size_t i = 0; i < n; ++i) {
      b.push_back(bf16(static_cast<float>(u(g))));
      d.push_back(static_cast<double>(static_cast<float>(b.back())));
    }
  }
};

/// A device copy of host values.
template <class T>
struct Device {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Device(const std::vector<T>& host) : n(host.size()) {
    MT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)));
    MT_CUDA_CHECK(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Device() { (void)cudaFree(p); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  std::vector<T> host() const {
    std::vector<T> out(n);
    MT_CUDA_CHECK(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  View<T> view(Shape s) const { return View<T>(std::span<T>(p, n), s); }
};

/// ||got - want|| / ||want||, got in bf16.
double relative_error(const std::vector<bf16>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = static_cast<double>(static_cast<float>(got[i])) - want[i];
    REQUIRE(std::isfinite(e));
    num += e * e;
    den += want[i] * want[i];
  }
  REQUIRE(den > 0);
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("attention over a KV cache on the GPU: the CPU reference's outputs, the caches extended bit for bit") {
  std::mt19937 g(41);
  for (const std::int64_t D : {64, 256}) {
    for (const std::int64_t window : {0, 5}) {
      for (const bool with_sinks : {false, true}) {
        CAPTURE(D);
        CAPTURE(window);
        CAPTURE(with_sinks);
        const std::int64_t rows = 3, cache_rows = 5, first = 1, cap = 13, H = 4, KV = 2, width = KV * D;
        const std::vector<std::int32_t> pos{12, 0, 7};
        Bf16Values q(g, static_cast<std::size_t>(rows * H * D), -1, 1), k(g, static_cast<std::size_t>(rows * width), -1, 1),
            v(g, static_cast<std::size_t>(rows * width), -1, 1), kc(g, static_cast<std::size_t>(cache_rows * cap * width), -1, 1),
            vc(g, static_cast<std::size_t>(cache_rows * cap * width), -1, 1);
        std::vector<float> sinks_f{0.5f, -1.0f, 2.0f, 0.0f};
        std::vector<double> sinks_d(sinks_f.begin(), sinks_f.end());
        AttentionShape s{rows, 1, H, KV, D, {}, 0.0, window};
        // the reference, in double
        DecodeRows hd{View<const std::int32_t>(std::span<const std::int32_t>(pos), Shape{rows}), pos, {}, cache_rows, first, cap};
        std::vector<double> out_d(q.d.size()), kc_d = kc.d, vc_d = vc.d;
        CpuBackend<double> cpu;
        cpu.attention_decode(View<const double>(std::span<const double>(q.d), Shape{rows, H * D}),
                             View<const double>(std::span<const double>(k.d), Shape{rows, width}),
                             View<const double>(std::span<const double>(v.d), Shape{rows, width}),
                             View<double>(std::span<double>(kc_d), Shape{cache_rows * cap, width}),
                             View<double>(std::span<double>(vc_d), Shape{cache_rows * cap, width}), hd,
                             View<double>(std::span<double>(out_d), Shape{rows, H * D}), s,
                             with_sinks ? View<const double>(std::span<const double>(sinks_d), Shape{H}) : View<const double>{});
        // the GPU
        Device<bf16> dq(q.b), dk(k.b), dv(v.b), dkc(kc.b), dvc(vc.b), dout(std::vector<bf16>(q.b.size()));
        Device<std::int32_t> dpos(pos);
        Device<float> dsinks(sinks_f);
        DecodeRows dd{dpos.view(Shape{rows}), pos, {}, cache_rows, first, cap};
        CudaBackend gpu;
        gpu.attention_decode(View<const bf16>(dq.view(Shape{rows, H * D})), View<const bf16>(dk.view(Shape{rows, width})),
                             View<const bf16>(dv.view(Shape{rows, width})), dkc.view(Shape{cache_rows * cap, width}),
                             dvc.view(Shape{cache_rows * cap, width}), dd, dout.view(Shape{rows, H * D}), s,
                             with_sinks ? View<const float>(dsinks.view(Shape{H})) : View<const float>{});
        gpu.synchronize();
        CHECK(relative_error(dout.host(), out_d) < 3 * kBf16Round);
        const auto kc_got = dkc.host(), vc_got = dvc.host();
        for (std::size_t i = 0; i < kc_got.size(); ++i) {
          REQUIRE(static_cast<double>(static_cast<float>(kc_got[i])) == kc_d[i]);
          REQUIRE(static_cast<double>(static_cast<float>(vc_got[i])) == vc_d[i]);
        }
      }
    }
  }
}

TEST_CASE("Gated DeltaNet's step over its cache on the GPU: the CPU reference's output, taps and state") {
  std::mt19937 g(43);
  const DeltaNetShape sh{2, 4, 32, 48, 4, 1e-6};
  const std::int64_t rows = 3, cache_rows = 4, first = 1, cd = sh.conv_dim(), vd = sh.value_dim(), hv = sh.value_heads;
  const std::vector<std::int32_t> pos{9, 0, 2};
  Bf16Values mixed(g, static_cast<std::size_t>(rows * cd), -1, 1), z(g, static_cast<std::size_t>(rows * vd), -2, 2),
      a(g, static_cast<std::size_t>(rows * hv), -2, 2), b(g, static_cast<std::size_t>(rows * hv), -2, 2),
      conv(g, static_cast<std::size_t>(cd * sh.taps), -0.5, 0.5),
      taps(g, static_cast<std::size_t>(cache_rows * (sh.taps - 1) * cd), -1, 1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f), st(-0.3f, 0.3f);
  std::vector<float> A_log(static_cast<std::size_t>(hv)), dt_bias(A_log.size()), norm(static_cast<std::size_t>(sh.dv)),
      state(static_cast<std::size_t>(cache_rows * hv * sh.dk * sh.dv));
  for (auto& x : A_log) x = std::log(1.0f + 15.0f * u(g));
  for (auto& x : dt_bias) x = u(g) - 0.5f;
  for (auto& x : norm) x = 0.9f + 0.2f * u(g);
  for (auto& x : state) x = st(g);
  // the reference, in double
  const std::vector<double> A_log_d(A_log.begin(), A_log.end()), dt_d(dt_bias.begin(), dt_bias.end()),
      norm_d(norm.begin(), norm.end());
  std::vector<double> taps_d = taps.d, state_d(state.begin(), state.end()), y_d(static_cast<std::size_t>(rows * vd));
  const std::vector<std::int32_t> starts{0, 1, 2, 3};
  cpu::GatedDeltaNetMix<double> m;
  m.key_heads = sh.key_heads;
  m.value_heads = sh.value_heads;
  m.dk = sh.dk;
  m.dv = sh.dv;
  m.taps = sh.taps;
  m.norm_eps = sh.norm_eps;
  m.starts = starts;
  m.mixed = mixed.d.data();
  m.z = z.d.data();
  m.a = a.d.data();
  m.b = b.d.data();
  m.conv = conv.d.data();
  m.A_log = A_log_d.data();
  m.dt_bias = dt_d.data();
  m.norm = norm_d.data();
  cpu::gated_deltanet_decode(m, pos, first, taps_d.data(), state_d.data(), y_d.data());
  // the GPU
  Device<bf16> dmixed(mixed.b), dz(z.b), da(a.b), db(b.b), dconv(conv.b), dtaps(taps.b), dy(std::vector<bf16>(y_d.size()));
  Device<float> dA(A_log), ddt(dt_bias), dnorm(norm), dstate(state);
  Device<std::int32_t> dpos(pos);
  const auto ops = delta_net_operands<bf16, bf16, float>(
      sh, ChunkShape{rows, 1}, std::span<const bf16>(dmixed.p, dmixed.n), std::span<const bf16>(dz.p, dz.n),
      std::span<const bf16>(da.p, da.n), std::span<const bf16>(db.p, db.n), std::span<const bf16>(dconv.p, dconv.n),
      std::span<const float>(dA.p, dA.n), std::span<const float>(ddt.p, ddt.n), std::span<const float>(dnorm.p, dnorm.n));
  DecodeRows dd{dpos.view(Shape{rows}), pos, {}, cache_rows, first, 0};
  CudaBackend gpu;
  gpu.gated_deltanet_decode(ops, dd, dtaps.view(Shape{cache_rows * (sh.taps - 1), cd}), dstate.view(Shape{cache_rows * hv * sh.dk, sh.dv}),
                            dy.view(Shape{rows, vd}));
  gpu.synchronize();
  CHECK(relative_error(dy.host(), y_d) < 3 * kBf16Round);
  const auto taps_got = dtaps.host();
  for (std::size_t i = 0; i < taps_got.size(); ++i) REQUIRE(static_cast<double>(static_cast<float>(taps_got[i])) == taps_d[i]);
  const auto state_got = dstate.host();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < state_got.size(); ++i) {
    num += (state_got[i] - state_d[i]) * (state_got[i] - state_d[i]);
    den += state_d[i] * state_d[i];
  }
  CHECK(std::sqrt(num / den) < 1e-5);
}

TEST_CASE("generation on the GPU: the cache where the kernels are in use, else each prefix recomputed; the CPU's tokens") {
  const auto cfg = ModelConfig::from_json(
      nlohmann::json{{"architectures", {"Qwen3_5ForCausalLM"}}, {"hidden_size", 128}, {"intermediate_size", 344},
                     {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 64},
                     {"vocab_size", 301}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4},
                     {"linear_key_head_dim", 32}, {"linear_value_head_dim", 48}, {"linear_conv_kernel_dim", 4},
                     {"full_attention_interval", 4}, {"partial_rotary_factor", 0.25}},
      "qwen3.5 test");
  TrainerOptions o;
  o.batch_rows = 3;
  o.seq_len = 24;
  std::vector<std::vector<std::int32_t>> prompts{{5, 9, 17}, {200, 3}, {42, 43, 44, 45, 46}, {7}};
  generate::GenerationOptions gen;
  gen.max_new_tokens = 10;
  gen.sampling.temperature = 0;
  const auto complete = [&](auto& be) {
    using B = std::remove_reference_t<decltype(be)>;
    DecoderModel<> model(cfg);
    StoreOptions so;
    so.seed = 3;
    HostParamStore<float> store(model.units(), Trainer<B>::store_options(o, so));
    Trainer<B> trainer(model, store, be, o);
    if constexpr (B::kDevice) CHECK(trainer.decodes() == CudaBackend::kDecodes);
    return generate::generate(trainer, {3, 24, cfg.vocab_size, 0}, prompts, gen);
  };
  CpuBackend<float> cpu;
  CudaBackend gpu;
  const auto want = complete(cpu), got = complete(gpu);
  // (bf16 may flip a near tie of an untrained model's logits: most tokens agree, every first one)
  std::size_t same = 0, all = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    REQUIRE(!got[i].tokens.empty());
    CHECK(got[i].tokens[0] == want[i].tokens[0]);
    for (std::size_t t = 0; t < std::min(got[i].tokens.size(), want[i].tokens.size()); ++t, ++all)
      same += got[i].tokens[t] == want[i].tokens[t];
  }
  CHECK(same * 10 >= all * 8);
}
