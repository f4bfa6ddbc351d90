// What the families' files share (common.hpp).
#include "common.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace megatrain::model_families {

namespace {
std::string type_name(const json& v) { return v.type_name(); }
}  // namespace

std::int64_t get_int(const json& j, const char* key, std::string_view src, std::optional<std::int64_t> def) {
  if (!j.contains(key) || j.at(key).is_null()) {
    MT_CHECK(def.has_value(), "{}: required field '{}' is missing", src, key);
    return *def;
  }
  const json& v = j.at(key);
  // A float is accepted when it holds a whole number that fits (4096.0); beyond 2^63 the cast
  // below would be undefined.
  MT_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
                                     std::abs(v.get<double>()) < 0x1p63),
           "{}: field '{}' must be an integer, not {} ({})", src, key, type_name(v), v.dump());
  return v.is_number_integer() ? v.get<std::int64_t>() : static_cast<std::int64_t>(v.get<double>());
}

double get_double(const json& j, const char* key, std::string_view src, std::optional<double> def) {
  if (!j.contains(key) || j.at(key).is_null()) {
    MT_CHECK(def.has_value(), "{}: required field '{}' is missing", src, key);
    return *def;
  }
  const json& v = j.at(key);
  MT_CHECK(v.is_number(), "{}: field '{}' must be a number, not {} ({})", src, key, type_name(v), v.dump());
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, std::string_view src, bool def) {
  if (!j.contains(key) || j.at(key).is_null()) return def;
  const json& v = j.at(key);
  MT_CHECK(v.is_boolean(), "{}: field '{}' must be true or false, not {} ({})", src, key, type_name(v), v.dump());
  return v.get<bool>();
}


RopeScaling parse_rope_scaling(const json& r, std::string_view src) {
  RopeScaling s;
  MT_CHECK(r.is_object(), "{}: rope_scaling must be an object or null, not {}", src, type_name(r));
  std::string type = "default";
  // "type" (the older spelling) wins over "rope_type", as in transformers 4's LlamaConfig.
  for (const char* key : {"rope_type", "type"}) {
    if (!r.contains(key) || r.at(key).is_null()) continue;
    MT_CHECK(r.at(key).is_string(), "{}: rope scaling field '{}' must be a string, not {} ({})", src, key,
             type_name(r.at(key)), r.at(key).dump());
    type = r.at(key).get<std::string>();
  }
  if (type == "default") return s;
  if (type == "linear") {
    s.type = RopeScaling::Type::linear;
    s.factor = get_double(r, "factor", src);
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::llama3;
    s.factor = get_double(r, "factor", src);
    s.low_freq_factor = get_double(r, "low_freq_factor", src, 1.0);
    s.high_freq_factor = get_double(r, "high_freq_factor", src, 4.0);
    s.original_max_position_embeddings = get_int(r, "original_max_position_embeddings", src, 8192);
  } else if (type == "yarn") {
    s.type = RopeScaling::Type::yarn;
    const auto given = [&](const char* key) { return r.contains(key) && !r.at(key).is_null(); };
    s.factor = given("factor") ? get_double(r, "factor", src) : 0.0;  // (0: from the two lengths)
    s.original_max_position_embeddings = given("original_max_position_embeddings")
                                              ? get_int(r, "original_max_position_embeddings", src)
                                              : 0;  // (0: max_position_embeddings)
    // (transformers takes `x or default`: a 0 is the default too)
    if (given("beta_fast") && get_double(r, "beta_fast", src) != 0) s.beta_fast = get_double(r, "beta_fast", src);
    if (given("beta_slow") && get_double(r, "beta_slow", src) != 0) s.beta_slow = get_double(r, "beta_slow", src);
    if (given("truncate")) s.truncate = get_bool(r, "truncate", src, true);
    if (given("attention_factor")) s.attention_factor = get_double(r, "attention_factor", src);
    if (given("mscale")) s.mscale = get_double(r, "mscale", src);
    if (given("mscale_all_dim")) s.mscale_all_dim = get_double(r, "mscale_all_dim", src);
    MT_CHECK(s.original_max_position_embeddings >= 0, "{}: yarn's original_max_position_embeddings must be > 0 (got {})",
             src, s.original_max_position_embeddings);
    MT_CHECK(s.factor >= 0, "{}: rope scaling factor must be > 0 (got {})", src, s.factor);
    return s;
  } else if (type == "longrope") {
    s.type = RopeScaling::Type::longrope;
    const auto factors = [&](const char* key) {
      MT_CHECK(r.contains(key) && r.at(key).is_array() && !r.at(key).empty(),
               "{}: longrope scaling needs '{}', a list of numbers", src, key);
      std::vector<double> v;
      for (const auto& x : r.at(key)) {
        MT_CHECK(x.is_number() && x.get<double>() > 0, "{}: longrope's '{}' holds {}; each must be a number > 0", src, key,
                 x.dump());
        v.push_back(x.get<double>());
      }
      return v;
    };
    s.short_factor = factors("short_factor");
    s.long_factor = factors("long_factor");
    const auto given = [&](const char* key) { return r.contains(key) && !r.at(key).is_null(); };
    s.factor = given("factor") ? get_double(r, "factor", src) : 0.0;
    s.original_max_position_embeddings =
        given("original_max_position_embeddings") ? get_int(r, "original_max_position_embeddings", src) : 0;
    if (given("attention_factor")) s.attention_factor = get_double(r, "attention_factor", src);
    MT_CHECK(s.factor >= 0, "{}: rope scaling factor must be > 0 (got {})", src, s.factor);
    return s;
  } else {
    MT_FAIL("{}: rope scaling type '{}' is not supported (supported: default, linear, llama3, yarn, longrope)", src, type);
  }
  MT_CHECK(s.factor > 0, "{}: rope scaling factor must be > 0 (got {})", src, s.factor);
  return s;
}

