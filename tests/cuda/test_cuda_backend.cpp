// The CUDA backend's ops (bf16, fp32 accumulation, an fp32 residual stream and fp32 norm gains)
// against the CPU reference in float64, run on the same inputs and weights: the decoder block,
// the embedding and the head, forward and backward, with attention through cuDNN and through
// megatrain's own kernel (forced, and chosen automatically for a shape cuDNN refuses).
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "block_check.hpp"

using namespace megatrain;
using namespace megatrain::test;

TEST_CASE("decoder block on the GPU matches the float64 reference (cuDNN attention)") {
  check_block(config(128, 4, 2, 64, 101, true, true), {2, 37}, true);
  check_block(config(256, 8, 8, 64, 101, false, true), {1, 128}, true);
  check_block(config(192, 6, 1, 128, 101, true, true), {3, 13}, true);
  // Qwen3: q/k norms per head (head_rmsnorm), q wider than the hidden size
  check_block(config(64, 4, 2, 32, 101, false, true, "Qwen3ForCausalLM"), {2, 37}, true);
  check_block(config(256, 2, 1, 128, 101, false, true, "Qwen3ForCausalLM"), {1, 64}, true);
  // Gemma 3: a full layer through cuDNN with query_pre_attn_scalar's scale; a sliding one (the
  // own kernel runs windows) beside it
  check_block(gemma3(128, 4, 2, 64, 48, 0), {2, 37}, true);
  check_block(gemma3(256, 2, 1, 128, 256, 9), {1, 70}, true);
  // SmolLM3: a NoPE layer (no rotary). (Without biases: a key bias's gradient is zero in exact
  // arithmetic there, the same logit added to every key, and bf16 leaves only noise to compare.)
  check_block(config(128, 4, 2, 32, 101, false, true, "SmolLM3ForCausalLM",
                     {{"no_rope_layers", {0}}, {"pad_token_id", nullptr}}),
              {2, 37}, true);
}

TEST_CASE("a mixture-of-experts block on the GPU matches the float64 reference") {
  // Every expert chosen by every token (top k = E): the routing cannot differ between bf16 and
  // float64, so the whole path is compared (router, softmax, renormalisation, grouped products,
  // weighted sums and their backward).
  const auto moe = [](const char* arch, int experts, int k, bool norm, int inter) {
    return config(96, 4, 2, 24, 101, false, true, arch,
                  {{"num_experts", experts}, {"num_local_experts", experts}, {"num_experts_per_tok", k},
                   {"moe_intermediate_size", inter}, {"norm_topk_prob", norm}, {"intermediate_size", inter}});
  };
  check_block(moe("Qwen3MoeForCausalLM", 4, 4, true, 40), {2, 37}, true);
  check_block(moe("Qwen3MoeForCausalLM", 3, 3, false, 72), {1, 50}, true);
  check_block(moe("MixtralForCausalLM", 5, 5, true, 56), {3, 13}, true);
  check_block(moe("OlmoeForCausalLM", 4, 4, false, 24), {2, 21}, true);
  // A router that sends every token to one expert (zero weights: the first of equals), the other
  // experts without a token: top 1 of 6, and top 2 of 8.
  check_block(moe("Qwen3MoeForCausalLM", 6, 1, false, 40), {2, 37}, true, {}, true);
  check_block(moe("OlmoeForCausalLM", 8, 2, false, 32), {1, 29}, true, {}, true);
}

TEST_CASE("a GPT-OSS block on the GPU matches the float64 reference (sinks, biased experts, clamped SwiGLU)") {
  // Layer 0 of GPT-OSS slides (window `window`; 0: a full layer); every expert chosen, as above,
  // and a router (weights and bias zero) sending every token to expert 0 with the others idle.
  const auto gpt = [](int experts, int k, int inter, int window) {
    return config(96, 4, 2, 24, 101, false, true, "GptOssForCausalLM",
                  {{"num_local_experts", experts}, {"num_experts_per_tok", k}, {"intermediate_size", inter},
                   {"sliding_window", window > 0 ? window : 4096},
                   {"layer_types", {window > 0 ? "sliding_attention" : "full_attention"}}});
  };
  check_block(gpt(4, 4, 40, 9), {2, 37}, true);   // sliding: the own kernel, with sinks
  check_block(gpt(3, 3, 72, 0), {1, 50}, true);   // full: the own kernel too (cuDNN has no sinks)
  check_block(gpt(5, 5, 56, 4), {3, 13}, false);
  check_block(gpt(6, 1, 40, 0), {2, 37}, true, {}, true);
}

TEST_CASE("decoder block on the GPU matches the float64 reference (megatrain's attention kernel)") {
  check_block(config(72, 6, 2, 12, 101, true, true), {2, 13}, false);
  check_block(config(200, 7, 1, 40, 101, false, true), {1, 67}, false);
  check_block(config(128, 2, 2, 64, 101, false, true), {3, 1}, false);
  check_block(config(72, 6, 2, 12, 101, false, true, "Qwen3ForCausalLM"), {2, 13}, false);
  check_block(gemma3(72, 6, 2, 12, 20, 4), {2, 13}, false);
  check_block(gemma3(96, 3, 3, 32, 16, 0), {1, 45}, false);
  check_block(gemma3(64, 2, 1, 32, 32, 40), {1, 100}, false);  // a window across tiles
  check_block(config(72, 6, 2, 12, 101, false, true, "SmolLM3ForCausalLM", {{"no_rope_layers", {0}}, {"pad_token_id", nullptr}}),
              {2, 13}, false);
}

TEST_CASE("packed rows: a decoder block matches the float64 reference, attention within each sequence") {
  std::mt19937 rng(77);
  for (const bool cudnn : {true, false}) {
    CAPTURE(cudnn);
    check_block(config(256, 8, 8, 64, 101, false, true), {3, 128}, cudnn, random_lengths(3, 128, 40, rng));
    check_block(config(128, 4, 2, 64, 101, true, true), {2, 37}, cudnn, {5, 1, 20, 11, 37});
    check_block(config(192, 6, 1, 128, 101, true, true), {2, 300}, cudnn, random_lengths(2, 300, 25, rng));
    check_block(config(128, 4, 2, 64, 101, true, true), {1, 1000}, cudnn, random_lengths(1, 1000, 400, rng));
  }
}

