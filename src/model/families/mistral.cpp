// Mistral (MistralForCausalLM): Llama's block without biases; a sliding window bounds the
// sequence length (4096 when the key is absent, as MistralConfig; null: none).
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_bias_keys(j, src, c.architecture_name(), "it has no bias in attention or MLP");
  if (!j.contains("sliding_window")) c.sliding_window = 4096;
  else if (given(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", src);
}

void write(const ModelConfig& c, json& j) { j["sliding_window"] = window_json(c); }

}  // namespace

extern const Family kMistral;  // (declared first: the table in families.cpp names it)
const Family kMistral{Architecture::mistral, "MistralForCausalLM", "mistral", 131072, 10000.0, false, std::nullopt,
                             BlockRecipe{}, parse, check_no_bias, write};

}  // namespace megatrain::model_families