json rope_scaling_json(const RopeScaling& r, double yarn_factor, std::int64_t yarn_original) {
  switch (r.type) {
    case RopeScaling::Type::none: return nullptr;
    case RopeScaling::Type::linear: return {{"rope_type", "linear"}, {"factor", r.factor}};
    case RopeScaling::Type::llama3:
      return {{"rope_type", "llama3"},
              {"factor", r.factor},
              {"low_freq_factor", r.low_freq_factor},
              {"high_freq_factor", r.high_freq_factor},
              {"original_max_position_embeddings", r.original_max_position_embeddings}};
    case RopeScaling::Type::yarn: {
      json y = {{"rope_type", "yarn"}, {"factor", yarn_factor}, {"original_max_position_embeddings", yarn_original},
                {"beta_fast", r.beta_fast}, {"beta_slow", r.beta_slow}, {"truncate", r.truncate}};
      if (r.attention_factor) y["attention_factor"] = *r.attention_factor;
      if (r.mscale) y["mscale"] = *r.mscale;
      if (r.mscale_all_dim) y["mscale_all_dim"] = *r.mscale_all_dim;
      return y;
    }
    case RopeScaling::Type::longrope: {
      json y = {{"rope_type", "longrope"},
                {"short_factor", r.short_factor},
                {"long_factor", r.long_factor},
                {"original_max_position_embeddings", r.original_max_position_embeddings}};
      if (r.factor > 0) y["factor"] = r.factor;
      if (r.attention_factor) y["attention_factor"] = *r.attention_factor;
      return y;
    }
  }
  return nullptr;
}


json rope_parameters_json(const ModelConfig& c) {
  json p = rope_scaling_json(c.rope_scaling, c.yarn_factor(), c.yarn_original_length());
  if (p.is_null()) p = {{"rope_type", "default"}};
  p["rope_theta"] = c.rope_theta;
  return p;
}

json layer_types_json(const ModelConfig& c) {
  json types = json::array();
  for (const TokenMixerKind t : c.layer_types) types.push_back(layer_type_name(t));
  return types;
}

