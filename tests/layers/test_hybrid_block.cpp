// Qwen3.5's blocks on the CPU reference backend in float64: the gated attention against an
// ungated attention of the same weights whose output is gated by hand, and each kind of layer's
// whole block (norms, token mixer, MLP) against central differences of its forward.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <variant>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;

constexpr std::int64_t kHidden = 13, kHeads = 2, kKv = 1, kHeadDim = 8;

/// A Qwen3.5 text model of the given layer types (rotary over `partial` of each head).
ModelConfig qwen3_5(const std::vector<std::string>& types, double partial) {
  return ModelConfig::from_json(
      {{"architectures", {"Qwen3_5ForCausalLM"}}, {"hidden_size", kHidden}, {"intermediate_size", 24},
       {"num_hidden_layers", types.size()}, {"num_attention_heads", kHeads}, {"num_key_value_heads", kKv},
       {"head_dim", kHeadDim}, {"vocab_size", 37}, {"rms_norm_eps", 1e-6}, {"linear_num_key_heads", 1},
       {"linear_num_value_heads", 2}, {"linear_key_head_dim", 4}, {"linear_value_head_dim", 5},
       {"layer_types", types}, {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0},
                                                    {"partial_rotary_factor", partial}}}},
      "qwen3.5 test config");
}

/// Gemma 3's attention: the same (1 + w) q/k norms and rotary, its softmax scale set to head_dim's.
ModelConfig gemma3() {
  return ModelConfig::from_json({{"architectures", {"Gemma3ForCausalLM"}}, {"hidden_size", kHidden},
                                 {"intermediate_size", 24}, {"num_hidden_layers", 1}, {"num_attention_heads", kHeads},
                                 {"num_key_value_heads", kKv}, {"head_dim", kHeadDim}, {"vocab_size", 37},
                                 {"rms_norm_eps", 1e-6}, {"query_pre_attn_scalar", kHeadDim}, {"sliding_window", 64},
                                 {"layer_types", {"full_attention"}}, {"rope_theta", 10000.0}},
                                "gemma3 test config");
}

const double* tensor(const UnitLayout& l, const Vec& slab, const std::string& name) {
  const auto* e = l.find("model.layers.0.self_attn." + name);
  REQUIRE(e != nullptr);
  return slab.data() + e->offset;
}

}  // namespace

