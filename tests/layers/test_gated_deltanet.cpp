// Gated DeltaNet as a whole layer (layers/ops/gated_deltanet.hpp) on the CPU reference backend in
// float64:
//   - its output against the layer written out token by token in long double from transformers'
//     formulas (projections, causal convolution, SiLU, L2 norms, gates, the recurrence, the
//     gated RMSNorm, the output projection);
//   - Qwen3-Next's fused projections against Qwen3.5's separate ones holding the same rows;
//   - a packed row of two examples against each example alone (outputs and gradients);
//   - the backward against central differences of the forward (gradcheck.hpp), for the input
//     and every weight, fused and not, with token blocks that split the sequences.
// Awkward sizes throughout: hidden 13, 2 key heads of 5, 4 or 6 value heads of 3, 4 taps,
// sequences of 1, 4, 5, 7, 9 and 70 tokens (past the delta rule's chunk of 64).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/layer_template.hpp"
#include "megatrain/layers/ops/gated_deltanet.hpp"
#include "megatrain/layers/ops/self_attention.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;
using LD = long double;

static_assert(LinearAttentionBackend<CpuBackend<float>> && LinearAttentionBackend<CpuBackend<double>>);

ModelConfig linear_config(std::int64_t value_heads, bool fused) {
  ModelConfig cfg = make_config({"LlamaForCausalLM", 13, 20, 2, 2, 6});
  cfg.linear_attention = {2, value_heads, 5, 3, 4, fused};
  return cfg;
}

/// The layer's weights as dense long-double matrices, read from an unfused slab.
struct Reference {
  const LinearAttentionConfig la;
  std::int64_t d;
  double eps;
  std::vector<LD> qkv, z, b, a, conv, A_log, dt_bias, norm, out;

  Reference(const ModelConfig& cfg, const UnitLayout& layout, const Vec& slab)
      : la(cfg.linear_attention), d(cfg.hidden_size), eps(cfg.rms_norm_eps) {
    const auto get = [&](const char* n) {
      const auto* e = layout.find(std::string("model.layers.0.linear_attn.") + n);
      REQUIRE(e != nullptr);
      return std::vector<LD>(slab.begin() + e->offset, slab.begin() + e->offset + e->numel());
    };
    qkv = get("in_proj_qkv.weight"), z = get("in_proj_z.weight"), b = get("in_proj_b.weight"), a = get("in_proj_a.weight");
    conv = get("conv1d.weight"), A_log = get("A_log"), dt_bias = get("dt_bias"), norm = get("norm.weight");
    out = get("out_proj.weight");
  }

