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
#include "megatrain/model/family.hpp"
#include "families/common.hpp"

namespace megatrain {

namespace {

using json = nlohmann::json;
using model_families::get_bool;
using model_families::get_double;
using model_families::get_int;
using model_families::given;

std::string supported_list(bool model_types) {
  std::string s;
  for (const Family* f : families()) s += fmt::format("{}{}", s.empty() ? "" : ", ", model_types ? f->model_type : f->class_name);
  return s;
}

/// The Hugging Face name of an MLP activation.
const char* activation_name(Activation a) {
  switch (a) {
    case Activation::silu: return "silu";
    case Activation::gelu_tanh: return "gelu_pytorch_tanh";
    case Activation::clamped_swiglu: return "silu";  // (GPT-OSS's experts; not a config value)
  }
  return "silu";
}

/// The family a config.json names: the first entry of "architectures", else "model_type"; both
/// must name the same model where both are given.
const Family& find_family(const json& j, std::string_view src) {
  if (given(j, "architectures")) {
    const json& a = j.at("architectures");
    MT_CHECK(a.is_array() && !a.empty() && a.at(0).is_string(),
             "{}: 'architectures' must be a non-empty list of names, not {}", src, a.dump());
    const std::string name = a.at(0).get<std::string>();
    const Family* found = nullptr;
    for (const Family* f : families())
      if (name == f->class_name) found = f;
    MT_CHECK(found != nullptr, "{}: architecture '{}' is not supported (supported: {})", src, name, supported_list(false));
    // transformers picks the config class by model_type and other loaders (vLLM, ...) pick the
    // model class by architectures: when both are given they must name the same model.
    if (given(j, "model_type")) {
      const json& mt = j.at("model_type");
      MT_CHECK(mt.is_string(), "{}: field 'model_type' must be a string, not {} ({})", src, mt.type_name(), mt.dump());
      MT_CHECK(mt.get<std::string>() == found->model_type,
               "{}: 'architectures' and 'model_type' disagree: architectures names {}, whose model_type is '{}', "
               "but model_type is '{}'", src, name, found->model_type, mt.get<std::string>());
    }
    return *found;
  }
  MT_CHECK(j.contains("model_type") && j.at("model_type").is_string(),
           "{}: neither 'architectures' nor 'model_type' says what model this is", src);
  const std::string name = j.at("model_type").get<std::string>();
  for (const Family* f : families())
    if (name == f->model_type) return *f;
  MT_FAIL("{}: model_type '{}' is not supported (supported: {})", src, name, supported_list(true));
}

}  // namespace

namespace {

// The multimodal wrappers whose language model megatrain trains: the wrapper's class and
// model_type, its text model's, and where the checkpoint keeps the text model's tensors.
struct Wrapper {
  const char* arch;
  const char* model_type;
  const char* text_arch;
  const char* text_model_type;
  const char* prefix;        // prepended to every name (Gemma 3's language_model.model.layers...)
  const char* model_prefix;  // in place of "model." (Qwen3.5's model.language_model.layers...; lm_head stays)
};
constexpr Wrapper kWrappers[] = {
    {"Gemma3ForConditionalGeneration", "gemma3", "Gemma3ForCausalLM", "gemma3_text", "language_model.", ""},
    {"Qwen3_5ForConditionalGeneration", "qwen3_5", "Qwen3_5ForCausalLM", "qwen3_5_text", "", "model.language_model."},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "",
     "model.language_model."},
};

const Wrapper* find_wrapper(const json& j) {
  if (!j.is_object()) return nullptr;
  for (const Wrapper& w : kWrappers) {
    const bool named = given(j, "architectures") && j.at("architectures").is_array() && !j.at("architectures").empty() &&
                       j.at("architectures").at(0) == w.arch;
    const bool typed = !given(j, "architectures") && given(j, "model_type") && j.at("model_type") == w.model_type;
    if (named || typed) return &w;
  }
  return nullptr;
}

}  // namespace

