// A user-defined op is a first-class citizen: the GPT-2 block of examples/gpt2_block (written
// outside the library, with its own LayerNorm and GELU loops) satisfies LayerOp, computes what
// a GPT-2 block computes (against a naive reference written here), has the gradients of its
// forward (float64 finite differences for the input and every weight tensor, method in
// gradcheck.hpp), and plugs into DecoderModel (block factory) and HostParamStore.
//
// Sizes are awkward on purpose: hidden sizes 10, 12, 18, 20 (none a power of two), head_dim 4,
// 6 and 10, one to five heads, 1, 5, 7 and 13 tokens per sequence, several sequences per chunk.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpt2_block.hpp"
#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;
using namespace megatrain::test;
using example::Gpt2Block;
using example::Gpt2Options;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// A backend like the CPU one whose views claim to live on a device: the GPT-2 op's host loops
/// cannot run there, and the concept says so.
struct DeviceLikeBackend : CpuBackend<float> {
  static constexpr bool kDevice = true;
};

}  // namespace

static_assert(LayerOp<Gpt2Block, CpuBackend<double>>);
static_assert(LayerOp<Gpt2Block, CpuBackend<float>>);
// (its carve takes no kept arena: it recomputes in the backward, and the trainer keeps nothing of it)
static_assert(!KeepingLayerOp<Gpt2Block, CpuBackend<float>>);
static_assert(Backend<DeviceLikeBackend>);
static_assert(!LayerOp<Gpt2Block, DeviceLikeBackend>);
static_assert(std::is_same_v<DecoderModel<Gpt2Block>::BlockFactory::result_type, Gpt2Block>);

namespace {

/// A GPT-2-shaped config: hidden = heads x head_dim, as many key/value heads as heads.
ModelConfig gpt2_config(std::int64_t hidden, std::int64_t heads, std::int64_t intermediate, std::int64_t layers = 1) {
  return make_config(
      {"LlamaForCausalLM", hidden, intermediate, heads, heads, hidden / heads, false, false, 1e4, 37, false, layers});
}

Vec minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

/// A GPT-2 block written the obvious way, token by token (no backend, no shared code with the op).
Vec reference_forward(const ModelConfig& cfg, double eps, const UnitLayout& layout, const Vec& slab,
                      const std::string& prefix, const Vec& x, ChunkShape c) {
  const std::int64_t M = c.tokens(), d = cfg.hidden_size, f = cfg.intermediate_size, H = cfg.num_attention_heads,
                     D = cfg.head_dim;
  auto p = [&](const char* name) {
    const auto* e = layout.find(prefix + name);
    REQUIRE(e != nullptr);
    return slab.data() + e->offset;
  };
  auto at = [](const Vec& v, std::int64_t i) { return v[static_cast<std::size_t>(i)]; };
  auto layer_norm = [&](const Vec& in, const double* w, const double* b) {
    Vec out(in.size());
    for (std::int64_t t = 0; t < M; ++t) {
      double mu = 0, var = 0;
      for (std::int64_t i = 0; i < d; ++i) mu += at(in, t * d + i) / static_cast<double>(d);
      for (std::int64_t i = 0; i < d; ++i) var += std::pow(at(in, t * d + i) - mu, 2) / static_cast<double>(d);
      for (std::int64_t i = 0; i < d; ++i)
        out[static_cast<std::size_t>(t * d + i)] = (at(in, t * d + i) - mu) / std::sqrt(var + eps) * w[i] + b[i];
    }
    return out;
  };
  auto linear = [&](const Vec& in, std::int64_t k, const double* w, const double* b, std::int64_t n) {
    Vec out(static_cast<std::size_t>(M * n));
    for (std::int64_t t = 0; t < M; ++t)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = b[j];
        for (std::int64_t i = 0; i < k; ++i) s += at(in, t * k + i) * w[j * k + i];
        out[static_cast<std::size_t>(t * n + j)] = s;
      }
    return out;
  };
  const Vec n1 = layer_norm(x, p("ln_1.weight"), p("ln_1.bias"));
  const Vec qkv = linear(n1, d, p("attn.c_attn.weight"), p("attn.c_attn.bias"), 3 * d);  // [M, q | k | v]
  Vec att(static_cast<std::size_t>(M * d), 0.0);
  for (std::int64_t s = 0; s < c.rows; ++s)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < c.seq; ++i) {
        const std::int64_t ti = s * c.seq + i;
        std::vector<double> e(static_cast<std::size_t>(i + 1));
        double z = 0;
        for (std::int64_t j = 0; j <= i; ++j) {  // causal: keys up to the query
          const std::int64_t tj = s * c.seq + j;
          double dot = 0;
          for (std::int64_t k = 0; k < D; ++k) dot += at(qkv, ti * 3 * d + h * D + k) * at(qkv, tj * 3 * d + d + h * D + k);
          e[static_cast<std::size_t>(j)] = std::exp(dot / std::sqrt(static_cast<double>(D)));
          z += e[static_cast<std::size_t>(j)];
        }
        for (std::int64_t j = 0; j <= i; ++j)
          for (std::int64_t k = 0; k < D; ++k)
            att[static_cast<std::size_t>(ti * d + h * D + k)] +=
                e[static_cast<std::size_t>(j)] / z * at(qkv, (s * c.seq + j) * 3 * d + 2 * d + h * D + k);
      }
  Vec hid = linear(att, d, p("attn.c_proj.weight"), p("attn.c_proj.bias"), d);
  for (std::size_t i = 0; i < hid.size(); ++i) hid[i] += x[i];
  const Vec n2 = layer_norm(hid, p("ln_2.weight"), p("ln_2.bias"));
  Vec fc = linear(n2, d, p("mlp.c_fc.weight"), p("mlp.c_fc.bias"), f);
  for (double& v : fc) v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
  Vec y = linear(fc, f, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"), d);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += hid[i];
  return y;
}

