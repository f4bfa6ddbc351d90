// Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's block without biases, q/k/v and gate/up fused into one
// tensor each in the checkpoint (qkv_proj, gate_up_proj), longrope for the long-context variants.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_bias_keys(j, src, c.architecture_name(), "it has no bias in attention or MLP");
  // (every published Phi-3 and Phi-4 has its dropouts at 0)
  refuse_dropout(j, src, {"resid_pdrop", "embd_pdrop", "attention_dropout"});
  if (given(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", src);
}

void write(const ModelConfig& c, json& j) { j["sliding_window"] = window_json(c); }

}  // namespace

extern const Family kPhi3;  // (declared first: the table in families.cpp names it)
const Family kPhi3{Architecture::phi3, "Phi3ForCausalLM", "phi3", 4096, 10000.0, false, std::nullopt,
                          BlockRecipe{.fused_projections = true}, parse, check_no_bias, write};

}  // namespace megatrain::model_families
