// ModelConfig: parsing real Hugging Face config.json files (configs/, copied from the published
// checkpoints' files), transformers-5-style rope_parameters, presets, param_count against the
// published parameter counts and against the layer ops' own specs, to_json round trips, the
// rotary frequencies against an independent computation, and every error a user can hit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numbers>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/model/family.hpp"

using namespace megatrain;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

fs::path fixture(const char* name) { return fs::path(MEGATRAIN_TEST_CONFIGS) / name; }

/// Every field, so a round trip or a preset comparison cannot miss one.
void check_same(const ModelConfig& a, const ModelConfig& b) {
  CHECK(a.architecture == b.architecture);
  CHECK(a.hidden_size == b.hidden_size);
  CHECK(a.intermediate_size == b.intermediate_size);
  CHECK(a.num_hidden_layers == b.num_hidden_layers);
  CHECK(a.num_attention_heads == b.num_attention_heads);
  CHECK(a.num_key_value_heads == b.num_key_value_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.max_position_embeddings == b.max_position_embeddings);
  CHECK(a.rms_norm_eps == b.rms_norm_eps);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.rope_scaling.type == b.rope_scaling.type);
  if (a.rope_scaling.type == RopeScaling::Type::yarn) {  // (absent lengths and factor are written resolved)
    CHECK(a.yarn_factor() == b.yarn_factor());
    CHECK(a.yarn_original_length() == b.yarn_original_length());
    CHECK(a.rope_scaling.beta_fast == b.rope_scaling.beta_fast);
    CHECK(a.rope_scaling.beta_slow == b.rope_scaling.beta_slow);
    CHECK(a.rope_scaling.truncate == b.rope_scaling.truncate);
    CHECK(a.rope_scaling.attention_factor == b.rope_scaling.attention_factor);
    CHECK(a.rope_scaling.mscale == b.rope_scaling.mscale);
    CHECK(a.rope_scaling.mscale_all_dim == b.rope_scaling.mscale_all_dim);
    CHECK(a.rope_attention_scaling() == b.rope_attention_scaling());
  } else {
    CHECK(a.rope_scaling.factor == b.rope_scaling.factor);
    CHECK(a.rope_scaling.original_max_position_embeddings == b.rope_scaling.original_max_position_embeddings);
  }
  CHECK(a.rope_scaling.low_freq_factor == b.rope_scaling.low_freq_factor);
  CHECK(a.rope_scaling.high_freq_factor == b.rope_scaling.high_freq_factor);
  CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
  CHECK(a.qkv_bias == b.qkv_bias);
  CHECK(a.o_bias == b.o_bias);
  CHECK(a.mlp_bias == b.mlp_bias);
  CHECK(a.sliding_window == b.sliding_window);
  CHECK(a.pad_token_id == b.pad_token_id);
  CHECK(a.rope_scaling.short_factor == b.rope_scaling.short_factor);
  CHECK(a.rope_scaling.long_factor == b.rope_scaling.long_factor);
  CHECK(a.initializer_range == b.initializer_range);
  CHECK(a.sliding_layers() == b.sliding_layers());
  CHECK(a.local_rope_theta == b.local_rope_theta);
  CHECK(a.local_rope_scaling.type == b.local_rope_scaling.type);
  CHECK(a.local_rope_scaling.factor == b.local_rope_scaling.factor);
  CHECK(a.hidden_act == b.hidden_act);
  CHECK(a.query_pre_attn_scalar == b.query_pre_attn_scalar);
  CHECK(a.partial_rotary_factor == b.partial_rotary_factor);
  CHECK(a.nope_layers == b.nope_layers);
  CHECK(a.layer_types == b.layer_types);
  CHECK(a.linear_attention == b.linear_attention);
  CHECK(a.moe.num_experts == b.moe.num_experts);
  CHECK(a.moe.experts_per_token == b.moe.experts_per_token);
  CHECK(a.moe.intermediate_size == b.moe.intermediate_size);
  CHECK(a.moe.norm_topk_prob == b.moe.norm_topk_prob);
  CHECK(a.moe.dense_layers == b.moe.dense_layers);
  CHECK(a.moe.decoder_sparse_step == b.moe.decoder_sparse_step);
  CHECK(a.moe.output_router_logits == b.moe.output_router_logits);
  CHECK(a.moe.router_aux_loss_coef == b.moe.router_aux_loss_coef);
  CHECK(a.moe.biases == b.moe.biases);
  CHECK(a.moe.shared_expert_size == b.moe.shared_expert_size);
}

/// from_json(to_json(c)) == c, both directly and through the JSON text.
void check_round_trip(const ModelConfig& c) {
  check_same(ModelConfig::from_json(c.to_json(), "round trip"), c);
  check_same(ModelConfig::from_json(json::parse(c.to_json().dump(2)), "round trip (text)"), c);
}

/// Parameters counted tensor by tensor, the way a state_dict lists them (independent of
/// ModelConfig::param_count's closed form).
std::int64_t state_dict_count(const ModelConfig& c) {
  const std::int64_t d = c.hidden_size, f = c.intermediate_size, qd = c.num_attention_heads * c.head_dim,
                     kd = c.num_key_value_heads * c.head_dim;
  std::vector<std::int64_t> tensors{c.vocab_size * d};  // model.embed_tokens.weight
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool linear = c.layer_kind(l).token_mixer == TokenMixerKind::linear_attention;
    const bool hybrid = c.architecture == Architecture::qwen3_5 || c.architecture == Architecture::qwen3_5_moe ||
                        c.architecture == Architecture::qwen3_next;
    if (linear && c.architecture == Architecture::qwen3_next) {  // fused: in_proj_qkvz, in_proj_ba
      const auto& la = c.linear_attention;
      const std::int64_t key = la.key_heads * la.key_head_dim, value = la.value_heads * la.value_head_dim;
      tensors.insert(tensors.end(), {d, d, (2 * key + 2 * value) * d, 2 * la.value_heads * d,
                                     (2 * key + value) * la.conv_kernel, la.value_heads, la.value_heads,
                                     la.value_head_dim, d * value});
    } else if (linear) {  // the norms; linear_attn's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias, norm, out_proj
      const auto& la = c.linear_attention;
      const std::int64_t key = la.key_heads * la.key_head_dim, value = la.value_heads * la.value_head_dim;
      tensors.insert(tensors.end(), {d, d, (2 * key + value) * d, value * d, la.value_heads * d, la.value_heads * d,
                                     (2 * key + value) * la.conv_kernel, la.value_heads, la.value_heads,
                                     la.value_head_dim, d * value});
    } else {  // the norms; q (with its gate: Qwen3.5's), k, v, o
      tensors.insert(tensors.end(), {d, (hybrid ? 2 : 1) * qd * d, kd * d, kd * d, d * qd, d});
    }
    if (c.architecture == Architecture::gpt_oss) {  // mlp.router.{weight,bias}, the stacked experts, sinks
      const std::int64_t e = c.moe.num_experts, fe = c.moe.intermediate_size;
      tensors.insert(tensors.end(), {e * d, e, e * d * 2 * fe, e * 2 * fe, e * fe * d, e * d, c.num_attention_heads});
    } else if (c.is_moe_layer(l)) {  // mlp.gate.weight, then each expert's gate_proj, up_proj, down_proj
      const std::int64_t e = c.moe.num_experts, fe = c.moe.intermediate_size;
      tensors.push_back(e * d);
      for (std::int64_t x = 0; x < e; ++x) tensors.insert(tensors.end(), {fe * d, fe * d, d * fe});
      const std::int64_t s = c.moe.shared_expert_size;  // shared_expert.{gate,up,down}_proj, shared_expert_gate
      if (s > 0) tensors.insert(tensors.end(), {s * d, s * d, d * s, d});
    } else {
      tensors.insert(tensors.end(), {f * d, f * d, d * f});
    }
    if (c.qkv_bias && !linear) tensors.insert(tensors.end(), {(hybrid ? 2 : 1) * qd, kd, kd});
    if (c.o_bias && !linear) tensors.push_back(d);
    if (c.mlp_bias) tensors.insert(tensors.end(), {f, f, d});
    if ((c.architecture == Architecture::qwen3 || c.architecture == Architecture::gemma3 ||
         c.architecture == Architecture::qwen3_moe || hybrid) && !linear)
      tensors.insert(tensors.end(), {c.head_dim, c.head_dim});  // q_norm, k_norm
    if (c.architecture == Architecture::olmoe) tensors.insert(tensors.end(), {qd, kd});  // over the whole projections
    if (c.architecture == Architecture::gemma3) tensors.insert(tensors.end(), {d, d});  // pre/post_feedforward_layernorm
  }
  tensors.push_back(d);                                          // model.norm.weight
  if (!c.tie_word_embeddings) tensors.push_back(c.vocab_size * d);  // lm_head.weight
  std::int64_t n = 0;
  for (auto t : tensors) n += t;
  return n;
}

/// The parameters the layer ops declare for this config (what HostParamStore would hold).
std::int64_t op_spec_count(const ModelConfig& c) {
  std::int64_t n = 0;
  for (const auto& u : DecoderModel<>(c).units())
    for (const auto& p : u.params) n += p.numel();
  return n;
}

/// A small valid config that the error cases below break one field at a time.
json base_config() {
  return json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"hidden_act":"silu"})");
}
json with(json j, const char* key, json value) {
  j[key] = std::move(value);
  return j;
}
json without(json j, const char* key) {
  j.erase(key);
  return j;
}
/// The message of the Error that parsing `j` throws ("" and a failed check if it does not throw).
std::string error_of(const json& j, std::string_view source = "config.json") {
  try {
    (void)ModelConfig::from_json(j, source);
  } catch (const Error& e) {
    return e.what();
  }
  FAIL_CHECK("no error for " << j.dump());
  return {};
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  FAIL_CHECK("no error");
  return {};
}
bool contains(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

/// Rotary inverse frequencies as transformers computes them (modeling_rope_utils.py), written
/// independently of ModelConfig::rope_inv_freq: the default table from exp/log, then the
/// llama3 adjustment as three whole-vector steps (`torch.where` on wavelengths).
std::vector<double> reference_inv_freq(const ModelConfig& c) {
  // (the rotated width: int(head_dim x partial_rotary_factor), as transformers' rope functions)
  const auto rotated = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  const auto half = static_cast<std::size_t>(rotated / 2);
  std::vector<double> f(half);
  for (std::size_t i = 0; i < half; ++i)
    f[i] = std::exp(-std::log(c.rope_theta) * static_cast<double>(2 * i) / static_cast<double>(rotated));
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::linear)
    for (auto& x : f) x /= s.factor;
  if (s.type == RopeScaling::Type::llama3) {
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_ctx / s.low_freq_factor, high_wavelen = old_ctx / s.high_freq_factor;
    std::vector<double> wavelen(half), scaled(half), smoothed(half);
    for (std::size_t i = 0; i < half; ++i) wavelen[i] = 2 * std::numbers::pi / f[i];
    for (std::size_t i = 0; i < half; ++i) scaled[i] = wavelen[i] > low_wavelen ? f[i] / s.factor : f[i];
    for (std::size_t i = 0; i < half; ++i) {
      const double smooth = (old_ctx / wavelen[i] - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      smoothed[i] = (1 - smooth) * scaled[i] / s.factor + smooth * scaled[i];
    }
    for (std::size_t i = 0; i < half; ++i) {
      const bool medium = !(wavelen[i] < high_wavelen) && !(wavelen[i] > low_wavelen);
      f[i] = medium ? smoothed[i] : scaled[i];
    }
  }
  if (s.type == RopeScaling::Type::yarn) {
    // transformers' _compute_yarn_parameters: the correction range from the number of turns each
    // dimension makes over the original context, a ramp over it, interpolation and extrapolation
    // blended by the ramp, as whole vectors.
    const double orig = static_cast<double>(s.original_max_position_embeddings > 0 ? s.original_max_position_embeddings
                                                                                   : c.max_position_embeddings);
    const double factor = s.factor > 0 ? s.factor : static_cast<double>(c.max_position_embeddings) / orig;
    const double dim = static_cast<double>(c.head_dim), base = c.rope_theta;
    const auto corr = [&](double turns) { return dim * std::log(orig / (turns * 2 * std::numbers::pi)) / (2 * std::log(base)); };
    double lo = corr(s.beta_fast), hi = corr(s.beta_slow);
    if (s.truncate) {
      lo = std::floor(lo);
      hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, dim - 1);
    if (lo == hi) hi += 0.001;
    std::vector<double> interpolation(half), extrapolation_factor(half);
    for (std::size_t i = 0; i < half; ++i) interpolation[i] = f[i] / factor;
    for (std::size_t i = 0; i < half; ++i)
      extrapolation_factor[i] = 1 - std::min(1.0, std::max(0.0, (static_cast<double>(i) - lo) / (hi - lo)));
    for (std::size_t i = 0; i < half; ++i)
      f[i] = interpolation[i] * (1 - extrapolation_factor[i]) + f[i] * extrapolation_factor[i];
  }
  return f;
}

void check_inv_freq(const ModelConfig& c) {
  const auto got = c.rope_inv_freq();
  const auto want = reference_inv_freq(c);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("i = " << i);
    CHECK(std::abs(got[i] - want[i]) <= 1e-13 * std::abs(want[i]));
  }
}

}  // namespace

