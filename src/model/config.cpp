#include "megatrain/model/config.hpp"

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <numbers>
#include <sstream>

#include <fmt/format.h>

#include "megatrain/core/checked.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain {

namespace {

using json = nlohmann::json;

std::string type_name(const json& v) { return v.type_name(); }

std::int64_t get_int(const json& j, const char* key, std::string_view src, std::optional<std::int64_t> def = {}) {
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

double get_double(const json& j, const char* key, std::string_view src, std::optional<double> def = {}) {
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

// The families, one entry each: what transformers calls them, the context its config class
// defaults to, and the parts that set one apart (biases are parsed per family in from_json).
struct ArchInfo {
  Architecture arch;
  const char* class_name;
  const char* model_type;
  std::int64_t default_max_position_embeddings;
  bool qk_norm;            ///< q_norm and k_norm: RMSNorm of each head before the rotation
  bool fused_projections;  ///< qkv_proj and gate_up_proj in the checkpoint
  bool unit_offset_norms;  ///< every norm multiplies by (1 + w) (Gemma)
  bool sandwich_norms;     ///< the attention's and the MLP's outputs normalised too (Gemma 3)
  bool scaled_embedding;   ///< the embedding's output times sqrt(hidden_size) (Gemma)
  bool qk_norm_full;       ///< q_norm and k_norm over the whole projection, not per head (OLMoE)
  bool moe;                ///< sparse mixture-of-experts MLPs (MoeConfig)
  bool attention_sinks;    ///< a learned sink logit per attention head (GPT-OSS)
};
constexpr ArchInfo kArchs[] = {
    {Architecture::llama, "LlamaForCausalLM", "llama", 2048, false, false, false, false, false, false, false, false},
    {Architecture::mistral, "MistralForCausalLM", "mistral", 131072, false, false, false, false, false, false, false, false},
    {Architecture::qwen2, "Qwen2ForCausalLM", "qwen2", 32768, false, false, false, false, false, false, false, false},
    {Architecture::qwen3, "Qwen3ForCausalLM", "qwen3", 32768, true, false, false, false, false, false, false, false},
    {Architecture::phi3, "Phi3ForCausalLM", "phi3", 4096, false, true, false, false, false, false, false, false},
    {Architecture::gemma3, "Gemma3ForCausalLM", "gemma3_text", 131072, true, false, true, true, true, false, false, false},
    {Architecture::qwen3_moe, "Qwen3MoeForCausalLM", "qwen3_moe", 32768, true, false, false, false, false, false, true, false},
    {Architecture::mixtral, "MixtralForCausalLM", "mixtral", 131072, false, false, false, false, false, false, true, false},
    {Architecture::olmoe, "OlmoeForCausalLM", "olmoe", 4096, true, false, false, false, false, true, true, false},
    // (GPT-OSS: its experts' tensors are stacked and fused in the checkpoint, io::fused_tensors)
    {Architecture::gpt_oss, "GptOssForCausalLM", "gpt_oss", 131072, false, false, false, false, false, false, true, true},
};
const ArchInfo& arch_info(Architecture a) {
  for (const auto& info : kArchs)
    if (info.arch == a) return info;
  MT_FAIL("unknown architecture {}", static_cast<int>(a));
}
std::string supported_list(bool model_types) {
  std::string s;
  for (const auto& info : kArchs) s += fmt::format("{}{}", s.empty() ? "" : ", ", model_types ? info.model_type : info.class_name);
  return s;
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

/// Hugging Face's rope_scaling object for `r` (null for none); yarn's factor and original length
/// as resolved by the config.
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

// layer_types (Gemma 3, GPT-OSS): which layers attend within sliding_window ("sliding_attention")
// and which over the whole sequence ("full_attention"); `sliding_default(i)` where it is absent.
template <class F>
void parse_layer_types(const json& j, std::string_view src, ModelConfig& c, F sliding_default) {
  c.sliding_layers.assign(static_cast<std::size_t>(std::max<std::int64_t>(c.num_hidden_layers, 0)), false);
  if (j.contains("layer_types") && !j.at("layer_types").is_null()) {
    const json& lt = j.at("layer_types");
    MT_CHECK(lt.is_array() && static_cast<std::int64_t>(lt.size()) == c.num_hidden_layers,
             "{}: layer_types must list one type per layer ({}), not {}", src, c.num_hidden_layers, lt.dump());
    for (std::size_t i = 0; i < lt.size(); ++i) {
      MT_CHECK(lt[i].is_string() && (lt[i] == "full_attention" || lt[i] == "sliding_attention"),
               "{}: layer_types holds {}; each entry must be \"full_attention\" or \"sliding_attention\"", src,
               lt[i].dump());
      c.sliding_layers[i] = lt[i] == "sliding_attention";
    }
  } else {
    for (std::size_t i = 0; i < c.sliding_layers.size(); ++i) c.sliding_layers[i] = sliding_default(static_cast<std::int64_t>(i));
  }
}

// GptOssConfig's own fields (transformers 5.17; the defaults are its defaults): sliding and full
// layers (layer_types, else every other layer slides, the first included), a window of 128, yarn
// rotary scaling by default (factor 32 over 4096 positions, untruncated ramp) with rope_theta
// 150000, the experts' clamped SwiGLU. The published checkpoints' quantization_config (MXFP4
// experts) is read by io::HfCheckpoint, which dequantizes them; another method is refused.
void parse_gpt_oss(const json& j, std::string_view src, ModelConfig& c) {
  if (j.contains("sliding_window") && !j.at("sliding_window").is_null()) {
    c.sliding_window = get_int(j, "sliding_window", src);
  } else if (!j.contains("sliding_window")) {
    c.sliding_window = 128;
  }
  parse_layer_types(j, src, c, [](std::int64_t i) { return (i + 1) % 2 != 0; });
  if (!c.sliding_window) std::fill(c.sliding_layers.begin(), c.sliding_layers.end(), false);  // (null: no window)
  const auto given = [&](const json& o, const char* key) { return o.contains(key) && !o.at(key).is_null(); };
  const bool rope_params = given(j, "rope_parameters") && j.at("rope_parameters").is_object();
  if (!given(j, "rope_theta") && !(rope_params && given(j.at("rope_parameters"), "rope_theta"))) c.rope_theta = 150000.0;
  if (!given(j, "rope_scaling") && !(rope_params && given(j.at("rope_parameters"), "rope_type"))) {
    c.rope_scaling = RopeScaling{};
    c.rope_scaling.type = RopeScaling::Type::yarn;
    c.rope_scaling.factor = 32.0;
    c.rope_scaling.original_max_position_embeddings = 4096;
    c.rope_scaling.truncate = false;
  }
  if (given(j, "swiglu_limit"))
    MT_CHECK(get_double(j, "swiglu_limit", src) == kClampedSwigluLimit,
             "{}: swiglu_limit is {}, but transformers' GptOssExperts clamps at {} whatever the config says; megatrain "
             "trains the model transformers runs, so set it to {}", src, get_double(j, "swiglu_limit", src),
             kClampedSwigluLimit, kClampedSwigluLimit);
  if (given(j, "quantization_config")) {
    const json& q = j.at("quantization_config");
    const bool mxfp4 = q.is_object() && q.contains("quant_method") && q.at("quant_method") == "mxfp4";
    MT_CHECK(mxfp4, "{}: quantization_config {} is not supported; megatrain reads GPT-OSS's MXFP4 experts (quant_method "
             "\"mxfp4\", dequantized at load) or unquantized weights", src, q.dump());
  }
}

// The mixture-of-experts families' fields (Qwen3MoeConfig, MixtralConfig, OlmoeConfig of
// transformers 5.17; the defaults are theirs). Their attention is Qwen3's (per-head q/k norms,
// attention_bias), Mistral's (no bias, a window where sliding_window is set) and OLMoE's (q/k
// norms over the whole projections, attention_bias). output_router_logits: the auxiliary
// load-balancing loss, times router_aux_loss_coef, is added to the training loss as transformers
// adds it. What megatrain does not train the way transformers does is refused by name: Mixtral's
// router jitter (random), OLMoE's clip_qkv.
void parse_moe(const json& j, std::string_view src, ModelConfig& c) {
  MoeConfig& m = c.moe;
  const bool mixtral = c.architecture == Architecture::mixtral, qwen = c.architecture == Architecture::qwen3_moe;
  const bool gpt = c.architecture == Architecture::gpt_oss;
  MT_CHECK(!get_bool(j, "mlp_bias", src, false), "{}: 'mlp_bias' is true, but {} has no such option (its experts have no "
           "bias); remove the field", src, c.architecture_name());
  if (mixtral) {
    MT_CHECK(!get_bool(j, "attention_bias", src, false), "{}: 'attention_bias' is true, but MixtralForCausalLM has no "
             "such option (its attention has no bias); remove the field", src);
    // (MixtralConfig's sliding_window defaults to None, unlike Mistral's)
    if (j.contains("sliding_window") && !j.at("sliding_window").is_null()) c.sliding_window = get_int(j, "sliding_window", src);
  } else {
    c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, gpt);  // (GptOssConfig defaults it to true)
  }
  if (gpt) parse_gpt_oss(j, src, c);
  if (qwen && get_bool(j, "use_sliding_window", src, false)) c.sliding_window = get_int(j, "sliding_window", src, 4096);
  MT_CHECK(get_double(j, "attention_dropout", src, 0.0) == 0.0,
           "{}: 'attention_dropout' is {}, but megatrain trains without dropout; set it to 0.0 to train this model", src,
           get_double(j, "attention_dropout", src, 0.0));
  // (transformers 5 writes the count as num_local_experts for Qwen3-MoE and Mixtral and as
  // num_experts for OLMoE, and reads either name for each; the Hub's Qwen3-MoE configs say num_experts)
  const auto given = [&](const char* key) { return j.contains(key) && !j.at(key).is_null(); };
  m.num_experts = given("num_local_experts") ? get_int(j, "num_local_experts", src)
                  : given("num_experts")     ? get_int(j, "num_experts", src)
                                             : (mixtral ? 8 : qwen || gpt ? 128 : 64);
  if (given("num_local_experts") && given("num_experts"))
    MT_CHECK(get_int(j, "num_experts", src) == m.num_experts,
             "{}: num_experts ({}) and num_local_experts ({}) name the same count and disagree", src,
             get_int(j, "num_experts", src), m.num_experts);
  m.experts_per_token = get_int(j, "num_experts_per_tok", src, mixtral ? 2 : gpt ? 4 : 8);
  m.intermediate_size = qwen ? get_int(j, "moe_intermediate_size", src, 768) : c.intermediate_size;
  // (GPT-OSS: the softmax of the top-k logits, which is the renormalised top-k of the softmax)
  m.norm_topk_prob = mixtral || gpt || get_bool(j, "norm_topk_prob", src, false);
  m.router_aux_loss_coef = get_double(j, "router_aux_loss_coef", src, mixtral || qwen || gpt ? 0.001 : 0.01);
  m.biases = gpt;
  MT_CHECK(m.num_experts > 0 && m.num_experts <= (1 << 16),
           "{}: num_experts must be in [1, 65536] (got {})", src, m.num_experts);
  MT_CHECK(m.experts_per_token > 0 && m.experts_per_token <= m.num_experts,
           "{}: num_experts_per_tok must be in [1, {}] (the experts there are; got {})", src, m.num_experts,
           m.experts_per_token);
  m.output_router_logits = get_bool(j, "output_router_logits", src, false);
  MT_CHECK(std::isfinite(m.router_aux_loss_coef) && m.router_aux_loss_coef >= 0,
           "{}: router_aux_loss_coef must be a finite number >= 0 (got {})", src, m.router_aux_loss_coef);
  if (mixtral)
    MT_CHECK(get_double(j, "router_jitter_noise", src, 0.0) == 0.0,
             "{}: router_jitter_noise is {}: Mixtral's router then multiplies its input by random noise while training, "
             "which megatrain does not; set it to 0.0", src, get_double(j, "router_jitter_noise", src, 0.0));
  if (c.architecture == Architecture::olmoe)
    MT_CHECK(!j.contains("clip_qkv") || j.at("clip_qkv").is_null(),
             "{}: clip_qkv is {}: clamping the q, k and v projections is not supported; OLMoE's published models have "
             "it null", src, j.contains("clip_qkv") ? j.at("clip_qkv").dump() : "");
  if (qwen) {
    m.decoder_sparse_step = get_int(j, "decoder_sparse_step", src, 1);
    MT_CHECK(m.decoder_sparse_step >= 1, "{}: decoder_sparse_step must be >= 1 (got {})", src, m.decoder_sparse_step);
    if (j.contains("mlp_only_layers") && !j.at("mlp_only_layers").is_null()) {
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
  }
}

// Gemma3TextConfig's fields (transformers 5.17; the defaults are its defaults). Softcapping and
// bidirectional attention (Gemma 2, the embedding variants) are refused by name rather than
// trained differently.
void parse_gemma3(const json& j, std::string_view src, ModelConfig& c) {
  MT_CHECK(!get_bool(j, "mlp_bias", src, false),
           "{}: 'mlp_bias' is true, but Gemma3ForCausalLM has no such option (transformers ignores it: its MLP never "
           "has a bias); remove the field", src);
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  MT_CHECK(get_double(j, "attention_dropout", src, 0.0) == 0.0,
           "{}: 'attention_dropout' is {}, but megatrain trains without dropout; set it to 0.0 to train this model", src,
           get_double(j, "attention_dropout", src, 0.0));
  for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"})
    MT_CHECK(!j.contains(key) || j.at(key).is_null(),
             "{}: '{}' is {}; softcapping (Gemma 2) is not supported, and Gemma 3 has none (null)", src, key,
             j.at(key).dump());
  MT_CHECK(!get_bool(j, "use_bidirectional_attention", src, false),
           "{}: 'use_bidirectional_attention' is true (an embedding model); megatrain trains causal decoders only", src);
  std::string act = "gelu_pytorch_tanh";
  if (j.contains("hidden_activation") && !j.at("hidden_activation").is_null()) {
    const json& a = j.at("hidden_activation");
    MT_CHECK(a.is_string(), "{}: field 'hidden_activation' must be a string, not {}", src, a.dump());
    act = a.get<std::string>();
  }
  MT_CHECK(act == "gelu_pytorch_tanh", "{}: hidden_activation \"{}\" is not supported (Gemma 3 uses \"gelu_pytorch_tanh\")",
           src, act);
  c.hidden_act = Activation::gelu_tanh;
  c.query_pre_attn_scalar = get_double(j, "query_pre_attn_scalar", src, 256.0);
  MT_CHECK(std::isfinite(*c.query_pre_attn_scalar) && *c.query_pre_attn_scalar > 0,
           "{}: query_pre_attn_scalar must be > 0 (got {})", src, *c.query_pre_attn_scalar);
  c.sliding_window = get_int(j, "sliding_window", src, 4096);
  // Which layers slide: layer_types, else every sliding_window_pattern-th layer is full
  const std::int64_t pattern = get_int(j, "sliding_window_pattern", src, 6);
  MT_CHECK(pattern > 0, "{}: sliding_window_pattern must be > 0 (got {})", src, pattern);
  parse_layer_types(j, src, c, [&](std::int64_t i) { return (i + 1) % pattern != 0; });
  // Rotary: transformers 5 writes rope_parameters per layer type; transformers 4's configs (those
  // on the Hub) keep rope_theta and rope_scaling for the full layers and rope_local_base_freq for
  // the sliding ones (unscaled), which transformers 5 reads the same way.
  const json* rp = j.contains("rope_parameters") && j.at("rope_parameters").is_object() ? &j.at("rope_parameters") : nullptr;
  if (rp != nullptr && (rp->contains("full_attention") || rp->contains("sliding_attention"))) {
    const auto one = [&](const char* type, double theta_default, double& theta, RopeScaling& scaling) {
      theta = theta_default;
      scaling = RopeScaling{};
      if (!rp->contains(type) || rp->at(type).is_null()) return;
      const json& r = rp->at(type);
      const std::string where = fmt::format("{} (rope_parameters.{})", src, type);
      MT_CHECK(r.is_object(), "{}: must be an object, not {}", where, r.dump());
      theta = get_double(r, "rope_theta", where, theta_default);
      scaling = parse_rope_scaling(r, where);
    };
    one("full_attention", 1000000.0, c.rope_theta, c.rope_scaling);
    one("sliding_attention", 10000.0, c.local_rope_theta, c.local_rope_scaling);
  } else {
    c.rope_theta = get_double(j, "rope_theta", src, 1000000.0);
    c.local_rope_theta = get_double(j, "rope_local_base_freq", src, 10000.0);
    c.local_rope_scaling = RopeScaling{};
  }
  for (const RopeScaling* r : {&c.rope_scaling, &c.local_rope_scaling})
    MT_CHECK(r->type != RopeScaling::Type::longrope, "{}: longrope rotary scaling on Gemma 3 is not supported", src);
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, std::string_view src) {
  MT_NVTX_RANGE("ModelConfig::from_json");
  MT_CHECK(j.is_object(), "{}: a model config must be a JSON object, not {}", src, type_name(j));
  ModelConfig c;
  // Architecture: the first entry of "architectures", else "model_type".
  std::string arch_name;
  if (j.contains("architectures") && !j.at("architectures").is_null()) {
    const json& a = j.at("architectures");
    MT_CHECK(a.is_array() && !a.empty() && a.at(0).is_string(),
             "{}: 'architectures' must be a non-empty list of names, not {}", src, a.dump());
    arch_name = a.at(0).get<std::string>();
    const ArchInfo* found = nullptr;
    for (const auto& info : kArchs)
      if (arch_name == info.class_name) found = &info;
    MT_CHECK(arch_name != "Gemma3ForConditionalGeneration",
             "{}: architecture 'Gemma3ForConditionalGeneration' (Gemma 3 with its vision tower, 4B and larger) is not "
             "supported; megatrain trains Gemma 3's text models (Gemma3ForCausalLM, e.g. gemma-3-1b)", src);
    MT_CHECK(found != nullptr, "{}: architecture '{}' is not supported (supported: {})", src, arch_name,
             supported_list(false));
    c.architecture = found->arch;
    // transformers picks the config class by model_type and other loaders (vLLM, ...) pick the
    // model class by architectures: when both are given they must name the same model.
    if (j.contains("model_type") && !j.at("model_type").is_null()) {
      const json& mt = j.at("model_type");
      MT_CHECK(mt.is_string(), "{}: field 'model_type' must be a string, not {} ({})", src, type_name(mt), mt.dump());
      MT_CHECK(mt.get<std::string>() == found->model_type,
               "{}: 'architectures' and 'model_type' disagree: architectures names {}, whose model_type is '{}', "
               "but model_type is '{}'", src, arch_name, found->model_type, mt.get<std::string>());
    }
  } else {
    MT_CHECK(j.contains("model_type") && j.at("model_type").is_string(),
             "{}: neither 'architectures' nor 'model_type' says what model this is", src);
    arch_name = j.at("model_type").get<std::string>();
    const ArchInfo* found = nullptr;
    for (const auto& info : kArchs)
      if (arch_name == info.model_type) found = &info;
    MT_CHECK(found != nullptr, "{}: model_type '{}' is not supported (supported: {})", src, arch_name, supported_list(true));
    c.architecture = found->arch;
  }
  // (Gemma 3 names its activation hidden_activation, parsed below; transformers ignores a
  // hidden_act key there)
  if (c.architecture != Architecture::gemma3 && j.contains("hidden_act") && !j.at("hidden_act").is_null()) {
    const json& act = j.at("hidden_act");
    MT_CHECK(act.is_string() && act.get<std::string>() == "silu",
             "{}: hidden_act {} is not supported (these architectures use \"silu\")", src, act.dump());
  }

  c.hidden_size = get_int(j, "hidden_size", src);
  c.intermediate_size = get_int(j, "intermediate_size", src);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", src);
  // (bounded first: the per-layer tables below are sized by it)
  MT_CHECK(c.num_hidden_layers > 0, "{}: num_hidden_layers must be > 0 (got {})", src, c.num_hidden_layers);
  MT_CHECK(c.num_hidden_layers <= kMaxLayers, "{}: num_hidden_layers {} is beyond any model (at most {})", src,
           c.num_hidden_layers, kMaxLayers);
  c.num_attention_heads = get_int(j, "num_attention_heads", src);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", src, c.num_attention_heads);
  c.vocab_size = get_int(j, "vocab_size", src);
  MT_CHECK(c.num_attention_heads > 0, "{}: num_attention_heads must be > 0 (got {})", src, c.num_attention_heads);
  if (j.contains("head_dim") && !j.at("head_dim").is_null()) {
    c.head_dim = get_int(j, "head_dim", src);
  } else {
    MT_CHECK(c.hidden_size % c.num_attention_heads == 0,
             "{}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given", src,
             c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings =
      get_int(j, "max_position_embeddings", src, arch_info(c.architecture).default_max_position_embeddings);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", src, 1e-6);
  c.initializer_range = get_double(j, "initializer_range", src, 0.02);
  // (Gemma3TextConfig defaults to tied embeddings and pad_token_id 0)
  const bool gemma3 = c.architecture == Architecture::gemma3;
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, gemma3);
  if (gemma3 && !j.contains("pad_token_id")) c.pad_token_id = 0;
  if (c.architecture == Architecture::olmoe && !j.contains("pad_token_id")) c.pad_token_id = 1;  // (OlmoeConfig's default)
  if (j.contains("pad_token_id") && !j.at("pad_token_id").is_null()) {
    c.pad_token_id = get_int(j, "pad_token_id", src);
    // nn.Embedding counts a negative padding_idx from the end of the table (old Llama configs say -1)
    if (*c.pad_token_id < 0 && *c.pad_token_id >= -c.vocab_size) *c.pad_token_id += c.vocab_size;
  }

  // Rotary: transformers 4 keeps rope_theta and rope_scaling at the top level; transformers 5
  // may put both into rope_parameters.
  c.rope_theta = get_double(j, "rope_theta", src, 10000.0);
  if (j.contains("rope_parameters") && !j.at("rope_parameters").is_null()) {
    const json& rp = j.at("rope_parameters");
    MT_CHECK(rp.is_object(), "{}: rope_parameters must be an object", src);
    if (rp.contains("rope_theta")) c.rope_theta = get_double(rp, "rope_theta", src);
    c.rope_scaling = parse_rope_scaling(rp, src);
  }
  if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null())
    c.rope_scaling = parse_rope_scaling(j.at("rope_scaling"), src);
  // Rotary over part of each head (Phi-4-mini): transformers 4 keeps partial_rotary_factor at the
  // top level, transformers 5 in rope_parameters too; its rope functions read it for every family
  {
    const bool in_rope = j.contains("rope_parameters") && j.at("rope_parameters").is_object() &&
                         j.at("rope_parameters").contains("partial_rotary_factor");
    c.partial_rotary_factor = in_rope ? get_double(j.at("rope_parameters"), "partial_rotary_factor", src, 1.0)
                                      : get_double(j, "partial_rotary_factor", src, 1.0);
  }
  // longrope's original context: in its parameters, else the top-level field Phi3Config keeps
  if (c.rope_scaling.type == RopeScaling::Type::longrope && c.rope_scaling.original_max_position_embeddings == 0) {
    MT_CHECK(j.contains("original_max_position_embeddings"),
             "{}: longrope scaling needs original_max_position_embeddings (in the rope parameters or at the top level)", src);
    c.rope_scaling.original_max_position_embeddings = get_int(j, "original_max_position_embeddings", src);
  }

  // Qwen2Config and MistralConfig have no attention_bias or mlp_bias: transformers keeps such a
  // key as an unused attribute and builds the projections from the architecture alone (Qwen2:
  // q/k/v biases, no o_proj or MLP bias; Mistral: no bias at all). A `true` there describes a
  // model transformers does not build (Llama's attention_bias also covers o_proj), whose bias
  // tensors it would drop on load, so it is refused. A `false` changes nothing in transformers
  // and is accepted (Qwen2's q/k/v biases stay).
  auto refuse_bias_keys = [&](std::string_view what_it_has) {
    for (const char* key : {"attention_bias", "mlp_bias"})
      MT_CHECK(!get_bool(j, key, src, false),
               "{}: '{}' is true, but {} has no such option (transformers ignores it: {}); remove the field, or "
               "use LlamaForCausalLM for a model with these biases",
               src, key, c.architecture_name(), what_it_has);
  };
  switch (c.architecture) {
    case Architecture::llama:
      c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
      c.mlp_bias = get_bool(j, "mlp_bias", src, false);
      break;
    case Architecture::qwen2:
      refuse_bias_keys("its q/k/v projections always have a bias, its o_proj and MLP never do");
      c.qkv_bias = true;  // Qwen2's q/k/v projections always carry a bias; o_proj never does
      if (get_bool(j, "use_sliding_window", src, false)) c.sliding_window = get_int(j, "sliding_window", src);
      break;
    case Architecture::qwen3: {
      // Qwen3Config: one attention_bias for q, k, v and o (as Llama's); its MLP has no bias.
      MT_CHECK(!get_bool(j, "mlp_bias", src, false),
               "{}: 'mlp_bias' is true, but Qwen3ForCausalLM has no such option (transformers ignores it: its MLP "
               "never has a bias); remove the field", src);
      c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
      // Sliding-window layers (use_sliding_window, or "sliding_attention" in layer_types): the
      // window bounds the sequence length (check_sequence_length), where every layer is exact.
      bool sliding = get_bool(j, "use_sliding_window", src, false);
      if (j.contains("layer_types") && !j.at("layer_types").is_null()) {
        const json& lt = j.at("layer_types");
        MT_CHECK(lt.is_array() && static_cast<std::int64_t>(lt.size()) == c.num_hidden_layers,
                 "{}: layer_types must list one type per layer ({}), not {}", src, c.num_hidden_layers, lt.dump());
        for (const auto& t : lt) {
          MT_CHECK(t.is_string() && (t == "full_attention" || t == "sliding_attention"),
                   "{}: layer_types holds {}; each entry must be \"full_attention\" or \"sliding_attention\"", src, t.dump());
          sliding = sliding || t == "sliding_attention";
        }
      }
      if (sliding) c.sliding_window = get_int(j, "sliding_window", src);
      break;
    }
    case Architecture::phi3: {
      // Phi3Config: no bias anywhere; dropouts that megatrain does not apply must be 0 (every
      // published Phi-3 and Phi-4 has them at 0); rotary over a whole head.
      refuse_bias_keys("it has no bias in attention or MLP");
      for (const char* key : {"resid_pdrop", "embd_pdrop", "attention_dropout"})
        MT_CHECK(get_double(j, key, src, 0.0) == 0.0,
                 "{}: '{}' is {}, but megatrain trains without dropout; set it to 0.0 to train this model", src, key,
                 get_double(j, key, src, 0.0));
      if (j.contains("sliding_window") && !j.at("sliding_window").is_null())
        c.sliding_window = get_int(j, "sliding_window", src);
      break;
    }
    case Architecture::gemma3:
      parse_gemma3(j, src, c);
      break;
    case Architecture::qwen3_moe:
    case Architecture::mixtral:
    case Architecture::olmoe:
    case Architecture::gpt_oss:
      parse_moe(j, src, c);
      break;
    case Architecture::mistral:
      refuse_bias_keys("it has no bias in attention or MLP");
      // transformers' MistralConfig defaults sliding_window to 4096 when the key is absent;
      // an explicit null (v0.2 and later) means full attention.
      if (!j.contains("sliding_window")) c.sliding_window = 4096;
      else if (!j.at("sliding_window").is_null()) c.sliding_window = get_int(j, "sliding_window", src);
      break;
  }
  c.validate(src);
  return c;
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& path) {
  MT_NVTX_RANGE("ModelConfig::from_file");
  // An ifstream opens a directory without complaint and then reads nothing ("malformed JSON").
  MT_CHECK(!std::filesystem::is_directory(path), "'{}' is a directory; give the path of the config.json in it",
           path.string());
  std::ifstream f(path);
  MT_CHECK(f.good(), "cannot open model config '{}'", path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  json j;
  try {
    j = json::parse(ss.str());
  } catch (const json::exception& e) {
    MT_FAIL("{}: malformed JSON: {}", path.string(), e.what());
  }
  return from_json(j, path.string());
}

void ModelConfig::validate(std::string_view src) const {
  auto positive = [&](std::int64_t v, const char* name) { MT_CHECK(v > 0, "{}: {} must be > 0 (got {})", src, name, v); };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  MT_CHECK(num_hidden_layers <= kMaxLayers, "{}: num_hidden_layers {} is beyond any model (at most {})", src,
           num_hidden_layers, kMaxLayers);
  MT_CHECK(head_dim <= kMaxHeadDim, "{}: head_dim {} is beyond any model (at most {})", src, head_dim, kMaxHeadDim);
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(vocab_size, "vocab_size");
  positive(max_position_embeddings, "max_position_embeddings");
  // Every size the model derives must fit in 64 bits (a hostile config.json could say 2^62).
  for (const auto& [v, name] : {std::pair{num_attention_heads, "num_attention_heads"}, {num_key_value_heads, "num_key_value_heads"}})
    MT_CHECK(v <= (std::int64_t{1} << 24) && head_dim <= (std::int64_t{1} << 24),
             "{}: {} {} with head_dim {} is beyond any model (at most 2^24 each)", src, name, v, head_dim);
  try {
    (void)param_count();
  } catch (const Error& e) {
    MT_FAIL("{}: hidden_size {}, intermediate_size {}, num_hidden_layers {} and vocab_size {} describe more parameters "
            "than fit in 64 bits ({})", src, hidden_size, intermediate_size, num_hidden_layers, vocab_size, e.what());
  }
  MT_CHECK(num_attention_heads % num_key_value_heads == 0,
           "{}: num_key_value_heads {} does not divide num_attention_heads {}", src, num_key_value_heads,
           num_attention_heads);
  MT_CHECK(head_dim % 2 == 0, "{}: head_dim must be even for rotary embeddings (got {})", src, head_dim);
  MT_CHECK(std::isfinite(partial_rotary_factor) && partial_rotary_factor > 0 && partial_rotary_factor <= 1 &&
               rotary_dim() >= 2 && rotary_dim() % 2 == 0,
           "{}: partial_rotary_factor {} must be in (0, 1] and turn an even number of each head's {} dimensions (it "
           "turns {})", src, partial_rotary_factor, head_dim, rotary_dim());
  MT_CHECK(architecture != Architecture::gemma3 || partial_rotary_factor == 1.0,
           "{}: partial_rotary_factor on Gemma 3 is not supported", src);
  MT_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0, "{}: rms_norm_eps must be > 0 (got {})", src, rms_norm_eps);
  MT_CHECK(std::isfinite(rope_theta) && rope_theta > 1, "{}: rope_theta must be > 1 (got {})", src, rope_theta);
  MT_CHECK(vocab_size <= (std::int64_t{1} << 31) - 1, "{}: vocab_size {} does not fit 32-bit token ids", src, vocab_size);
  MT_CHECK(!pad_token_id || (*pad_token_id >= 0 && *pad_token_id < vocab_size),
           "{}: pad_token_id {} is not a token of the vocabulary [0, {}) (transformers would not build this model's "
           "embedding either)", src, pad_token_id.value_or(0), vocab_size);
  MT_CHECK(!sliding_window || *sliding_window > 0, "{}: sliding_window must be > 0 (got {})", src, *sliding_window);
  MT_CHECK(rope_scaling.type != RopeScaling::Type::llama3 || rope_scaling.high_freq_factor > rope_scaling.low_freq_factor,
           "{}: llama3 rope scaling needs high_freq_factor > low_freq_factor", src);
  if (rope_scaling.type == RopeScaling::Type::longrope) {
    const auto half = static_cast<std::size_t>(rotary_dim() / 2);
    MT_CHECK(rope_scaling.short_factor.size() == half && rope_scaling.long_factor.size() == half,
             "{}: longrope's short_factor and long_factor must have rotary_dim / 2 = {} entries each (got {} and {})", src, half,
             rope_scaling.short_factor.size(), rope_scaling.long_factor.size());
    MT_CHECK(rope_scaling.original_max_position_embeddings > 0,
             "{}: longrope's original_max_position_embeddings must be > 0 (got {})", src,
             rope_scaling.original_max_position_embeddings);
  }
  MT_CHECK(!qk_norm_full() || q_dim() == hidden_size,
           "{}: OLMoE's q_norm spans hidden_size ({}), so num_attention_heads x head_dim must equal it (got {})", src,
           hidden_size, q_dim());
  MT_CHECK(architecture == Architecture::gemma3 ||
               ((sliding_layers.empty() || architecture == Architecture::gpt_oss) && hidden_act == Activation::silu &&
                !query_pre_attn_scalar),
           "{}: per-layer sliding windows (but GPT-OSS's), GeGLU and query_pre_attn_scalar are Gemma 3's; {} has none of "
           "them", src, architecture_name());
  MT_CHECK(sliding_layers.empty() || static_cast<std::int64_t>(sliding_layers.size()) == num_hidden_layers,
           "{}: {} layer types for {} layers", src, sliding_layers.size(), num_hidden_layers);
  MT_CHECK(moe.biases == (architecture == Architecture::gpt_oss), "{}: biased routers and experts are GPT-OSS's; {} has "
           "{}", src, architecture_name(), moe.biases ? "none" : "them");
  // The biases a config.json can describe (from_json above): anything else would not survive
  // to_json, nor load in transformers.
  switch (architecture) {
    case Architecture::llama:
      MT_CHECK(qkv_bias == o_bias, "{}: qkv_bias ({}) and o_bias ({}) must agree for LlamaForCausalLM: its one "
               "attention_bias sets both", src, qkv_bias, o_bias);
      break;
    case Architecture::qwen2:
      MT_CHECK(qkv_bias && !o_bias && !mlp_bias, "{}: Qwen2ForCausalLM has q/k/v biases and no o_proj or MLP bias "
               "(got qkv_bias {}, o_bias {}, mlp_bias {})", src, qkv_bias, o_bias, mlp_bias);
      break;
    case Architecture::mistral:
      MT_CHECK(!qkv_bias && !o_bias && !mlp_bias, "{}: MistralForCausalLM has no biases (got qkv_bias {}, o_bias {}, "
               "mlp_bias {})", src, qkv_bias, o_bias, mlp_bias);
      break;
    case Architecture::phi3:
      MT_CHECK(!qkv_bias && !o_bias && !mlp_bias, "{}: Phi3ForCausalLM has no biases (got qkv_bias {}, o_bias {}, "
               "mlp_bias {})", src, qkv_bias, o_bias, mlp_bias);
      break;
    case Architecture::gemma3:
      MT_CHECK(qkv_bias == o_bias && !mlp_bias, "{}: Gemma3ForCausalLM's one attention_bias sets q/k/v and o_proj "
               "biases alike and its MLP has none (got qkv_bias {}, o_bias {}, mlp_bias {})", src, qkv_bias, o_bias, mlp_bias);
      MT_CHECK(static_cast<std::int64_t>(sliding_layers.size()) == num_hidden_layers && sliding_window.has_value(),
               "{}: Gemma3ForCausalLM needs sliding_window and one layer type per layer ({} for {} layers)", src,
               sliding_layers.size(), num_hidden_layers);
      MT_CHECK(std::isfinite(local_rope_theta) && local_rope_theta > 1,
               "{}: the sliding layers' rope_theta must be > 1 (got {})", src, local_rope_theta);
      MT_CHECK(query_pre_attn_scalar.has_value() && *query_pre_attn_scalar > 0,
               "{}: Gemma3ForCausalLM needs query_pre_attn_scalar > 0", src);
      break;
    case Architecture::qwen3:
    case Architecture::qwen3_moe:
    case Architecture::olmoe:
    case Architecture::gpt_oss:
      MT_CHECK(qkv_bias == o_bias && !mlp_bias, "{}: {}'s one attention_bias sets q/k/v and o_proj biases alike and its "
               "MLP has none (got qkv_bias {}, o_bias {}, mlp_bias {})", src, architecture_name(), qkv_bias, o_bias, mlp_bias);
      break;
    case Architecture::mixtral:
      MT_CHECK(!qkv_bias && !o_bias && !mlp_bias, "{}: MixtralForCausalLM has no biases (got qkv_bias {}, o_bias {}, "
               "mlp_bias {})", src, qkv_bias, o_bias, mlp_bias);
      break;
  }
  if (arch_info(architecture).moe) {
    MT_CHECK(moe.num_experts > 0 && moe.num_experts <= (1 << 16) && moe.experts_per_token > 0 &&
                 moe.experts_per_token <= moe.num_experts && moe.intermediate_size > 0 && moe.decoder_sparse_step >= 1,
             "{}: {} needs 1 <= num_experts_per_tok ({}) <= num_experts ({}) <= 65536, an expert intermediate size > 0 "
             "({}) and decoder_sparse_step >= 1 ({})", src, architecture_name(), moe.experts_per_token, moe.num_experts,
             moe.intermediate_size, moe.decoder_sparse_step);
    for (const auto l : moe.dense_layers)
      MT_CHECK(l >= 0 && l < num_hidden_layers, "{}: dense layer {} is not a layer [0, {})", src, l, num_hidden_layers);
    MT_CHECK(architecture == Architecture::qwen3_moe || (moe.dense_layers.empty() && moe.decoder_sparse_step == 1),
             "{}: only Qwen3-MoE has dense layers (mlp_only_layers, decoder_sparse_step)", src);
    MT_CHECK(architecture == Architecture::qwen3_moe || architecture == Architecture::olmoe || moe.norm_topk_prob,
             "{}: {} always renormalises its top-k weights", src, architecture_name());
  } else {
    MT_CHECK(moe.num_experts == 0, "{}: {} has no experts (num_experts {})", src, architecture_name(), moe.num_experts);
  }
}

std::string_view ModelConfig::architecture_name() const { return arch_info(architecture).class_name; }
std::string_view ModelConfig::model_type() const { return arch_info(architecture).model_type; }
bool ModelConfig::qk_norm() const { return arch_info(architecture).qk_norm; }
bool ModelConfig::qk_norm_full() const { return arch_info(architecture).qk_norm_full; }
bool ModelConfig::attention_sinks() const { return arch_info(architecture).attention_sinks; }
Activation ModelConfig::expert_act() const {
  return architecture == Architecture::gpt_oss ? Activation::clamped_swiglu : hidden_act;
}
bool ModelConfig::is_moe_layer(std::int64_t layer) const {
  if (moe.num_experts == 0) return false;
  if (std::find(moe.dense_layers.begin(), moe.dense_layers.end(), layer) != moe.dense_layers.end()) return false;
  return (layer + 1) % moe.decoder_sparse_step == 0;
}
std::int64_t ModelConfig::moe_layer_count() const {
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < num_hidden_layers && moe.num_experts > 0; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}
std::string_view ModelConfig::moe_module() const {
  return architecture == Architecture::mixtral ? "block_sparse_moe" : "mlp";
}
bool ModelConfig::fused_projections() const { return arch_info(architecture).fused_projections; }
bool ModelConfig::norm_unit_offset() const { return arch_info(architecture).unit_offset_norms; }
bool ModelConfig::sandwich_norms() const { return arch_info(architecture).sandwich_norms; }
double ModelConfig::embed_scale() const {
  // transformers: the Python float hidden_size ** 0.5 made a float32 tensor
  return arch_info(architecture).scaled_embedding ? static_cast<double>(static_cast<float>(std::sqrt(static_cast<double>(hidden_size))))
                                                  : 1.0;
}
double ModelConfig::attention_scale() const {
  return 1.0 / std::sqrt(query_pre_attn_scalar ? *query_pre_attn_scalar : static_cast<double>(head_dim));
}
std::int64_t ModelConfig::attention_window(std::int64_t layer) const {
  const auto l = static_cast<std::size_t>(layer);
  return l < sliding_layers.size() && sliding_layers[l] ? sliding_window.value_or(0) : 0;
}
ModelConfig ModelConfig::rope_for_layer(std::int64_t layer) const {
  ModelConfig c = *this;
  if (architecture == Architecture::gemma3 && attention_window(layer) > 0) {  // (GPT-OSS's layers share theirs)
    c.rope_theta = local_rope_theta;
    c.rope_scaling = local_rope_scaling;
  }
  return c;
}

json ModelConfig::to_json() const {
  json j;
  j["architectures"] = {std::string(architecture_name())};
  j["model_type"] = std::string(model_type());
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  if (architecture == Architecture::gemma3) {
    // as transformers 5 writes it: the rotary parameters per layer type, the activation by its
    // own key, no top-level rope_theta
    j.erase("rope_theta");
    j.erase("hidden_act");
    const auto params = [&](double theta, const RopeScaling& r) {
      ModelConfig layer = *this;  // (yarn's factor and original length resolved for these parameters)
      layer.rope_scaling = r;
      json p = rope_scaling_json(r, layer.yarn_factor(), layer.yarn_original_length());
      if (p.is_null()) p = {{"rope_type", "default"}};
      p["rope_theta"] = theta;
      return p;
    };
    j["rope_parameters"] = {{"full_attention", params(rope_theta, rope_scaling)},
                            {"sliding_attention", params(local_rope_theta, local_rope_scaling)}};
    j["hidden_activation"] = "gelu_pytorch_tanh";
    j["query_pre_attn_scalar"] = *query_pre_attn_scalar;
    j["sliding_window"] = *sliding_window;
    json types = json::array();
    for (const bool sl : sliding_layers) types.push_back(sl ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["attention_bias"] = qkv_bias;
    j["final_logit_softcapping"] = nullptr;
    j["attn_logit_softcapping"] = nullptr;
    j["use_bidirectional_attention"] = false;
    return j;
  }
  j["rope_scaling"] = rope_scaling_json(rope_scaling, yarn_factor(), yarn_original_length());
  if (partial_rotary_factor != 1.0) j["partial_rotary_factor"] = partial_rotary_factor;
  if (rope_scaling.type == RopeScaling::Type::longrope)
    j["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
  if (architecture == Architecture::llama) {
    j["attention_bias"] = qkv_bias;
    j["mlp_bias"] = mlp_bias;
  }
  if (architecture == Architecture::qwen3 || architecture == Architecture::qwen3_moe || architecture == Architecture::olmoe ||
      architecture == Architecture::gpt_oss)
    j["attention_bias"] = qkv_bias;
  if (architecture == Architecture::gpt_oss) {
    // as transformers 5 writes it: the rotary parameters in rope_parameters, the layer types
    j.erase("rope_theta");
    j.erase("rope_scaling");
    json p = rope_scaling_json(rope_scaling, yarn_factor(), yarn_original_length());
    if (p.is_null()) p = {{"rope_type", "default"}};
    p["rope_theta"] = rope_theta;
    j["rope_parameters"] = p;
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
    json types = json::array();
    for (const bool sl : sliding_layers) types.push_back(sl ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["attention_dropout"] = 0.0;
  }
  if (arch_info(architecture).moe) {
    j["num_experts"] = moe.num_experts;  // (both names: transformers 5 reads either, 4 only its family's)
    j["num_local_experts"] = moe.num_experts;
    j["num_experts_per_tok"] = moe.experts_per_token;
    j["output_router_logits"] = moe.output_router_logits;
    j["router_aux_loss_coef"] = moe.router_aux_loss_coef;
    if (architecture == Architecture::mixtral) {
      j["router_jitter_noise"] = 0.0;
    } else if (architecture == Architecture::gpt_oss) {
      j.erase("num_experts");  // (GptOssConfig maps num_experts onto num_local_experts; one name suffices)
    } else {
      j["norm_topk_prob"] = moe.norm_topk_prob;
    }
    if (architecture == Architecture::qwen3_moe) {
      j["moe_intermediate_size"] = moe.intermediate_size;
      j["decoder_sparse_step"] = moe.decoder_sparse_step;
      j["mlp_only_layers"] = moe.dense_layers;
    }
    if (architecture == Architecture::olmoe) j["clip_qkv"] = nullptr;
  }
  if (architecture == Architecture::qwen2 || architecture == Architecture::qwen3 || architecture == Architecture::qwen3_moe) {
    j["use_sliding_window"] = sliding_window.has_value();
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
  }
  if (architecture == Architecture::mistral || architecture == Architecture::phi3 || architecture == Architecture::mixtral)
    j["sliding_window"] = sliding_window ? json(*sliding_window) : json(nullptr);
  return j;
}

std::int64_t ModelConfig::yarn_original_length() const {
  return rope_scaling.original_max_position_embeddings > 0 ? rope_scaling.original_max_position_embeddings
                                                           : max_position_embeddings;
}
double ModelConfig::yarn_factor() const {
  return rope_scaling.factor > 0 ? rope_scaling.factor
                                 : static_cast<double>(max_position_embeddings) / static_cast<double>(yarn_original_length());
}

double ModelConfig::rope_attention_scaling() const {
  if (rope_scaling.type == RopeScaling::Type::longrope) {  // as transformers' _compute_longrope_parameters
    if (rope_scaling.attention_factor) return *rope_scaling.attention_factor;
    const double orig = static_cast<double>(rope_scaling.original_max_position_embeddings);
    const double factor = rope_scaling.factor > 0 ? rope_scaling.factor : static_cast<double>(max_position_embeddings) / orig;
    return factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(orig));
  }
  if (rope_scaling.type != RopeScaling::Type::yarn) return 1.0;
  if (rope_scaling.attention_factor) return *rope_scaling.attention_factor;
  const auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  const double factor = yarn_factor();
  if (rope_scaling.mscale && rope_scaling.mscale_all_dim && *rope_scaling.mscale != 0 && *rope_scaling.mscale_all_dim != 0)
    return mscale(factor, *rope_scaling.mscale) / mscale(factor, *rope_scaling.mscale_all_dim);
  return mscale(factor, 1.0);
}

std::int64_t ModelConfig::rotary_dim() const {
  return static_cast<std::int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);  // (Python's int(): truncation)
}

std::vector<double> ModelConfig::rope_inv_freq(std::int64_t seq_len) const {
  const std::int64_t dim = rotary_dim(), half = dim / 2;
  std::vector<double> f(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i)
    f[static_cast<std::size_t>(i)] = 1.0 / std::pow(rope_theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  switch (rope_scaling.type) {
    case RopeScaling::Type::none: break;
    case RopeScaling::Type::linear:
      for (auto& x : f) x /= rope_scaling.factor;
      break;
    case RopeScaling::Type::longrope: {  // (transformers: long factors once a sequence exceeds the original context)
      const auto& ext = seq_len > rope_scaling.original_max_position_embeddings ? rope_scaling.long_factor
                                                                                : rope_scaling.short_factor;
      for (std::size_t i = 0; i < f.size(); ++i) f[i] /= ext[i];
      break;
    }
    case RopeScaling::Type::yarn: {
      // Frequencies that turn fewer than beta_slow times over the original context are slowed
      // by `factor` (interpolated), those that turn more than beta_fast times are kept
      // (extrapolated), and a linear ramp over the dimensions in between blends the two.
      const double base = rope_theta, rdim = static_cast<double>(dim);
      const double orig = static_cast<double>(yarn_original_length());
      const double factor = yarn_factor();
      const auto correction_dim = [&](double rotations) {
        return rdim * std::log(orig / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
      };
      double low = correction_dim(rope_scaling.beta_fast), high = correction_dim(rope_scaling.beta_slow);
      if (rope_scaling.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, rdim - 1);
      if (low == high) high += 0.001;
      for (std::int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1 - ramp;  // the share of the original frequency
        double& x = f[static_cast<std::size_t>(i)];
        x = x / factor * (1 - extrapolation) + x * extrapolation;
      }
      break;
    }
    case RopeScaling::Type::llama3: {
      // Long wavelengths are slowed by `factor`, short ones kept, and those in between blended.
      const double old_ctx = static_cast<double>(rope_scaling.original_max_position_embeddings);
      const double low_wavelen = old_ctx / rope_scaling.low_freq_factor;
      const double high_wavelen = old_ctx / rope_scaling.high_freq_factor;
      for (auto& x : f) {
        const double wavelen = 2 * std::numbers::pi / x;
        if (wavelen > low_wavelen) {
          x /= rope_scaling.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth = (old_ctx / wavelen - rope_scaling.low_freq_factor) /
                                (rope_scaling.high_freq_factor - rope_scaling.low_freq_factor);
          x = (1 - smooth) * x / rope_scaling.factor + smooth * x;
        }
      }
      break;
    }
  }
  return f;
}

std::int64_t ModelConfig::param_count() const {
  // (checked: every factor comes from a file or a flag, and a product past 2^63 is an error)
  const auto mul = [](std::int64_t a, std::int64_t b) { return checked_mul(a, b, "the model's parameter count"); };
  const auto add = [](std::int64_t a, std::int64_t b) { return checked_add(a, b, "the model's parameter count"); };
  const std::int64_t d = hidden_size;
  std::int64_t block = add(add(add(mul(2, d), mul(d, q_dim())), mul(mul(2, d), kv_dim())), mul(q_dim(), d));  // norms, q, k, v, o
  if (qkv_bias) block = add(block, add(q_dim(), mul(2, kv_dim())));
  if (o_bias) block = add(block, d);
  if (mlp_bias) block = add(block, add(mul(2, intermediate_size), d));
  if (qk_norm()) block = add(block, qk_norm_full() ? add(q_dim(), kv_dim()) : mul(2, head_dim));
  if (sandwich_norms()) block = add(block, mul(2, d));
  if (attention_sinks()) block = add(block, num_attention_heads);
  // the MLPs: dense gate, up, down; or the router and each expert's three
  const std::int64_t sparse = moe_layer_count();
  const std::int64_t dense_mlp = mul(mul(3, d), intermediate_size);
  const std::int64_t moe_mlp = moe.num_experts > 0 ? add(mul(moe.num_experts, add(d, moe.biases ? 1 : 0)),
                                                         mul(moe.num_experts, expert_params())) : 0;
  std::int64_t n = add(add(mul(vocab_size, d), mul(num_hidden_layers, block)), d);
  n = add(n, add(mul(num_hidden_layers - sparse, dense_mlp), mul(sparse, moe_mlp)));
  if (!tie_word_embeddings) n = add(n, mul(vocab_size, d));
  return n;
}

std::int64_t ModelConfig::expert_params() const {
  const auto mul = [](std::int64_t a, std::int64_t b) { return checked_mul(a, b, "the model's parameter count"); };
  const std::int64_t w = mul(mul(3, hidden_size), moe.intermediate_size);
  return moe.biases ? checked_add(w, 2 * moe.intermediate_size + hidden_size, "the model's parameter count") : w;
}

std::int64_t ModelConfig::active_param_count() const {
  // (each sparse layer's experts a token is not routed to: every factor bounded by param_count's)
  const auto mul = [](std::int64_t x, std::int64_t y) { return checked_mul(x, y, "the model's active parameters"); };
  const std::int64_t idle_experts = mul(moe_layer_count(), moe.num_experts - moe.experts_per_token);
  return param_count() - mul(idle_experts, expert_params());
}

ModelConfig ModelConfig::with_layers(std::int64_t layers) const {
  MT_CHECK(layers > 0 && layers <= kMaxLayers, "a model of {} layers: the count must be in [1, {}]", layers, kMaxLayers);
  ModelConfig c = *this;
  c.num_hidden_layers = layers;
  if (!sliding_layers.empty()) {
    c.sliding_layers.resize(static_cast<std::size_t>(layers));
    for (std::size_t l = sliding_layers.size(); l < c.sliding_layers.size(); ++l)
      c.sliding_layers[l] = sliding_layers[l % sliding_layers.size()];
  }
  std::erase_if(c.moe.dense_layers, [&](std::int64_t l) { return l >= layers; });
  c.validate(fmt::format("{} cut to {} layers", architecture_name(), layers));
  return c;
}

void ModelConfig::check_sequence_length(std::int64_t seq_len) const {
  MT_CHECK(seq_len > 0, "sequence length must be > 0 (got {})", seq_len);
  MT_CHECK(!sliding_window || !sliding_layers.empty() || seq_len <= *sliding_window,
           "sequence length {} exceeds this {} model's sliding_window {}; sliding-window attention is not implemented, "
           "so train with sequences of at most {} tokens",
           seq_len, architecture_name(), *sliding_window, *sliding_window);
}

namespace {
struct Preset {
  const char* name;
  const char* json_text;
};
// Shapes of public models (their config.json fields), for benchmarks and from-scratch training.
constexpr Preset kPresets[] = {
    {"qwen2.5-0.5b", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":896,"intermediate_size":4864,
      "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true})"},
    {"qwen2.5-1.5b", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":1536,"intermediate_size":8960,
      "num_hidden_layers":28,"num_attention_heads":12,"num_key_value_heads":2,"vocab_size":151936,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true})"},
    {"qwen2.5-7b", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":3584,"intermediate_size":18944,
      "num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,"vocab_size":152064,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":false})"},
    {"qwen2.5-14b", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":5120,"intermediate_size":13824,
      "num_hidden_layers":48,"num_attention_heads":40,"num_key_value_heads":8,"vocab_size":152064,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":false})"},
    {"qwen2.5-72b", R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":8192,"intermediate_size":29568,
      "num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"vocab_size":152064,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":false})"},
    {"qwen3-0.6b", R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":1024,"intermediate_size":3072,
      "num_hidden_layers":28,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,
      "max_position_embeddings":40960,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true})"},
    {"qwen3-8b", R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":4096,"intermediate_size":12288,
      "num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"vocab_size":151936,
      "max_position_embeddings":40960,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":false})"},
    // Gemma 3's text models (the 4B and larger are Gemma3ForConditionalGeneration on the Hub; these
    // are their language models' shapes)
    {"gemma-3-1b", R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":1152,"intermediate_size":6912,
      "num_hidden_layers":26,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":256,"vocab_size":262144,
      "max_position_embeddings":32768,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
      "query_pre_attn_scalar":256,"sliding_window":512,"sliding_window_pattern":6,"tie_word_embeddings":true})"},
    {"gemma-3-4b", R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":2560,"intermediate_size":10240,
      "num_hidden_layers":34,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"vocab_size":262208,
      "max_position_embeddings":131072,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
      "rope_scaling":{"rope_type":"linear","factor":8.0},"query_pre_attn_scalar":256,"sliding_window":1024,
      "sliding_window_pattern":6,"tie_word_embeddings":true})"},
    {"gemma-3-12b", R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":3840,"intermediate_size":15360,
      "num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":256,"vocab_size":262208,
      "max_position_embeddings":131072,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
      "rope_scaling":{"rope_type":"linear","factor":8.0},"query_pre_attn_scalar":256,"sliding_window":1024,
      "sliding_window_pattern":6,"tie_word_embeddings":true})"},
    {"gemma-3-27b", R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":5376,"intermediate_size":21504,
      "num_hidden_layers":62,"num_attention_heads":32,"num_key_value_heads":16,"head_dim":128,"vocab_size":262208,
      "max_position_embeddings":131072,"rms_norm_eps":1e-6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
      "rope_scaling":{"rope_type":"linear","factor":8.0},"query_pre_attn_scalar":168,"sliding_window":1024,
      "sliding_window_pattern":6,"tie_word_embeddings":true})"},
    {"llama-3.2-1b", R"({"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,
      "num_hidden_layers":16,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"vocab_size":128256,
      "max_position_embeddings":131072,"rms_norm_eps":1e-5,"rope_theta":500000.0,"tie_word_embeddings":true,
      "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
      "original_max_position_embeddings":8192}})"},
    {"llama-3.2-3b", R"({"architectures":["LlamaForCausalLM"],"hidden_size":3072,"intermediate_size":8192,
      "num_hidden_layers":28,"num_attention_heads":24,"num_key_value_heads":8,"head_dim":128,"vocab_size":128256,
      "max_position_embeddings":131072,"rms_norm_eps":1e-5,"rope_theta":500000.0,"tie_word_embeddings":true,
      "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
      "original_max_position_embeddings":8192}})"},
    {"llama-3.1-8b", R"({"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
      "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
      "max_position_embeddings":131072,"rms_norm_eps":1e-5,"rope_theta":500000.0,"tie_word_embeddings":false,
      "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
      "original_max_position_embeddings":8192}})"},
    {"mistral-7b", R"({"architectures":["MistralForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
      "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32768,
      "max_position_embeddings":32768,"rms_norm_eps":1e-5,"rope_theta":1000000.0,"sliding_window":null,
      "tie_word_embeddings":false})"},
    // Mixtures of experts (their published config.json; the CPU backend trains them for now)
    {"qwen3-30b-a3b", R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":2048,"intermediate_size":6144,
      "moe_intermediate_size":768,"num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,
      "vocab_size":151936,"num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,"max_position_embeddings":40960,
      "rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":false})"},
    {"mixtral-8x7b", R"({"architectures":["MixtralForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
      "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32000,"num_local_experts":8,
      "num_experts_per_tok":2,"max_position_embeddings":32768,"rms_norm_eps":1e-5,"rope_theta":1000000.0,
      "sliding_window":null,"tie_word_embeddings":false})"},
    {"olmoe-1b-7b", R"({"architectures":["OlmoeForCausalLM"],"hidden_size":2048,"intermediate_size":1024,
      "num_hidden_layers":16,"num_attention_heads":16,"num_key_value_heads":16,"vocab_size":50304,"num_experts":64,
      "num_experts_per_tok":8,"norm_topk_prob":false,"max_position_embeddings":4096,"rms_norm_eps":1e-5,
      "rope_theta":10000.0,"pad_token_id":1,"tie_word_embeddings":false})"},
    // (GptOssConfig's defaults, which from_json applies, give the rest: top 4 experts, windows of 128
    // on every other layer, yarn x32 over 4,096 positions, rope_theta 150,000, untied)
    {"gpt-oss-20b", R"({"architectures":["GptOssForCausalLM"],"hidden_size":2880,"intermediate_size":2880,
      "num_hidden_layers":24,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":64,"vocab_size":201088,
      "num_local_experts":32,"rms_norm_eps":1e-5,"pad_token_id":199999})"},
    {"gpt-oss-120b", R"({"architectures":["GptOssForCausalLM"],"hidden_size":2880,"intermediate_size":2880,
      "num_hidden_layers":36,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":64,"vocab_size":201088,
      "num_local_experts":128,"rms_norm_eps":1e-5,"pad_token_id":199999})"},
};
}  // namespace

std::vector<std::string> ModelConfig::preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

ModelConfig ModelConfig::preset(std::string_view name) {
  MT_NVTX_RANGE("ModelConfig::preset");
  for (const auto& p : kPresets)
    if (name == p.name) return from_json(json::parse(p.json_text), std::string("preset ") + p.name);
  std::string all;
  for (const auto& p : kPresets) all += std::string(all.empty() ? "" : ", ") + p.name;
  MT_FAIL("unknown model preset '{}' (known: {})", name, all);
}

}  // namespace megatrain