struct Case {
  std::int64_t hidden, heads, intermediate;
  ChunkShape chunk;
};

/// Forward against the reference; backward against finite differences of the forward, for the
/// input and every weight tensor. Weight gradients start random (backward must add to them) and
/// dx starts as NaN (backward must overwrite it).
void check_gpt2_block(const Case& k, std::uint64_t seed, bool every_coordinate = false) {
  const ModelConfig cfg = gpt2_config(k.hidden, k.heads, k.intermediate, 2);
  const ChunkShape c = k.chunk;
  CAPTURE(k.hidden);
  CAPTURE(k.heads);
  CAPTURE(c.rows);
  CAPTURE(c.seq);
  Random rng(test_seed(seed));
  Be be;
  const double eps = 1e-5;
  const LayerTemplate<Gpt2Block> block{Gpt2Block(cfg, 1, {.layer_norm_epsilon = eps})};  // the second layer: "h.1."
  const auto& op = block.op();
  const std::int64_t M = c.tokens(), d = cfg.hidden_size;
  Vec slab = random_weights(block.layout(), rng);
  Vec x = rng.vector(M * d, -1, 1);
  const Vec r = rng.vector(M * d, -1, 1);
  std::vector<std::byte> mem(op.scratch_bytes<Be>(c));  // exactly what the op asked for
  Arena arena{std::span<std::byte>(mem)};
  const auto w = block.bind(std::span<const double>(slab));
  Vec y(x.size());

  op.forward(be, c, w, cview(x, {M, d}), view(y, {M, d}), arena);
  check_close("forward against the reference", y, reference_forward(cfg, eps, block.layout(), slab, "h.1.", x, c), 1e-12,
              1e-12);

  auto objective = [&] {
    op.forward(be, c, w, cview(x, {M, d}), view(y, {M, d}), arena);
    return contract(y, r);
  };
  const Vec g0 = rng.vector(block.layout().numel(), -1, 1);
  Vec g = g0, dx(x.size(), kNaN);
  op.backward(be, c, w, cview(x, {M, d}), cview(r, {M, d}), view(dx, {M, d}), block.bind(std::span<double>(g)), arena);
  const Vec inc = minus(g, g0);
  for (std::size_t i = 0; i < dx.size(); ++i) REQUIRE(std::isfinite(dx[i]));
  // The alignment gaps between tensors are no one's gradient: backward leaves them alone.
  std::vector<bool> in_tensor(inc.size(), false);
  for (const auto& e : block.layout().entries())
    for (std::int64_t i = 0; i < e.numel(); ++i) in_tensor[static_cast<std::size_t>(e.offset + i)] = true;
  for (std::size_t i = 0; i < inc.size(); ++i)
    if (!in_tensor[i]) REQUIRE(inc[i] == 0.0);

  std::vector<GradTensor> t{{"x", x, dx}};
  for (const auto& e : block.layout().entries()) {
    const auto off = static_cast<std::size_t>(e.offset), n = static_cast<std::size_t>(e.numel());
    t.push_back({e.spec.name, std::span<double>(slab).subspan(off, n), std::span<const double>(inc).subspan(off, n)});
  }
  GradcheckOptions opt;
  if (every_coordinate) opt.exhaustive_limit = std::int64_t{1} << 30;
  report(fmt::format("GPT-2 block, hidden {}, {} heads, {}x{} tokens", k.hidden, k.heads, c.rows, c.seq),
         gradcheck(objective, t, rng, opt));
}

}  // namespace