// ---- real config.json files ----------------------------------------------------------------

TEST_CASE("config: Llama 2 7B") {
  const auto c = ModelConfig::from_file(fixture("llama-2-7b.json"));
  CHECK(c.architecture == Architecture::llama);
  CHECK(c.architecture_name() == "LlamaForCausalLM");
  CHECK(c.model_type() == "llama");
  CHECK(c.hidden_size == 4096);
  CHECK(c.intermediate_size == 11008);
  CHECK(c.num_hidden_layers == 32);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 32);
  CHECK(c.head_dim == 128);  // hidden / heads: the file has no head_dim
  CHECK(c.vocab_size == 32000);
  CHECK(c.max_position_embeddings == 4096);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.rope_theta == 10000.0);  // absent: the default
  CHECK(c.rope_scaling.type == RopeScaling::Type::none);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE(c.qkv_bias);
  CHECK_FALSE(c.o_bias);
  CHECK_FALSE(c.mlp_bias);
  CHECK_FALSE(c.sliding_window.has_value());
  CHECK(c.q_dim() == 4096);
  CHECK(c.kv_dim() == 4096);
  CHECK(c.param_count() == 6'738'415'616);  // Llama-2-7b-hf
  CHECK(c.param_count() == state_dict_count(c));
  check_round_trip(c);
}

TEST_CASE("config: Qwen3 8B as transformers 5 writes it (q/k norms, head_dim, rope_parameters, layer_types)") {
  const auto c = ModelConfig::from_file(fixture("qwen3-8b-transformers5.json"));
  CHECK(c.architecture == Architecture::qwen3);
  CHECK(c.architecture_name() == "Qwen3ForCausalLM");
  CHECK(c.model_type() == "qwen3");
  CHECK(c.qk_norm());
  CHECK(c.hidden_size == 4096);
  CHECK(c.intermediate_size == 12288);
  CHECK(c.num_hidden_layers == 36);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.vocab_size == 151936);
  CHECK(c.max_position_embeddings == 40960);
  CHECK(c.rope_theta == 1000000.0);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE(c.qkv_bias);
  CHECK_FALSE(c.o_bias);
  CHECK_FALSE(c.mlp_bias);
  CHECK_FALSE(c.sliding_window.has_value());  // every layer full_attention
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == 8'190'735'360);
  check_round_trip(c);
  CHECK_FALSE(ModelConfig::preset("qwen2.5-7b").qk_norm());
}

TEST_CASE("config: Gemma 3 1B as published (transformers 4 form: rope_local_base_freq, sliding_window_pattern)") {
  const auto c = ModelConfig::from_file(fixture("gemma-3-1b-it.json"));
  CHECK(c.architecture == Architecture::gemma3);
  CHECK(c.architecture_name() == "Gemma3ForCausalLM");
  CHECK(c.model_type() == "gemma3_text");
  CHECK(c.qk_norm());
  CHECK(c.norm_unit_offset());
  CHECK(c.sandwich_norms());
  CHECK(c.hidden_act == Activation::gelu_tanh);
  CHECK(c.head_dim == 256);
  CHECK(c.num_key_value_heads == 1);
  CHECK(c.vocab_size == 262144);
  CHECK(c.tie_word_embeddings);  // (Gemma3TextConfig's default; the file does not say)
  CHECK(c.pad_token_id == 0);
  CHECK(c.rope_theta == 1000000.0);
  CHECK(c.rope_scaling.type == RopeScaling::Type::none);
  CHECK(c.local_rope_theta == 10000.0);
  CHECK(c.embed_scale() == static_cast<double>(static_cast<float>(std::sqrt(1152.0))));
  CHECK(c.attention_scale() == 1.0 / 16);
  REQUIRE(c.sliding_layers().size() == 26);
  for (std::int64_t l = 0; l < 26; ++l) {
    CAPTURE(l);
    const bool full = (l + 1) % 6 == 0;  // layers 5, 11, 17, 23 attend over everything
    CHECK(c.attention_window(l) == (full ? 0 : 512));
    CHECK(c.rope_for_layer(l).rope_theta == (full ? 1000000.0 : 10000.0));
  }
  CHECK_NOTHROW(c.check_sequence_length(8192));  // longer than the window: the sliding layers slide
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == op_spec_count(c));
  CHECK(c.param_count() == 999'885'952);
  check_round_trip(c);
  // transformers 5 writes the same model with rope_parameters per layer type and layer_types
  const json j = c.to_json();
  CHECK(j.at("rope_parameters").at("sliding_attention").at("rope_theta") == 10000.0);
  CHECK(j.at("rope_parameters").at("full_attention").at("rope_type") == "default");
  CHECK(j.at("layer_types").size() == 26);
  CHECK_FALSE(j.contains("rope_theta"));
}

TEST_CASE("config: Gemma 3 as transformers 5 writes it (the family fixture: scaled full layers, per-type rope)") {
  const auto c = ModelConfig::from_file(fs::path(MEGATRAIN_TEST_CONFIGS) / ".." / ".." / "fixtures" / "gemma3" / "config.json");
  CHECK(c.architecture == Architecture::gemma3);
  CHECK(c.sliding_layers() == std::vector<bool>{true, false, true});
  CHECK(c.sliding_window == 4);
  CHECK(c.rope_theta == 1000000.0);
  CHECK(c.rope_scaling.type == RopeScaling::Type::linear);
  CHECK(c.rope_scaling.factor == 8.0);
  CHECK(c.local_rope_theta == 10000.0);
  CHECK(c.local_rope_scaling.type == RopeScaling::Type::none);
  CHECK(c.rope_for_layer(0).rope_scaling.type == RopeScaling::Type::none);
  CHECK(c.rope_for_layer(1).rope_scaling.type == RopeScaling::Type::linear);
  CHECK(c.query_pre_attn_scalar == 12.0);
  CHECK(c.pad_token_id == 5);
  check_round_trip(c);
  // the same model in transformers 4's form: rope_scaling for the full layers, rope_local_base_freq
  json old = c.to_json();
  old.erase("rope_parameters");
  old.erase("layer_types");
  old["rope_theta"] = 1000000.0;
  old["rope_local_base_freq"] = 10000.0;
  old["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  old["sliding_window_pattern"] = 2;  // sliding, full, sliding
  check_same(ModelConfig::from_json(old, "gemma3 (transformers 4)"), c);
}

TEST_CASE("config: Gemma 3's refusals name the field") {
  const json g = ModelConfig::preset("gemma-3-1b").to_json();
  CHECK(contains(error_of(with(g, "final_logit_softcapping", 30.0)), "'final_logit_softcapping'"));
  CHECK(contains(error_of(with(g, "attn_logit_softcapping", 50.0)), "'attn_logit_softcapping'"));
  CHECK(contains(error_of(with(g, "hidden_activation", "gelu")), "hidden_activation \"gelu\""));
  CHECK(contains(error_of(with(g, "use_bidirectional_attention", true)), "'use_bidirectional_attention'"));
  CHECK(contains(error_of(with(g, "mlp_bias", true)), "'mlp_bias'"));
  CHECK(contains(error_of(with(g, "attention_dropout", 0.1)), "'attention_dropout'"));
  CHECK(contains(error_of(with(g, "layer_types", json::array({"full_attention"}))), "layer_types"));
  CHECK(contains(error_of(with(g, "architectures", json::array({"Gemma3ForConditionalGeneration"}))),
                 "whose model_type is 'gemma3'"));
  CHECK(contains(error_of(json{{"architectures", json::array({"Gemma3ForConditionalGeneration"})}}), "'text_config'"));
  // Gemma's parts are refused on another family (a config assembled by hand)
  auto c = ModelConfig::preset("qwen2.5-0.5b");
  c.hidden_act = Activation::gelu_tanh;
  CHECK(contains(error_of([&] { c.validate("hand-made"); }), "MLP activation is silu, not gelu_pytorch_tanh"));
}

TEST_CASE("config: Gemma3ForConditionalGeneration (4B and larger) is its language model, the text_config's gaps Gemma3TextConfig's defaults") {
  // google/gemma-3-4b-it's config.json, as published: a sparse text_config beside the vision tower's
  const json mm = json::parse(R"({"architectures":["Gemma3ForConditionalGeneration"],"model_type":"gemma3",
    "boi_token_index":255999,"eoi_token_index":256000,"eos_token_id":[1,106],"image_token_index":262144,
    "initializer_range":0.02,"mm_tokens_per_image":256,"torch_dtype":"bfloat16","transformers_version":"4.50.0.dev0",
    "text_config":{"hidden_size":2560,"intermediate_size":10240,"model_type":"gemma3_text","num_hidden_layers":34,
      "rope_scaling":{"factor":8.0,"rope_type":"linear"},"sliding_window":1024},
    "vision_config":{"hidden_size":1152,"image_size":896,"intermediate_size":4304,"model_type":"siglip_vision_model",
      "num_attention_heads":16,"num_hidden_layers":27,"patch_size":14,"vision_use_head":false}})");
  const ModelConfig c = ModelConfig::from_json(mm, "gemma-3-4b-it");
  CHECK(c.checkpoint_prefix == "language_model.");
  CHECK(c.architecture == Architecture::gemma3);
  CHECK(c.to_json() == ModelConfig::preset("gemma-3-4b").to_json());  // (the published language model's shape)
  const auto text = ModelConfig::language_model_config(mm);
  REQUIRE(text.has_value());
  CHECK(text->at("architectures") == json::array({"Gemma3ForCausalLM"}));
  CHECK(text->at("torch_dtype") == "bfloat16");  // (the wrapper's, which the checkpoint's tensors are checked against)
  CHECK(!ModelConfig::language_model_config(ModelConfig::preset("gemma-3-1b").to_json()).has_value());
  // what is not a Gemma 3 language model is refused, naming it
  auto bad = mm;
  bad["text_config"]["model_type"] = "llama";
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(bad, "x"); }), "text_config's model_type is \"llama\""));
  bad = mm;
  bad["model_type"] = "paligemma";
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(bad, "x"); }), "model_type is \"paligemma\""));
  bad = mm;
  bad["text_config"]["final_logit_softcapping"] = 30.0;
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(bad, "x"); }), "text_config of Gemma3ForConditionalGeneration"));
}