  static std::vector<LD> matvec(const std::vector<LD>& w, std::int64_t rows, std::int64_t cols, const LD* x) {
    std::vector<LD> y(static_cast<std::size_t>(rows), 0);
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) y[i] += w[i * cols + j] * x[j];
    return y;
  }
  static LD sigmoid(LD x) { return 1 / (1 + std::exp(-x)); }

  /// The layer on one sequence of `n` tokens x [n, d]: out [n, d].
  std::vector<LD> run(const Vec& xs, std::int64_t first, std::int64_t n) const {
    const std::int64_t cd = la.conv_dim(), kd = la.key_dim(), vd = la.value_dim(), hv = la.value_heads;
    const std::int64_t dk = la.key_head_dim, dv = la.value_head_dim, K = la.conv_kernel, r = hv / la.key_heads;
    std::vector<std::vector<LD>> mixed, zz, bb, aa;
    for (std::int64_t t = 0; t < n; ++t) {
      std::vector<LD> x(xs.begin() + (first + t) * d, xs.begin() + (first + t + 1) * d);
      mixed.push_back(matvec(qkv, cd, d, x.data()));
      zz.push_back(matvec(z, vd, d, x.data()));
      bb.push_back(matvec(b, hv, d, x.data()));
      aa.push_back(matvec(a, hv, d, x.data()));
    }
    std::vector<LD> S(static_cast<std::size_t>(hv * dk * dv), 0), result;
    for (std::int64_t t = 0; t < n; ++t) {
      std::vector<LD> c(static_cast<std::size_t>(cd));
      for (std::int64_t ch = 0; ch < cd; ++ch) {
        LD pre = 0;
        for (std::int64_t j = 0; j < K; ++j)
          if (const std::int64_t s = t - K + 1 + j; s >= 0) pre += conv[ch * K + j] * mixed[s][ch];
        c[ch] = pre * sigmoid(pre);
      }
      const auto unit = [&](std::int64_t at) {
        LD ss = 0;
        for (std::int64_t i = 0; i < dk; ++i) ss += c[at + i] * c[at + i];
        std::vector<LD> u(static_cast<std::size_t>(dk));
        for (std::int64_t i = 0; i < dk; ++i) u[i] = c[at + i] / std::sqrt(ss + 1e-6L);
        return u;
      };
      std::vector<LD> y(static_cast<std::size_t>(vd));
      for (std::int64_t h = 0; h < hv; ++h) {
        const std::int64_t hk = h / r;
        const auto q = unit(hk * dk), k = unit(kd + hk * dk);
        const LD xa = aa[t][h] + dt_bias[h];
        const LD g = -std::exp(A_log[h]) * (xa > 20 ? xa : std::log1p(std::exp(xa))), beta = sigmoid(bb[t][h]);
        LD* s = S.data() + h * dk * dv;
        for (std::int64_t i = 0; i < dk * dv; ++i) s[i] *= std::exp(g);
        for (std::int64_t j = 0; j < dv; ++j) {
          LD kv = 0;
          for (std::int64_t i = 0; i < dk; ++i) kv += s[i * dv + j] * k[i];
          const LD delta = beta * (c[2 * kd + h * dv + j] - kv);
          for (std::int64_t i = 0; i < dk; ++i) s[i * dv + j] += k[i] * delta;
        }
        LD ms = 0;
        std::vector<LD> o(static_cast<std::size_t>(dv), 0);
        for (std::int64_t j = 0; j < dv; ++j) {
          for (std::int64_t i = 0; i < dk; ++i) o[j] += s[i * dv + j] * q[i];
          o[j] /= std::sqrt(static_cast<LD>(dk));
          ms += o[j] * o[j] / dv;
        }
        for (std::int64_t j = 0; j < dv; ++j) {
          const LD zg = zz[t][h * dv + j];
          y[h * dv + j] = norm[j] * o[j] / std::sqrt(ms + static_cast<LD>(eps)) * zg * sigmoid(zg);
        }
      }
      const auto o = matvec(out, d, vd, y.data());
      result.insert(result.end(), o.begin(), o.end());
    }
    return result;
  }
};

/// The fused slab holding the same rows as the unfused one (Qwen3-Next's order).
Vec fuse(const ModelConfig& cfg, const UnitLayout& plain, const Vec& slab, const UnitLayout& fused) {
  const auto& la = cfg.linear_attention;
  const std::int64_t d = cfg.hidden_size, dk = la.key_head_dim, dv = la.value_head_dim, r = la.value_heads / la.key_heads;
  Vec out(static_cast<std::size_t>(fused.numel()), 0.0);
  const auto at = [](const UnitLayout& l, const char* n) { return l.find(std::string("model.layers.0.linear_attn.") + n)->offset; };
  for (const char* n : {"conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"}) {
    const auto* e = plain.find(std::string("model.layers.0.linear_attn.") + n);
    std::copy_n(slab.begin() + e->offset, e->numel(), out.begin() + at(fused, n));
  }
  const auto row = [&](const char* from, std::int64_t i, const char* to, std::int64_t j) {
    std::copy_n(slab.begin() + at(plain, from) + i * d, d, out.begin() + at(fused, to) + j * d);
  };
  std::int64_t next = 0, next_ba = 0;
  for (std::int64_t h = 0; h < la.key_heads; ++h) {
    for (std::int64_t i = 0; i < dk; ++i) row("in_proj_qkv.weight", h * dk + i, "in_proj_qkvz.weight", next++);
    for (std::int64_t i = 0; i < dk; ++i) row("in_proj_qkv.weight", la.key_dim() + h * dk + i, "in_proj_qkvz.weight", next++);
    for (std::int64_t i = 0; i < r * dv; ++i) row("in_proj_qkv.weight", 2 * la.key_dim() + h * r * dv + i, "in_proj_qkvz.weight", next++);
    for (std::int64_t i = 0; i < r * dv; ++i) row("in_proj_z.weight", h * r * dv + i, "in_proj_qkvz.weight", next++);
    for (std::int64_t i = 0; i < r; ++i) row("in_proj_b.weight", h * r + i, "in_proj_ba.weight", next_ba++);
    for (std::int64_t i = 0; i < r; ++i) row("in_proj_a.weight", h * r + i, "in_proj_ba.weight", next_ba++);
  }
  return out;
}