void write_full_layer_types(const ModelConfig& c, json& j) {
  if (c.sliding_window) return;
  j["layer_types"] = json(std::vector<std::string_view>(static_cast<std::size_t>(c.num_hidden_layers),
                                                        layer_type_name(TokenMixerKind::full_attention)));
}

void refuse_dropout(const json& j, std::string_view src, std::initializer_list<const char*> keys) {
  for (const char* key : keys)
    MT_CHECK(get_double(j, key, src, 0.0) == 0.0,
             "{}: '{}' is {}, but megatrain trains without dropout; set it to 0.0 to train this model", src, key,
             get_double(j, key, src, 0.0));
}

// Qwen2Config and MistralConfig (and Phi3Config) have no attention_bias or mlp_bias: transformers
// keeps such a key as an unused attribute and builds the projections from the architecture alone.
// A `true` there describes a model transformers does not build (Llama's attention_bias also covers
// o_proj), whose bias tensors it would drop on load, so it is refused. A `false` changes nothing
// in transformers and is accepted.
void refuse_bias_keys(const json& j, std::string_view src, std::string_view family, std::string_view what_it_has) {
  for (const char* key : {"attention_bias", "mlp_bias"})
    MT_CHECK(!get_bool(j, key, src, false),
             "{}: '{}' is true, but {} has no such option (transformers ignores it: {}); remove the field, or use "
             "LlamaForCausalLM for a model with these biases", src, key, family, what_it_has);
}

void refuse_mlp_bias(const json& j, std::string_view src, std::string_view family) {
  MT_CHECK(!get_bool(j, "mlp_bias", src, false),
           "{}: 'mlp_bias' is true, but {} has no such option (transformers ignores it: its MLP never has a bias); "
           "remove the field", src, family);
}

void check_attention_bias_only(const ModelConfig& c, std::string_view src) {
  MT_CHECK(c.qkv_bias == c.o_bias && !c.mlp_bias, "{}: {}'s one attention_bias sets q/k/v and o_proj biases alike and "
           "its MLP has none (got qkv_bias {}, o_bias {}, mlp_bias {})", src, c.architecture_name(), c.qkv_bias,
           c.o_bias, c.mlp_bias);
}

void check_no_bias(const ModelConfig& c, std::string_view src) {
  MT_CHECK(!c.qkv_bias && !c.o_bias && !c.mlp_bias, "{}: {} has no biases (got qkv_bias {}, o_bias {}, mlp_bias {})",
           src, c.architecture_name(), c.qkv_bias, c.o_bias, c.mlp_bias);
}

void check_llama_biases(const ModelConfig& c, std::string_view src) {
  MT_CHECK(c.qkv_bias == c.o_bias, "{}: qkv_bias ({}) and o_bias ({}) must agree for {}: its one attention_bias sets "
           "both", src, c.qkv_bias, c.o_bias, c.architecture_name());
}

void parse_moe(const json& j, std::string_view src, ModelConfig& c, const MoeDefaults& d) {
  MoeConfig& m = c.moe;
  refuse_dropout(j, src, {"attention_dropout"});
  // (transformers 5 writes the count as num_local_experts for Qwen3-MoE and Mixtral and as
  // num_experts for OLMoE, and reads either name for each; the Hub's Qwen3-MoE configs say num_experts)
  m.num_experts = given(j, "num_local_experts") ? get_int(j, "num_local_experts", src)
                  : given(j, "num_experts")     ? get_int(j, "num_experts", src)
                                                : d.num_experts;
  if (given(j, "num_local_experts") && given(j, "num_experts"))
    MT_CHECK(get_int(j, "num_experts", src) == m.num_experts,
             "{}: num_experts ({}) and num_local_experts ({}) name the same count and disagree", src,
             get_int(j, "num_experts", src), m.num_experts);
  m.experts_per_token = get_int(j, "num_experts_per_tok", src, d.experts_per_token);
  m.intermediate_size = d.expert_size_key ? get_int(j, d.expert_size_key, src, d.expert_size) : c.intermediate_size;
  m.norm_topk_prob = !d.reads_norm_topk_prob || get_bool(j, "norm_topk_prob", src, d.norm_topk_prob);
  m.router_aux_loss_coef = get_double(j, "router_aux_loss_coef", src, d.router_aux_loss_coef);
  m.biases = family(c.architecture).block.moe_biases;
  MT_CHECK(m.num_experts > 0 && m.num_experts <= (1 << 16),
           "{}: num_experts must be in [1, 65536] (got {})", src, m.num_experts);
  MT_CHECK(m.experts_per_token > 0 && m.experts_per_token <= m.num_experts,
           "{}: num_experts_per_tok must be in [1, {}] (the experts there are; got {})", src, m.num_experts,
           m.experts_per_token);
  m.output_router_logits = get_bool(j, "output_router_logits", src, false);
  MT_CHECK(std::isfinite(m.router_aux_loss_coef) && m.router_aux_loss_coef >= 0,
           "{}: router_aux_loss_coef must be a finite number >= 0 (got {})", src, m.router_aux_loss_coef);
}