TEST_CASE("config: Qwen3_5ForConditionalGeneration and its MoE are their language models, read under model.language_model.") {
  // The Hub's form of every Qwen3.5: the text model's config in text_config, its tensors under
  // model.language_model. with lm_head.weight at the top, the vision tower and mtp.* beside them.
  json text = ModelConfig::preset("qwen3.5-2b").to_json();
  text.erase("architectures");
  text["model_type"] = "qwen3_5_text";
  const json mm{{"architectures", {"Qwen3_5ForConditionalGeneration"}}, {"model_type", "qwen3_5"}, {"text_config", text},
                {"vision_config", {{"depth", 24}, {"hidden_size", 1024}}}, {"tie_word_embeddings", true}};
  const ModelConfig c = ModelConfig::from_json(mm, "Qwen3.5-2B");
  CHECK(c.to_json() == ModelConfig::preset("qwen3.5-2b").to_json());
  CHECK(c.architecture_name() == "Qwen3_5ForCausalLM");
  CHECK(c.wrapper_architecture == "Qwen3_5ForConditionalGeneration");
  CHECK(c.checkpoint_name("model.layers.3.linear_attn.A_log") == "model.language_model.layers.3.linear_attn.A_log");
  CHECK(c.checkpoint_name("model.embed_tokens.weight") == "model.language_model.embed_tokens.weight");
  CHECK(c.checkpoint_name("lm_head.weight") == "lm_head.weight");
  CHECK(c.param_name("model.language_model.norm.weight") == "model.norm.weight");
  CHECK(c.param_name("lm_head.weight") == "lm_head.weight");
  CHECK_FALSE(c.param_name("model.visual.blocks.0.attn.qkv.weight").has_value());
  CHECK_FALSE(c.param_name("mtp.fc.weight").has_value());
  // a text model's config names its tensors as they are
  const ModelConfig plain = ModelConfig::preset("qwen3.5-2b");
  CHECK(plain.checkpoint_name("model.norm.weight") == "model.norm.weight");
  CHECK(plain.param_name("mtp.fc.weight") == "mtp.fc.weight");
  // the MoE's wrapper, and a text_config of another family refused, naming it
  json moe_text = ModelConfig::preset("qwen3.5-35b-a3b").to_json();
  moe_text.erase("architectures");
  const json moe{{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"text_config", moe_text}};
  const ModelConfig cm = ModelConfig::from_json(moe, "Qwen3.5-35B-A3B");
  CHECK(cm.to_json() == ModelConfig::preset("qwen3.5-35b-a3b").to_json());
  CHECK(cm.checkpoint_model_prefix == "model.language_model.");
  auto bad = mm;
  bad["text_config"]["model_type"] = "qwen3";
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(bad, "x"); }), "text_config's model_type is \"qwen3\", not 'qwen3_5_text'"));
}

TEST_CASE("config: Phi-3 mini 4k (fused projections in the checkpoint, a window, pad_token_id)") {
  const auto c = ModelConfig::from_file(fixture("phi-3-mini-4k.json"));
  CHECK(c.architecture == Architecture::phi3);
  CHECK(c.architecture_name() == "Phi3ForCausalLM");
  CHECK(c.fused_projections());
  CHECK_FALSE(c.qk_norm());
  CHECK(c.hidden_size == 3072);
  CHECK(c.num_key_value_heads == 32);
  CHECK(c.head_dim == 96);
  CHECK(c.vocab_size == 32064);
  REQUIRE(c.sliding_window.has_value());
  CHECK(*c.sliding_window == 2047);
  REQUIRE(c.pad_token_id.has_value());
  CHECK(*c.pad_token_id == 32000);
  CHECK_FALSE(c.qkv_bias);
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == 3'821'079'552);  // Phi-3-mini: 3.8B
  check_round_trip(c);
  json j = json::parse(std::ifstream(fixture("phi-3-mini-4k.json")));
  j["resid_pdrop"] = 0.1;
  CHECK(contains(error_of(j, "phi.json"), "resid_pdrop"));
  j["resid_pdrop"] = 0.0;
  j["partial_rotary_factor"] = 0.75;  // Phi-4-mini: 72 of the 96 dimensions turn
  const auto partial = ModelConfig::from_json(j, "phi.json");
  CHECK(partial.rotary_dim() == 72);
  CHECK(partial.rope_inv_freq().size() == 36);
  CHECK(partial.rope_inv_freq()[1] == std::pow(10000.0, -2.0 / 72));
  check_round_trip(partial);
  j.erase("partial_rotary_factor");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.75}};
  CHECK(ModelConfig::from_json(j, "phi.json").rotary_dim() == 72);  // where transformers 5 writes it
  j["rope_parameters"]["partial_rotary_factor"] = 0.01;  // (no dimension would turn)
  CHECK(contains(error_of(j, "phi.json"), "partial_rotary_factor"));
  j.erase("rope_parameters");
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {1.0}}};
  CHECK(contains(error_of(j, "phi.json"), "rotary_dim / 2"));  // 48 factors each for head_dim 96
  // Phi-3-mini-128k's kind: the factors, the original context at the top level
  std::vector<double> short_f(48), long_f(48);
  for (std::size_t i = 0; i < 48; ++i) {
    short_f[i] = 1.0 + 0.01 * static_cast<double>(i);
    long_f[i] = 1.0 + 0.5 * static_cast<double>(i);
  }
  j["rope_scaling"] = {{"type", "longrope"}, {"short_factor", short_f}, {"long_factor", long_f}};
  j["max_position_embeddings"] = 131072;
  const auto lr = ModelConfig::from_json(j);
  CHECK(lr.rope_scaling.type == RopeScaling::Type::longrope);
  CHECK(lr.rope_scaling.original_max_position_embeddings == 4096);
  CHECK(lr.rope_attention_scaling() == doctest::Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))));
  const auto short_freq = lr.rope_inv_freq(4096), long_freq = lr.rope_inv_freq(4097);
  for (std::size_t i = 0; i < 48; ++i) {
    const double base = std::pow(10000.0, -static_cast<double>(2 * i) / 96.0);
    CHECK(short_freq[i] == doctest::Approx(base / short_f[i]).epsilon(1e-12));
    CHECK(long_freq[i] == doctest::Approx(base / long_f[i]).epsilon(1e-12));
  }
  check_round_trip(lr);
  j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = 4096;
  j["pad_token_id"] = 40000;
  CHECK(contains(error_of(j, "phi.json"), "pad_token_id"));
  j["pad_token_id"] = -1;  // nn.Embedding counts a negative padding_idx from the end
  CHECK(ModelConfig::from_json(j).pad_token_id == 32063);
}

TEST_CASE("config: Qwen3's attention_bias, sliding layers and refusals") {
  json j = json::parse(R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
    "vocab_size":100})");
  const auto plain = ModelConfig::from_json(j);
  CHECK(plain.max_position_embeddings == 32768);  // Qwen3Config's default
  CHECK(plain.head_dim == 32);                    // wider q than hidden: 4 x 32 = 128
  CHECK(plain.q_dim() == 128);
  j["attention_bias"] = true;
  const auto biased = ModelConfig::from_json(j);
  CHECK(biased.qkv_bias);
  CHECK(biased.o_bias);  // one attention_bias for q, k, v and o, as transformers builds Qwen3Attention
  check_round_trip(biased);
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  j["sliding_window"] = 512;
  const auto sliding = ModelConfig::from_json(j);
  REQUIRE(sliding.sliding_window.has_value());
  CHECK(*sliding.sliding_window == 512);
  CHECK_NOTHROW(sliding.check_sequence_length(512));
  CHECK(contains(error_of([&] { sliding.check_sequence_length(513); }), "sliding_window"));
  check_round_trip(sliding);
  j["layer_types"] = {"full_attention", "full_attention"};
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(j, "q3.json"); }), "layer_types"));
  j["layer_types"] = {"full_attention", "chunked_attention", "full_attention"};
  CHECK(contains(error_of([&] { (void)ModelConfig::from_json(j, "q3.json"); }), "chunked_attention"));
  j.erase("layer_types");
  j["mlp_bias"] = true;
  const auto msg = error_of([&] { (void)ModelConfig::from_json(j, "q3.json"); });
  CHECK(contains(msg, "q3.json"));
  CHECK(contains(msg, "mlp_bias"));
  j.erase("mlp_bias");
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j.erase("model_type");
  const auto unsupported = error_of([&] { (void)ModelConfig::from_json(j, "q3.json"); });
  CHECK(contains(unsupported, "DeepseekV3ForCausalLM"));
  CHECK(contains(unsupported, "Qwen3ForCausalLM"));  // the supported list names it
}