TEST_CASE("gradcheck: user op (GPT-2 block), every coordinate of every tensor") {
  check_gpt2_block({12, 3, 20, {2, 5}}, 3000, true);  // head_dim 4
}

TEST_CASE("gradcheck: user op (GPT-2 block), awkward shapes") {
  check_gpt2_block({18, 3, 44, {3, 7}}, 3001);   // head_dim 6
  check_gpt2_block({20, 5, 36, {1, 13}}, 3002);  // five heads of 4, one long sequence
  check_gpt2_block({10, 1, 30, {2, 7}}, 3003);   // a single head of 10
}

TEST_CASE("gradcheck: user op (GPT-2 block), one token per sequence") {
  // Attention over one token returns its value: the q and k rows of c_attn get no gradient,
  // the v rows do, so the fused tensor still has one to check.
  check_gpt2_block({12, 2, 16, {4, 1}}, 3004);
}

TEST_CASE("user op: a batch run chunk by chunk gives the same outputs and summed gradients") {
  const ModelConfig cfg = gpt2_config(18, 3, 28);
  Random rng(test_seed(3100));
  Be be;
  const LayerTemplate<Gpt2Block> block{Gpt2Block(cfg, 0)};
  const auto& op = block.op();
  const ChunkShape whole{4, 5}, half{2, 5};
  const std::int64_t M = whole.tokens(), Mh = half.tokens(), d = cfg.hidden_size;
  const Vec slab = random_weights(block.layout(), rng);
  const Vec x = rng.vector(M * d, -1, 1), dy = rng.vector(M * d, -1, 1);
  std::vector<std::byte> mem(op.scratch_bytes<Be>(whole));
  Arena arena{std::span<std::byte>(mem)};
  const auto w = block.bind(std::span<const double>(slab));

  Vec y(x.size()), dx(x.size()), g(static_cast<std::size_t>(block.layout().numel()), 0.0);
  op.forward(be, whole, w, cview(x, {M, d}), view(y, {M, d}), arena);
  op.backward(be, whole, w, cview(x, {M, d}), cview(dy, {M, d}), view(dx, {M, d}), block.bind(std::span<double>(g)), arena);

  Vec yc(x.size()), dxc(x.size()), gc(g.size(), 0.0);
  for (std::int64_t part = 0; part < 2; ++part) {
    const std::int64_t off = part * Mh * d;
    op.forward(be, half, w, cview_at(x, off, {Mh, d}), view_at(yc, off, {Mh, d}), arena);
    op.backward(be, half, w, cview_at(x, off, {Mh, d}), cview_at(dy, off, {Mh, d}), view_at(dxc, off, {Mh, d}),
                block.bind(std::span<double>(gc)), arena);
  }
  // Rows are independent; only the matrix products' blocking differs with the row count.
  check_close("y", yc, y, 1e-13, 1e-14);
  check_close("dx", dxc, dx, 1e-13, 1e-14);
  check_close("weight gradients", gc, g, 1e-12, 1e-13);  // summed in another order
  // The same run twice gives identical results.
  Vec y2(x.size());
  op.forward(be, whole, w, cview(x, {M, d}), view(y2, {M, d}), arena);
  check_close("forward, twice", y2, y, 0.0, 0.0);
}

