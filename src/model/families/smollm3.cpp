// SmolLM3 (SmolLM3ForCausalLM): Llama's block and biases, with no rotary embedding on every
// no_rope_layer_interval-th layer (NoPE; no_rope_layers lists 1 for a layer with rotary, 0 for one
// without). Its sliding windows (use_sliding_window, on the NoPE layers only) are refused: the
// published models have none, and transformers' mask and attention read them differently.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  c.mlp_bias = get_bool(j, "mlp_bias", src, false);
  refuse_dropout(j, src, {"attention_dropout"});
  MT_CHECK(!get_bool(j, "use_sliding_window", src, false),
           "{}: use_sliding_window is true; SmolLM3's sliding-window layers are not supported (the published SmolLM3 "
           "models have none): set it to false", src);
  const auto types = read_layer_types(j, src, c.num_hidden_layers, [](std::int64_t) { return false; });
  for (std::size_t l = 0; l < types.size(); ++l)
    MT_CHECK(types[l] != TokenMixerKind::sliding_attention, "{}: layer_types makes layer {} a sliding_attention layer; SmolLM3's sliding "
             "windows are not supported: list every layer as \"full_attention\" (or leave layer_types out)", src, l);
  c.nope_layers.assign(static_cast<std::size_t>(c.num_hidden_layers), false);
  if (given(j, "no_rope_layers")) {
    const json& n = j.at("no_rope_layers");
    MT_CHECK(n.is_array() && static_cast<std::int64_t>(n.size()) >= c.num_hidden_layers,
             "{}: no_rope_layers must list 1 (rotary) or 0 (none) for each of the {} layers, not {}", src,
             c.num_hidden_layers, n.dump());
    for (std::size_t l = 0; l < c.nope_layers.size(); ++l) {
      MT_CHECK(n[l].is_number_integer() && (n[l] == 0 || n[l] == 1),
               "{}: no_rope_layers holds {} for layer {}; each entry must be 1 (rotary) or 0 (none)", src, n[l].dump(), l);
      c.nope_layers[l] = n[l] == 0;
    }
  } else {
    const std::int64_t interval = get_int(j, "no_rope_layer_interval", src, 4);
    MT_CHECK(interval > 0, "{}: no_rope_layer_interval must be > 0 (got {})", src, interval);
    for (std::size_t l = 0; l < c.nope_layers.size(); ++l)
      c.nope_layers[l] = (static_cast<std::int64_t>(l) + 1) % interval == 0;
  }
}

void check(const ModelConfig& c, std::string_view src) {
  check_llama_biases(c, src);
  MT_CHECK(static_cast<std::int64_t>(c.nope_layers.size()) == c.num_hidden_layers,
           "{}: {} needs one no_rope_layers entry per layer ({} for {} layers)", src, c.architecture_name(),
           c.nope_layers.size(), c.num_hidden_layers);
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  j["mlp_bias"] = c.mlp_bias;
  json rope = json::array();
  for (const bool nope : c.nope_layers) rope.push_back(nope ? 0 : 1);
  j["no_rope_layers"] = rope;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  write_full_layer_types(c, j);
}

}  // namespace

// (SmolLM3Config: tied embeddings, rope_theta 2,000,000, pad_token_id 128004)
extern const Family kSmolLM3;  // (declared first: the table in families.cpp names it)
const Family kSmolLM3{Architecture::smollm3, "SmolLM3ForCausalLM", "smollm3", 32768, 2000000.0, true, 128004,
                             BlockRecipe{.nope_layers = true}, parse, check, write};

}  // namespace megatrain::model_families