TEST_CASE("config: Llama 3.2 1B (llama3 rope scaling, explicit head_dim, tied embeddings)") {
  const auto c = ModelConfig::from_file(fixture("llama-3.2-1b.json"));
  CHECK(c.architecture == Architecture::llama);
  CHECK(c.hidden_size == 2048);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 64);
  CHECK(c.q_dim() == 2048);
  CHECK(c.kv_dim() == 512);
  CHECK(c.vocab_size == 128256);
  CHECK(c.max_position_embeddings == 131072);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.rope_scaling.type == RopeScaling::Type::llama3);
  CHECK(c.rope_scaling.factor == 32.0);
  CHECK(c.rope_scaling.low_freq_factor == 1.0);
  CHECK(c.rope_scaling.high_freq_factor == 4.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(c.tie_word_embeddings);
  CHECK_FALSE(c.qkv_bias);
  CHECK_FALSE(c.mlp_bias);
  CHECK(c.param_count() == 1'235'814'400);  // Llama-3.2-1B
  CHECK(c.param_count() == state_dict_count(c));
  check_same(c, ModelConfig::preset("llama-3.2-1b"));
  check_round_trip(c);
}

TEST_CASE("config: Llama 3.2 3B in transformers-5 form (rope_theta and scaling inside rope_parameters)") {
  const auto c = ModelConfig::from_file(fixture("llama-3.2-3b-transformers5.json"));
  CHECK(c.rope_theta == 500000.0);  // only in rope_parameters
  CHECK(c.rope_scaling.type == RopeScaling::Type::llama3);
  CHECK(c.rope_scaling.factor == 32.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
  CHECK(c.head_dim == 128);
  CHECK(c.num_attention_heads == 24);
  CHECK(c.param_count() == 3'212'749'824);  // Llama-3.2-3B
  check_same(c, ModelConfig::preset("llama-3.2-3b"));
  check_round_trip(c);
}

TEST_CASE("config: Mistral 7B v0.1 (sliding_window 4096)") {
  const auto c = ModelConfig::from_file(fixture("mistral-7b-v0.1.json"));
  CHECK(c.architecture == Architecture::mistral);
  CHECK(c.architecture_name() == "MistralForCausalLM");
  CHECK(c.model_type() == "mistral");
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.vocab_size == 32000);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.sliding_window == std::optional<std::int64_t>(4096));
  CHECK_FALSE(c.qkv_bias);
  CHECK(c.param_count() == 7'241'732'096);  // Mistral-7B-v0.1
  CHECK(c.param_count() == state_dict_count(c));
  CHECK_NOTHROW(c.check_sequence_length(1));
  CHECK_NOTHROW(c.check_sequence_length(4096));
  const auto msg = error_of([&] { c.check_sequence_length(4097); });
  CHECK(contains(msg, "sequence length 4097"));
  CHECK(contains(msg, "MistralForCausalLM"));
  CHECK(contains(msg, "sliding_window 4096"));
  check_round_trip(c);
}

TEST_CASE("config: Mistral 7B v0.3 (sliding_window null)") {
  const auto c = ModelConfig::from_file(fixture("mistral-7b-v0.3.json"));
  CHECK(c.architecture == Architecture::mistral);
  CHECK(c.vocab_size == 32768);
  CHECK(c.rope_theta == 1000000.0);
  CHECK_FALSE(c.sliding_window.has_value());
  CHECK_NOTHROW(c.check_sequence_length(32768));
  CHECK_NOTHROW(c.check_sequence_length(std::int64_t{1} << 20));
  CHECK(c.param_count() == 7'248'023'552);  // Mistral-7B-v0.3
  check_same(c, ModelConfig::preset("mistral-7b"));
  check_round_trip(c);
}

TEST_CASE("config: Mistral without a sliding_window key gets transformers' default window of 4096") {
  auto j = json::parse(std::ifstream(fixture("mistral-7b-v0.1.json")));
  j.erase("sliding_window");
  CHECK(ModelConfig::from_json(j).sliding_window == std::optional<std::int64_t>(4096));
  j["sliding_window"] = nullptr;
  CHECK_FALSE(ModelConfig::from_json(j).sliding_window.has_value());
  j["sliding_window"] = 1000;
  CHECK(ModelConfig::from_json(j).sliding_window == std::optional<std::int64_t>(1000));
}

TEST_CASE("config: Qwen2.5 1.5B (q/k/v bias implied, tied embeddings, unused sliding_window)") {
  const auto c = ModelConfig::from_file(fixture("qwen2.5-1.5b.json"));
  CHECK(c.architecture == Architecture::qwen2);
  CHECK(c.architecture_name() == "Qwen2ForCausalLM");
  CHECK(c.model_type() == "qwen2");
  CHECK(c.hidden_size == 1536);
  CHECK(c.num_attention_heads == 12);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.head_dim == 128);
  CHECK(c.qkv_bias);  // not in the file: Qwen2 always has it
  CHECK_FALSE(c.o_bias);
  CHECK_FALSE(c.mlp_bias);
  CHECK(c.tie_word_embeddings);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.rope_theta == 1000000.0);
  CHECK_FALSE(c.sliding_window.has_value());  // "sliding_window": 131072 but "use_sliding_window": false
  CHECK(c.param_count() == 1'543'714'304);    // Qwen2.5-1.5B
  CHECK(c.param_count() == state_dict_count(c));
  // The preset is the same model but for the context length (the preset keeps 32768).
  auto preset = ModelConfig::preset("qwen2.5-1.5b");
  CHECK(preset.max_position_embeddings == 32768);
  preset.max_position_embeddings = c.max_position_embeddings;
  check_same(c, preset);
  check_round_trip(c);
}

TEST_CASE("config: Qwen2.5 7B in transformers-5 form (rope_parameters with rope_type default)") {
  const auto c = ModelConfig::from_file(fixture("qwen2.5-7b-transformers5.json"));
  CHECK(c.architecture == Architecture::qwen2);
  CHECK(c.rope_theta == 1000000.0);  // only in rope_parameters
  CHECK(c.rope_scaling.type == RopeScaling::Type::none);
  CHECK(c.qkv_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK_FALSE(c.sliding_window.has_value());
  CHECK(c.param_count() == 7'615'616'512);  // Qwen2.5-7B
  CHECK(c.param_count() == state_dict_count(c));
  check_round_trip(c);
}

TEST_CASE("config: Qwen2 with use_sliding_window reads the window") {
  auto j = json::parse(std::ifstream(fixture("qwen2.5-1.5b.json")));
  j["use_sliding_window"] = true;
  j["sliding_window"] = 4096;
  const auto c = ModelConfig::from_json(j);
  CHECK(c.sliding_window == std::optional<std::int64_t>(4096));
  CHECK_NOTHROW(c.check_sequence_length(4096));
  CHECK(contains(error_of([&] { c.check_sequence_length(4097); }), "sliding_window 4096"));
  check_round_trip(c);
}

TEST_CASE("config: Llama attention_bias and mlp_bias") {
  auto j = base_config();
  j["attention_bias"] = true;
  auto c = ModelConfig::from_json(j);
  CHECK(c.qkv_bias);
  CHECK(c.o_bias);  // Llama's attention_bias covers o_proj too
  CHECK_FALSE(c.mlp_bias);
  CHECK(c.param_count() == state_dict_count(c));
  check_round_trip(c);
  j["mlp_bias"] = true;
  c = ModelConfig::from_json(j);
  CHECK(c.mlp_bias);
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == op_spec_count(c));
  check_round_trip(c);
}

TEST_CASE("config: model_type alone names the architecture; defaults fill optional fields") {
  auto j = without(base_config(), "architectures");
  j["model_type"] = "mistral";
  auto c = ModelConfig::from_json(j);
  CHECK(c.architecture == Architecture::mistral);
  CHECK(c.max_position_embeddings == 131072);  // MistralConfig's default
  j["model_type"] = "qwen2";
  c = ModelConfig::from_json(j);
  CHECK(c.architecture == Architecture::qwen2);
  CHECK(c.max_position_embeddings == 32768);
  j["model_type"] = "llama";
  c = ModelConfig::from_json(without(j, "num_key_value_heads"));
  CHECK(c.max_position_embeddings == 2048);
  CHECK(c.num_key_value_heads == c.num_attention_heads);  // no key: multi-head attention
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.rope_theta == 10000.0);
  CHECK(c.initializer_range == 0.02);
  CHECK_FALSE(c.tie_word_embeddings);
  // Integers written as floats are accepted when whole.
  c = ModelConfig::from_json(with(base_config(), "hidden_size", 64.0));
  CHECK(c.hidden_size == 64);
}

TEST_CASE("config: linear rope scaling, in the older \"type\" spelling and in rope_parameters") {
  auto c = ModelConfig::from_json(with(base_config(), "rope_scaling", {{"type", "linear"}, {"factor", 4.0}}));
  CHECK(c.rope_scaling.type == RopeScaling::Type::linear);
  CHECK(c.rope_scaling.factor == 4.0);
  check_round_trip(c);
  c = ModelConfig::from_json(
      with(base_config(), "rope_parameters", {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 20000.0}}));
  CHECK(c.rope_scaling.type == RopeScaling::Type::linear);
  CHECK(c.rope_scaling.factor == 2.0);
  CHECK(c.rope_theta == 20000.0);
  check_round_trip(c);
  // Precedence, as documented in docs/layers.md: rope_parameters' rope_theta over a top-level
  // one; a non-null rope_scaling over rope_parameters' scaling; "type" over "rope_type".
  auto j = with(base_config(), "rope_theta", 10000.0);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000.0}};
  CHECK(ModelConfig::from_json(j).rope_theta == 20000.0);
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 3.0}};
  CHECK(ModelConfig::from_json(j).rope_scaling.type == RopeScaling::Type::linear);
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"type", "linear"}, {"factor", 3.0}};
  CHECK(ModelConfig::from_json(j).rope_scaling.type == RopeScaling::Type::linear);
}

TEST_CASE("config: from_file names the file in its errors") {
  const fs::path dir = fs::temp_directory_path() / ("megatrain_test_config_" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const fs::path bad = dir / "config.json";
  {
    std::ofstream f(bad);
    f << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,})";  // trailing comma
  }
  auto msg = error_of([&] { (void)ModelConfig::from_file(bad); });
  CHECK(contains(msg, "malformed JSON"));
  CHECK(contains(msg, bad.string()));
  {
    std::ofstream f(bad);  // empty file
  }
  CHECK(contains(error_of([&] { (void)ModelConfig::from_file(bad); }), "malformed JSON"));
  {
    std::ofstream f(bad);
    f << R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})";  // valid JSON, fields missing
  }
  msg = error_of([&] { (void)ModelConfig::from_file(bad); });
  CHECK(contains(msg, bad.string()));
  CHECK(contains(msg, "'intermediate_size' is missing"));
  msg = error_of([&] { (void)ModelConfig::from_file(dir); });  // a model directory, not its config.json
  CHECK(contains(msg, "is a directory; give the path of the config.json in it"));
  msg = error_of([&] { (void)ModelConfig::from_file(dir / "no-such-file.json"); });
  CHECK(contains(msg, "cannot open"));
  CHECK(contains(msg, "no-such-file.json"));
  fs::remove_all(dir);
}

// ---- presets --------------------------------------------------------------------------------

TEST_CASE("config: every preset loads, validates, round-trips and agrees with the layer ops") {
  const auto names = ModelConfig::preset_names();
  CHECK(names == std::vector<std::string>{"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-72b",
                                          "qwen3-0.6b", "qwen3-8b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b",
                                          "gemma-3-27b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "mistral-7b", "smollm3-3b", "qwen3.5-27b",
                                          "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-35b-a3b",
                                          "qwen3.5-122b-a10b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b", "qwen3-30b-a3b",
                                          "mixtral-8x7b", "olmoe-1b-7b", "gpt-oss-20b", "gpt-oss-120b"});
  for (const auto& name : names) {
    CAPTURE(name);
    const auto c = ModelConfig::preset(name);
    CHECK_NOTHROW(c.validate());
    check_round_trip(c);
    CHECK(c.param_count() == state_dict_count(c));
    CHECK(c.param_count() == op_spec_count(c));  // what DecoderModel would ask HostParamStore for
    check_inv_freq(c);
  }
}

