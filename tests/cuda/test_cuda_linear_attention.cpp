// Qwen3.5's layers on the GPU against the CPU reference in float64, on the same bf16 inputs:
// Gated DeltaNet's mixing alone (the convolution, the norms, the gates, the chunked delta rule and
// the gated norm, forward and backward) at awkward lengths and head shapes, in rows and packed;
// then whole blocks (a linear-attention layer, a gated full-attention layer, the mixture of
// experts with its shared expert) through check_block.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "block_check.hpp"
#include "megatrain/backend/cpu/gated_deltanet_mix.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/layers/ops/gated_deltanet.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

struct MixCase {
  std::int64_t key_heads, value_heads, dk, dv, taps;
  std::int64_t rows, seq;
  std::vector<int> lengths;  ///< packed sequences (empty: each row one sequence)
  std::int64_t window = 0;   ///< tokens a window of the GPU's kernels (0: their default)
};

/// Every input of one mixing, drawn once: bf16 where the GPU reads bf16, fp32 parameters.
struct MixData {
  std::vector<bf16> mixed, z, a, b, conv, dy;
  std::vector<float> A_log, dt_bias, norm;
  MixData(const DeltaNetShape& s, std::int64_t T, std::mt19937& rng) {
    mixed = random_bf16(static_cast<std::size_t>(T * s.conv_dim()), 1.0f, rng);
    z = random_bf16(static_cast<std::size_t>(T * s.value_dim()), 1.0f, rng);
    a = random_bf16(static_cast<std::size_t>(T * s.value_heads), 1.0f, rng);
    b = random_bf16(static_cast<std::size_t>(T * s.value_heads), 1.0f, rng);
    conv = random_bf16(static_cast<std::size_t>(s.conv_dim() * s.taps), 0.5f, rng);
    dy = random_bf16(static_cast<std::size_t>(T * s.value_dim()), 1.0f, rng);
    std::uniform_real_distribution<float> u(0.5f, 16.0f);  // A in (0, 16), as transformers draws it
    for (std::int64_t h = 0; h < s.value_heads; ++h) {
      A_log.push_back(std::log(u(rng)));
      dt_bias.push_back(1.0f + 0.3f * std::normal_distribution<float>()(rng));
    }
    for (std::int64_t j = 0; j < s.dv; ++j) norm.push_back(1.0f + 0.1f * std::normal_distribution<float>()(rng));
  }
};

template <class E>
View<const E> cv(const CudaBackend::Buffer<E>& b, Shape s) {
  return View<const E>(std::span<const E>(b.span()), std::move(s));
}
template <class E>
View<E> mv(CudaBackend::Buffer<E>& b, Shape s) {
  return View<E>(b.span(), std::move(s));
}

bool every_sequence_one_token(const std::vector<std::int32_t>& starts) {
  for (std::size_t i = 1; i < starts.size(); ++i)
    if (starts[i] - starts[i - 1] != 1) return false;
  return true;
}

