// What the CUDA backend's tests share: random bf16 and fp32 data, transfers, relative errors and
// their bf16 tolerances, packed rows, and check_block(), which runs one decoder block forward and
// backward on the GPU and on CpuBackend<double> with the same inputs and weights and compares.
#pragma once

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

namespace megatrain::test {

inline ModelConfig config(int hidden, int heads, int kv_heads, int head_dim, int vocab, bool qkv_bias, bool tied,
                   const char* arch = nullptr,  // (default: Qwen2 with q/k/v biases, else Llama)
                   const nlohmann::json& more = nlohmann::json::object()) {
  nlohmann::json j{{"architectures", {arch ? arch : qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                   {"hidden_size", hidden},
                   {"intermediate_size", hidden * 3 - 8},
                   {"num_hidden_layers", 1},
                   {"num_attention_heads", heads},
                   {"num_key_value_heads", kv_heads},
                   {"head_dim", head_dim},
                   {"vocab_size", vocab},
                   {"tie_word_embeddings", tied}};
  j.update(more);
  return ModelConfig::from_json(j, "test");
}

/// A one-layer Gemma 3 block: (1 + w) norms, four of them, q/k norms, GeGLU, the softmax scale of
/// query_pre_attn_scalar; `window` > 0: a sliding layer of that window (its own rotary base),
/// else a full one.
inline ModelConfig gemma3(int hidden, int heads, int kv_heads, int head_dim, double query_pre_attn_scalar, int window) {
  return config(hidden, heads, kv_heads, head_dim, 101, false, true, "Gemma3ForCausalLM",
                {{"query_pre_attn_scalar", query_pre_attn_scalar},
                 {"sliding_window", window > 0 ? window : 4096},
                 {"layer_types", {window > 0 ? "sliding_attention" : "full_attention"}}});
}

inline std::vector<bf16> random_bf16(std::size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<bf16> v(n);
  for (auto& x : v) x = bf16(nd(rng));
  return v;
}
inline std::vector<float> random_f32(std::size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
template <class E>
inline std::vector<double> to_double(const std::vector<E>& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) d[i] = static_cast<double>(static_cast<float>(v[i]));
  return d;
}
/// The unit's full-precision parameters (norm gains), packed by its full_layout(), drawn near 1
/// in fp32; the same values written into the double reference's slab.
template <class Tmpl>
inline std::vector<float> random_gains(const Tmpl& tmpl, std::vector<double>& reference, std::mt19937& rng) {
  std::vector<float> g(static_cast<std::size_t>(tmpl.full_layout().numel()), 0.0f);
  for (const auto& e : tmpl.full_layout().entries()) {
    const auto* full = tmpl.layout().find(e.spec.name);
    for (std::int64_t i = 0; i < e.numel(); ++i) {
      const float v = 1.0f + 0.1f * std::normal_distribution<float>()(rng);
      g[static_cast<std::size_t>(e.offset + i)] = v;
      reference[static_cast<std::size_t>(full->offset + i)] = v;
    }
  }
  return g;
}

template <class E>
inline CudaBackend::Buffer<E> to_device(CudaBackend& be, const std::vector<E>& host) {
  auto b = be.alloc<E>(host.size());
  MT_CUDA_CHECK(cudaMemcpy(b.span().data(), host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice));
  return b;
}
template <class E>
inline std::vector<double> from_device(const CudaBackend::Buffer<E>& b) {
  std::vector<E> h(b.size());
  MT_CUDA_CHECK(cudaMemcpy(h.data(), b.span().data(), b.size() * sizeof(E), cudaMemcpyDeviceToHost));
  std::vector<double> d(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) d[i] = static_cast<double>(static_cast<float>(h[i]));
  return d;
}

/// ||a - b|| / max(||b||, floor).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-300) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(std::isfinite(a[i]));
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), floor);
}
inline double norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// bf16 keeps 8 significant bits: one rounding is 2^-9 relative. Through a block's chain of
// products, norms and the attention, errors of a few roundings accumulate.
constexpr double kOutTol = 16 * 0x1p-9;   // 3.1e-2
constexpr double kGradTol = 24 * 0x1p-9;  // 4.7e-2