TEST_CASE("embedding and head on the GPU match the float64 reference") {
  for (int variant : {0, 1, 2}) {  // untied, tied, and Gemma 3's (scaled embedding, (1 + w) final norm; tied)
    const bool tied = variant != 0;
    CAPTURE(variant);
    auto cfg = config(96, 4, 2, 24, 1001, false, tied);
    if (variant == 2) {
      cfg = gemma3(96, 4, 2, 24, 24, 0);
      cfg.vocab_size = 1001;
    }
    DecoderModel<> model(cfg);
    std::mt19937 rng(7);
    const ChunkShape c{3, 29};
    const std::int64_t M = c.tokens(), d = cfg.hidden_size, V = cfg.vocab_size;
    const auto ne = static_cast<std::size_t>(model.embedding().layout().numel());
    const auto nh = static_cast<std::size_t>(model.head().layout().numel());
    auto e16 = random_bf16(ne, 0.5f, rng), h16 = random_bf16(nh, 0.5f, rng);
    auto x32 = random_f32(static_cast<std::size_t>(M * d), 1.0f, rng);
    auto hd = to_double(h16);
    const auto hgains = random_gains(model.head(), hd, rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(M)), labels(ids.size());
    for (auto& t : ids) t = static_cast<std::int32_t>(rng() % V);
    for (auto& t : labels) t = rng() % 5 == 0 ? kIgnoreIndex : static_cast<std::int32_t>(rng() % V);
    std::int64_t valid = 0;
    for (auto t : labels) valid += t != kIgnoreIndex;
    const double scale = 1.0 / static_cast<double>(valid);

    CpuBackend<double> cpu;
    std::vector<std::byte> mem(model.head().op().scratch_bytes<CpuBackend<double>>(c));
    Arena arena{std::span<std::byte>(mem)};
    auto ed = to_double(e16), xd = to_double(x32);
    std::vector<double> embd(static_cast<std::size_t>(M * d)), lossd(static_cast<std::size_t>(M)), dxd(static_cast<std::size_t>(M * d));
    std::vector<double> ge(ne, 0.0), gh(nh, 0.0);
    const View<const std::int32_t> idv(std::span<const std::int32_t>(ids), Shape{M}), lbv(std::span<const std::int32_t>(labels), Shape{M});
    model.embedding().op().forward(cpu, c, model.embedding().bind(std::span<const double>(ed)), idv,
                                   View<double>(std::span<double>(embd), Shape{M, d}), arena);
    const auto hw = model.head().bind(std::span<const double>(hd), {{&model.embedding().layout(), std::span<const double>(ed)}});
    const auto hg = model.head().bind(std::span<double>(gh), {{&model.embedding().layout(), std::span<double>(ge)}});
    model.head().op().forward_backward(cpu, c, hw, View<const double>(std::span<const double>(xd), Shape{M, d}), lbv, scale,
                                       View<double>(std::span<double>(lossd), Shape{M}), View<double>(std::span<double>(dxd), Shape{M, d}),
                                       hg, arena);
    model.embedding().op().backward(cpu, c, idv, View<const double>(std::span<const double>(xd), Shape{M, d}),
                                    model.embedding().bind(std::span<double>(ge)), arena);

    CudaBackendOptions opt;
    opt.logits_block = 37;  // several blocks, the last one short
    CudaBackend be(opt);
    be.prepare({M, 3 * d, V, {}});
    auto e = to_device(be, e16), h = to_device(be, h16);
    auto hg32 = to_device(be, hgains), x = to_device(be, x32);
    auto idd = to_device(be, ids), lbd = to_device(be, labels);
    auto emb = be.alloc<float>(static_cast<std::size_t>(M * d)), dx = be.alloc<float>(static_cast<std::size_t>(M * d));
    auto loss = be.alloc<float>(static_cast<std::size_t>(M));
    auto gE = be.alloc<float>(ne), gH = be.alloc<float>(nh);
    MT_CUDA_CHECK(cudaMemset(gE.span().data(), 0, ne * 4));
    MT_CUDA_CHECK(cudaMemset(gH.span().data(), 0, nh * 4));
    auto scratch = be.alloc<std::byte>(model.head().op().scratch_bytes<CudaBackend>(c));
    Arena darena{scratch.span()};
    const View<const std::int32_t> idg(std::span<const std::int32_t>(idd.span()), Shape{M}), lbg(std::span<const std::int32_t>(lbd.span()), Shape{M});
    model.embedding().op().forward(be, c, model.embedding().bind(std::span<const bf16>(e.span())), idg,
                                   View<float>(emb.span(), Shape{M, d}), darena);
    const auto hwg = model.head().bind(std::span<const bf16>(h.span()), {&model.head().full_layout(), std::span<const float>(hg32.span())},
                                       {{&model.embedding().layout(), std::span<const bf16>(e.span())}});
    const auto hgg = model.head().bind(gH.span(), {{&model.embedding().layout(), gE.span()}});
    model.head().op().forward_backward(be, c, hwg, View<const float>(std::span<const float>(x.span()), Shape{M, d}), lbg, scale,
                                       View<float>(loss.span(), Shape{M}), View<float>(dx.span(), Shape{M, d}), hgg, darena);
    model.embedding().op().backward(be, c, idg, View<const float>(std::span<const float>(x.span()), Shape{M, d}),
                                    model.embedding().bind(gE.span()), darena);
    be.synchronize();
    // a gather is exact; scaled (Gemma), within one fp32 rounding of the product
    CHECK(rel_err(from_device(emb), embd) <= (variant == 2 ? 0x1p-24 : 0.0));
    CHECK(rel_err(from_device(loss), lossd) < 4 * 0x1p-9);
    CHECK(rel_err(from_device(dx), dxd) < kGradTol);
    CHECK(rel_err(from_device(gE), ge) < kGradTol);
    CHECK(rel_err(from_device(gH), gh) < kGradTol);
    // the logits themselves (LmHead::logits: the final norm, then the head's product; bf16 out)
    std::vector<double> logitsd(static_cast<std::size_t>(M * V));
    model.head().op().logits(cpu, c, hw, View<const double>(std::span<const double>(xd), Shape{M, d}),
                             View<double>(std::span<double>(logitsd), Shape{M, V}), arena);
    auto logits = be.alloc<bf16>(static_cast<std::size_t>(M * V));
    model.head().op().logits(be, c, hwg, View<const float>(std::span<const float>(x.span()), Shape{M, d}),
                             View<bf16>(logits.span(), Shape{M, V}), darena);
    be.synchronize();
    CHECK(rel_err(from_device(logits), logitsd) < 4 * 0x1p-9);
  }
}

