// What the families' files share: reading config.json fields with errors that name the file and
// the field, the rotary and layer-type tables, the bias and dropout refusals, and the mixture of
// experts' fields. Private to src/model.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/model/family.hpp"

namespace megatrain::model_families {

using json = nlohmann::json;

/// The field is there and not null.
inline bool given(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

std::int64_t get_int(const json& j, const char* key, std::string_view src, std::optional<std::int64_t> def = {});
double get_double(const json& j, const char* key, std::string_view src, std::optional<double> def = {});
bool get_bool(const json& j, const char* key, std::string_view src, bool def);

RopeScaling parse_rope_scaling(const json& r, std::string_view src);
/// Hugging Face's rope_scaling object for `r` (null for none); yarn's factor and original length
/// as resolved by the config.
json rope_scaling_json(const RopeScaling& r, double yarn_factor, std::int64_t yarn_original);
/// transformers 5's rope_parameters object of `c`'s rotary (theta and scaling).
json rope_parameters_json(const ModelConfig& c);

/// layer_types: each of the `layers` layers' token mixer (full_attention, or sliding_attention:
/// within sliding_window); `sliding_default(i)` says whether layer i slides where it is absent.
template <class F>
std::vector<TokenMixerKind> read_layer_types(const json& j, std::string_view src, std::int64_t layers, F sliding_default) {
  std::vector<TokenMixerKind> types(static_cast<std::size_t>(std::max<std::int64_t>(layers, 0)), TokenMixerKind::full_attention);
  if (given(j, "layer_types")) {
    const json& lt = j.at("layer_types");
    MT_CHECK(lt.is_array() && static_cast<std::int64_t>(lt.size()) == layers,
             "{}: layer_types must list one type per layer ({}), not {}", src, layers, lt.dump());
    for (std::size_t i = 0; i < lt.size(); ++i) {
      const auto kind = lt[i].is_string() ? token_mixer_named(lt[i].get<std::string>()) : std::nullopt;
      MT_CHECK(kind.has_value(),
               "{}: layer_types holds {}; each entry must be \"full_attention\", \"sliding_attention\" or \"linear_attention\"",
               src, lt[i].dump());
      types[i] = *kind;
    }
  } else {
    for (std::size_t i = 0; i < types.size(); ++i)
      if (sliding_default(static_cast<std::int64_t>(i))) types[i] = TokenMixerKind::sliding_attention;
  }
  return types;
}
/// sliding_window as config.json holds it (null: none).
inline json window_json(const ModelConfig& c) { return c.sliding_window ? json(*c.sliding_window) : json(nullptr); }
/// c.layer_types as config.json's layer_types.
json layer_types_json(const ModelConfig& c);
/// layer_types of a model whose every layer is full attention, as transformers 5 writes it for
/// Qwen2, Qwen3 and SmolLM3 without sliding windows; nothing (no key) where a window is set.
void write_full_layer_types(const ModelConfig& c, json& j);

/// Refuses each of `keys` that is nonzero: megatrain trains without dropout.
void refuse_dropout(const json& j, std::string_view src, std::initializer_list<const char*> keys);
/// Refuses attention_bias and mlp_bias set true on a family whose config class has no such
/// option (transformers ignores the key and builds `what_it_has`).
void refuse_bias_keys(const json& j, std::string_view src, std::string_view family, std::string_view what_it_has);
/// Refuses mlp_bias set true on a family whose MLP never has a bias.
void refuse_mlp_bias(const json& j, std::string_view src, std::string_view family);

/// The biases a family can describe: one attention_bias for q/k/v and o_proj, none in the MLP
/// (Qwen3, Gemma 3, Qwen3-MoE, OLMoE, GPT-OSS); or none at all (Mistral, Phi-3, Mixtral).
void check_attention_bias_only(const ModelConfig& c, std::string_view src);
void check_no_bias(const ModelConfig& c, std::string_view src);
/// Llama's: one attention_bias for q/k/v and o_proj (qkv_bias == o_bias), mlp_bias free.
void check_llama_biases(const ModelConfig& c, std::string_view src);

/// A mixture-of-experts family's defaults (those of its config class in transformers 5.17).
struct MoeDefaults {
  std::int64_t num_experts, experts_per_token;
  double router_aux_loss_coef;
  /// The expert's own intermediate size is read from this key (Qwen3-MoE's moe_intermediate_size);
  /// null: intermediate_size.
  const char* expert_size_key = nullptr;
  std::int64_t expert_size = 0;
  /// Whether norm_topk_prob is read (false: the top-k weights are always renormalised), and its
  /// default where config.json leaves it out.
  bool reads_norm_topk_prob = true;
  bool norm_topk_prob = false;
};
/// The experts' fields common to the mixture-of-experts families: their count (num_experts or
/// num_local_experts), top k, renormalisation, the auxiliary loss; bounds checked.
void parse_moe(const json& j, std::string_view src, ModelConfig& c, const MoeDefaults& d);
/// The dense layers among sparse ones (Qwen3-MoE, Qwen3-Next): decoder_sparse_step and
/// mlp_only_layers, bounds checked.
void parse_dense_layers(const json& j, std::string_view src, ModelConfig& c);
/// The experts' fields as parse_moe reads them back.
void write_moe(const ModelConfig& c, json& j, bool writes_norm_topk_prob);
/// The experts' bounds; `dense_layers`: whether the family may have dense layers among sparse ones.
void check_moe(const ModelConfig& c, std::string_view src, bool dense_layers);

}  // namespace megatrain::model_families
