// Qwen3 (Qwen3ForCausalLM): Qwen2's block with each query and key head RMS-normalised before the
// rotation (q_norm, k_norm), one attention_bias as Llama's, no MLP bias.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  // Sliding-window layers (use_sliding_window, or "sliding_attention" in layer_types): the window
  // bounds the sequence length (check_sequence_length), where every layer is exact.
  const auto types = read_layer_types(j, src, c.num_hidden_layers, [](std::int64_t) { return false; });
  const bool any = std::find(types.begin(), types.end(), TokenMixerKind::sliding_attention) != types.end();
  if (get_bool(j, "use_sliding_window", src, false) || any) c.sliding_window = get_int(j, "sliding_window", src);
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  j["use_sliding_window"] = c.sliding_window.has_value();
  j["sliding_window"] = window_json(c);
  write_full_layer_types(c, j);
}

}  // namespace

extern const Family kQwen3;  // (declared first: the table in families.cpp names it)
const Family kQwen3{Architecture::qwen3, "Qwen3ForCausalLM", "qwen3", 32768, 10000.0, false, std::nullopt,
                           BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head}, parse, check_attention_bias_only, write};

}  // namespace megatrain::model_families