TEST_CASE("take_rows on the GPU moves exactly the rows the CPU backend moves") {
  for (const std::int64_t d : {96, 37}) {  // the float4 path and the scalar one
    CAPTURE(d);
    const std::int64_t V = 1001, U = 313;
    std::mt19937 rng(static_cast<unsigned>(11 + d));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> table(static_cast<std::size_t>(V * d));
    for (auto& x : table) x = nd(rng);
    std::vector<std::int32_t> all(static_cast<std::size_t>(V));
    for (std::int64_t i = 0; i < V; ++i) all[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<std::int32_t> rows(all.begin(), all.begin() + U);  // distinct, unsorted

    CpuBackend<float> cpu;
    std::vector<float> want_table = table, want(static_cast<std::size_t>(U * d));
    cpu.take_rows(View<const std::int32_t>(std::span<const std::int32_t>(rows), Shape{U}),
                  View<float>(std::span<float>(want_table), Shape{V, d}), View<float>(std::span<float>(want), Shape{U, d}));

    CudaBackend be;
    auto t = to_device(be, table);
    auto r = to_device(be, rows);
    auto out = be.alloc<float>(static_cast<std::size_t>(U * d));
    be.take_rows(View<const std::int32_t>(std::span<const std::int32_t>(r.span()), Shape{U}), View<float>(t.span(), Shape{V, d}),
                 View<float>(out.span(), Shape{U, d}));
    be.synchronize();
    const auto got = from_device(out), got_table = from_device(t);
    CHECK(std::equal(got.begin(), got.end(), want.begin()));
    CHECK(std::equal(got_table.begin(), got_table.end(), want_table.begin()));
    const auto row0 = static_cast<std::size_t>(rows[0] * d);
    CHECK(got_table[row0] == 0.0);
    CHECK(want[0] == table[row0]);
  }
}

namespace {

/// bf16's machine epsilon (7 stored fraction bits: the gap after 1.0); rounding to nearest is off
/// by at most half of it, relative.
constexpr double kBf16Eps = 0x1p-7;
/// fp32's, for what accumulates in fp32 (products of bf16 values are exact in fp32).
constexpr double kF32Eps = 0x1p-23;

template <class E>
std::vector<float> to_float(const std::vector<E>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}
View<const float> cview(const std::vector<float>& v, Shape s) { return {std::span<const float>(v), s}; }
View<float> mview(std::vector<float>& v, Shape s) { return {std::span<float>(v), s}; }
template <class E>
View<const E> cview(const CudaBackend::Buffer<E>& b, Shape s) { return {b.span(), s}; }
template <class E>
View<E> mview(CudaBackend::Buffer<E>& b, Shape s) { return {b.span(), s}; }

/// Every element within its own bound: |got - want| <= bound[i]. Reports the worst one.
void check_within(const std::vector<double>& got, const std::vector<float>& want, const std::vector<double>& bound,
                  const char* what) {
  REQUIRE(got.size() == want.size());
  REQUIRE(bound.size() == want.size());
  std::size_t worst = 0;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(got[i]));
    const double ratio = std::abs(got[i] - static_cast<double>(want[i])) / bound[i];
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  const std::string name(what);
  CAPTURE(name);
  CAPTURE(worst);
  CAPTURE(got[worst]);
  CAPTURE(want[worst]);
  CAPTURE(bound[worst]);
  CHECK(worst_ratio <= 1.0);
}

}  // namespace

TEST_CASE("the cuBLASLt plan cache builds one plan per shape and reuses it") {
  CudaBackend be;
  auto ws = be.alloc<std::byte>(std::size_t{32} << 20);
  cuda::Gemm gemm(ws.span().data(), ws.size());
  std::mt19937 rng(3);
  const std::int64_t M = 33, N = 64, K = 128;
  auto x = to_device(be, random_bf16(static_cast<std::size_t>((M + 1) * K), 1.0f, rng));
  auto w = to_device(be, random_bf16(static_cast<std::size_t>(N * K), 0.1f, rng));
  auto y1 = be.alloc<bf16>(static_cast<std::size_t>((M + 1) * N)), y2 = be.alloc<bf16>(y1.size());
  const bf16* xp = x.span().data();
  const bf16* wp = w.span().data();
  CHECK(gemm.cached_plans() == 0);

  gemm.forward(xp, wp, nullptr, y1.span().data(), M, N, K, be.stream());
  const std::size_t after_first = gemm.cached_plans();
  CHECK(after_first == 1);
  // The same shape again, into the same and into another (equally aligned) output: no new plan,
  // and the cached plan gives the same bits.
  for (int i = 0; i < 3; ++i) gemm.forward(xp, wp, nullptr, y2.span().data(), M, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first);
  be.synchronize();
  const auto a = from_device(y1), b = from_device(y2);
  CHECK(std::equal(a.begin(), a.begin() + M * N, b.begin()));

  // A new shape: exactly one more plan, then reused.
  gemm.forward(xp, wp, nullptr, y1.span().data(), M + 1, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 1);
  gemm.forward(xp, wp, nullptr, y2.span().data(), M + 1, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 1);
  // Another kind of product (the weight gradient) of an old shape: one more, once.
  auto dw = be.alloc<float>(static_cast<std::size_t>(N * K));
  MT_CUDA_CHECK(cudaMemset(dw.span().data(), 0, dw.size() * sizeof(float)));
  gemm.weight_grad(y1.span().data(), xp, dw.span().data(), M, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 2);
  gemm.weight_grad(y2.span().data(), xp, dw.span().data(), M, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 2);
  // Pointers off the 16-byte grid need a plan of their own (part of the key), also built once.
  gemm.forward(xp + 1, wp, nullptr, y1.span().data(), M, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 3);
  gemm.forward(xp + 1, wp, nullptr, y2.span().data(), M, N, K, be.stream());
  CHECK(gemm.cached_plans() == after_first + 3);
  be.synchronize();
}