std::optional<json> ModelConfig::language_model_config(const json& j, std::string_view src) {
  const Wrapper* w = find_wrapper(j);
  if (w == nullptr) return std::nullopt;
  MT_CHECK(!given(j, "model_type") || j.at("model_type") == w->model_type,
           "{}: 'architectures' names {}, whose model_type is '{}', but model_type is {}", src, w->arch, w->model_type,
           j.at("model_type").dump());
  MT_CHECK(j.contains("text_config") && j.at("text_config").is_object(),
           "{}: a {} config needs 'text_config', its language model's config (an object)", src, w->arch);
  json t = j.at("text_config");
  MT_CHECK(!given(t, "model_type") || t.at("model_type") == w->text_model_type, "{}: text_config's model_type is {}, not '{}'",
           src, t.at("model_type").dump(), w->text_model_type);
  t["architectures"] = json::array({w->text_arch});
  t["model_type"] = w->text_model_type;
  if (std::string_view(w->arch) == "Gemma3ForConditionalGeneration") {
    // (Gemma3TextConfig's defaults, which a published text_config relies on: google/gemma-3-4b-it's
    // gives only its sizes and rotary scaling)
    const json defaults = {{"vocab_size", 262208},        {"hidden_size", 2304},   {"intermediate_size", 9216},
                           {"num_hidden_layers", 26},     {"num_attention_heads", 8}, {"num_key_value_heads", 4},
                           {"head_dim", 256},             {"max_position_embeddings", 131072},
                           {"query_pre_attn_scalar", 256}, {"sliding_window", 4096}};
    for (const auto& [key, value] : defaults.items())
      if (!given(t, key.c_str())) t[key] = value;
  }
  for (const char* key : {"torch_dtype", "dtype", "tie_word_embeddings"})
    if (!t.contains(key) && j.contains(key)) t[key] = j.at(key);
  return t;
}

std::string ModelConfig::checkpoint_name(std::string_view param) const {
  if (!checkpoint_prefix.empty()) return checkpoint_prefix + std::string(param);
  if (!checkpoint_model_prefix.empty() && param.starts_with("model."))
    return checkpoint_model_prefix + std::string(param.substr(6));
  return std::string(param);
}

std::optional<std::string> ModelConfig::param_name(std::string_view tensor) const {
  if (!checkpoint_prefix.empty()) {
    if (!tensor.starts_with(checkpoint_prefix)) return std::nullopt;
    return std::string(tensor.substr(checkpoint_prefix.size()));
  }
  if (!checkpoint_model_prefix.empty()) {
    if (tensor.starts_with(checkpoint_model_prefix)) return "model." + std::string(tensor.substr(checkpoint_model_prefix.size()));
    if (tensor.starts_with("model.") || tensor.starts_with("mtp.")) return std::nullopt;  // (the vision tower, the MTP layers)
  }
  return std::string(tensor);
}