TEST_CASE("config: presets' parameter counts are the published ones") {
  CHECK(ModelConfig::preset("qwen2.5-0.5b").param_count() == 494'032'768);
  CHECK(ModelConfig::preset("qwen2.5-1.5b").param_count() == 1'543'714'304);
  CHECK(ModelConfig::preset("qwen2.5-7b").param_count() == 7'615'616'512);
  CHECK(ModelConfig::preset("qwen2.5-14b").param_count() == 14'770'033'664);
  CHECK(ModelConfig::preset("qwen2.5-72b").param_count() == 72'706'203'648);
  CHECK(ModelConfig::preset("llama-3.2-1b").param_count() == 1'235'814'400);
  CHECK(ModelConfig::preset("llama-3.2-3b").param_count() == 3'212'749'824);
  CHECK(ModelConfig::preset("llama-3.1-8b").param_count() == 8'030'261'248);
  CHECK(ModelConfig::preset("mistral-7b").param_count() == 7'248'023'552);
  CHECK(ModelConfig::preset("gemma-3-1b").param_count() == 999'885'952);
  // (OpenAI's model card: 20.91B and 116.83B in all, 3.61B and 5.13B active)
  CHECK(ModelConfig::preset("gpt-oss-20b").param_count() == 20'914'757'184);
  CHECK(ModelConfig::preset("gpt-oss-120b").param_count() == 116'829'156'672);
}

TEST_CASE("config: the Qwen3.5 and Qwen3-Next presets have the sizes their names give (text model, billions)") {
  // (the names' total and active parameters in billions; Qwen3.5's include its vision tower)
  struct Size {
    const char* preset;
    double total, active;
  };
  for (const Size& s : {Size{"qwen3.5-0.8b", 0.8, 0.8}, Size{"qwen3.5-2b", 2, 2}, Size{"qwen3.5-4b", 4, 4},
                        Size{"qwen3.5-9b", 9, 9}, Size{"qwen3.5-27b", 27, 27}, Size{"qwen3.5-35b-a3b", 35, 3},
                        Size{"qwen3.5-122b-a10b", 122, 10}, Size{"qwen3.5-397b-a17b", 397, 17},
                        Size{"qwen3-next-80b-a3b", 80, 3}}) {
    CAPTURE(s.preset);
    const auto c = ModelConfig::preset(s.preset);
    const double total = static_cast<double>(c.param_count()) / 1e9, active = static_cast<double>(c.active_param_count()) / 1e9;
    MESSAGE(std::string(s.preset) << ": " << total << "B, " << active << "B active");
    CHECK(total > 0.9 * s.total);  // (names round; the embedding is counted in active parameters here, not in all names)
    CHECK(total < 1.06 * s.total);
    CHECK(active > 0.75 * s.active);
    CHECK(active < 1.35 * s.active);
  }
}

TEST_CASE("config: an unknown preset is refused with the known names") {
  const auto msg = error_of([] { (void)ModelConfig::preset("llama-4-405b"); });
  CHECK(contains(msg, "llama-4-405b"));
  for (const auto& name : ModelConfig::preset_names()) CHECK(contains(msg, name));
}

// ---- rotary frequencies ---------------------------------------------------------------------

TEST_CASE("config: rope_inv_freq matches an independent computation") {
  SUBCASE("default") {
    const auto c = ModelConfig::from_file(fixture("llama-2-7b.json"));
    const auto f = c.rope_inv_freq();
    REQUIRE(f.size() == 64);
    CHECK(f[0] == 1.0);
    CHECK(std::abs(f[1] - std::pow(10000.0, -2.0 / 128)) <= 1e-15);
    check_inv_freq(c);
  }
  SUBCASE("linear") {
    auto j = base_config();
    const auto plain = ModelConfig::from_json(j).rope_inv_freq();
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 4.0}};
    const auto c = ModelConfig::from_json(j);
    const auto f = c.rope_inv_freq();
    for (std::size_t i = 0; i < f.size(); ++i) CHECK(f[i] == doctest::Approx(plain[i] / 4).epsilon(1e-15));
    check_inv_freq(c);
  }
  SUBCASE("yarn (Qwen2.5's long-context setting): frequencies turning often kept, slow ones divided, a ramp between") {
    auto j = base_config();
    j["head_dim"] = 128;
    j["hidden_size"] = 512;
    j["rope_theta"] = 1000000.0;
    j["max_position_embeddings"] = 32768;
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
    const auto c = ModelConfig::from_json(j);
    CHECK(c.rope_scaling.type == RopeScaling::Type::yarn);
    auto plain_cfg = c;
    plain_cfg.rope_scaling = {};
    const auto plain = plain_cfg.rope_inv_freq(), f = c.rope_inv_freq();
    CHECK(f.front() == plain.front());                                       // fast: extrapolated
    CHECK(f.back() == doctest::Approx(plain.back() / 4).epsilon(1e-12));     // slow: interpolated
    check_inv_freq(c);
    CHECK(c.rope_attention_scaling() == doctest::Approx(0.1 * std::log(4.0) + 1).epsilon(1e-15));
    check_round_trip(c);
    // the attention factor given, or from mscale and mscale_all_dim (DeepSeek's spelling)
    j["rope_scaling"]["attention_factor"] = 1.25;
    CHECK(ModelConfig::from_json(j).rope_attention_scaling() == 1.25);
    j["rope_scaling"].erase("attention_factor");
    j["rope_scaling"]["mscale"] = 0.707;
    j["rope_scaling"]["mscale_all_dim"] = 1.0;
    CHECK(ModelConfig::from_json(j).rope_attention_scaling() ==
          doctest::Approx((0.1 * 0.707 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1)).epsilon(1e-15));
    // no factor: max_position_embeddings / original_max_position_embeddings; other betas; no truncation
    j["rope_scaling"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 4096}, {"beta_fast", 16.0},
                         {"beta_slow", 2.0}, {"truncate", false}};
    const auto d = ModelConfig::from_json(j);
    CHECK(d.yarn_factor() == 8.0);
    check_inv_freq(d);
    check_round_trip(d);
    CHECK(ModelConfig::from_json(j).rope_attention_scaling() == doctest::Approx(0.1 * std::log(8.0) + 1).epsilon(1e-15));
    // and a type it does not take is named
    j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
    const auto msg = error_of([&] { (void)ModelConfig::from_json(j, "cfg.json"); });
    CHECK(contains(msg, "'dynamic' is not supported (supported: default, linear, llama3, yarn, longrope)"));
  }
  SUBCASE("llama3: high frequencies kept, low ones divided by factor, the band between blended") {
    const auto c = ModelConfig::from_file(fixture("llama-3.2-1b.json"));
    auto plain_cfg = c;
    plain_cfg.rope_scaling = {};
    const auto plain = plain_cfg.rope_inv_freq();
    const auto f = c.rope_inv_freq();
    int kept = 0, divided = 0, blended = 0;
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (f[i] == plain[i]) ++kept;
      else if (std::abs(f[i] - plain[i] / 32) <= 1e-15 * plain[i]) ++divided;
      else if (f[i] < plain[i] && f[i] > plain[i] / 32) ++blended;
    }
    CHECK(kept > 0);
    CHECK(divided > 0);
    CHECK(blended > 0);
    CHECK(kept + divided + blended == static_cast<int>(f.size()));
    check_inv_freq(c);
    // Other factors and a shorter original context.
    auto j = json::parse(std::ifstream(fixture("llama-3.2-1b.json")));
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 2.0},
                         {"high_freq_factor", 8.0},
                         {"original_max_position_embeddings", 4096}};
    check_inv_freq(ModelConfig::from_json(j));
  }
}

// ---- errors ---------------------------------------------------------------------------------

TEST_CASE("config errors: unknown architecture, named") {
  auto msg = error_of(with(base_config(), "architectures", {"GPT2LMHeadModel"}));
  CHECK(contains(msg, "'GPT2LMHeadModel' is not supported"));
  CHECK(contains(msg, "LlamaForCausalLM"));  // and what is
  auto j = without(base_config(), "architectures");
  j["model_type"] = "gpt2";
  CHECK(contains(error_of(j), "model_type 'gpt2' is not supported"));
  CHECK(contains(error_of(without(base_config(), "architectures")), "neither 'architectures' nor 'model_type'"));
  CHECK(contains(error_of(with(base_config(), "architectures", json::array())), "'architectures' must be"));
  CHECK(contains(error_of(with(base_config(), "architectures", "LlamaForCausalLM")), "'architectures' must be"));
}

TEST_CASE("config errors: 'architectures' and 'model_type' that name different models") {
  const std::pair<const char*, const char*> archs[] = {
      {"LlamaForCausalLM", "llama"}, {"MistralForCausalLM", "mistral"}, {"Qwen2ForCausalLM", "qwen2"}};
  for (const auto& [arch, own_type] : archs) {
    auto j = with(base_config(), "architectures", {arch});
    j["model_type"] = own_type;
    CHECK_NOTHROW((void)ModelConfig::from_json(j));  // agreeing: every real config.json has both
    for (const char* other : {"llama", "mistral", "qwen2", "gpt2", "Llama"}) {
      if (std::string_view(other) == own_type) continue;
      CAPTURE(arch);
      CAPTURE(other);
      j["model_type"] = other;
      const auto msg = error_of(j, "my/config.json");
      CHECK(contains(msg, "my/config.json: 'architectures' and 'model_type' disagree"));
      CHECK(contains(msg, std::string("architectures names ") + arch + ", whose model_type is '" + own_type + "'"));
      CHECK(contains(msg, std::string("but model_type is '") + other + "'"));
    }
  }
  // The issue's example, and a model_type that is not a string.
  auto j = with(base_config(), "architectures", {"Qwen2ForCausalLM"});
  j["model_type"] = "llama";
  CHECK(contains(error_of(j), "Qwen2ForCausalLM, whose model_type is 'qwen2', but model_type is 'llama'"));
  CHECK(contains(error_of(with(base_config(), "model_type", 3)), "'model_type' must be a string, not number"));
  CHECK_NOTHROW((void)ModelConfig::from_json(with(base_config(), "model_type", nullptr)));  // null: as if absent
}

TEST_CASE("config errors: attention_bias or mlp_bias on Qwen2 and Mistral, which have no such option") {
  // Qwen2Config and MistralConfig have neither key; transformers ignores them (Qwen2 always has
  // q/k/v biases and no o_proj or MLP bias, Mistral no bias). `true` is refused, `false` is not.
  for (const char* fixture_name : {"qwen2.5-1.5b.json", "mistral-7b-v0.3.json"}) {
    const auto file = json::parse(std::ifstream(fixture(fixture_name)));
    const std::string arch = file.at("architectures").at(0).get<std::string>();
    const bool qwen2 = arch == "Qwen2ForCausalLM";
    for (const char* key : {"attention_bias", "mlp_bias"}) {
      CAPTURE(fixture_name);
      CAPTURE(key);
      REQUIRE_FALSE(file.contains(key));  // the published files do not have them
      const auto msg = error_of(with(file, key, true), "my/config.json");
      CHECK(contains(msg, std::string("my/config.json: '") + key + "' is true, but " + arch + " has no such option"));
      CHECK(contains(msg, qwen2 ? "q/k/v projections always have a bias" : "no bias in attention or MLP"));
      // Named by model_type alone, the same.
      CHECK(contains(error_of(without(with(file, key, true), "architectures")), std::string("'") + key + "' is true"));
      // false describes the model transformers builds anyway: accepted, biases as without it.
      const auto c = ModelConfig::from_json(with(file, key, false));
      CHECK(c.qkv_bias == qwen2);
      CHECK_FALSE(c.o_bias);
      CHECK_FALSE(c.mlp_bias);
      CHECK(contains(error_of(with(file, key, "true")), std::string("'") + key + "' must be true or false"));
    }
  }
  // Llama 3's config.json carries "attention_bias": false and "mlp_bias": false: accepted.
  const auto llama3 = json::parse(std::ifstream(fixture("llama-3.2-1b.json")));
  REQUIRE(llama3.at("attention_bias") == false);
  REQUIRE(llama3.at("mlp_bias") == false);
  CHECK_NOTHROW((void)ModelConfig::from_json(llama3));
}

TEST_CASE("config errors: validate() refuses biases the architecture cannot have") {
  struct Case {
    const char* preset;
    bool qkv, o, mlp;
    const char* message;  // empty: valid
  };
  const Case cases[] = {
      {"llama-3.2-1b", false, false, false, ""},
      {"llama-3.2-1b", true, true, true, ""},
      {"llama-3.2-1b", true, false, false, "qkv_bias (true) and o_bias (false) must agree for LlamaForCausalLM"},
      {"llama-3.2-1b", false, true, false, "qkv_bias (false) and o_bias (true) must agree"},
      {"qwen2.5-0.5b", true, false, false, ""},
      {"qwen2.5-0.5b", false, false, false, "Qwen2ForCausalLM has q/k/v biases and no o_proj or MLP bias"},
      {"qwen2.5-0.5b", true, true, false, "(got qkv_bias true, o_bias true, mlp_bias false)"},
      {"qwen2.5-0.5b", true, false, true, "Qwen2ForCausalLM has q/k/v biases"},
      {"mistral-7b", false, false, false, ""},
      {"mistral-7b", true, false, false, "MistralForCausalLM has no biases"},
      {"mistral-7b", false, true, false, "MistralForCausalLM has no biases"},
      {"mistral-7b", false, false, true, "(got qkv_bias false, o_bias false, mlp_bias true)"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.preset);
    CAPTURE(k.message);
    auto c = ModelConfig::preset(k.preset);
    c.qkv_bias = k.qkv;
    c.o_bias = k.o;
    c.mlp_bias = k.mlp;
    if (std::string_view(k.message).empty()) {
      CHECK_NOTHROW(c.validate());
      check_round_trip(c);
    } else {
      const auto msg = error_of([&] { c.validate("hand-built"); });
      CHECK(contains(msg, "hand-built: "));
      CHECK(contains(msg, k.message));
    }
  }
}

TEST_CASE("config errors: a missing required field is named, with the source") {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"}) {
    CAPTURE(field);
    const auto msg = error_of(without(base_config(), field), "my/config.json");
    CHECK(contains(msg, std::string("'") + field + "' is missing"));
    CHECK(contains(msg, "my/config.json"));
    CHECK(contains(error_of(with(base_config(), field, nullptr)), std::string("'") + field + "' is missing"));
  }
  CHECK(contains(error_of(with(base_config(), "rope_scaling", {{"rope_type", "linear"}})), "'factor' is missing"));
  CHECK(contains(error_of(with(base_config(), "rope_scaling", {{"rope_type", "llama3"}})), "'factor' is missing"));
  auto j = json::parse(std::ifstream(fixture("qwen2.5-1.5b.json")));
  j["use_sliding_window"] = true;
  j.erase("sliding_window");
  CHECK(contains(error_of(j), "'sliding_window' is missing"));
}

TEST_CASE("config errors: wrong JSON types") {
  CHECK(contains(error_of(json::array({1, 2})), "must be a JSON object"));
  CHECK(contains(error_of(with(base_config(), "hidden_size", "64")), "'hidden_size' must be an integer, not string"));
  CHECK(contains(error_of(with(base_config(), "hidden_size", 64.5)), "'hidden_size' must be an integer"));
  CHECK(contains(error_of(with(base_config(), "hidden_size", 1e30)), "'hidden_size' must be an integer"));
  CHECK(contains(error_of(with(base_config(), "hidden_size", true)), "'hidden_size' must be an integer"));
  CHECK(contains(error_of(with(base_config(), "num_attention_heads", json::array({4}))),
                 "'num_attention_heads' must be an integer"));
  CHECK(contains(error_of(with(base_config(), "rms_norm_eps", "1e-5")), "'rms_norm_eps' must be a number"));
  CHECK(contains(error_of(with(base_config(), "rope_theta", json::object())), "'rope_theta' must be a number"));
  CHECK(contains(error_of(with(base_config(), "tie_word_embeddings", "true")), "'tie_word_embeddings' must be true or false"));
  CHECK(contains(error_of(with(base_config(), "attention_bias", 1)), "'attention_bias' must be true or false"));
  CHECK(contains(error_of(with(base_config(), "rope_scaling", "llama3")), "rope_scaling must be an object"));
  CHECK(contains(error_of(with(base_config(), "rope_parameters", json::array())), "rope_parameters must be an object"));
  CHECK(contains(error_of(with(base_config(), "rope_scaling", {{"rope_type", 3}, {"factor", 8.0}})),
                 "'rope_type' must be a string"));
  CHECK(contains(error_of(with(base_config(), "rope_scaling", {{"rope_type", "linear"}, {"factor", "4"}})),
                 "'factor' must be a number"));
  CHECK(contains(error_of(with(base_config(), "hidden_act", 1)), "hidden_act 1 is not supported"));
  auto j = json::parse(std::ifstream(fixture("mistral-7b-v0.1.json")));
  j["sliding_window"] = "4096";
  CHECK(contains(error_of(j), "'sliding_window' must be an integer"));
}

TEST_CASE("config errors: inconsistent head counts and sizes") {
  SUBCASE("hidden_size not a multiple of the heads, without head_dim") {
    auto j = with(base_config(), "hidden_size", 100);
    j["num_attention_heads"] = 3;
    j["num_key_value_heads"] = 1;
    CHECK(contains(error_of(j), "hidden_size 100 is not a multiple of num_attention_heads 3 and no head_dim is given"));
    j["head_dim"] = 32;  // an explicit head_dim makes it a valid shape
    const auto c = ModelConfig::from_json(j);
    CHECK(c.q_dim() == 96);
    CHECK(c.param_count() == op_spec_count(c));
  }
  SUBCASE("key/value heads that do not divide the heads") {
    CHECK(contains(error_of(with(base_config(), "num_key_value_heads", 3)),
                   "num_key_value_heads 3 does not divide num_attention_heads 4"));
  }
  SUBCASE("odd head_dim, given or implied") {
    CHECK(contains(error_of(with(base_config(), "head_dim", 15)), "head_dim must be even for rotary embeddings (got 15)"));
    auto j = with(base_config(), "hidden_size", 12);
    CHECK(contains(error_of(j), "head_dim must be even for rotary embeddings (got 3)"));
  }
  SUBCASE("non-positive sizes") {
    for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"}) {
      for (int v : {0, -4}) {
        CAPTURE(field);
        CAPTURE(v);
        CHECK(contains(error_of(with(base_config(), field, v)), std::string(field) + " must be > 0"));
      }
    }
    CHECK(contains(error_of(with(base_config(), "rms_norm_eps", 0.0)), "rms_norm_eps must be > 0"));
    CHECK(contains(error_of(with(base_config(), "rms_norm_eps", -1e-6)), "rms_norm_eps must be > 0"));
    CHECK(contains(error_of(with(base_config(), "rope_theta", 1.0)), "rope_theta must be > 1"));
    CHECK(contains(error_of(with(base_config(), "vocab_size", std::int64_t{1} << 31)), "does not fit 32-bit token ids"));
    auto j = json::parse(std::ifstream(fixture("mistral-7b-v0.1.json")));
    j["sliding_window"] = 0;
    CHECK(contains(error_of(j), "sliding_window must be > 0"));
    CHECK(contains(error_of(with(base_config(), "rope_scaling", {{"rope_type", "linear"}, {"factor", 0.0}})),
                   "rope scaling factor must be > 0"));
    CHECK(contains(error_of(with(base_config(), "rope_scaling",
                                 {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 4.0}, {"high_freq_factor", 4.0}})),
                   "high_freq_factor > low_freq_factor"));
  }
}

TEST_CASE("config errors: unsupported rope scaling and activation are named") {
  for (const char* type : {"dynamic", "ntk"}) {
    CAPTURE(type);
    const auto msg = error_of(with(base_config(), "rope_scaling", {{"rope_type", type}, {"factor", 4.0}}));
    CHECK(contains(msg, std::string("rope scaling type '") + type + "' is not supported"));
    CHECK(contains(msg, "default, linear, llama3, yarn, longrope"));
    CHECK(contains(error_of(with(base_config(), "rope_parameters", {{"rope_type", type}, {"factor", 4.0}})),
                   std::string("'") + type + "'"));
  }
  for (const char* act : {"gelu", "gelu_pytorch_tanh", "relu"}) {
    CAPTURE(act);
    CHECK(contains(error_of(with(base_config(), "hidden_act", act)),
                   std::string("hidden_act \"") + act + "\" is not supported"));
  }
}

TEST_CASE("config errors: sequence lengths") {
  const auto c = ModelConfig::from_json(base_config());
  CHECK_NOTHROW(c.check_sequence_length(100000));  // no window: any length is exact
  CHECK(contains(error_of([&] { c.check_sequence_length(0); }), "sequence length must be > 0"));
  CHECK(contains(error_of([&] { c.check_sequence_length(-1); }), "sequence length must be > 0"));
}

TEST_CASE("config errors: sizes whose products overflow 64 bits are refused, not wrapped") {
  const json b = base_config();
  const std::int64_t huge = std::int64_t{1} << 62;
  for (const char* key : {"hidden_size", "intermediate_size", "vocab_size"}) {
    CAPTURE(key);
    json j = with(b, key, huge);
    if (std::string_view(key) == "hidden_size") j["head_dim"] = 16;  // (so that only the products overflow)
    const std::string e = error_of(j, "big.json");
    CHECK(contains(e, "big.json"));
    CHECK(contains(e, "64 bits"));
  }
  CHECK(contains(error_of(with(b, "num_attention_heads", huge)), "num_attention_heads"));
  // Layers and head widths are bounded before anything sized by them is built (a per-layer table,
  // rotary frequencies): far beyond any model, and refused at once
  for (const std::int64_t layers : {huge, std::int64_t{1000000000}, ModelConfig::kMaxLayers + 1}) {
    const std::string e = error_of(with(b, "num_hidden_layers", layers), "deep.json");
    CHECK(contains(e, "deep.json"));
    CHECK(contains(e, fmt::format("num_hidden_layers {} is beyond any model (at most {})", layers, ModelConfig::kMaxLayers)));
  }
  json gemma = b;
  gemma["architectures"] = json::array({"Gemma3ForCausalLM"});
  gemma["model_type"] = "gemma3_text";
  gemma["num_hidden_layers"] = 1000000000;  // (Gemma 3 keeps a table per layer: bounded first)
  CHECK(contains(error_of(gemma), "num_hidden_layers 1000000000 is beyond any model (at most 65536)"));
  json wide = with(b, "head_dim", ModelConfig::kMaxHeadDim * 2);
  CHECK(contains(error_of(wide), fmt::format("head_dim {} is beyond any model (at most {})", ModelConfig::kMaxHeadDim * 2,
                                             ModelConfig::kMaxHeadDim)));
  CHECK_NOTHROW(ModelConfig::from_json(with(b, "num_hidden_layers", 300)));
  // and a shape that would overflow is an error wherever it is built
  CHECK(contains(error_of([] { (void)Shape{std::int64_t{1} << 40, std::int64_t{1} << 40}; }), "64 bits"));
}

TEST_CASE("config: the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE), their counts and their refusals") {
  // Qwen3-30B-A3B's config.json (as on the Hub: num_experts, not num_local_experts)
  const auto q = ModelConfig::from_json(json::parse(R"({"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
    "hidden_size":2048,"intermediate_size":6144,"moe_intermediate_size":768,"num_hidden_layers":48,
    "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"vocab_size":151936,"num_experts":128,
    "num_experts_per_tok":8,"norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[],
    "output_router_logits":false,"router_aux_loss_coef":0.001,"tie_word_embeddings":false,"rope_theta":1000000.0,
    "max_position_embeddings":40960,"rms_norm_eps":1e-6,"hidden_act":"silu"})"), "qwen3-30b-a3b.json");
  CHECK(q.architecture == Architecture::qwen3_moe);
  CHECK(q.qk_norm());
  CHECK(!q.qk_norm_full());
  CHECK(q.moe.num_experts == 128);
  CHECK(q.moe.experts_per_token == 8);
  CHECK(q.moe.intermediate_size == 768);
  CHECK(q.moe.norm_topk_prob);
  CHECK(q.is_moe_layer(0));
  CHECK(q.is_moe_layer(47));
  CHECK(q.param_count() == 30'532'122'624);  // the published 30.5B
  CHECK(q.active_param_count() == 3'353'032'704);  // and 3.3B active
  CHECK(q.moe_module() == "mlp");
  {
    const auto back = ModelConfig::from_json(q.to_json(), "round trip");
    CHECK(back.to_json() == q.to_json());
    CHECK(back.moe.num_experts == 128);
  }
  // dense layers: mlp_only_layers and decoder_sparse_step, as transformers picks them
  json j = q.to_json();
  j["num_hidden_layers"] = 6;
  j["mlp_only_layers"] = {0, 4};
  j["decoder_sparse_step"] = 2;
  const auto qs = ModelConfig::from_json(j, "q.json");
  std::vector<bool> sparse;
  for (std::int64_t l = 0; l < 6; ++l) sparse.push_back(qs.is_moe_layer(l));
  CHECK(sparse == std::vector<bool>{false, true, false, true, false, true});
  CHECK(ModelConfig::from_json(qs.to_json()).to_json() == qs.to_json());

  // Mixtral 8x7B: always renormalised, experts under block_sparse_moe, no window unless given
  const auto m = ModelConfig::from_json(json::parse(R"({"architectures":["MixtralForCausalLM"],"hidden_size":4096,
    "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
    "vocab_size":32000,"num_local_experts":8,"num_experts_per_tok":2,"rope_theta":1000000.0,
    "max_position_embeddings":32768,"rms_norm_eps":1e-5,"sliding_window":null,"tie_word_embeddings":false})"), "mixtral.json");
  CHECK(m.architecture == Architecture::mixtral);
  CHECK(m.moe.norm_topk_prob);
  CHECK(!m.sliding_window);
  CHECK(m.moe.intermediate_size == 14336);
  CHECK(m.param_count() == 46'702'792'704);  // Mixtral-8x7B's published count
  CHECK(m.moe_module() == "block_sparse_moe");
  CHECK(ModelConfig::from_json(m.to_json()).to_json() == m.to_json());

  // OLMoE-1B-7B: q/k norms over the whole projections, not renormalised, padding id 1 by default
  const auto o = ModelConfig::from_json(json::parse(R"({"architectures":["OlmoeForCausalLM"],"hidden_size":2048,
    "intermediate_size":1024,"num_hidden_layers":16,"num_attention_heads":16,"num_key_value_heads":16,
    "vocab_size":50304,"num_experts":64,"num_experts_per_tok":8,"norm_topk_prob":false,"clip_qkv":null,
    "rope_theta":10000.0,"max_position_embeddings":4096,"rms_norm_eps":1e-5,"tie_word_embeddings":false})"), "olmoe.json");
  CHECK(o.qk_norm_full());
  CHECK(!o.moe.norm_topk_prob);
  CHECK(o.pad_token_id == 1);
  CHECK(o.param_count() == 6'919'161'856);  // OLMoE-1B-7B: 6.9B
  CHECK(ModelConfig::from_json(o.to_json()).to_json() == o.to_json());

  // The auxiliary load-balancing loss: read, and written back
  json aux = q.to_json();
  aux["output_router_logits"] = true;
  aux["router_aux_loss_coef"] = 0.02;
  const auto qa = ModelConfig::from_json(aux);
  CHECK(qa.moe.output_router_logits);
  CHECK(qa.moe.router_aux_loss_coef == 0.02);
  CHECK(qa.to_json().at("output_router_logits") == true);
  CHECK(!q.moe.output_router_logits);

  // What megatrain would not train as transformers does is refused, by name
  const auto refused = [&](json cfg, const char* key, json value, std::initializer_list<const char*> words) {
    cfg[key] = std::move(value);
    const std::string e = error_of(cfg, "moe.json");
    CAPTURE(e);
    CHECK(contains(e, "moe.json"));
    for (const char* w : words) CHECK(contains(e, w));
  };
  refused(q.to_json(), "router_aux_loss_coef", -0.5, {"router_aux_loss_coef must be a finite number >= 0"});
  refused(q.to_json(), "num_experts_per_tok", 129, {"num_experts_per_tok must be in [1, 128]"});
  refused(q.to_json(), "mlp_only_layers", json::array({48}), {"mlp_only_layers holds 48", "[0, 48)"});
  refused(q.to_json(), "decoder_sparse_step", 0, {"decoder_sparse_step must be >= 1"});
  refused(m.to_json(), "router_jitter_noise", 0.01, {"router_jitter_noise", "random"});
  refused(m.to_json(), "num_experts", 4, {"num_experts (4) and num_local_experts (8)"});
  refused(o.to_json(), "clip_qkv", 8.0, {"clip_qkv"});
  refused(o.to_json(), "head_dim", 64, {"q_norm spans hidden_size"});
  json none = o.to_json();
  none.erase("num_local_experts");
  refused(none, "num_experts", 0, {"num_experts must be in [1, 65536]"});
}

TEST_CASE("config: GPT-OSS, as published and as transformers 5 writes it") {
  // gpt-oss-20b's config.json as published (MXFP4 experts; fields transformers does not read kept)
  json layer_types = json::array();
  for (int l = 0; l < 24; ++l) layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  json pub = json::parse(R"({"architectures":["GptOssForCausalLM"],"attention_bias":true,"attention_dropout":0.0,
    "eos_token_id":200002,"experts_per_token":4,"head_dim":64,"hidden_act":"silu","hidden_size":2880,
    "initial_context_length":4096,"initializer_range":0.02,"intermediate_size":2880,"max_position_embeddings":131072,
    "model_type":"gpt_oss","num_attention_heads":64,"num_experts_per_tok":4,"num_hidden_layers":24,
    "num_key_value_heads":8,"num_local_experts":32,"output_router_logits":false,"pad_token_id":199999,
    "quantization_config":{"modules_to_not_convert":["model.layers.*.self_attn","model.layers.*.mlp.router",
    "model.embed_tokens","lm_head"],"quant_method":"mxfp4"},"rms_norm_eps":1e-05,
    "rope_scaling":{"beta_fast":32.0,"beta_slow":1.0,"factor":32.0,"original_max_position_embeddings":4096,
    "rope_type":"yarn","truncate":false},"rope_theta":150000,"router_aux_loss_coef":0.9,"sliding_window":128,
    "swiglu_limit":7.0,"tie_word_embeddings":false,"use_cache":true,"vocab_size":201088})");
  pub["layer_types"] = layer_types;
  const auto g = ModelConfig::from_json(pub, "gpt-oss-20b/config.json");
  CHECK(g.architecture == Architecture::gpt_oss);
  CHECK(g.attention_sinks());
  CHECK(g.qkv_bias);
  CHECK(g.o_bias);
  CHECK(!g.qk_norm());
  CHECK(g.moe.biases);
  CHECK(g.moe.norm_topk_prob);
  CHECK(g.moe.num_experts == 32);
  CHECK(g.moe.experts_per_token == 4);
  CHECK(g.moe.intermediate_size == 2880);
  CHECK(g.moe.router_aux_loss_coef == 0.9);
  CHECK(g.expert_act() == Activation::clamped_swiglu);
  CHECK(g.hidden_act == Activation::silu);
  CHECK(g.moe_layer_count() == 24);
  CHECK(g.attention_window(0) == 128);
  CHECK(g.attention_window(1) == 0);
  CHECK(g.rope_scaling.type == RopeScaling::Type::yarn);
  CHECK(!g.rope_scaling.truncate);
  CHECK(g.rope_theta == 150000.0);
  // one rotary table for the sliding and the full layers (not Gemma's local one)
  CHECK(g.rope_for_layer(0).rope_inv_freq() == g.rope_for_layer(1).rope_inv_freq());
  CHECK(g.rope_attention_scaling() == doctest::Approx(0.1 * std::log(32.0) + 1.0));
  CHECK(g.param_count() == ModelConfig::preset("gpt-oss-20b").param_count());
  // active: 3.61B on OpenAI's model card, which counts the unembedding but not the embedding
  CHECK((g.active_param_count() - g.vocab_size * g.hidden_size + 5'000'000) / 10'000'000 == 361);
  // written as transformers 5 writes it, read back the same (the same model as the preset)
  CHECK(ModelConfig::from_json(g.to_json()).to_json() == g.to_json());
  CHECK(g.to_json().contains("rope_parameters"));
  CHECK(!g.to_json().contains("rope_scaling"));
  CHECK(g.to_json().at("layer_types") == layer_types);

  // GptOssConfig's defaults: every other layer slides (the first included), window 128, yarn x32
  // over 4096 positions with rope_theta 150000, attention biases, 128 experts, top 4
  const auto d = ModelConfig::from_json(json::parse(R"({"model_type":"gpt_oss","hidden_size":64,"intermediate_size":32,
    "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":100})"), "d.json");
  CHECK(d.sliding_layers() == std::vector<bool>{true, false, true});
  CHECK(d.sliding_window == 128);
  CHECK(d.rope_theta == 150000.0);
  CHECK(d.rope_scaling.type == RopeScaling::Type::yarn);
  CHECK(d.yarn_factor() == 32.0);
  CHECK(d.yarn_original_length() == 4096);
  CHECK(d.qkv_bias);
  CHECK(d.moe.num_experts == 128);
  CHECK(d.moe.experts_per_token == 4);
  CHECK(ModelConfig::from_json(d.to_json()).to_json() == d.to_json());

  // refused by name: another clamp than transformers' 7, another quantization than MXFP4
  json bad = pub;
  bad["swiglu_limit"] = 5.0;
  std::string e = error_of(bad, "gpt.json");
  CHECK(contains(e, "gpt.json"));
  CHECK(contains(e, "swiglu_limit"));
  bad = pub;
  bad["quantization_config"] = json{{"quant_method", "bitsandbytes"}};
  e = error_of(bad, "gpt.json");
  CHECK(contains(e, "quantization_config"));
  CHECK(contains(e, "mxfp4"));
  bad = pub;
  bad["attention_dropout"] = 0.1;
  CHECK(contains(error_of(bad, "gpt.json"), "attention_dropout"));
}

TEST_CASE("config: with_layers cuts a model and its per-layer tables") {
  const auto g = ModelConfig::preset("gpt-oss-20b").with_layers(3);
  CHECK(g.num_hidden_layers == 3);
  CHECK(g.sliding_layers() == std::vector<bool>{true, false, true});
  const auto gemma = ModelConfig::preset("gemma-3-1b").with_layers(8);  // five sliding, one full, ...
  CHECK(gemma.sliding_layers() == std::vector<bool>{true, true, true, true, true, false, true, true});
  auto q = ModelConfig::preset("qwen3-30b-a3b");
  q.moe.dense_layers = {1, 5};
  const auto qc = q.with_layers(4);
  CHECK(qc.moe.dense_layers == std::vector<std::int64_t>{1});
  CHECK(qc.moe_layer_count() == 3);
  CHECK(ModelConfig::preset("qwen2.5-0.5b").with_layers(30).num_hidden_layers == 30);
  CHECK(contains(error_of([] { (void)ModelConfig::preset("qwen2.5-0.5b").with_layers(0); }), "layers"));
}

TEST_CASE("config: SmolLM3 (NoPE layers), as published and by SmolLM3Config's defaults") {
  json no_rope = json::array();
  for (int l = 0; l < 36; ++l) no_rope.push_back((l + 1) % 4 == 0 ? 0 : 1);
  json pub = json::parse(R"({"architectures":["SmolLM3ForCausalLM"],"model_type":"smollm3","attention_bias":false,
    "attention_dropout":0.0,"bos_token_id":128000,"eos_token_id":128012,"hidden_act":"silu","hidden_size":2048,
    "initializer_range":0.02,"intermediate_size":11008,"max_position_embeddings":65536,"mlp_bias":false,
    "num_attention_heads":16,"num_hidden_layers":36,"num_key_value_heads":4,"pad_token_id":128004,
    "rms_norm_eps":1e-06,"rope_scaling":null,"rope_theta":5000000.0,"sliding_window":null,"use_sliding_window":false,
    "tie_word_embeddings":true,"vocab_size":128256})");
  pub["no_rope_layers"] = no_rope;
  const auto s = ModelConfig::from_json(pub, "SmolLM3-3B/config.json");
  CHECK(s.architecture == Architecture::smollm3);
  CHECK(s.architecture_name() == "SmolLM3ForCausalLM");
  CHECK(s.rope_theta == 5000000.0);
  CHECK(s.tie_word_embeddings);
  CHECK(s.pad_token_id == 128004);
  CHECK(!s.qkv_bias);
  CHECK(!s.sliding_window);
  std::int64_t nope = 0;
  for (std::int64_t l = 0; l < 36; ++l) {
    CAPTURE(l);
    CHECK(s.rotary_layer(l) == ((l + 1) % 4 != 0));
    nope += s.rotary_layer(l) ? 0 : 1;
  }
  CHECK(nope == 9);
  CHECK(s.param_count() == state_dict_count(s));
  CHECK((s.param_count() + 5'000'000) / 10'000'000 == 308);  // 3.08B, as published
  check_same(s, ModelConfig::preset("smollm3-3b"));
  check_round_trip(s);
  CHECK(s.to_json().at("no_rope_layers") == no_rope);
  CHECK(ModelConfig::from_json(s.to_json()).to_json() == s.to_json());

  // SmolLM3Config's defaults: a NoPE layer every no_rope_layer_interval (4), rope_theta 2,000,000,
  // tied, pad_token_id 128004; Llama's biases
  json d = json::parse(R"({"model_type":"smollm3","hidden_size":64,"intermediate_size":96,"num_hidden_layers":6,
    "num_attention_heads":4,"vocab_size":130000,"attention_bias":true,"mlp_bias":true})");
  const auto c = ModelConfig::from_json(d, "d.json");
  CHECK(c.nope_layers == std::vector<bool>{false, false, false, true, false, false});
  CHECK(c.rope_theta == 2000000.0);
  CHECK(c.tie_word_embeddings);
  CHECK(c.pad_token_id == 128004);
  CHECK(c.qkv_bias);
  CHECK(c.o_bias);
  CHECK(c.mlp_bias);
  CHECK(c.param_count() == state_dict_count(c));
  check_round_trip(c);
  d["no_rope_layer_interval"] = 2;
  CHECK(ModelConfig::from_json(d).nope_layers == std::vector<bool>{false, true, false, true, false, true});
  CHECK(ModelConfig::from_json(d).with_layers(3).nope_layers == std::vector<bool>{false, true, false});
  // a list longer than the layers is read as transformers reads it: its first entries
  d["no_rope_layers"] = {1, 0, 0, 1, 1, 1, 0, 0};
  CHECK(ModelConfig::from_json(d).nope_layers == std::vector<bool>{false, true, true, false, false, false});

  // refused by name: sliding windows, a short or malformed no_rope_layers, dropout, an interval of 0
  const auto with = [&](const char* key, json v) {
    json j = d;
    j.erase("no_rope_layers");
    j[key] = std::move(v);
    return error_of(j, "smol.json");
  };
  std::string e = with("use_sliding_window", true);
  CHECK(contains(e, "smol.json"));
  CHECK(contains(e, "use_sliding_window"));
  CHECK(contains(with("layer_types", {"full_attention", "sliding_attention", "full_attention", "full_attention",
                                      "full_attention", "full_attention"}), "sliding_attention"));
  CHECK(contains(with("no_rope_layers", {1, 1}), "no_rope_layers"));
  CHECK(contains(with("no_rope_layers", {1, 1, 2, 1, 1, 1}), "no_rope_layers holds 2"));
  CHECK(contains(with("attention_dropout", 0.1), "attention_dropout"));
  CHECK(contains(with("no_rope_layer_interval", 0), "no_rope_layer_interval"));
  CHECK(contains(with("pad_token_id", 200000), "pad_token_id"));
  // a NoPE table is SmolLM3's alone (a config assembled by hand)
  auto q = ModelConfig::preset("qwen2.5-0.5b");
  q.nope_layers.assign(static_cast<std::size_t>(q.num_hidden_layers), false);
  CHECK(contains(error_of([&] { q.validate("hand-made"); }), "no_rope_layers"));
}

TEST_CASE("families: each family's entry reads, checks and writes its own config") {
  std::set<std::string> names, types;
  for (const Family* f : families()) {
    CAPTURE(f->class_name);
    CHECK(names.insert(f->class_name).second);
    CHECK(types.insert(f->model_type).second);
    CHECK(&family(f->arch) == f);
    // the smallest config.json of the family: its model_type and the sizes; every other field
    // is the family's default
    json j{{"model_type", f->model_type}, {"hidden_size", 64},    {"intermediate_size", 96}, {"num_hidden_layers", 3},
           {"num_attention_heads", 4},    {"head_dim", 16},       {"vocab_size", 130000}};
    const auto c = ModelConfig::from_json(j, "minimal.json");
    CHECK(c.architecture == f->arch);
    CHECK(&c.block() == &f->block);
    CHECK(c.max_position_embeddings == f->default_max_position_embeddings);
    CHECK(c.tie_word_embeddings == f->default_tied);
    CHECK(c.pad_token_id == f->default_pad_token_id);
    CHECK(c.hidden_act == f->block.activation);
    CHECK(c.qk_norm() == (f->block.qk_norm != BlockRecipe::QkNorm::none));
    CHECK((c.moe.num_experts > 0) == f->block.moe);
    CHECK(c.param_count() == state_dict_count(c));
    check_round_trip(c);
    CHECK(ModelConfig::from_json(c.to_json()).to_json() == c.to_json());
    // written under the family's names, read back by them alone
    CHECK(c.to_json().at("architectures") == json::array({f->class_name}));
    CHECK(c.to_json().at(f->block.activation_key).is_string());
  }
  CHECK(families().size() == 14);
}

TEST_CASE("config: a layer type megatrain does not build is refused, naming the entry") {
  json j = json::parse(R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":32,"intermediate_size":56,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":97,
    "query_pre_attn_scalar":8,"sliding_window":4,"layer_types":["mamba","full_attention"]})");
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(j, "c.json"),
                       doctest::Contains("c.json: layer_types holds \"mamba\"; each entry must be \"full_attention\", "
                                         "\"sliding_attention\" or \"linear_attention\""),
                       Error);
  // linear attention is known, and refused in a family that has none
  j["layer_types"] = {"linear_attention", "full_attention"};
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(j, "c.json"),
                       doctest::Contains("c.json: layer_types makes layer 0 a linear_attention layer, which "
                                         "Gemma3ForCausalLM has not"),
                       Error);
}