/// Packed rows: positions and sequence starts of rows of `seq` holding sequences of `lengths`
/// (each row's add up to seq).
struct Packing {
  std::vector<std::int32_t> positions, starts;
  Packing(const std::vector<int>& lengths, std::int64_t rows, std::int64_t seq) {
    std::int32_t at = 0;
    for (const int n : lengths) {
      starts.push_back(at);
      for (int t = 0; t < n; ++t) positions.push_back(t);
      at += n;
    }
    starts.push_back(at);
    REQUIRE(at == rows * seq);
    for (std::int64_t r = 0; r < rows; ++r) REQUIRE(positions[static_cast<std::size_t>(r * seq)] == 0);
  }
  PackedRows view(const std::vector<std::int32_t>& pos, const std::vector<std::int32_t>& st) const {
    PackedRows p;
    p.positions = View<const std::int32_t>(std::span<const std::int32_t>(pos), Shape{static_cast<std::int64_t>(pos.size())});
    p.starts = View<const std::int32_t>(std::span<const std::int32_t>(st), Shape{static_cast<std::int64_t>(st.size())});
    p.host_starts = starts;
    return p;
  }
};

/// Sequences of random lengths in 1..most filling `rows` rows of `seq`.
inline std::vector<int> random_lengths(std::int64_t rows, std::int64_t seq, int most, std::mt19937& rng) {
  std::vector<int> out;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t left = seq; left > 0;) {
      const int n = std::min<int>(static_cast<int>(left), 1 + static_cast<int>(rng() % static_cast<unsigned>(most)));
      out.push_back(n);
      left -= n;
    }
  return out;
}