void check_mix(const MixCase& mc) {
  const DeltaNetShape s{mc.key_heads, mc.value_heads, mc.dk, mc.dv, mc.taps, 1e-6};
  const std::int64_t T = mc.rows * mc.seq, cd = s.conv_dim(), vd = s.value_dim(), Hv = s.value_heads;
  CAPTURE(T);
  CAPTURE(mc.lengths.size());
  CAPTURE(s.key_heads);
  CAPTURE(s.value_heads);
  CAPTURE(s.dk);
  CAPTURE(s.dv);
  CAPTURE(mc.window);
  std::mt19937 rng(static_cast<unsigned>(7 + T + 31 * s.dk + s.dv));
  const MixData in(s, T, rng);

  // The reference: the CPU's mixing in float64 on the same values.
  std::vector<std::int32_t> starts{0};
  if (mc.lengths.empty()) {
    for (std::int64_t r = 1; r <= mc.rows; ++r) starts.push_back(static_cast<std::int32_t>(r * mc.seq));
  } else {
    for (const int n : mc.lengths) starts.push_back(starts.back() + n);
  }
  REQUIRE(starts.back() == T);
  const auto mixed = to_double(in.mixed), z = to_double(in.z), a = to_double(in.a), b = to_double(in.b);
  const auto conv = to_double(in.conv), A_log = to_double(in.A_log), dt_bias = to_double(in.dt_bias),
             norm = to_double(in.norm), dy = to_double(in.dy);
  cpu::GatedDeltaNetMix<double> m;
  m.key_heads = s.key_heads;
  m.value_heads = s.value_heads;
  m.dk = s.dk;
  m.dv = s.dv;
  m.taps = s.taps;
  m.norm_eps = s.norm_eps;
  m.starts = starts;
  m.mixed = mixed.data();
  m.z = z.data();
  m.a = a.data();
  m.b = b.data();
  m.conv = conv.data();
  m.A_log = A_log.data();
  m.dt_bias = dt_bias.data();
  m.norm = norm.data();
  std::vector<double> o(static_cast<std::size_t>(T * vd)), rstd(static_cast<std::size_t>(T * Hv)), y(o.size());
  cpu::gated_deltanet_mix(m, o.data(), rstd.data(), y.data());
  std::vector<double> dmixed(mixed.size()), dz(z.size()), da(a.size()), db(b.size()), dconv(conv.size(), 0.0),
      dA(A_log.size(), 0.0), ddt(dt_bias.size(), 0.0), dnorm(norm.size(), 0.0);
  cpu::gated_deltanet_mix_backward(m, o.data(), rstd.data(), dy.data(),
                                   {dmixed.data(), dz.data(), da.data(), db.data(), dconv.data(), dA.data(), ddt.data(),
                                    dnorm.data()});

  // The GPU, its workspace prepared for this chunk.
  CudaBackendOptions opt;
  opt.delta_net_window = mc.window;
  CudaBackend be(opt);
  WorkspacePlan plan{T, vd, 0, {{mc.rows, mc.seq, 1, 1, 64, {}, 0.0, 0}}};
  plan.packed = !mc.lengths.empty();
  plan.packed_sequences_per_row = plan.packed ? static_cast<std::int64_t>(mc.lengths.size()) : 8;
  plan.linear_attention = s;
  be.prepare(plan);
  ChunkShape c{mc.rows, mc.seq};
  std::optional<CudaBackend::Buffer<std::int32_t>> dpos, dstarts;
  std::vector<std::int32_t> positions;
  if (!mc.lengths.empty()) {
    for (const int n : mc.lengths)
      for (int t = 0; t < n; ++t) positions.push_back(t);
    dpos.emplace(to_device(be, positions));
    dstarts.emplace(to_device(be, starts));
    c.packed.positions = cv(*dpos, Shape{T});
    c.packed.starts = cv(*dstarts, Shape{static_cast<std::int64_t>(starts.size())});
    c.packed.host_starts = starts;
  }
  auto gm = to_device(be, in.mixed), gz = to_device(be, in.z), ga = to_device(be, in.a), gb = to_device(be, in.b);
  auto gconv = to_device(be, in.conv), gdy = to_device(be, in.dy);
  auto gA = to_device(be, in.A_log), gdt = to_device(be, in.dt_bias), gnorm = to_device(be, in.norm);
  auto go = be.alloc<bf16>(o.size()), gy = be.alloc<bf16>(y.size());
  auto grstd = be.alloc<float>(rstd.size());
  const auto sp = [](auto& buf) {
    using E = std::remove_reference_t<decltype(buf.span()[0])>;
    return std::span<const E>(buf.span());
  };
  const CudaBackend::DeltaNetIn dm =
      delta_net_operands<bf16, bf16, float>(s, c, sp(gm), sp(gz), sp(ga), sp(gb), sp(gconv), sp(gA), sp(gdt), sp(gnorm));
  auto gdm = be.alloc<bf16>(mixed.size()), gdz = be.alloc<bf16>(z.size()), gda = be.alloc<bf16>(a.size()),
       gdb = be.alloc<bf16>(b.size());
  // The parameters' gradients are added to: start them at a value, and take it off after.
  const std::vector<float> base_conv(conv.size(), 0.25f), base_h(static_cast<std::size_t>(Hv), -0.5f),
      base_n(norm.size(), 0.125f);
  auto gdconv = to_device(be, base_conv), gdA = to_device(be, base_h), gddt = to_device(be, base_h),
       gdnorm = to_device(be, base_n);
  const std::size_t held = be.allocated_bytes();  // (the workspace prepare() made must do: nothing more allocated)
  be.gated_deltanet_mix(dm, mv(go, Shape{T, vd}), mv(grstd, Shape{T * Hv}), mv(gy, Shape{T, vd}));
  be.gated_deltanet_mix_backward(dm, cv(go, Shape{T, vd}), cv(grstd, Shape{T * Hv}), cv(gdy, Shape{T, vd}),
                                 {mv(gdm, Shape{T, cd}), mv(gdz, Shape{T, vd}), mv(gda, Shape{T, Hv}), mv(gdb, Shape{T, Hv}),
                                  mv(gdconv, Shape{cd, 1, s.taps}), mv(gdA, Shape{Hv}), mv(gddt, Shape{Hv}),
                                  mv(gdnorm, Shape{s.dv})});
  be.synchronize();
  CHECK(be.allocated_bytes() == held);
  const auto less = [](std::vector<double> v, double by) {
    for (double& x : v) x -= by;
    return v;
  };
  const double eo = rel_err(from_device(go), o), edm = rel_err(from_device(gdm), dmixed), edz = rel_err(from_device(gdz), dz),
               edb = rel_err(from_device(gdb), db);
  MESSAGE("T ", T, " (", mc.lengths.size(), " packed) heads ", s.key_heads, "/", s.value_heads, " dk ", s.dk, " dv ", s.dv,
          " window ", mc.window, ": relative errors o ", eo, ", dmixed ", edm, ", dz ", edz, ", db ", edb);
  CHECK(eo < kOutTol);
  CHECK(rel_err(from_device(gy), y) < kOutTol);
  CHECK(rel_err(from_device(grstd), rstd) < kOutTol);
  CHECK(edm < kGradTol);
  CHECK(edz < kGradTol);
  CHECK(edb < kGradTol);
  CHECK(rel_err(less(from_device(gdconv), 0.25), dconv) < kGradTol);
  // The decay's gradients (da, dA_log, ddt_bias) are exactly 0 where every sequence is one token
  // long (its state starts at 0: nothing to decay); the GPU's chunked sums leave bf16 rounding
  // there, held to the tolerance on the scale of beta's gradient (the same per-head quantity).
  const double decay_floor = every_sequence_one_token(starts) ? test::norm(db) : 1e-300;
  CHECK(rel_err(from_device(gda), da, decay_floor) < kGradTol);
  CHECK(rel_err(less(from_device(gdA), -0.5), dA, decay_floor) < kGradTol);
  CHECK(rel_err(less(from_device(gddt), -0.5), ddt, decay_floor) < kGradTol);
  if (every_sequence_one_token(starts)) CHECK(test::norm(da) == 0.0);
  CHECK(rel_err(less(from_device(gdnorm), 0.125), dnorm) < kGradTol);
}