TEST_CASE("config: Qwen3.5-MoE's text model: every layer sparse with a shared expert, no intermediate_size") {
  // (the fields of a published Qwen3.5-MoE text_config, shrunk; its class has no intermediate_size)
  json j = json::parse(R"({"architectures":["Qwen3_5MoeForCausalLM"],"model_type":"qwen3_5_moe_text","hidden_size":64,
    "num_hidden_layers":4,"num_attention_heads":4,"vocab_size":300,"linear_num_key_heads":2,"linear_num_value_heads":4,
    "linear_key_head_dim":8,"linear_value_head_dim":10,"num_experts":6,"num_experts_per_tok":2,
    "moe_intermediate_size":24,"shared_expert_intermediate_size":20})");
  auto c = ModelConfig::from_json(j, "m.json");
  CHECK(c.architecture == Architecture::qwen3_5_moe);
  CHECK(c.num_key_value_heads == 2);  // Qwen3_5MoeTextConfig's default (the dense class's is 4)
  CHECK(c.head_dim == 256);
  CHECK(c.partial_rotary_factor == 0.25);
  CHECK(c.intermediate_size == 0);
  CHECK(c.moe_layer_count() == 4);    // every layer
  CHECK(c.moe.norm_topk_prob);        // always renormalised
  CHECK(c.moe.intermediate_size == 24);
  CHECK(c.moe.shared_expert_size == 20);
  CHECK(c.attention_output_gate());
  CHECK(!c.linear_attention.fused);
  CHECK(c.layer_kind(3).token_mixer == TokenMixerKind::full_attention);
  CHECK(c.layer_kind(2).token_mixer == TokenMixerKind::linear_attention);
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == op_spec_count(c));
  // the active parameters: every routed expert a token is not sent to left out; the shared one kept
  CHECK(c.active_param_count() == c.param_count() - 4 * (6 - 2) * 3 * 64 * 24);
  check_round_trip(c);
  const json out = c.to_json();
  CHECK(!out.contains("intermediate_size"));
  CHECK(!out.contains("num_local_experts"));
  CHECK(out.at("shared_expert_intermediate_size") == 20);
  // the class's defaults where the file is silent
  j.erase("num_experts");
  j.erase("moe_intermediate_size");
  j.erase("shared_expert_intermediate_size");
  c = ModelConfig::from_json(j, "m.json");
  CHECK(c.moe.num_experts == 256);
  CHECK(c.moe.experts_per_token == 2);
  CHECK(c.moe.intermediate_size == 512);
  CHECK(c.moe.shared_expert_size == 512);
  // refused, naming the field
  json w = j;
  w["shared_expert_intermediate_size"] = 0;
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(w, "m.json"), doctest::Contains("m.json: shared_expert_intermediate_size must "
                       "be in [1, 2^24] (got 0)"), Error);
  w = j;
  w["output_router_logits"] = true;
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(w, "m.json"), doctest::Contains("m.json: output_router_logits is true"), Error);
  w = j;
  w["num_experts_per_tok"] = 300;
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(w, "m.json"), doctest::Contains("num_experts_per_tok must be in [1, 256]"),
                       Error);
}

