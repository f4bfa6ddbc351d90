// The shared expert of Qwen3.5-MoE and Qwen3-Next on the CPU reference backend in float64:
// MoeMlp's output with one is the routed experts' output plus sigmoid(shared_expert_gate . x)
// times the shared SwiGLU's output, written out here by hand; and the gradients of whole blocks
// that hold one (a linear-attention layer and a gated attention layer of Qwen3.5-MoE, Qwen3-Next's
// fused projections beside a dense layer) against central differences.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/layers/ops/moe_mlp.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;

constexpr std::int64_t kHidden = 13, kExperts = 5, kTop = 2, kExpertSize = 6, kShared = 7;

/// A tiny hybrid MoE model of the given family and layer types.
ModelConfig hybrid_moe(const char* arch, const std::vector<std::string>& types,
                       nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json j{{"architectures", {arch}}, {"hidden_size", kHidden}, {"intermediate_size", 11},
                   {"num_hidden_layers", types.size()}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                   {"head_dim", 8}, {"vocab_size", 37}, {"linear_num_key_heads", 1}, {"linear_num_value_heads", 2},
                   {"linear_key_head_dim", 4}, {"linear_value_head_dim", 5}, {"layer_types", types},
                   {"num_experts", kExperts}, {"num_experts_per_tok", kTop}, {"moe_intermediate_size", kExpertSize},
                   {"shared_expert_intermediate_size", kShared}, {"rope_parameters", {{"rope_type", "default"},
                   {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}};
  j.update(extra);
  return ModelConfig::from_json(j, "shared expert test config");
}

double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }

}  // namespace

TEST_CASE("shared expert: the routed experts' sum plus sigmoid(shared_expert_gate . x) times the shared SwiGLU") {
  const ModelConfig cfg = hybrid_moe("Qwen3_5MoeForCausalLM", {"linear_attention"});
  ModelConfig routed_only = cfg;
  routed_only.moe.shared_expert_size = 0;
  const MoeMlp op(cfg, 0), op0(routed_only, 0);
  const UnitLayout layout(op.params()), layout0(op0.params());
  CHECK(layout.numel() > layout0.numel());
  REQUIRE(layout.find("model.layers.0.mlp.shared_expert_gate.weight") != nullptr);
  CHECK(layout.find("model.layers.0.mlp.shared_expert_gate.weight")->spec.shape == Shape{1, kHidden});
  CHECK(layout.find("model.layers.0.mlp.shared_expert.down_proj.weight")->spec.shape == Shape{kHidden, kShared});
  Random rng(test_seed(5600));
  const Vec slab = random_weights<double>(layout, rng);
  Vec slab0(static_cast<std::size_t>(layout0.numel()), 0.0);  // (the routed part's weights, the same)
  for (const auto& e : layout0.entries())
    std::copy_n(slab.begin() + layout.find(e.spec.name)->offset, e.numel(), slab0.begin() + e.offset);
  const auto at = [&](const std::string& name) { return slab.data() + layout.find("model.layers.0.mlp." + name)->offset; };
  const std::int64_t T = 11;  // (odd: no token block of a round size)
  const Vec x = rng.vector(T * kHidden, -1, 1), h = rng.vector(T * kHidden, -1, 1);
  Be be;
  const auto run = [&](const MoeMlp& o, const UnitLayout& l, const Vec& s) {
    std::vector<std::byte> mem(std::size_t{1} << 20);
    Arena arena{std::span<std::byte>(mem)};
    const auto a = o.carve<Be>(arena, T, false);
    const ParamBinder<const double> p{{&l, std::span<const double>(s)}};
    Vec y(static_cast<std::size_t>(T * kHidden));
    o.run(be, o.bind(p), cview(x, {T, kHidden}), a, cview(h, {T, kHidden}), view(y, {T, kHidden}));
    return y;
  };
  const Vec y = run(op, layout, slab), y0 = run(op0, layout0, slab0);
  Vec want = y0;
  const double *wg = at("shared_expert.gate_proj.weight"), *wu = at("shared_expert.up_proj.weight"),
               *wd = at("shared_expert.down_proj.weight"), *gate = at("shared_expert_gate.weight");
  for (std::int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * kHidden;
    double logit = 0;
    for (std::int64_t j = 0; j < kHidden; ++j) logit += gate[j] * xt[j];
    Vec m(kShared);
    for (std::int64_t i = 0; i < kShared; ++i) {
      double g = 0, u = 0;
      for (std::int64_t j = 0; j < kHidden; ++j) {
        g += wg[i * kHidden + j] * xt[j];
        u += wu[i * kHidden + j] * xt[j];
      }
      m[static_cast<std::size_t>(i)] = g * sigmoid(g) * u;
    }
    for (std::int64_t o = 0; o < kHidden; ++o) {
      double out = 0;
      for (std::int64_t i = 0; i < kShared; ++i) out += wd[o * kShared + i] * m[static_cast<std::size_t>(i)];
      want[static_cast<std::size_t>(t * kHidden + o)] += sigmoid(logit) * out;
    }
  }
  check_close("routed experts + gated shared expert", y, want, 1e-12, 1e-13);
}

TEST_CASE("gradcheck: Qwen3.5-MoE's and Qwen3-Next's blocks with a shared expert") {
  const ModelConfig q35 = hybrid_moe("Qwen3_5MoeForCausalLM", {"linear_attention", "full_attention"});
  const ModelConfig next = hybrid_moe("Qwen3NextForCausalLM", {"linear_attention", "full_attention"},
                                      {{"mlp_only_layers", {1}}});
  CHECK(next.is_moe_layer(0));
  CHECK(!next.is_moe_layer(1));
  for (const auto* cfg : {&q35, &next})
    for (const std::int64_t l : {std::int64_t{0}, std::int64_t{1}})
      for (const ChunkShape& c : {ChunkShape{2, 5}, ChunkShape{1, 9, {}, 4}}) {
        const LayerTemplate<DecoderBlock> block{DecoderBlock(*cfg, l)};
        gradcheck_layer(block, c, 5610 + 10 * static_cast<std::uint64_t>(l) + static_cast<std::uint64_t>(c.seq),
                        fmt::format("{} block {}, {}x{} tokens", cfg->architecture_name(), l, c.rows, c.seq));
      }
}