/// A one-layer Qwen3.5 (text) config whose layer 0 is `kind`.
ModelConfig qwen3_5(const char* kind, int hidden, int dk, int dv, int key_heads, int value_heads, const char* arch = "Qwen3_5ForCausalLM",
                    const nlohmann::json& more = nlohmann::json::object()) {
  nlohmann::json j{{"layer_types", {kind}},
                   {"linear_conv_kernel_dim", 4},
                   {"linear_key_head_dim", dk},
                   {"linear_value_head_dim", dv},
                   {"linear_num_key_heads", key_heads},
                   {"linear_num_value_heads", value_heads},
                   {"partial_rotary_factor", 0.25},
                   {"rms_norm_eps", 1e-6}};
  j.update(more);
  return config(hidden, 4, 2, 32, 101, false, false, arch, j);
}

}  // namespace

TEST_CASE("Gated DeltaNet's mixing on the GPU matches the float64 reference at awkward lengths, in rows") {
  for (const std::int64_t seq : {1, 63, 64, 65, 1000})
    check_mix({2, 4, 128, 128, 4, 2, seq, {}});
  check_mix({1, 3, 48, 80, 4, 1, 130, {}});   // key head narrower than the state's tile, value head not a multiple of 32
  check_mix({2, 2, 128, 128, 3, 1, 4096, {}});
  check_mix({4, 8, 16, 8, 4, 3, 77, {}});     // tiny heads
}

