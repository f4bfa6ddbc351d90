// Mixtral (MixtralForCausalLM): Mistral's attention (no bias; a window where sliding_window is set)
// and a mixture of experts in block_sparse_moe, each expert's projections named w1, w3, w2, its
// top-k weights always renormalised. The router's jitter (random noise while training) is refused.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_bias_keys(j, src, c.architecture_name(), "it has no bias in attention or experts");
  // (MixtralConfig's sliding_window defaults to None, unlike Mistral's)
  if (given(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", src);
  parse_moe(j, src, c, {.num_experts = 8, .experts_per_token = 2, .router_aux_loss_coef = 0.001,
                        .reads_norm_topk_prob = false});
  MT_CHECK(get_double(j, "router_jitter_noise", src, 0.0) == 0.0,
           "{}: router_jitter_noise is {}: Mixtral's router then multiplies its input by random noise while training, "
           "which megatrain does not; set it to 0.0", src, get_double(j, "router_jitter_noise", src, 0.0));
}

void check(const ModelConfig& c, std::string_view src) {
  check_no_bias(c, src);
  check_moe(c, src, /*dense_layers=*/false);
  MT_CHECK(c.moe.norm_topk_prob, "{}: {} always renormalises its top-k weights", src, c.architecture_name());
}

void write(const ModelConfig& c, json& j) {
  write_moe(c, j, /*writes_norm_topk_prob=*/false);
  j["router_jitter_noise"] = 0.0;
  j["sliding_window"] = window_json(c);
}

}  // namespace

extern const Family kMixtral;  // (declared first: the table in families.cpp names it)
const Family kMixtral{Architecture::mixtral, "MixtralForCausalLM", "mixtral", 131072, 10000.0, false, std::nullopt,
                             BlockRecipe{.moe = true,
                                         .moe_module = "block_sparse_moe",
                                         .expert_projections = {"w1", "w3", "w2"}},
                             parse, check, write};

}  // namespace megatrain::model_families