TEST_CASE("user op: GPT-2 blocks in a DecoderModel and a HostParamStore") {
  const ModelConfig cfg = gpt2_config(20, 2, 44, 3);
  const DecoderModel<Gpt2Block> model(cfg, [](const ModelConfig& c, std::int64_t layer) {
    return Gpt2Block(c, layer, {.layer_norm_epsilon = 1e-5});
  });
  REQUIRE(model.num_blocks() == 3);
  REQUIRE(model.num_units() == 5);
  CHECK(model.head_unit() == 4);

  const auto units = model.units();
  REQUIRE(units.size() == 5);
  CHECK(units[0].name == "embed");
  CHECK(units[4].name == "head");
  const std::int64_t d = 20, f = 44;
  const std::vector<std::pair<std::string, Shape>> expected{
      {"ln_1.weight", Shape{d}},           {"ln_1.bias", Shape{d}},           {"attn.c_attn.weight", Shape{3 * d, d}},
      {"attn.c_attn.bias", Shape{3 * d}},  {"attn.c_proj.weight", Shape{d, d}}, {"attn.c_proj.bias", Shape{d}},
      {"ln_2.weight", Shape{d}},           {"ln_2.bias", Shape{d}},           {"mlp.c_fc.weight", Shape{f, d}},
      {"mlp.c_fc.bias", Shape{f}},         {"mlp.c_proj.weight", Shape{d, f}}, {"mlp.c_proj.bias", Shape{d}}};
  for (std::size_t l = 0; l < 3; ++l) {
    CAPTURE(l);
    const auto& u = units[l + 1];
    CHECK(u.name == "layers." + std::to_string(l));
    REQUIRE(u.params.size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CHECK(u.params[i].name == "h." + std::to_string(l) + "." + expected[i].first);
      CHECK(u.params[i].shape == expected[i].second);
    }
    CHECK(model.block(l).op().prefix() == "h." + std::to_string(l) + ".");
    CHECK(model.block(l).op().hidden_size() == d);
  }
  // Initialisation and decay follow GPT-2: LayerNorm weights one, biases zero, neither decayed;
  // the residual projections drawn with std / sqrt(2 n_layer).
  const auto& p = units[1].params;
  CHECK(p[0].init == ParamInit::ones);
  CHECK_FALSE(p[0].weight_decay);
  CHECK(p[1].init == ParamInit::zeros);
  CHECK_FALSE(p[1].weight_decay);
  CHECK(p[2].init == ParamInit::normal);
  CHECK(p[2].weight_decay);
  CHECK(p[2].init_std == doctest::Approx(0.02));
  CHECK(p[4].init_std == doctest::Approx(0.02 / std::sqrt(6.0)));
  CHECK(p[10].init_std == doctest::Approx(0.02 / std::sqrt(6.0)));

  StoreOptions so;
  so.pinning = Pinning::never;
  HostParamStore<double> store(units, so);
  CHECK(store.num_units() == 5);
  std::int64_t counted = 0;
  for (const auto& u : units)
    for (const auto& s : u.params) counted += s.numel();
  CHECK(store.param_count() == counted);
  CHECK(store.contains("h.2.mlp.c_proj.bias"));
  CHECK(store.find("h.1.attn.c_attn.weight").first->name() == "layers.1");

  // Binding the op to the store's slab gives views into the store; to a gradient buffer, views
  // at the same offsets.
  for (std::size_t l = 0; l < 3; ++l) {
    const auto& blk = model.block(l);
    const auto& unit = store.unit(l + 1);
    const auto pre = "h." + std::to_string(l) + ".";
    const auto w = blk.bind(std::span<const double>(unit.master()));
    CHECK(w.ln_1_weight.data() == store.master(pre + "ln_1.weight").data());
    CHECK(w.c_attn_weight.data() == store.master(pre + "attn.c_attn.weight").data());
    CHECK(w.c_attn_weight.shape() == Shape{3 * d, d});
    CHECK(w.mlp_proj_bias.data() == store.master(pre + "mlp.c_proj.bias").data());
    CHECK(w.ln_1_weight(0) == 1.0);
    CHECK(w.ln_1_bias(0) == 0.0);
    std::vector<double> grad(static_cast<std::size_t>(unit.numel()));
    const auto gw = blk.bind(std::span<double>(grad));
    CHECK(gw.c_fc_weight.data() - grad.data() == unit.param(pre + "mlp.c_fc.weight").offset);
    CHECK(gw.c_fc_weight.shape() == Shape{f, d});
    // A buffer shorter than the unit's layout cannot be bound.
    std::vector<double> short_buf(static_cast<std::size_t>(unit.numel() - 1));
    CHECK_THROWS_WITH_AS(blk.bind(std::span<double>(short_buf)), doctest::Contains("is shorter than its unit's layout"),
                         Error);
  }

  // Forward and backward straight from the store, with exactly the scratch the op asks for.
  Random rng(test_seed(3200));
  Be be;
  const ChunkShape c{3, 7};
  const std::int64_t M = c.tokens();
  const Vec x = rng.vector(M * d, -1, 1), dy = rng.vector(M * d, -1, 1);
  Vec y(x.size()), dx(x.size());
  const auto& blk = model.block(2);
  const std::size_t need = blk.op().scratch_bytes<Be>(c);
  std::vector<std::byte> mem(need);
  Arena arena{std::span<std::byte>(mem)};
  const auto w = blk.bind(std::span<const double>(store.unit(3).master()));
  std::vector<double> grad(static_cast<std::size_t>(store.unit(3).numel()), 0.0);
  blk.op().forward(be, c, w, cview(x, {M, d}), view(y, {M, d}), arena);
  blk.op().backward(be, c, w, cview(x, {M, d}), cview(dy, {M, d}), view(dx, {M, d}), blk.bind(std::span<double>(grad)),
                    arena);
  CHECK(arena.used() == 0);  // everything released
  CHECK(arena.peak() == need);
  double gn = 0;
  for (double v : grad) gn += v * v;
  CHECK(gn > 0);
  // One byte less is refused.
  std::vector<std::byte> small(need - 1);
  Arena too_small{std::span<std::byte>(small)};
  CHECK_THROWS_WITH_AS(blk.op().backward(be, c, w, cview(x, {M, d}), cview(dy, {M, d}), view(dx, {M, d}),
                                         blk.bind(std::span<double>(grad)), too_small),
                       doctest::Contains("too small"), Error);

  // The plain constructor works too (the options have defaults), and a factory can rename.
  CHECK(DecoderModel<Gpt2Block>(cfg).units()[1].params[0].name == "h.0.ln_1.weight");
  const DecoderModel<Gpt2Block> renamed(
      cfg, [](const ModelConfig& cc, std::int64_t l) { return Gpt2Block(cc, l, {.prefix = "transformer.h."}); });
  CHECK(renamed.units()[3].params[11].name == "transformer.h.2.mlp.c_proj.bias");
}