TEST_CASE("config: Qwen3-Next: fused linear-attention projections, sparse and dense layers, a shared expert") {
  json j = json::parse(R"({"architectures":["Qwen3NextForCausalLM"],"model_type":"qwen3_next","hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
    "vocab_size":300,"linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":8,
    "linear_value_head_dim":10,"num_experts":6,"num_experts_per_tok":2,"moe_intermediate_size":24,
    "shared_expert_intermediate_size":20,"mlp_only_layers":[1],"rope_theta":10000000.0})");
  auto c = ModelConfig::from_json(j, "n.json");
  CHECK(c.architecture == Architecture::qwen3_next);
  CHECK(c.linear_attention.fused);
  CHECK(c.moe.norm_topk_prob);  // Qwen3NextConfig's default
  CHECK(c.moe.dense_layers == std::vector<std::int64_t>{1});
  CHECK(c.moe_layer_count() == 3);
  CHECK(c.partial_rotary_factor == 0.25);
  CHECK(c.rotary_dim() == 4);
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == op_spec_count(c));
  check_round_trip(c);
  j["norm_topk_prob"] = false;
  j["decoder_sparse_step"] = 2;
  c = ModelConfig::from_json(j, "n.json");
  CHECK(!c.moe.norm_topk_prob);
  CHECK(c.moe_layer_count() == 1);  // layer 3 (layer 1 is dense by mlp_only_layers too)
  CHECK(c.param_count() == state_dict_count(c));
  check_round_trip(c);
  json w = j;
  w["output_router_logits"] = true;
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(w, "n.json"), doctest::Contains("n.json: output_router_logits is true"), Error);
  w = j;
  w.erase("intermediate_size");  // (its dense layers need one)
  CHECK_THROWS_WITH_AS(ModelConfig::from_json(w, "n.json"), doctest::Contains("intermediate_size"), Error);
}