TEST_CASE("tuned matrix products: every candidate's result is right, the choice is fixed, saved and restored bit for bit") {
  CudaBackend be;
  auto ws = be.alloc<std::byte>(std::size_t{32} << 20);
  std::mt19937 rng(11);
  // Shapes where cuBLASLt offers several algorithms (long sums: some split them): forward and the
  // weight gradient (fp32, accumulated).
  const std::int64_t M = 1027, N = 768, K = 2560;
  const auto x16 = random_bf16(static_cast<std::size_t>(M * K), 1.0f, rng), w16 = random_bf16(static_cast<std::size_t>(N * K), 0.1f, rng),
             dy16 = random_bf16(static_cast<std::size_t>(M * N), 1.0f, rng);
  auto x = to_device(be, x16), w = to_device(be, w16), dy = to_device(be, dy16);
  auto y = be.alloc<bf16>(static_cast<std::size_t>(M * N));
  auto dw = be.alloc<float>(static_cast<std::size_t>(N * K));
  // The float64 products and the bound of one bf16 rounding plus fp32 accumulation (as above).
  const auto xf = to_float(x16), wf = to_float(w16), dyf = to_float(dy16);
  std::vector<float> y_ref(static_cast<std::size_t>(M * N)), dw_ref(static_cast<std::size_t>(N * K));
  std::vector<double> y_bound(y_ref.size()), dw_bound(dw_ref.size());
  const auto raw = [](const auto& b) {
    using E = std::remove_cvref_t<decltype(b.span()[0])>;
    std::vector<E> h(b.size());
    MT_CUDA_CHECK(cudaMemcpy(h.data(), b.span().data(), b.size() * sizeof(E), cudaMemcpyDeviceToHost));
    return h;
  };
  // (the sum of n products p(t) in float64, and of their magnitudes)
  const auto dot = [](std::int64_t n, const auto& p) {
    double v = 0, a = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      v += p(t);
      a += std::abs(p(t));
    }
    return std::pair{v, a};
  };
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      const auto [v, a] = dot(K, [&](std::int64_t k) { return static_cast<double>(xf[i * K + k]) * wf[j * K + k]; });
      y_ref[i * N + j] = static_cast<float>(v);
      y_bound[i * N + j] = kBf16Eps * std::abs(v) + 4 * static_cast<double>(K + 2) * kF32Eps * a + 1e-30;
    }
  for (std::int64_t j = 0; j < N; ++j)
    for (std::int64_t k = 0; k < K; ++k) {
      const auto [v, a] = dot(M, [&](std::int64_t i) { return static_cast<double>(dyf[i * N + j]) * xf[i * K + k]; });
      dw_ref[j * K + k] = static_cast<float>(v);
      dw_bound[j * K + k] = 4 * static_cast<double>(M + 2) * kF32Eps * a + 1e-30;
    }
  const auto forward = [&](cuda::Gemm& g) {
    g.forward(x.span().data(), w.span().data(), nullptr, y.span().data(), M, N, K, be.stream());
    be.synchronize();
    return raw(y);
  };
  const auto weight_grad = [&](cuda::Gemm& g) {
    MT_CUDA_CHECK(cudaMemset(dw.span().data(), 0, dw.size() * sizeof(float)));
    g.weight_grad(dy.span().data(), x.span().data(), dw.span().data(), M, N, K, be.stream());
    be.synchronize();
    return raw(dw);
  };
  const auto to_double = [](const auto& v) {
    std::vector<double> d(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) d[i] = static_cast<double>(static_cast<float>(v[i]));
    return d;
  };

  cuda::Gemm tuned(ws.span().data(), ws.size(), true);
  CHECK(tuned.tuning());
  // While tuning, the calls take the candidates in turn: each call's product is right.
  std::vector<std::vector<bf16>> seen_y;
  for (int call = 0; call < 40; ++call) {
    CAPTURE(call);
    const auto yc = forward(tuned);
    check_within(to_double(yc), y_ref, y_bound, "y (tuning)");
    if (std::find(seen_y.begin(), seen_y.end(), yc) == seen_y.end()) seen_y.push_back(yc);
    check_within(to_double(weight_grad(tuned)), dw_ref, dw_bound, "dW (tuning)");
  }
  MESSAGE("distinct results of the forward's candidates while tuning: " << seen_y.size());
  // (each shape's candidates after a first untimed round: timed calls of both shapes)
  CHECK(tuned.timed_calls() >= 2);
  tuned.end_tuning();
  CHECK_FALSE(tuned.tuning());
  CHECK(tuned.timed_calls() == 0);
  // Fixed: every call the same bits.
  const auto y_fixed = forward(tuned);
  const auto dw_fixed = weight_grad(tuned);
  for (int call = 0; call < 3; ++call) {
    CHECK(forward(tuned) == y_fixed);
    CHECK(weight_grad(tuned) == dw_fixed);
  }
  const std::string saved = tuned.algorithms();
  CHECK(std::count(saved.begin(), saved.end(), '\n') == 3);  // the header and two shapes

  // Restored into another Gemm (one that would tune, before and after its plans are built): the
  // same algorithms, the same bits.
  for (const bool built_first : {false, true}) {
    CAPTURE(built_first);
    cuda::Gemm again(ws.span().data(), ws.size(), true);
    if (built_first) (void)forward(again);
    REQUIRE(again.restore(saved));
    CHECK_FALSE(again.tuning());
    CHECK(forward(again) == y_fixed);
    CHECK(weight_grad(again) == dw_fixed);
    CHECK(again.algorithms() == saved);
  }
  // Saved by another cuBLASLt or GPU: nothing taken (an untuned Gemm keeps the heuristic's first).
  {
    cuda::Gemm plain(ws.span().data(), ws.size());
    const auto y_plain = forward(plain);
    std::string other = saved;
    other.replace(other.find("cublasLt "), 9, "cublasLt 1");
    cuda::Gemm again(ws.span().data(), ws.size());
    CHECK_FALSE(again.restore(other));
    CHECK(forward(again) == y_plain);
    cuda::Gemm tuning(ws.span().data(), ws.size(), true);
    CHECK_FALSE(tuning.restore(other));
    CHECK(tuning.tuning());  // (nothing taken: it goes on tuning)
  }
  // Text that is not algorithms()'s: refused, naming the line.
  {
    cuda::Gemm again(ws.span().data(), ws.size(), true);
    CHECK_THROWS_WITH_AS(again.restore("not megatrain's\n"), doctest::Contains("does not start with"), megatrain::Error);
    std::string cut = saved.substr(0, saved.rfind(' '));  // (the last line loses a word)
    CHECK_THROWS_WITH_AS(again.restore(cut), doctest::Contains("line 3"), megatrain::Error);
  }
}