void parse_dense_layers(const json& j, std::string_view src, ModelConfig& c) {
  MoeConfig& m = c.moe;
  m.decoder_sparse_step = get_int(j, "decoder_sparse_step", src, 1);
  MT_CHECK(m.decoder_sparse_step >= 1, "{}: decoder_sparse_step must be >= 1 (got {})", src, m.decoder_sparse_step);
  if (!given(j, "mlp_only_layers")) return;
  const json& ml = j.at("mlp_only_layers");
  MT_CHECK(ml.is_array(), "{}: mlp_only_layers must be a list of layer indices, not {}", src, ml.dump());
  for (const auto& v : ml) {
    MT_CHECK(v.is_number_integer() && v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() < c.num_hidden_layers,
             "{}: mlp_only_layers holds {}; each entry must be a layer index in [0, {})", src, v.dump(),
             c.num_hidden_layers);
    m.dense_layers.push_back(v.get<std::int64_t>());
  }
  std::sort(m.dense_layers.begin(), m.dense_layers.end());
  m.dense_layers.erase(std::unique(m.dense_layers.begin(), m.dense_layers.end()), m.dense_layers.end());
}

void write_moe(const ModelConfig& c, json& j, bool writes_norm_topk_prob) {
  j["num_experts"] = c.moe.num_experts;  // (both names: transformers 5 reads either, 4 only its family's)
  j["num_local_experts"] = c.moe.num_experts;
  j["num_experts_per_tok"] = c.moe.experts_per_token;
  j["output_router_logits"] = c.moe.output_router_logits;
  j["router_aux_loss_coef"] = c.moe.router_aux_loss_coef;
  if (writes_norm_topk_prob) j["norm_topk_prob"] = c.moe.norm_topk_prob;
}

void check_moe(const ModelConfig& c, std::string_view src, bool dense_layers) {
  const MoeConfig& m = c.moe;
  MT_CHECK(m.num_experts > 0 && m.num_experts <= (1 << 16) && m.experts_per_token > 0 &&
               m.experts_per_token <= m.num_experts && m.intermediate_size > 0 && m.decoder_sparse_step >= 1,
           "{}: {} needs 1 <= num_experts_per_tok ({}) <= num_experts ({}) <= 65536, an expert intermediate size > 0 "
           "({}) and decoder_sparse_step >= 1 ({})", src, c.architecture_name(), m.experts_per_token, m.num_experts,
           m.intermediate_size, m.decoder_sparse_step);
  for (const auto l : m.dense_layers)
    MT_CHECK(l >= 0 && l < c.num_hidden_layers, "{}: dense layer {} is not a layer [0, {})", src, l, c.num_hidden_layers);
  MT_CHECK(dense_layers || (m.dense_layers.empty() && m.decoder_sparse_step == 1),
           "{}: {} has no dense layers (mlp_only_layers, decoder_sparse_step): every layer is a mixture of experts", src,
           c.architecture_name());
}

}  // namespace megatrain::model_families