TEST_CASE("gated attention: o_proj reads attention * sigmoid(gate), each head's gate the second half of its q_proj rows") {
  const ModelConfig q35 = qwen3_5({"full_attention"}, 1.0), g3 = gemma3();
  const LayerTemplate<SelfAttention> gated{SelfAttention(q35, 0)}, plain{SelfAttention(g3, 0)};
  const std::int64_t qd = kHeads * kHeadDim;
  CHECK(gated.layout().find("model.layers.0.self_attn.q_proj.weight")->spec.shape == Shape{2 * qd, kHidden});
  Random rng(test_seed(5400));
  const Vec slab = random_weights(gated.layout(), rng);
  // the ungated attention's weights: q_proj's query rows, the rest as they are
  Vec pslab(static_cast<std::size_t>(plain.layout().numel()), 0.0);
  for (const auto& e : plain.layout().entries()) {
    const std::string name = e.spec.name.substr(std::string("model.layers.0.self_attn.").size());
    const double* src = tensor(gated.layout(), slab, name);
    if (name != "q_proj.weight") {
      std::copy_n(src, e.numel(), pslab.begin() + e.offset);
      continue;
    }
    for (std::int64_t h = 0; h < kHeads; ++h)  // (head h's rows 2h hd .. (2h + 1) hd: its query)
      std::copy_n(src + 2 * h * kHeadDim * kHidden, kHeadDim * kHidden, pslab.begin() + e.offset + h * kHeadDim * kHidden);
  }
  const ChunkShape c{2, 7};
  const std::int64_t M = c.tokens();
  const Vec x = rng.vector(M * kHidden, -1, 1);
  Be be;
  // the gated op, on the whole chunk and a token block of 4 at a time
  const auto gated_forward = [&](ChunkShape shape) {
    std::vector<std::byte> mem(gated.op().scratch_bytes<Be>(shape));
    Arena arena{std::span<std::byte>(mem)};
    Vec out(static_cast<std::size_t>(M * kHidden));
    gated.op().forward(be, shape, gated.bind(std::span<const double>(slab)), cview(x, {M, kHidden}),
                       view(out, {M, kHidden}), arena);
    return out;
  };
  const Vec y = gated_forward(c);
  CHECK(gated_forward(ChunkShape{2, 7, {}, 4}) == y);
  // by hand: the plain attention's output, times sigmoid of each head's gate rows, through o_proj
  std::vector<std::byte> pmem(plain.op().scratch_bytes<Be>(c));
  Arena parena{std::span<std::byte>(pmem)};
  const auto acts = plain.op().carve<Be>(parena, c, false);
  plain.op().run_kept(be, c, plain.bind(std::span<const double>(pslab)), cview(x, {M, kHidden}), acts);
  const double* wq = tensor(gated.layout(), slab, "q_proj.weight");
  const double* wo = tensor(gated.layout(), slab, "o_proj.weight");
  Vec want(y.size(), 0.0);
  for (std::int64_t t = 0; t < M; ++t) {
    Vec gated_att(static_cast<std::size_t>(qd));
    for (std::int64_t h = 0; h < kHeads; ++h)
      for (std::int64_t i = 0; i < kHeadDim; ++i) {
        double gate = 0;
        for (std::int64_t j = 0; j < kHidden; ++j) gate += wq[((2 * h + 1) * kHeadDim + i) * kHidden + j] * x[t * kHidden + j];
        gated_att[h * kHeadDim + i] = acts.att.data()[t * qd + h * kHeadDim + i] / (1 + std::exp(-gate));
      }
    for (std::int64_t o = 0; o < kHidden; ++o)
      for (std::int64_t i = 0; i < qd; ++i) want[t * kHidden + o] += wo[o * qd + i] * gated_att[i];
  }
  check_close("gated attention", y, want, 1e-12, 1e-13);
}

TEST_CASE("gradcheck: the gated attention op on its own, whole and a token block at a time") {
  const LayerTemplate<SelfAttention> gated{SelfAttention(qwen3_5({"full_attention"}, 0.5), 0)};
  for (const ChunkShape& c : {ChunkShape{2, 5}, ChunkShape{1, 9, {}, 4}})
    gradcheck_layer(gated, c, 5420 + static_cast<std::uint64_t>(c.seq), fmt::format("gated attention, {}x{} tokens", c.rows, c.seq));
}

TEST_CASE("gradcheck: Qwen3.5's blocks, a linear-attention layer and a gated full-attention layer") {
  const ModelConfig cfg = qwen3_5({"linear_attention", "full_attention"}, 0.5);
  const DecoderModel<> model(cfg);
  CHECK(std::holds_alternative<GatedDeltaNet>(model.block(0).op().token_mixer()));
  CHECK(std::holds_alternative<SelfAttention>(model.block(1).op().token_mixer()));
  for (const std::size_t l : {std::size_t{0}, std::size_t{1}})
    for (const ChunkShape& c : {ChunkShape{2, 5}, ChunkShape{1, 9, {}, 4}}) {
      const LayerTemplate<DecoderBlock> block{DecoderBlock(cfg, static_cast<std::int64_t>(l))};
      gradcheck_layer(block, c, 5410 + 10 * l + static_cast<std::uint64_t>(c.seq),
                      fmt::format("Qwen3.5 block {} ({}), {}x{} tokens", l, l == 0 ? "linear" : "gated attention", c.rows,
                                  c.seq));
    }
}