TEST_CASE("linear and linear_backward on the GPU match CpuBackend<float> at awkward sizes") {
  CudaBackend be;
  constexpr std::int64_t kSizes[] = {1, 7, 33, 130};
  be.prepare({130, 130, 0, {}});
  CpuBackend<float> cpu;
  std::mt19937 rng(29);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const std::int64_t M : kSizes)
    for (const std::int64_t K : kSizes)
      for (const std::int64_t N : kSizes)
        for (const bool bias : {false, true})
          for (const bool accumulate : {false, true}) {
            CAPTURE(M);
            CAPTURE(K);
            CAPTURE(N);
            CAPTURE(bias);
            CAPTURE(accumulate);
            const auto mk = static_cast<std::size_t>(M * K), nk = static_cast<std::size_t>(N * K),
                       mn = static_cast<std::size_t>(M * N);
            const auto x16 = random_bf16(mk, 1.0f, rng), w16 = random_bf16(nk, 0.5f, rng),
                       b16 = random_bf16(static_cast<std::size_t>(N), 1.0f, rng), dy16 = random_bf16(mn, 1.0f, rng),
                       dx16 = random_bf16(mk, 1.0f, rng);  // what dx holds before (accumulate)
            std::vector<float> dw0(nk), db0(static_cast<std::size_t>(N));  // fp32 accumulators, not zero
            for (auto& v : dw0) v = nd(rng);
            for (auto& v : db0) v = nd(rng);

            // Reference: the CPU backend in fp32 on the same (bf16-exact) values.
            const auto x = to_float(x16), w = to_float(w16), bv = to_float(b16), dy = to_float(dy16);
            const auto dx0 = to_float(dx16);
            std::vector<float> y(mn), dx = dx0, dw = dw0, db = db0;
            const Shape sx{M, K}, sw{N, K}, sy{M, N}, sb{N};
            cpu.linear(cview(x, sx), cview(w, sw), bias ? cview(bv, sb) : View<const float>{}, mview(y, sy));
            cpu.linear_backward(cview(x, sx), cview(w, sw), cview(dy, sy), mview(dx, sx), accumulate, mview(dw, sw),
                                bias ? mview(db, sb) : View<float>{});

            auto gx = to_device(be, x16), gw = to_device(be, w16), gb = to_device(be, b16), gdy = to_device(be, dy16);
            auto gdx = to_device(be, dx16);
            auto gdw = to_device(be, dw0), gdb = to_device(be, db0);
            auto gy = be.alloc<bf16>(mn);
            be.linear(cview(gx, sx), cview(gw, sw), bias ? cview(gb, sb) : View<const bf16>{}, mview(gy, sy));
            be.linear_backward(cview(gx, sx), cview(gw, sw), cview(gdy, sy), mview(gdx, sx), accumulate, mview(gdw, sw),
                               bias ? mview(gdb, sb) : View<float>{});
            be.synchronize();

            // Bounds, element by element. bf16 results (y, dx): one rounding to bf16 (at most
            // kBf16Eps / 2, relative; allowed kBf16Eps) on top of fp32 accumulation on both sides,
            // which is bounded by n * fp32 eps times the sum of |terms| (a worst case whatever the
            // order of summation; allowed 4x that). With a bias, cuBLASLt's bias epilogue rounds
            // the product x w^T to bf16 before it adds the bias (seen on H200, cuBLAS 13, for
            // M > 1): one more rounding, of |x w^T| (= |y - b|), allowed kBf16Eps too.
            // fp32 results (dW, db): the accumulation term.
            std::vector<double> by(mn), bdx(mk), bdw(nk), bdb(static_cast<std::size_t>(N));
            auto at = [](const std::vector<float>& v, std::int64_t i) { return std::abs(static_cast<double>(v[static_cast<std::size_t>(i)])); };
            for (std::int64_t i = 0; i < M; ++i)
              for (std::int64_t j = 0; j < N; ++j) {
                double s = bias ? at(bv, j) : 0.0;
                for (std::int64_t k = 0; k < K; ++k) s += at(x, i * K + k) * at(w, j * K + k);
                const auto ij = static_cast<std::size_t>(i * N + j), jj = static_cast<std::size_t>(j);
                const double product =  // |x w^T| of this element
                    bias ? std::abs(static_cast<double>(y[ij]) - static_cast<double>(bv[jj])) : 0.0;
                by[ij] = kBf16Eps * (at(y, i * N + j) + product) + 4 * static_cast<double>(K + 2) * kF32Eps * s + 1e-30;
              }
            for (std::int64_t i = 0; i < M; ++i)
              for (std::int64_t k = 0; k < K; ++k) {
                double s = accumulate ? at(dx0, i * K + k) : 0.0;
                for (std::int64_t j = 0; j < N; ++j) s += at(dy, i * N + j) * at(w, j * K + k);
                bdx[static_cast<std::size_t>(i * K + k)] =
                    kBf16Eps * at(dx, i * K + k) + 4 * static_cast<double>(N + 2) * kF32Eps * s + 1e-30;
              }
            for (std::int64_t j = 0; j < N; ++j)
              for (std::int64_t k = 0; k < K; ++k) {
                double s = at(dw0, j * K + k);
                for (std::int64_t i = 0; i < M; ++i) s += at(dy, i * N + j) * at(x, i * K + k);
                bdw[static_cast<std::size_t>(j * K + k)] = 4 * static_cast<double>(M + 2) * kF32Eps * s + 1e-30;
              }
            for (std::int64_t j = 0; j < N; ++j) {
              double s = at(db0, j);
              for (std::int64_t i = 0; i < M; ++i) s += at(dy, i * N + j);
              bdb[static_cast<std::size_t>(j)] = 4 * static_cast<double>(M + 2) * kF32Eps * s + 1e-30;
            }
            check_within(from_device(gy), y, by, "y");
            check_within(from_device(gdx), dx, bdx, "dx");
            check_within(from_device(gdw), dw, bdw, "dW");
            if (bias) check_within(from_device(gdb), db, bdb, "db");
            else CHECK(from_device(gdb) == std::vector<double>(db0.begin(), db0.end()));  // untouched
          }
}

namespace {
template <class E>
std::vector<E> raw_from_device(const CudaBackend::Buffer<E>& b) {
  std::vector<E> h(b.size());
  MT_CUDA_CHECK(cudaMemcpy(h.data(), b.span().data(), b.size() * sizeof(E), cudaMemcpyDeviceToHost));
  return h;
}
/// Views of E consecutive [rows, cols] matrices of a buffer (an expert's weights or gradients).
template <class E, class Storage>
std::vector<View<E>> per_expert(Storage& s, std::int64_t experts, std::int64_t rows, std::int64_t cols) {
  std::vector<View<E>> v;
  for (std::int64_t e = 0; e < experts; ++e)
    v.push_back(View<E>(std::span<E>(s.data() + e * rows * cols, static_cast<std::size_t>(rows * cols)), Shape{rows, cols}));
  return v;
}
}  // namespace