TEST_CASE("Gated DeltaNet's mixing on the GPU: packed sequences restart the state and the convolution") {
  std::mt19937 rng(5);
  check_mix({2, 4, 128, 128, 4, 2, 300, random_lengths(2, 300, 90, rng)});
  check_mix({1, 2, 64, 96, 4, 1, 200, {1, 63, 64, 65, 7}});
  check_mix({2, 2, 128, 128, 4, 1, 1000, random_lengths(1, 1000, 400, rng)});
}

TEST_CASE("Gated DeltaNet's mixing on the GPU in windows: the state, its gradient and the convolution carried across") {
  // Windows of 64, 128 or 192 tokens: sequences cross them (a window ends where a chunk does), a
  // window may hold the ends of two; the result must be the one-window result's (the reference).
  std::mt19937 rng(9);
  check_mix({2, 4, 128, 128, 4, 2, 1000, {}, 192});
  check_mix({2, 4, 64, 96, 4, 1, 777, {}, 64});
  check_mix({2, 4, 128, 128, 4, 2, 300, random_lengths(2, 300, 150, rng), 128});
  check_mix({1, 2, 64, 96, 4, 1, 260, {1, 63, 64, 65, 7, 60}, 64});
  check_mix({2, 2, 128, 128, 4, 1, 4096, {}, 1000});
}

TEST_CASE("Gated DeltaNet's mixing on the GPU at 65,536 tokens in one sequence") {
  check_mix({1, 2, 128, 128, 4, 1, 65536, {}});
}

TEST_CASE("Qwen3.5 blocks on the GPU match the float64 reference: linear attention, gated attention, shared expert") {
  check_block(qwen3_5("linear_attention", 96, 32, 48, 2, 4), {2, 37}, true);
  check_block(qwen3_5("linear_attention", 128, 128, 128, 1, 2), {1, 200}, true);
  check_block(qwen3_5("full_attention", 96, 32, 48, 2, 4), {2, 37}, true);   // q_proj's gate, partial rotary, (1 + w) norms
  check_block(qwen3_5("full_attention", 96, 32, 48, 2, 4), {2, 37}, false);
  check_block(qwen3_5("linear_attention", 96, 32, 48, 2, 4), {2, 64}, true, {5, 1, 58, 64});  // packed
  // Qwen3.5-MoE: every expert chosen by every token (the routing cannot differ), the shared expert
  const nlohmann::json moe{{"num_experts", 4},          {"num_experts_per_tok", 4},          {"moe_intermediate_size", 40},
                           {"shared_expert_intermediate_size", 56}, {"intermediate_size", 0}};
  check_block(qwen3_5("linear_attention", 96, 32, 48, 2, 4, "Qwen3_5MoeForCausalLM", moe), {2, 37}, true);
  check_block(qwen3_5("full_attention", 96, 32, 48, 2, 4, "Qwen3_5MoeForCausalLM", moe), {1, 50}, true);
}

TEST_CASE("Qwen3-Next blocks on the GPU match the float64 reference: the fused projections gathered and scattered") {
  const nlohmann::json next{{"num_experts", 4},          {"num_experts_per_tok", 4},          {"moe_intermediate_size", 40},
                            {"shared_expert_intermediate_size", 56}, {"norm_topk_prob", true}};
  check_block(qwen3_5("linear_attention", 96, 32, 48, 2, 4, "Qwen3NextForCausalLM", next), {2, 37}, true);
  check_block(qwen3_5("linear_attention", 96, 32, 16, 1, 3, "Qwen3NextForCausalLM", next), {1, 70}, true, {30, 40});
  auto dense = next;
  dense.update({{"mlp_only_layers", {0}}, {"intermediate_size", 72}});
  check_block(qwen3_5("full_attention", 96, 32, 48, 2, 4, "Qwen3NextForCausalLM", dense), {2, 37}, true);
}

TEST_CASE("key heads wider than the GPU kernels take are refused before anything runs, naming the way out") {
  auto cfg = qwen3_5("linear_attention", 96, 192, 48, 2, 4);
  try {
    GatedDeltaNet::check_backend<CudaBackend>(cfg);
    FAIL("not refused");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("--backend cpu") != std::string::npos);
  }
  GatedDeltaNet::check_backend<CudaBackend>(qwen3_5("linear_attention", 96, 128, 48, 2, 4));  // runs
}