TEST_CASE("config: Qwen3.5's text model, its hybrid layers and Qwen3_5TextConfig's defaults") {
  // (the fields of a published Qwen3.5 text config.json, shrunk)
  json j = json::parse(R"({"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text","hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":8,"num_attention_heads":4,"vocab_size":300,"linear_num_key_heads":2,
    "linear_num_value_heads":6,"linear_key_head_dim":8,"linear_value_head_dim":10,
    "rope_parameters":{"rope_type":"default","rope_theta":10000000.0,"mrope_section":[11,11,10],"mrope_interleaved":true}})");
  auto c = ModelConfig::from_json(j, "q.json");
  CHECK(c.architecture == Architecture::qwen3_5);
  CHECK(c.head_dim == 256);                    // Qwen3_5TextConfig's head_dim, not hidden / heads
  CHECK(c.num_key_value_heads == 4);           // and its num_key_value_heads
  CHECK(c.partial_rotary_factor == 0.25);      // and its partial_rotary_factor
  CHECK(c.rotary_dim() == 64);
  CHECK(c.rope_theta == 10000000.0);
  CHECK(c.attention_output_gate());
  CHECK(c.norm_unit_offset());
  CHECK(c.qk_norm());
  CHECK(c.linear_attention == LinearAttentionConfig{2, 6, 8, 10, 4, false});
  // full_attention_interval 4 (the default): layers 3 and 7 full, the others linear
  for (std::int64_t l = 0; l < 8; ++l)
    CHECK(c.layer_kind(l).token_mixer == (l % 4 == 3 ? TokenMixerKind::full_attention : TokenMixerKind::linear_attention));
  CHECK(c.param_count() == state_dict_count(c));
  CHECK(c.param_count() == op_spec_count(c));
  check_round_trip(c);
  const json out = c.to_json();
  CHECK(out.at("layer_types").size() == 8);
  CHECK(out.at("partial_rotary_factor") == 0.25);
  CHECK(out.at("linear_num_value_heads") == 6);
  // an interval, explicit layer types, a rotary over the whole head
  j["full_attention_interval"] = 2;
  CHECK(ModelConfig::from_json(j, "q.json").layer_kind(1).token_mixer == TokenMixerKind::full_attention);
  j["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "linear_attention",
                      "full_attention", "linear_attention", "linear_attention", "linear_attention"};
  j["rope_parameters"]["partial_rotary_factor"] = 1.0;
  c = ModelConfig::from_json(j, "q.json");
  CHECK(c.layer_kind(0).token_mixer == TokenMixerKind::full_attention);
  CHECK(c.layer_kind(3).token_mixer == TokenMixerKind::linear_attention);
  CHECK(c.partial_rotary_factor == 1.0);
  check_round_trip(c);
  // refused, naming the field
  const auto refused = [&](json bad, const char* what) {
    CHECK_THROWS_WITH_AS(ModelConfig::from_json(bad, "q.json"), doctest::Contains(what), Error);
  };
  json w = j;
  w["layer_types"][2] = "sliding_attention";
  refused(w, "q.json: layer_types makes layer 2 a sliding_attention layer");
  w = j;
  w["linear_num_value_heads"] = 3;
  refused(w, "linear_num_value_heads (3) must be a multiple of linear_num_key_heads (2)");
  w = j;
  w["linear_key_head_dim"] = 0;
  refused(w, "linear_key_head_dim (0)");
  w = j;
  w.erase("layer_types");
  w["full_attention_interval"] = 0;
  refused(w, "full_attention_interval must be > 0");
  w = j;
  w["attention_dropout"] = 0.1;
  refused(w, "attention_dropout");
}