TEST_CASE("user op: refuses what a GPT-2 block cannot be") {
  const ModelConfig gqa = make_config({"LlamaForCausalLM", 16, 24, 4, 2, 4});
  CHECK_THROWS_WITH_AS(Gpt2Block(gqa, 0), doctest::Contains("as many key/value heads as query heads"), Error);
  const ModelConfig wide = make_config({"LlamaForCausalLM", 16, 24, 4, 4, 6});  // 4 x 6 != 16
  CHECK_THROWS_WITH_AS(Gpt2Block(wide, 0), doctest::Contains("num_attention_heads x head_dim = hidden_size"), Error);
  const ModelConfig ok = gpt2_config(16, 4, 24, 2);
  CHECK_THROWS_WITH_AS(Gpt2Block(ok, 2), doctest::Contains("layer 2 out of range"), Error);
  CHECK_THROWS_WITH_AS(Gpt2Block(ok, 0, {.layer_norm_epsilon = 0.0}), doctest::Contains("layer_norm_epsilon"), Error);

  // A wrong input shape, and a sequence beyond a sliding window, are errors, not garbage.
  auto j = nlohmann::json::parse(R"({"architectures":["MistralForCausalLM"],"hidden_size":16,"intermediate_size":24,
    "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":4,"vocab_size":37,"sliding_window":8})");
  const ModelConfig windowed = ModelConfig::from_json(j);
  const LayerTemplate<Gpt2Block> block{Gpt2Block(windowed, 0)};
  Be be;
  Random rng(test_seed(3300));
  const Vec slab = random_weights(block.layout(), rng);
  const auto w = block.bind(std::span<const double>(slab));
  const ChunkShape c{1, 9};
  Vec x = rng.vector(c.tokens() * 16, -1, 1), y(x.size());
  std::vector<std::byte> mem(block.op().scratch_bytes<Be>(c));
  Arena arena{std::span<std::byte>(mem)};
  CHECK_THROWS_WITH_AS(block.op().forward(be, c, w, cview(x, {9, 16}), view(y, {9, 16}), arena),
                       doctest::Contains("sliding_window 8"), Error);
  CHECK_THROWS_WITH_AS(block.op().forward(be, ChunkShape{1, 8}, w, cview(x, {9, 16}), view(y, {9, 16}), arena),
                       doctest::Contains("is not [8 tokens, 16]"), Error);
}