/// The parameters of a layout (without its alignment gaps).
std::int64_t parameters(const UnitLayout& layout) {
  std::int64_t n = 0;
  for (const auto& e : layout.entries()) n += e.numel();
  return n;
}

/// The op's forward on x over chunk c.
Vec forward(const LayerTemplate<GatedDeltaNet>& layer, const Vec& slab, ChunkShape c, const Vec& x) {
  Be be;
  const std::int64_t M = c.tokens(), d = layer.op().hidden_size();
  std::vector<std::byte> mem(layer.op().scratch_bytes<Be>(c));
  Arena arena{std::span<std::byte>(mem)};
  Vec y(static_cast<std::size_t>(M * d));
  layer.op().forward(be, c, layer.bind(std::span<const double>(slab)), cview(x, {M, d}), view(y, {M, d}), arena);
  return y;
}

/// One row of `lengths` packed examples.
struct Packed {
  std::vector<std::int32_t> positions, starts;
  explicit Packed(const std::vector<std::int32_t>& lengths) {
    starts.push_back(0);
    for (const auto n : lengths) {
      for (std::int32_t i = 0; i < n; ++i) positions.push_back(i);
      starts.push_back(starts.back() + n);
    }
  }
  ChunkShape chunk() const {
    ChunkShape c{1, starts.back()};
    c.packed.positions = View<const std::int32_t>(std::span<const std::int32_t>(positions), Shape{starts.back()});
    c.packed.starts = View<const std::int32_t>(std::span<const std::int32_t>(starts), Shape{static_cast<std::int64_t>(starts.size())});
    c.packed.host_starts = starts;
    return c;
  }
};

}  // namespace

TEST_CASE("Gated DeltaNet: the layer against transformers' formulas written out token by token") {
  for (const std::int64_t value_heads : {4, 6}) {
    CAPTURE(value_heads);
    const ModelConfig cfg = linear_config(value_heads, false);
    const LayerTemplate<GatedDeltaNet> layer{GatedDeltaNet(cfg, 0)};
    Random rng(test_seed(5300 + value_heads));
    const Vec slab = random_weights(layer.layout(), rng);
    // (70 tokens: past the delta rule's chunk of 64, the state carried across)
    for (const ChunkShape& c : {ChunkShape{2, 9}, ChunkShape{3, 1}, ChunkShape{1, 7, {}, 3}, ChunkShape{1, 70}}) {
      CAPTURE(c.rows);
      CAPTURE(c.seq);
      const Vec x = rng.vector(c.tokens() * cfg.hidden_size, -1, 1);
      const Vec y = forward(layer, slab, c, x);
      const Reference ref(cfg, layer.layout(), slab);
      std::vector<double> want;
      for (std::int64_t row = 0; row < c.rows; ++row) {
        const auto r = ref.run(x, row * c.seq, c.seq);
        want.insert(want.end(), r.begin(), r.end());
      }
      check_close("output", y, want, 1e-10, 1e-12);
    }
  }
}

TEST_CASE("Gated DeltaNet: Qwen3-Next's fused projections compute what Qwen3.5's separate ones do") {
  const ModelConfig plain_cfg = linear_config(6, false), fused_cfg = linear_config(6, true);
  const LayerTemplate<GatedDeltaNet> plain{GatedDeltaNet(plain_cfg, 0)}, fused{GatedDeltaNet(fused_cfg, 0)};
  CHECK(parameters(plain.layout()) == parameters(fused.layout()));
  CHECK(fused_cfg.linear_attention.params(13) == parameters(fused.layout()));
  CHECK(fused.layout().find("model.layers.0.linear_attn.in_proj_qkvz.weight")->spec.shape == Shape{2 * 10 + 2 * 18, 13});
  CHECK(fused.layout().find("model.layers.0.linear_attn.in_proj_ba.weight")->spec.shape == Shape{12, 13});
  Random rng(test_seed(5310));
  const Vec slab = random_weights(plain.layout(), rng);
  const Vec fslab = fuse(plain_cfg, plain.layout(), slab, fused.layout());
  const ChunkShape c{2, 7, {}, 4};  // (token blocks of 4: the gathers run a block at a time)
  const Vec x = rng.vector(c.tokens() * 13, -1, 1);
  check_close("fused output", forward(fused, fslab, c, x), forward(plain, slab, c, x), 1e-13, 1e-14);
}