ModelConfig ModelConfig::from_json(const json& j, std::string_view src) {
  MT_NVTX_RANGE("ModelConfig::from_json");
  MT_CHECK(j.is_object(), "{}: a model config must be a JSON object, not {}", src, j.type_name());
  if (const auto text = language_model_config(j, src)) {  // (a multimodal model: its language model)
    const Wrapper& w = *find_wrapper(j);
    ModelConfig c = from_json(*text, fmt::format("{} (text_config of {})", src, w.arch));
    c.checkpoint_prefix = w.prefix;
    c.checkpoint_model_prefix = w.model_prefix;
    c.wrapper_architecture = w.arch;
    return c;
  }
  ModelConfig c;
  const Family& fam = find_family(j, src);
  c.architecture = fam.arch;
  // The MLP's activation, under the key the family's config class reads (transformers ignores the other)
  c.hidden_act = fam.block.activation;
  if (given(j, fam.block.activation_key)) {
    const json& act = j.at(fam.block.activation_key);
    MT_CHECK(act.is_string() && act.get<std::string>() == activation_name(fam.block.activation),
             "{}: {} {} is not supported ({} uses \"{}\")", src, fam.block.activation_key, act.dump(), fam.class_name,
             activation_name(fam.block.activation));
  }

  c.hidden_size = get_int(j, "hidden_size", src);
  // (a family whose every layer is sparse has no such field: transformers ignores one)
  c.intermediate_size = fam.block.every_layer_sparse ? 0 : get_int(j, "intermediate_size", src);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", src);
  // (bounded first: the per-layer tables the families read are sized by it)
  MT_CHECK(c.num_hidden_layers > 0, "{}: num_hidden_layers must be > 0 (got {})", src, c.num_hidden_layers);
  MT_CHECK(c.num_hidden_layers <= kMaxLayers, "{}: num_hidden_layers {} is beyond any model (at most {})", src,
           c.num_hidden_layers, kMaxLayers);
  c.num_attention_heads = get_int(j, "num_attention_heads", src);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", src, c.num_attention_heads);
  c.vocab_size = get_int(j, "vocab_size", src);
  MT_CHECK(c.num_attention_heads > 0, "{}: num_attention_heads must be > 0 (got {})", src, c.num_attention_heads);
  if (given(j, "head_dim")) {
    c.head_dim = get_int(j, "head_dim", src);
  } else {
    MT_CHECK(c.hidden_size % c.num_attention_heads == 0,
             "{}: hidden_size {} is not a multiple of num_attention_heads {} and no head_dim is given", src,
             c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, fam.default_max_position_embeddings);
  c.rms_norm_eps = get_double(j, "rms_norm_eps", src, 1e-6);
  c.initializer_range = get_double(j, "initializer_range", src, 0.02);
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, fam.default_tied);
  if (!j.contains("pad_token_id")) c.pad_token_id = fam.default_pad_token_id;
  if (given(j, "pad_token_id")) {
    c.pad_token_id = get_int(j, "pad_token_id", src);
    // nn.Embedding counts a negative padding_idx from the end of the table (old Llama configs say -1)
    if (*c.pad_token_id < 0 && *c.pad_token_id >= -c.vocab_size) *c.pad_token_id += c.vocab_size;
  }

  // Rotary: transformers 4 keeps rope_theta and rope_scaling at the top level; transformers 5
  // may put both into rope_parameters.
  c.rope_theta = get_double(j, "rope_theta", src, fam.default_rope_theta);
  if (given(j, "rope_parameters")) {
    const json& rp = j.at("rope_parameters");
    MT_CHECK(rp.is_object(), "{}: rope_parameters must be an object", src);
    if (rp.contains("rope_theta")) c.rope_theta = get_double(rp, "rope_theta", src);
    c.rope_scaling = model_families::parse_rope_scaling(rp, src);
  }
  if (given(j, "rope_scaling")) c.rope_scaling = model_families::parse_rope_scaling(j.at("rope_scaling"), src);
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
  // The family's own fields: biases, windows, experts, per-layer tables
  fam.parse(j, src, c);
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
  positive(num_hidden_layers, "num_hidden_layers");
  MT_CHECK(num_hidden_layers <= kMaxLayers, "{}: num_hidden_layers {} is beyond any model (at most {})", src,
           num_hidden_layers, kMaxLayers);
  // (a dense MLP's; a model whose every layer is sparse may have none)
  if (moe_layer_count() < num_hidden_layers) positive(intermediate_size, "intermediate_size");
  MT_CHECK(intermediate_size >= 0, "{}: intermediate_size must be >= 0 (got {})", src, intermediate_size);
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
  const BlockRecipe& block = family(architecture).block;
  MT_CHECK(block.qk_norm != BlockRecipe::QkNorm::whole || q_dim() == hidden_size,
           "{}: {}'s q_norm spans hidden_size ({}), so num_attention_heads x head_dim must equal it (got {})", src,
           architecture_name(), hidden_size, q_dim());
  // The parts a family's recipe does not have (a config assembled by hand)
  MT_CHECK(hidden_act == block.activation, "{}: {}'s MLP activation is {}, not {}", src, architecture_name(),
           activation_name(block.activation), activation_name(hidden_act));
  for (std::size_t l = 0; l < layer_types.size(); ++l)
    MT_CHECK(layer_types[l] != TokenMixerKind::linear_attention || block.linear_attention,
             "{}: layer_types makes layer {} a linear_attention layer, which {} has not (Gated DeltaNet layers are "
             "Qwen3.5's and Qwen3-Next's)", src, l, architecture_name());
  if (block.linear_attention) linear_attention.check(src);
  MT_CHECK(layer_types.empty() || block.per_layer_windows || block.linear_attention,
           "{}: {} has no per-layer sliding windows (layer types)", src, architecture_name());
  MT_CHECK(!query_pre_attn_scalar || block.query_pre_attn_scalar, "{}: {} has no query_pre_attn_scalar", src,
           architecture_name());
  MT_CHECK(nope_layers.empty() || block.nope_layers, "{}: {} has a rotary embedding on every layer (no no_rope_layers)",
           src, architecture_name());
  MT_CHECK(layer_types.empty() || static_cast<std::int64_t>(layer_types.size()) == num_hidden_layers,
           "{}: {} layer types for {} layers", src, layer_types.size(), num_hidden_layers);
  MT_CHECK(moe.biases == block.moe_biases, "{}: {} has {} biases on its router and experts", src, architecture_name(),
           block.moe_biases ? "" : "no");
  MT_CHECK(block.moe || moe.num_experts == 0, "{}: {} has no experts (num_experts {})", src, architecture_name(),
           moe.num_experts);
  family(architecture).check(*this, src);
}