TEST_CASE("mixture-of-experts primitives on the GPU match CpuBackend<float>: routing, grouped products, sums, backward") {
  // The CPU backend in fp32 on the same (bf16-exact) values. Routing is compared exactly (the
  // chosen experts, the grouping and its order), the rest within bounds tied to bf16's and fp32's
  // epsilon. Cases: awkward sizes; most experts without a token (5 tokens x top 2 of 64); every
  // token's first choice one expert (skewed logits), with top 1 and top 2; 128 experts, top 8;
  // widths that are no multiple of 8 (the grouped products' element-wise loads); experts with
  // several tiles of rows, of columns and of depth, each with a ragged last tile.
  struct Case {
    std::int64_t M, E, k, d, inter;
    bool skew;
  };
  const Case cases[] = {{37, 12, 3, 40, 24, false}, {5, 64, 2, 16, 8, false},   {50, 8, 1, 24, 16, true},
                        {33, 8, 2, 8, 40, true},    {130, 128, 8, 64, 32, false}, {41, 6, 2, 20, 13, false},
                        {700, 6, 2, 136, 200, false}, {300, 4, 1, 72, 136, true}};
  CudaBackend be;
  CpuBackend<float> cpu;
  std::mt19937 rng(4242);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const Case& c : cases)
    for (const bool renorm : {false, true}) {
      CAPTURE(c.M);
      CAPTURE(c.E);
      CAPTURE(c.k);
      CAPTURE(renorm);
      const std::int64_t M = c.M, E = c.E, k = c.k, d = c.d, I = c.inter, N = M * k;
      const auto sz = [](std::int64_t n) { return static_cast<std::size_t>(n); };
      auto lg16 = random_bf16(sz(M * E), 1.0f, rng);
      if (c.skew)
        for (std::int64_t t = 0; t < M; ++t) lg16[sz(t * E + 3)] = bf16(8.0f);
      const auto lg = to_float(lg16);
      // ---- routing
      std::vector<float> probs(sz(M * E)), weights(sz(N));
      std::vector<std::int32_t> experts(sz(N)), order(sz(N)), slot(sz(N));
      std::vector<std::int64_t> offsets(sz(E + 1));
      cpu.moe_route(cview(lg, {M, E}), k, renorm, mview(probs, {M, E}), View<std::int32_t>(std::span(experts), {M, k}),
                    mview(weights, {M, k}), View<std::int32_t>(std::span(order), {N}), View<std::int32_t>(std::span(slot), {N}),
                    View<std::int64_t>(std::span(offsets), {E + 1}));
      auto glg = to_device(be, lg16);
      auto gprobs = be.alloc<float>(sz(M * E)), gweights = be.alloc<float>(sz(N));
      auto gexperts = be.alloc<std::int32_t>(sz(N)), gorder = be.alloc<std::int32_t>(sz(N)), gslot = be.alloc<std::int32_t>(sz(N));
      auto goffsets = be.alloc<std::int64_t>(sz(E + 1));
      be.moe_route(cview(glg, {M, E}), k, renorm, mview(gprobs, {M, E}), mview(gexperts, {M, k}), mview(gweights, {M, k}),
                   mview(gorder, {N}), mview(gslot, {N}), mview(goffsets, {E + 1}));
      be.synchronize();
      CHECK(raw_from_device(gexperts) == experts);
      CHECK(raw_from_device(goffsets) == offsets);
      CHECK(raw_from_device(gorder) == order);
      CHECK(raw_from_device(gslot) == slot);
      {
        std::vector<double> bp(probs.size()), bw(weights.size());
        for (std::size_t i = 0; i < bp.size(); ++i) bp[i] = 8 * kF32Eps * std::abs(probs[i]) + 1e-37;
        for (std::size_t i = 0; i < bw.size(); ++i) bw[i] = 16 * kF32Eps * std::abs(weights[i]) + 1e-37;
        check_within(from_device(gprobs), probs, bp, "probs");
        check_within(from_device(gweights), weights, bw, "weights");
      }
      std::int64_t empty = 0;
      for (std::int64_t e = 0; e < E; ++e) empty += offsets[sz(e + 1)] == offsets[sz(e)];
      if (M * k < E) CHECK(empty > 0);
      if (c.skew) CHECK(offsets[4] - offsets[3] == M);  // every token chose expert 3
      // ---- gather (copies: exact)
      const auto x16 = random_bf16(sz(M * d), 1.0f, rng);
      auto gx = to_device(be, x16);
      auto gxs = be.alloc<bf16>(sz(N * d));
      be.moe_gather(cview(gx, {M, d}), cview(gorder, {N}), k, mview(gxs, {N, d}));
      const auto x = to_float(x16);
      std::vector<float> xs(sz(N * d));
      cpu.moe_gather(cview(x, {M, d}), View<const std::int32_t>(std::span<const std::int32_t>(order), {N}), k, mview(xs, {N, d}));
      be.synchronize();
      CHECK(to_float(raw_from_device(gxs)) == xs);
      // ---- grouped products, forward and backward
      const auto w16 = random_bf16(sz(E * I * d), 0.5f, rng), dy16 = random_bf16(sz(N * I), 1.0f, rng),
                 dx16 = random_bf16(sz(N * d), 1.0f, rng);
      std::vector<float> dw0(sz(E * I * d));
      for (auto& v : dw0) v = nd(rng);
      const auto w = to_float(w16), dy = to_float(dy16), dx0 = to_float(dx16);
      const View<const std::int64_t> coff(std::span<const std::int64_t>(offsets), {E + 1});
      for (const bool accumulate : {false, true}) {
        CAPTURE(accumulate);
        std::vector<float> y(sz(N * I)), dx = dx0, dw = dw0;
        auto cw = per_expert<const float>(w, E, I, d);
        auto cdw = per_expert<float>(dw, E, I, d);
        cpu.grouped_linear(cview(xs, {N, d}), std::span<const View<const float>>(cw), coff, mview(y, {N, I}));
        cpu.grouped_linear_backward(cview(xs, {N, d}), std::span<const View<const float>>(cw), cview(dy, {N, I}),
                                    mview(dx, {N, d}), accumulate, std::span<const View<float>>(cdw), coff);
        auto gw = to_device(be, w16), gdy = to_device(be, dy16), gdx = to_device(be, dx16);
        auto gdw = to_device(be, dw0);
        auto gy = be.alloc<bf16>(sz(N * I));
        auto ws = gw.span();
        auto dws = gdw.span();
        auto gcw = per_expert<const bf16>(ws, E, I, d);
        auto gcdw = per_expert<float>(dws, E, I, d);
        be.grouped_linear(cview(gxs, {N, d}), std::span<const View<const bf16>>(gcw), cview(goffsets, {E + 1}),
                          mview(gy, {N, I}));
        be.grouped_linear_backward(cview(gxs, {N, d}), std::span<const View<const bf16>>(gcw), cview(gdy, {N, I}),
                                   mview(gdx, {N, d}), accumulate, std::span<const View<float>>(gcdw), cview(goffsets, {E + 1}));
        be.synchronize();
        // bounds as for linear: one bf16 rounding of bf16 results, fp32 accumulation of |terms|
        std::vector<double> by(y.size()), bdx(dx.size()), bdw(dw.size());
        for (std::int64_t e = 0; e < E; ++e)
          for (std::int64_t r = offsets[sz(e)]; r < offsets[sz(e + 1)]; ++r) {
            for (std::int64_t j = 0; j < I; ++j) {
              double sum = 0;
              for (std::int64_t q = 0; q < d; ++q) sum += std::abs(xs[sz(r * d + q)] * w[sz((e * I + j) * d + q)]);
              by[sz(r * I + j)] = kBf16Eps * std::abs(y[sz(r * I + j)]) + 4.0 * static_cast<double>(d + 2) * kF32Eps * sum + 1e-30;
            }
            for (std::int64_t q = 0; q < d; ++q) {
              double sum = accumulate ? std::abs(dx0[sz(r * d + q)]) : 0.0;
              for (std::int64_t j = 0; j < I; ++j) sum += std::abs(dy[sz(r * I + j)] * w[sz((e * I + j) * d + q)]);
              bdx[sz(r * d + q)] = kBf16Eps * std::abs(dx[sz(r * d + q)]) + 4.0 * static_cast<double>(I + 2) * kF32Eps * sum + 1e-30;
            }
          }
        for (std::int64_t e = 0; e < E; ++e)
          for (std::int64_t j = 0; j < I; ++j)
            for (std::int64_t q = 0; q < d; ++q) {
              double sum = std::abs(dw0[sz((e * I + j) * d + q)]);
              for (std::int64_t r = offsets[sz(e)]; r < offsets[sz(e + 1)]; ++r)
                sum += std::abs(dy[sz(r * I + j)] * xs[sz(r * d + q)]);
              bdw[sz((e * I + j) * d + q)] = 4.0 * static_cast<double>(N + 2) * kF32Eps * sum + 1e-30;
            }
        check_within(from_device(gy), y, by, "grouped y");
        check_within(from_device(gdx), dx, bdx, "grouped dx");
        check_within(from_device(gdw), dw, bdw, "grouped dW");  // (an expert without rows: untouched)
      }
      // ---- the weighted sum per token, and its backward
      const auto out16 = random_bf16(sz(N * d), 1.0f, rng), dyt16 = random_bf16(sz(M * d), 1.0f, rng);
      const auto h = random_f32(sz(M * d), 1.0f, rng);
      const auto out = to_float(out16), dyt = to_float(dyt16);
      const View<const std::int32_t> cslot(std::span<const std::int32_t>(slot), {N});
      const View<const float> cweights(std::span<const float>(weights), {M, k});
      std::vector<float> yc(sz(M * d)), dout(sz(N * d)), dweights(sz(N));
      cpu.moe_combine(cview(out, {N, d}), cslot, cweights, k, cview(h, {M, d}), mview(yc, {M, d}));
      cpu.moe_combine_backward(cview(dyt, {M, d}), cview(out, {N, d}), cslot, cweights, k, mview(dout, {N, d}),
                               mview(dweights, {M, k}));
      auto gout = to_device(be, out16), gdyt = to_device(be, dyt16);
      auto gh = to_device(be, h);
      auto gyc = be.alloc<float>(sz(M * d)), gdweights = be.alloc<float>(sz(N));
      auto gdout = be.alloc<bf16>(sz(N * d));
      be.moe_combine(cview(gout, {N, d}), cview(gslot, {N}), cview(gweights, {M, k}), k, cview(gh, {M, d}), mview(gyc, {M, d}));
      be.moe_combine_backward(cview(gdyt, {M, d}), cview(gout, {N, d}), cview(gslot, {N}), cview(gweights, {M, k}), k,
                              mview(gdout, {N, d}), mview(gdweights, {M, k}));
      be.synchronize();
      {
        std::vector<double> byc(yc.size()), bdout(dout.size()), bdw(dweights.size());
        for (std::int64_t t = 0; t < M; ++t)
          for (std::int64_t q = 0; q < d; ++q) {
            double sum = std::abs(h[sz(t * d + q)]);
            for (std::int64_t j = 0; j < k; ++j)
              sum += std::abs(weights[sz(t * k + j)] * out[sz(slot[sz(t * k + j)] * d + q)]);
            byc[sz(t * d + q)] = 4.0 * static_cast<double>(k + 2) * kF32Eps * sum + 1e-30;
          }
        for (std::size_t i = 0; i < dout.size(); ++i) bdout[i] = kBf16Eps * std::abs(dout[i]) + 1e-30;
        for (std::int64_t a = 0; a < N; ++a) {
          double sum = 0;
          for (std::int64_t q = 0; q < d; ++q) sum += std::abs(dyt[sz(a / k * d + q)] * out[sz(slot[sz(a)] * d + q)]);
          bdw[sz(a)] = 4.0 * static_cast<double>(d + 2) * kF32Eps * sum + 1e-30;
        }
        check_within(from_device(gyc), yc, byc, "combine y");
        check_within(from_device(gdout), dout, bdout, "combine dout");
        check_within(from_device(gdweights), dweights, bdw, "combine dweights");
      }
      // ---- the routing's statistics (exact counts; the probabilities summed in double)
      std::vector<std::int64_t> counts(sz(E));
      std::vector<double> psums(sz(E));
      for (std::int64_t e = 0; e < E; ++e) counts[sz(e)] = e % 3, psums[sz(e)] = 0.25 * static_cast<double>(e);
      auto gcounts = to_device(be, counts);
      auto gpsums = to_device(be, psums);
      const View<const std::int32_t> cexperts(std::span<const std::int32_t>(experts), {M, k});
      cpu.moe_record(cview(probs, {M, E}), cexperts, coff, {}, View<std::int64_t>(std::span(counts), {E}),
                     View<double>(std::span(psums), {E}));
      be.moe_record(cview(gprobs, {M, E}), cview(gexperts, {M, k}), cview(goffsets, {E + 1}), {}, mview(gcounts, {E}),
                    mview(gpsums, {E}));
      be.synchronize();
      CHECK(raw_from_device(gcounts) == counts);
      {
        const auto got = raw_from_device(gpsums);
        for (std::size_t e = 0; e < psums.size(); ++e) CHECK(got[e] == doctest::Approx(psums[e]).epsilon(1e-6));
      }
      // ... and of the tokens an attention mask keeps (every third left out): its tokens' assignments
      std::vector<std::uint8_t> valid(sz(M));
      for (std::int64_t t = 0; t < M; ++t) valid[sz(t)] = t % 3 == 1 ? 0 : 1;
      auto gvalid = to_device(be, valid);
      const View<const std::uint8_t> cvalid(std::span<const std::uint8_t>(valid), {M});
      std::vector<std::int64_t> mcounts(sz(E), 0), want_counts(sz(E), 0);
      std::vector<double> mpsums(sz(E), 0.0);
      for (std::int64_t t = 0; t < M; ++t)
        for (std::int64_t j = 0; valid[sz(t)] && j < k; ++j) ++want_counts[sz(experts[sz(t * k + j)])];
      auto gmcounts = to_device(be, mcounts);
      auto gmpsums = to_device(be, mpsums);
      cpu.moe_record(cview(probs, {M, E}), cexperts, coff, cvalid, View<std::int64_t>(std::span(mcounts), {E}),
                     View<double>(std::span(mpsums), {E}));
      be.moe_record(cview(gprobs, {M, E}), cview(gexperts, {M, k}), cview(goffsets, {E + 1}), cview(gvalid, {M}),
                    mview(gmcounts, {E}), mview(gmpsums, {E}));
      be.synchronize();
      CHECK(mcounts == want_counts);
      CHECK(raw_from_device(gmcounts) == want_counts);
      {
        const auto got = raw_from_device(gmpsums);
        for (std::int64_t e = 0; e < E; ++e) {
          double want = 0;  // (the kept tokens' probabilities alone)
          for (std::int64_t t = 0; t < M; ++t)
            if (valid[sz(t)]) want += static_cast<double>(probs[sz(t * E + e)]);
          CHECK(mpsums[sz(e)] == doctest::Approx(want).epsilon(1e-12));
          CHECK(got[sz(e)] == doctest::Approx(want).epsilon(1e-6));
        }
      }
      // ---- through the routing: dlogits (with the auxiliary loss's share where renormalised, so
      // both ways are seen); and the rows' input gradients summed per token
      std::vector<float> dwr(sz(N));
      for (auto& v : dwr) v = nd(rng);
      std::vector<std::int64_t> aux(sz(2 * E));
      for (auto& n : aux) n = static_cast<std::int64_t>(rng() % 50);
      const double aux_scale = renorm ? 1e-3 : 0.0;
      auto gaux = to_device(be, aux);
      const View<const std::int64_t> caux =
          renorm ? View<const std::int64_t>(std::span<const std::int64_t>(aux), {2, E}) : View<const std::int64_t>{};
      std::vector<float> dlogits(sz(M * E));
      cpu.moe_route_backward(cview(probs, {M, E}), View<const std::int32_t>(std::span<const std::int32_t>(experts), {M, k}),
                             cweights, cview(dwr, {M, k}), k, renorm, caux, aux_scale, renorm ? cvalid : View<const std::uint8_t>{},
                             mview(dlogits, {M, E}));
      auto gdwr = to_device(be, dwr);
      auto gdlogits = be.alloc<bf16>(sz(M * E));
      be.moe_route_backward(cview(gprobs, {M, E}), cview(gexperts, {M, k}), cview(gweights, {M, k}), cview(gdwr, {M, k}), k,
                            renorm, renorm ? cview(gaux, {2, E}) : View<const std::int64_t>{}, aux_scale,
                            renorm ? cview(gvalid, {M}) : View<const std::uint8_t>{}, mview(gdlogits, {M, E}));
      const auto dxs16 = random_bf16(sz(N * d), 1.0f, rng), dxt16 = random_bf16(sz(M * d), 1.0f, rng);
      const auto dxs = to_float(dxs16);
      auto dxt = to_float(dxt16);
      const auto dxt0 = dxt;
      cpu.moe_scatter_add(cview(dxs, {N, d}), cslot, k, mview(dxt, {M, d}));
      auto gdxs = to_device(be, dxs16), gdxt = to_device(be, dxt16);
      be.moe_scatter_add(cview(gdxs, {N, d}), cview(gslot, {N}), k, mview(gdxt, {M, d}));
      be.synchronize();
      {
        // dlogit_i = p_i (dp_i - sum_j p_j dp_j) with |dp| <= 2 sum |dw| / (the chosen mass)
        // where renormalised (+ the auxiliary share): the sum's fp32 roundings over E terms of that
        // size, then one rounding to bf16.
        std::vector<double> bdl(dlogits.size()), bsa(dxt.size());
        for (std::int64_t t = 0; t < M; ++t) {
          double mass = 0, sdw = 0;
          for (std::int64_t j = 0; j < k; ++j) {
            mass += probs[sz(t * E + experts[sz(t * k + j)])];
            sdw += std::abs(dwr[sz(t * k + j)]);
          }
          double aux_max = 0;  // the auxiliary loss's dp: the same at every token
          for (std::int64_t i = 0; renorm && i < E; ++i)
            aux_max = std::max(aux_max, aux_scale * static_cast<double>(aux[sz(i)] + aux[sz(E + i)]));
          const double scale = (renorm ? 2 * sdw / mass : sdw) + 2 * aux_max;
          for (std::int64_t i = 0; i < E; ++i)
            bdl[sz(t * E + i)] = kBf16Eps * std::abs(dlogits[sz(t * E + i)]) +
                                 4.0 * static_cast<double>(E + k + 8) * kF32Eps * std::abs(probs[sz(t * E + i)]) * scale + 1e-37;
          for (std::int64_t q = 0; q < d; ++q) {
            double sum = std::abs(dxt0[sz(t * d + q)]);
            for (std::int64_t j = 0; j < k; ++j) sum += std::abs(dxs[sz(slot[sz(t * k + j)] * d + q)]);
            bsa[sz(t * d + q)] = kBf16Eps * std::abs(dxt[sz(t * d + q)]) + 4.0 * static_cast<double>(k + 2) * kF32Eps * sum + 1e-30;
          }
        }
        check_within(from_device(gdlogits), dlogits, bdl, "route dlogits");
        check_within(from_device(gdxt), dxt, bsa, "scatter_add dx");
      }
    }
}