TEST_CASE("Gated DeltaNet: a packed row's examples each as if alone, forward and backward") {
  const ModelConfig cfg = linear_config(4, false);
  const LayerTemplate<GatedDeltaNet> layer{GatedDeltaNet(cfg, 0)};
  Random rng(test_seed(5320));
  const Vec slab = random_weights(layer.layout(), rng);
  const Packed packed({5, 1, 4});
  const ChunkShape c = packed.chunk();
  const std::int64_t d = cfg.hidden_size, M = c.tokens();
  const Vec x = rng.vector(M * d, -1, 1), dy = rng.vector(M * d, -1, 1);
  Be be;
  // the packed row
  std::vector<std::byte> mem(layer.op().scratch_bytes<Be>(c));
  Arena arena{std::span<std::byte>(mem)};
  Vec y = forward(layer, slab, c, x), dx(x.size()), g(static_cast<std::size_t>(layer.layout().numel()), 0.0);
  layer.op().backward(be, c, layer.bind(std::span<const double>(slab)), cview(x, {M, d}), cview(dy, {M, d}),
                      view(dx, {M, d}), layer.bind(std::span<double>(g)), arena);
  // each example alone
  Vec g_alone(g.size(), 0.0);
  for (std::size_t s = 0; s + 1 < packed.starts.size(); ++s) {
    const std::int64_t first = packed.starts[s], n = packed.starts[s + 1] - first;
    const ChunkShape one{1, n};
    const Vec xs(x.begin() + first * d, x.begin() + (first + n) * d), dys(dy.begin() + first * d, dy.begin() + (first + n) * d);
    std::vector<std::byte> m1(layer.op().scratch_bytes<Be>(one));
    Arena a1{std::span<std::byte>(m1)};
    Vec dxs(xs.size());
    layer.op().backward(be, one, layer.bind(std::span<const double>(slab)), cview(xs, {n, d}), cview(dys, {n, d}),
                        view(dxs, {n, d}), layer.bind(std::span<double>(g_alone)), a1);
    const std::string what = fmt::format("example {} ({} tokens)", s, n);
    check_close(what + " output", std::vector<double>(y.begin() + first * d, y.begin() + (first + n) * d),
                forward(layer, slab, one, xs), 1e-13, 1e-14);
    check_close(what + " input gradient", std::vector<double>(dx.begin() + first * d, dx.begin() + (first + n) * d), dxs,
                1e-12, 1e-13);
  }
  check_close("weight gradients", g, g_alone, 1e-11, 1e-12);
}

TEST_CASE("gradcheck: Gated DeltaNet, the input and every weight, fused and not") {
  for (const bool fused : {false, true}) {
    for (const ChunkShape& c : {ChunkShape{2, 7}, ChunkShape{1, 9, {}, 4}}) {
      const LayerTemplate<GatedDeltaNet> layer{GatedDeltaNet(linear_config(4, fused), 0)};
      gradcheck_layer(layer, c, 5330 + fused * 10 + static_cast<std::uint64_t>(c.seq),
                      fmt::format("Gated DeltaNet{}, {}x{} tokens", fused ? " (fused)" : "", c.rows, c.seq));
    }
  }
}

TEST_CASE("Gated DeltaNet: its parameters counted in the model's, and a config's linear_attention layers refused") {
  ModelConfig cfg = linear_config(4, false);
  const std::int64_t attention_only = cfg.param_count();
  const LayerTemplate<GatedDeltaNet> linear{GatedDeltaNet(cfg, 0)};
  const LayerTemplate<SelfAttention> attention{SelfAttention(cfg, 0)};
  cfg.layer_types = {TokenMixerKind::linear_attention};
  CHECK(GatedDeltaNet::builds(cfg, 0));
  CHECK_FALSE(SelfAttention::builds(cfg, 0));
  CHECK(cfg.param_count() == attention_only - parameters(attention.layout()) + parameters(linear.layout()));
  CHECK(cfg.linear_attention.params(cfg.hidden_size) == parameters(linear.layout()));
  // (no family reads linear attention yet: a config that asks for it is refused, naming the layer)
  CHECK_THROWS_WITH_AS(cfg.validate("c.json"),
                       doctest::Contains("c.json: layer_types makes layer 0 a linear_attention layer, which "
                                         "LlamaForCausalLM has not"),
                       Error);
  // and a shape out of range, naming the field
  cfg.linear_attention.value_heads = 3;
  CHECK_THROWS_WITH_AS(GatedDeltaNet(cfg, 0), doctest::Contains("linear_num_value_heads (3) must be a multiple of "
                                                                "linear_num_key_heads (2)"),
                       Error);
}