/// `zero_router`: a mixture of experts' router weights set to zero (every logit 0: a uniform
/// softmax, so the top k are the first k experts for every token, on both sides).
inline void check_block(const ModelConfig& cfg, ChunkShape c, bool use_cudnn, const std::vector<int>& lengths = {},
                 bool zero_router = false) {
  CAPTURE(cfg.hidden_size);
  CAPTURE(lengths.size());
  CAPTURE(cfg.head_dim);
  CAPTURE(cfg.num_attention_heads / cfg.num_key_value_heads);
  CAPTURE(c.rows);
  CAPTURE(c.seq);
  CAPTURE(use_cudnn);
  std::mt19937 rng(1234 + static_cast<unsigned>(cfg.hidden_size + c.seq));
  DecoderModel<> model(cfg);
  const auto& tmpl = model.block(0);
  const auto n = static_cast<std::size_t>(tmpl.layout().numel());
  auto w16 = random_bf16(n, 0.08f, rng);
  if (zero_router)
    for (const auto& e : tmpl.layout().entries())
      if (e.spec.name.ends_with(".gate.weight") || e.spec.name.ends_with(".router.weight") ||
          e.spec.name.ends_with(".router.bias"))
        std::fill_n(w16.begin() + e.offset, e.numel(), bf16(0.0f));
  auto wd = to_double(w16);
  const auto gains = random_gains(tmpl, wd, rng);  // fp32 gains near 1, read at full precision
  const std::int64_t M = c.tokens(), d = cfg.hidden_size;
  auto x32 = random_f32(static_cast<std::size_t>(M * d), 1.0f, rng);  // the residual stream, fp32
  auto dy32 = random_f32(static_cast<std::size_t>(M * d), 1.0f, rng);

  // Reference in float64 on the same values.
  CpuBackend<double> cpu;
  std::vector<std::byte> mem(tmpl.op().scratch_bytes<CpuBackend<double>>(c));
  Arena arena{std::span<std::byte>(mem)};
  std::optional<Packing> pk;
  if (!lengths.empty()) pk.emplace(lengths, c.rows, c.seq);
  if (pk) c.packed = pk->view(pk->positions, pk->starts);  // (host memory: the CPU's)
  auto xd = to_double(x32), dyd = to_double(dy32);
  std::vector<double> yd(xd.size()), dxd(xd.size()), gd(n, 0.0);
  const auto wr = tmpl.bind(std::span<const double>(wd));
  tmpl.op().forward(cpu, c, wr, View<const double>(std::span<const double>(xd), Shape{M, d}),
                    View<double>(std::span<double>(yd), Shape{M, d}), arena);
  tmpl.op().backward(cpu, c, wr, View<const double>(std::span<const double>(xd), Shape{M, d}),
                     View<const double>(std::span<const double>(dyd), Shape{M, d}), View<double>(std::span<double>(dxd), Shape{M, d}),
                     tmpl.bind(std::span<double>(gd)), arena);

  CudaBackendOptions opt;
  opt.use_cudnn = use_cudnn;
  CudaBackend be(opt);
  WorkspacePlan plan{M, std::max({cfg.hidden_size, cfg.intermediate_size, cfg.q_dim()}), cfg.vocab_size,
                     {{c.rows, c.seq, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, {},
                       cfg.query_pre_attn_scalar ? cfg.attention_scale() : 0.0, cfg.attention_window(0)}}};
  plan.packed = pk.has_value();
  plan.packed_sequences_per_row = pk ? static_cast<std::int64_t>(lengths.size()) : 8;
  be.prepare(plan);
  std::optional<CudaBackend::Buffer<std::int32_t>> dpos, dstarts;
  if (pk) {  // the same packing in device memory
    dpos.emplace(to_device(be, pk->positions));
    dstarts.emplace(to_device(be, pk->starts));
    c.packed.positions = View<const std::int32_t>(std::span<const std::int32_t>(dpos->span()), Shape{M});
    c.packed.starts = View<const std::int32_t>(std::span<const std::int32_t>(dstarts->span()),
                                               Shape{static_cast<std::int64_t>(pk->starts.size())});
    const AttentionShape as{c.rows, c.seq, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, c.packed};
    MESSAGE("packed: cuDNN " << (be.cudnn_attention(as) ? "runs" : "does not run") << " " << lengths.size()
                             << " sequences; " << be.attention_plan_summary(as));
    if (use_cudnn) CHECK(be.cudnn_attention(as));
  }
  auto w = to_device(be, w16);
  auto gd32 = to_device(be, gains), x = to_device(be, x32), dy = to_device(be, dy32);
  auto y = be.alloc<float>(x32.size()), dx = be.alloc<float>(x32.size());
  auto g = be.alloc<float>(n);
  MT_CUDA_CHECK(cudaMemset(g.span().data(), 0, n * sizeof(float)));
  auto scratch = be.alloc<std::byte>(tmpl.op().scratch_bytes<CudaBackend>(c));
  Arena darena{scratch.span()};
  const auto wb = tmpl.bind(std::span<const bf16>(w.span()), {&tmpl.full_layout(), std::span<const float>(gd32.span())});
  tmpl.op().forward(be, c, wb, View<const float>(std::span<const float>(x.span()), Shape{M, d}),
                    View<float>(y.span(), Shape{M, d}), darena);
  tmpl.op().backward(be, c, wb, View<const float>(std::span<const float>(x.span()), Shape{M, d}),
                     View<const float>(std::span<const float>(dy.span()), Shape{M, d}), View<float>(dx.span(), Shape{M, d}),
                     tmpl.bind(g.span()), darena);
  be.synchronize();
  CHECK(rel_err(from_device(y), yd) < kOutTol);
  CHECK(rel_err(from_device(dx), dxd) < kGradTol);
  const auto gh = from_device(g);
  // Some gradients are exactly zero in exact arithmetic (q and k with one token per sequence:
  // attention over one key ignores them); measure those against the whole gradient's size.
  const double floor = 1e-3 * norm(gd);
  for (const auto& e : tmpl.layout().entries()) {
    CAPTURE(e.spec.name);
    std::vector<double> a(gh.begin() + e.offset, gh.begin() + e.offset + e.numel()),
        b(gd.begin() + e.offset, gd.begin() + e.offset + e.numel());
    CHECK(rel_err(a, b, floor) < kGradTol);
  }
}

}  // namespace megatrain::test