TEST_CASE("a shape cuDNN refuses (head_dim 12) falls back to megatrain's kernel with default options") {
  // use_cudnn left at its default (true): the backend must pick its own kernel by itself, since
  // cuDNN's fused attention needs head_dim to be a multiple of 8.
  CudaBackend be;
  const AttentionShape s{2, 37, 6, 2, 12};  // grouped-query: 3 query heads per key/value head
  const std::int64_t M = s.rows * s.seq, qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim;
  be.prepare({M, qw, 0, {s}});
  CHECK_FALSE(be.cudnn_attention(s));

  std::mt19937 rng(41);
  const auto mq = static_cast<std::size_t>(M * qw), mk = static_cast<std::size_t>(M * kw),
             nl = static_cast<std::size_t>(s.rows * s.heads * s.seq);
  const auto q16 = random_bf16(mq, 1.0f, rng), k16 = random_bf16(mk, 1.0f, rng), v16 = random_bf16(mk, 1.0f, rng),
             dout16 = random_bf16(mq, 1.0f, rng);
  const Shape sq{M, qw}, sk{M, kw}, sl{s.rows, s.heads, s.seq};

  // Reference: CpuBackend<float> on the same (bf16-exact) values.
  CpuBackend<float> cpu;
  const auto q = to_float(q16), k = to_float(k16), v = to_float(v16), dout = to_float(dout16);
  std::vector<float> out(mq), lse(nl), dq(mq), dk(mk), dv(mk);
  cpu.attention(cview(q, sq), cview(k, sk), cview(v, sk), mview(out, sq), mview(lse, sl), s);
  cpu.attention_backward(cview(q, sq), cview(k, sk), cview(v, sk), cview(out, sq), cview(lse, sl), cview(dout, sq),
                         mview(dq, sq), mview(dk, sk), mview(dv, sk), s);

  auto gq = to_device(be, q16), gk = to_device(be, k16), gv = to_device(be, v16), gdout = to_device(be, dout16);
  auto gout = be.alloc<bf16>(mq), gdq = be.alloc<bf16>(mq), gdk = be.alloc<bf16>(mk), gdv = be.alloc<bf16>(mk);
  auto glse = be.alloc<float>(nl);
  be.attention(cview(gq, sq), cview(gk, sk), cview(gv, sk), mview(gout, sq), mview(glse, sl), s);
  be.attention_backward(cview(gq, sq), cview(gk, sk), cview(gv, sk), cview(gout, sq), cview(glse, sl),
                        cview(gdout, sq), mview(gdq, sq), mview(gdk, sk), mview(gdv, sk), s);
  be.synchronize();
  const auto wide = [](const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); };
  CHECK(rel_err(from_device(gout), wide(out)) < kOutTol);
  CHECK(rel_err(from_device(glse), wide(lse)) < kOutTol);
  CHECK(rel_err(from_device(gdq), wide(dq)) < kGradTol);
  CHECK(rel_err(from_device(gdk), wide(dk)) < kGradTol);
  CHECK(rel_err(from_device(gdv), wide(dv)) < kGradTol);
}

TEST_CASE("alloc counts against the cap exactly the bytes it allocates") {
  CudaBackendOptions opt;
  // the cuBLASLt workspace, the experts' routing workspace, and 4 KiB more
  opt.memory_limit = (std::size_t{32} << 20) + CudaBackend::kMoeWorkspaceBytes + 4096;
  CudaBackend be(opt);
  const std::size_t base = be.allocated_bytes();
  {
    auto empty = be.alloc<float>(0);  // cudaMalloc'ed with 1 byte: counted as 1
    CHECK(be.allocated_bytes() == base + 1);
    auto some = be.alloc<bf16>(1000);
    CHECK(be.allocated_bytes() == base + 1 + 2000);
  }
  CHECK(be.allocated_bytes() == base);
  auto fits = be.alloc<std::byte>(be.memory_limit() - base);
  CHECK(be.allocated_bytes() == be.memory_limit());
  CHECK(*be.memory_available() == 0);
  CHECK_THROWS_AS(be.alloc<std::byte>(1), megatrain::Error);
  CHECK_THROWS_AS(be.alloc<float>(0), megatrain::Error);  // a 0-element buffer still takes a byte
  CHECK(be.allocated_bytes() == be.memory_limit());
}