std::string_view ModelConfig::architecture_name() const { return family(architecture).class_name; }
std::string_view ModelConfig::model_type() const { return family(architecture).model_type; }
const BlockRecipe& ModelConfig::block() const { return family(architecture).block; }
bool ModelConfig::qk_norm() const { return block().qk_norm != BlockRecipe::QkNorm::none; }
bool ModelConfig::qk_norm_full() const { return block().qk_norm == BlockRecipe::QkNorm::whole; }
bool ModelConfig::attention_sinks() const { return block().attention_sinks; }
bool ModelConfig::attention_output_gate() const { return block().attention_output_gate; }
Activation ModelConfig::expert_act() const { return block().expert_activation.value_or(hidden_act); }
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
std::string_view ModelConfig::moe_module() const { return block().moe_module; }
bool ModelConfig::fused_projections() const { return block().fused_projections; }
bool ModelConfig::norm_unit_offset() const { return block().unit_offset_norms; }
bool ModelConfig::sandwich_norms() const { return block().sandwich_norms; }
double ModelConfig::embed_scale() const {
  // transformers: the Python float hidden_size ** 0.5 made a float32 tensor
  return block().scaled_embedding ? static_cast<double>(static_cast<float>(std::sqrt(static_cast<double>(hidden_size))))
                                  : 1.0;
}
double ModelConfig::attention_scale() const {
  return 1.0 / std::sqrt(query_pre_attn_scalar ? *query_pre_attn_scalar : static_cast<double>(head_dim));
}
LayerKind ModelConfig::layer_kind(std::int64_t layer) const {
  const auto l = static_cast<std::size_t>(layer);
  return {l < layer_types.size() ? layer_types[l] : TokenMixerKind::full_attention,
          is_moe_layer(layer) ? ChannelMixerKind::experts : ChannelMixerKind::dense_mlp};
}
std::vector<bool> ModelConfig::sliding_layers() const {
  std::vector<bool> sliding;
  for (const TokenMixerKind t : layer_types) sliding.push_back(t == TokenMixerKind::sliding_attention);
  return sliding;
}
std::int64_t ModelConfig::attention_window(std::int64_t layer) const {
  return layer_kind(layer).token_mixer == TokenMixerKind::sliding_attention ? sliding_window.value_or(0) : 0;
}
bool ModelConfig::rotary_layer(std::int64_t layer) const {
  const auto l = static_cast<std::size_t>(layer);
  return !(l < nope_layers.size() && nope_layers[l]);
}
ModelConfig ModelConfig::rope_for_layer(std::int64_t layer) const {
  ModelConfig c = *this;
  if (block().local_rope && attention_window(layer) > 0) {  // (GPT-OSS's layers share theirs)
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
  j[block().activation_key] = activation_name(hidden_act);
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  // Rotary: as transformers 5 writes it, rope_parameters (rope_theta, the scaling and the partial
  // factor in it); and for transformers 4, which reads only the top level, rope_theta, a scaling
  // other than the default as rope_scaling, the partial factor. transformers 5 reads a top-level
  // rope_scaling in place of rope_parameters, filling rope_theta and the partial factor from the
  // top level: the same values, since rope_scaling is rope_parameters less those two.
  json rope = model_families::rope_parameters_json(*this);
  if (partial_rotary_factor != 1.0) {
    rope["partial_rotary_factor"] = partial_rotary_factor;
    j["partial_rotary_factor"] = partial_rotary_factor;
  }
  j["rope_parameters"] = rope;
  if (rope_scaling.type != RopeScaling::Type::none) {
    rope.erase("rope_theta");
    rope.erase("partial_rotary_factor");
    j["rope_scaling"] = rope;
  }
  if (rope_scaling.type == RopeScaling::Type::longrope)
    j["original_max_position_embeddings"] = rope_scaling.original_max_position_embeddings;
  family(architecture).write(*this, j);
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
  std::int64_t block = mul(2, d);  // the norms
  if (mlp_bias) block = add(block, add(mul(2, intermediate_size), d));
  if (sandwich_norms()) block = add(block, mul(2, d));
  // the token mixers: attention's q, k, v, o (and its biases, norms, sinks), or linear attention's
  const std::int64_t q_rows = attention_output_gate() ? mul(2, q_dim()) : q_dim();  // (and a gate per head)
  std::int64_t attention = add(add(mul(d, q_rows), mul(mul(2, d), kv_dim())), mul(q_dim(), d));
  if (qkv_bias) attention = add(attention, add(q_rows, mul(2, kv_dim())));
  if (o_bias) attention = add(attention, d);
  if (qk_norm()) attention = add(attention, qk_norm_full() ? add(q_dim(), kv_dim()) : mul(2, head_dim));
  if (attention_sinks()) attention = add(attention, num_attention_heads);
  std::int64_t linear = 0;
  for (std::int64_t l = 0; l < num_hidden_layers; ++l) linear += layer_kind(l).token_mixer == TokenMixerKind::linear_attention;
  const std::int64_t mixers =
      add(mul(num_hidden_layers - linear, attention), linear > 0 ? mul(linear, linear_attention.params(d)) : 0);
  // the MLPs: dense gate, up, down; or the router and each expert's three
  const std::int64_t sparse = moe_layer_count();
  const std::int64_t dense_mlp = mul(mul(3, d), intermediate_size);
  std::int64_t moe_mlp = moe.num_experts > 0 ? add(mul(moe.num_experts, add(d, moe.biases ? 1 : 0)),
                                                   mul(moe.num_experts, expert_params())) : 0;
  if (moe.shared_expert_size > 0) moe_mlp = add(moe_mlp, moe.shared_expert_params(d));
  std::int64_t n = add(add(add(mul(vocab_size, d), mul(num_hidden_layers, block)), d), mixers);
  n = add(n, add(mul(num_hidden_layers - sparse, dense_mlp), mul(sparse, moe_mlp)));
  if (!tie_word_embeddings) n = add(n, mul(vocab_size, d));
  return n;
}

std::int64_t LinearAttentionConfig::params(std::int64_t d) const {
  const auto mul = [](std::int64_t a, std::int64_t b) { return checked_mul(a, b, "the model's parameter count"); };
  const auto add = [](std::int64_t a, std::int64_t b) { return checked_add(a, b, "the model's parameter count"); };
  // q, k, v and z; b and a; the convolution; A_log and dt_bias; the norm; the output projection
  const std::int64_t in = mul(d, add(add(conv_dim(), value_dim()), mul(2, value_heads)));
  return add(add(add(in, mul(conv_dim(), conv_kernel)), add(mul(2, value_heads), value_head_dim)), mul(value_dim(), d));
}

void LinearAttentionConfig::check(std::string_view src) const {
  MT_CHECK(key_heads > 0 && value_heads > 0 && key_head_dim > 0 && value_head_dim > 0 && conv_kernel > 0,
           "{}: linear_num_key_heads ({}), linear_num_value_heads ({}), linear_key_head_dim ({}), linear_value_head_dim "
           "({}) and linear_conv_kernel_dim ({}) must be > 0", src, key_heads, value_heads, key_head_dim, value_head_dim,
           conv_kernel);
  MT_CHECK(value_heads % key_heads == 0, "{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
           src, value_heads, key_heads);
  constexpr std::int64_t kMax = std::int64_t{1} << 14;
  MT_CHECK(key_heads <= kMax && value_heads <= kMax && key_head_dim <= kMax && value_head_dim <= kMax && conv_kernel <= kMax,
           "{}: a linear attention size is beyond any model (at most {})", src, kMax);
}

std::int64_t ModelConfig::expert_params() const {
  const auto mul = [](std::int64_t a, std::int64_t b) { return checked_mul(a, b, "the model's parameter count"); };
  const std::int64_t w = mul(mul(3, hidden_size), moe.intermediate_size);
  return moe.biases ? checked_add(w, 2 * moe.intermediate_size + hidden_size, "the model's parameter count") : w;
}

std::int64_t MoeConfig::shared_expert_params(std::int64_t hidden_size) const {
  const auto mul = [](std::int64_t a, std::int64_t b) { return checked_mul(a, b, "the model's parameter count"); };
  return checked_add(mul(mul(3, hidden_size), shared_expert_size), hidden_size, "the model's parameter count");
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
  const auto cut = [layers](const auto& table, auto& out) {  // (beyond the table: its entries again from the first)
    if (table.empty()) return;
    out.resize(static_cast<std::size_t>(layers));
    for (std::size_t l = table.size(); l < out.size(); ++l) out[l] = table[l % table.size()];
  };
  cut(layer_types, c.layer_types);
  cut(nope_layers, c.nope_layers);
  std::erase_if(c.moe.dense_layers, [&](std::int64_t l) { return l >= layers; });
  c.validate(fmt::format("{} cut to {} layers", architecture_name(), layers));
  return c;
}

void ModelConfig::check_sequence_length(std::int64_t seq_len) const {
  MT_CHECK(seq_len > 0, "sequence length must be > 0 (got {})", seq_len);
  MT_CHECK(!sliding_window || !layer_types.empty() || seq_len <= *sliding_window,
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
    // SmolLM3-3B (SmolLM3Config's defaults give the NoPE layers: every fourth)
    {"smollm3-3b", R"({"architectures":["SmolLM3ForCausalLM"],"hidden_size":2048,"intermediate_size":11008,
      "num_hidden_layers":36,"num_attention_heads":16,"num_key_value_heads":4,"vocab_size":128256,
      "max_position_embeddings":65536,"rms_norm_eps":1e-6,"rope_theta":5000000.0,"tie_word_embeddings":true,
      "pad_token_id":128004})"},
    // Qwen3.5's text model (its published text_config: 48 Gated DeltaNet layers and 16 gated
    // full-attention layers; the CPU backend trains it for now)
    {"qwen3.5-27b", R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":5120,"intermediate_size":17408,
      "num_hidden_layers":64,"num_attention_heads":24,"num_key_value_heads":4,"head_dim":256,"vocab_size":248320,
      "linear_num_key_heads":16,"linear_num_value_heads":48,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":false})"},
    // The smaller Qwen3.5 text models (their published text_config; 0.8B to 4B tie the head)
    {"qwen3.5-0.8b", R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":1024,"intermediate_size":3584,
      "num_hidden_layers":24,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":256,"vocab_size":248320,
      "linear_num_key_heads":16,"linear_num_value_heads":16,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":true})"},
    {"qwen3.5-2b", R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":2048,"intermediate_size":6144,
      "num_hidden_layers":24,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":256,"vocab_size":248320,
      "linear_num_key_heads":16,"linear_num_value_heads":16,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":true})"},
    {"qwen3.5-4b", R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":2560,"intermediate_size":9216,
      "num_hidden_layers":32,"num_attention_heads":16,"num_key_value_heads":4,"head_dim":256,"vocab_size":248320,
      "linear_num_key_heads":16,"linear_num_value_heads":32,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":true})"},
    {"qwen3.5-9b", R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":4096,"intermediate_size":12288,
      "num_hidden_layers":32,"num_attention_heads":16,"num_key_value_heads":4,"head_dim":256,"vocab_size":248320,
      "linear_num_key_heads":16,"linear_num_value_heads":32,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":false})"},
    // Qwen3.5's mixtures of experts (their published text_config: every layer sparse, a shared expert)
    {"qwen3.5-35b-a3b", R"({"architectures":["Qwen3_5MoeForCausalLM"],"hidden_size":2048,"num_hidden_layers":40,
      "num_attention_heads":16,"num_key_value_heads":2,"head_dim":256,"vocab_size":248320,"linear_num_key_heads":16,
      "linear_num_value_heads":32,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,
      "full_attention_interval":4,"num_experts":256,"num_experts_per_tok":8,"moe_intermediate_size":512,
      "shared_expert_intermediate_size":512,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":false})"},
    {"qwen3.5-122b-a10b", R"({"architectures":["Qwen3_5MoeForCausalLM"],"hidden_size":3072,"num_hidden_layers":48,
      "num_attention_heads":32,"num_key_value_heads":2,"head_dim":256,"vocab_size":248320,"linear_num_key_heads":16,
      "linear_num_value_heads":64,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,
      "full_attention_interval":4,"num_experts":256,"num_experts_per_tok":8,"moe_intermediate_size":1024,
      "shared_expert_intermediate_size":1024,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":false})"},
    {"qwen3.5-397b-a17b", R"({"architectures":["Qwen3_5MoeForCausalLM"],"hidden_size":4096,"num_hidden_layers":60,
      "num_attention_heads":32,"num_key_value_heads":2,"head_dim":256,"vocab_size":248320,"linear_num_key_heads":16,
      "linear_num_value_heads":64,"linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,
      "full_attention_interval":4,"num_experts":512,"num_experts_per_tok":10,"moe_intermediate_size":1024,
      "shared_expert_intermediate_size":1024,"max_position_embeddings":262144,"rms_norm_eps":1e-6,
      "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"partial_rotary_factor":0.25},
      "tie_word_embeddings":false})"},
    // Qwen3-Next-80B-A3B (its published config.json)
    {"qwen3-next-80b-a3b", R"({"architectures":["Qwen3NextForCausalLM"],"hidden_size":2048,"intermediate_size":5120,
      "num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":2,"head_dim":256,"vocab_size":151936,
      "linear_num_key_heads":16,"linear_num_value_heads":32,"linear_key_head_dim":128,"linear_value_head_dim":128,
      "linear_conv_kernel_dim":4,"full_attention_interval":4,"num_experts":512,"num_experts_per_tok":10,
      "moe_intermediate_size":512,"shared_expert_intermediate_size":512,"decoder_sparse_step":1,"mlp_only_layers":[],
      "norm_topk_prob":true,"max_position_embeddings":262144,"rms_norm_eps":1e-6,"rope_theta":10000000.0,
      "partial_rotary_factor":0.25,"tie_word_embeddings":false})"},
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
