// The fuzz targets' fixtures (see fuzz_fixtures.hpp), compiled once for every target.
#include "fuzz_fixtures.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "fuzz_util.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/layers/decoder_model.hpp"

namespace megatrain::fuzz {

/// One tiny checkpoint per family and variant (hidden 8, 1 or 2 layers, vocabulary 16).
std::vector<HfFixture> hf_fixtures() {
  const json base = {{"hidden_size", 8},         {"intermediate_size", 12}, {"num_hidden_layers", 2},
                     {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"vocab_size", 16},
                     {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                     {"bos_token_id", 1},        {"eos_token_id", 2}};
  const auto with = [&](json extra) {
    json j = base;
    for (const auto& [k, v] : extra.items()) j[k] = v;
    return j;
  };
  std::vector<HfFixture> f;
  f.push_back({"llama", with({{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"tie_word_embeddings", false}}),
               DType::f32});
  f.push_back({"llama-tied",
               with({{"architectures", {"LlamaForCausalLM"}},
                     {"model_type", "llama"},
                     {"tie_word_embeddings", true},
                     {"rope_scaling",
                      {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 16}}}}),
               DType::bf16, true});
  f.push_back({"llama-bias",
               with({{"architectures", {"LlamaForCausalLM"}},
                     {"model_type", "llama"},
                     {"tie_word_embeddings", false},
                     {"head_dim", 6},
                     {"attention_bias", true},
                     {"mlp_bias", true},
                     {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}}),
               DType::f16});
  f.push_back({"qwen2", with({{"architectures", {"Qwen2ForCausalLM"}}, {"model_type", "qwen2"}, {"tie_word_embeddings", true},
                              {"use_sliding_window", false}, {"sliding_window", 32}, {"rope_theta", 1000000.0}}),
               DType::bf16});
  f.push_back({"qwen3", with({{"architectures", {"Qwen3ForCausalLM"}},
                              {"model_type", "qwen3"},
                              {"num_attention_heads", 4},
                              {"num_key_value_heads", 2},
                              {"head_dim", 4},
                              {"tie_word_embeddings", false},
                              {"attention_bias", false},
                              {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}}}}),
               DType::f32});
  f.push_back({"mistral", with({{"architectures", {"MistralForCausalLM"}}, {"model_type", "mistral"},
                                {"tie_word_embeddings", false}, {"sliding_window", nullptr}}),
               DType::bf16});
  f.push_back({"phi3", with({{"architectures", {"Phi3ForCausalLM"}},
                             {"model_type", "phi3"},
                             {"num_hidden_layers", 1},
                             {"num_attention_heads", 1},
                             {"num_key_value_heads", 1},
                             {"partial_rotary_factor", 0.5},
                             {"tie_word_embeddings", false},
                             {"original_max_position_embeddings", 16},
                             {"rope_scaling", {{"type", "longrope"}, {"short_factor", {1.0, 1.5}}, {"long_factor", {2.0, 3.5}}}},
                             {"resid_pdrop", 0.0},
                             {"embd_pdrop", 0.0},
                             {"attention_dropout", 0.0},
                             {"sliding_window", 48}}),
               DType::bf16});
  f.push_back({"gemma3", with({{"architectures", {"Gemma3ForCausalLM"}},
                               {"model_type", "gemma3_text"},
                               {"head_dim", 4},
                               {"tie_word_embeddings", true},
                               {"hidden_activation", "gelu_pytorch_tanh"},
                               {"query_pre_attn_scalar", 4},
                               {"sliding_window", 4},
                               {"sliding_window_pattern", 2},
                               {"rope_theta", 1000000.0},
                               {"rope_local_base_freq", 10000.0},
                               {"pad_token_id", 0},
                               {"final_logit_softcapping", nullptr},
                               {"attn_logit_softcapping", nullptr}}),
               DType::f32});
  // the mixtures of experts: 3 experts of 6, top 2 (Qwen3-MoE with a dense layer, Mixtral), top 2
  // not renormalised (OLMoE)
  f.push_back({"qwen3_moe", with({{"architectures", {"Qwen3MoeForCausalLM"}},
                                  {"model_type", "qwen3_moe"},
                                  {"head_dim", 4},
                                  {"tie_word_embeddings", false},
                                  {"num_experts", 3},
                                  {"num_experts_per_tok", 2},
                                  {"moe_intermediate_size", 6},
                                  {"norm_topk_prob", true},
                                  {"mlp_only_layers", {1}}}),
               DType::bf16});
  f.push_back({"mixtral", with({{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
                                {"tie_word_embeddings", false}, {"num_local_experts", 3}, {"num_experts_per_tok", 2}}),
               DType::bf16});
  f.push_back({"olmoe", with({{"architectures", {"OlmoeForCausalLM"}}, {"model_type", "olmoe"},
                              {"num_key_value_heads", 2}, {"tie_word_embeddings", false}, {"num_experts", 3},
                              {"num_experts_per_tok", 2}, {"pad_token_id", 1}}),
               DType::f32});
  // GPT-OSS: sinks, biased router and experts (stacked and fused in the checkpoint), sliding layers
  f.push_back({"gpt_oss", with({{"architectures", {"GptOssForCausalLM"}}, {"model_type", "gpt_oss"}, {"head_dim", 4},
                                {"tie_word_embeddings", false}, {"num_local_experts", 3}, {"num_experts_per_tok", 2},
                                {"sliding_window", 4}}),
               DType::bf16});
  // SmolLM3: a NoPE layer beside rotary ones
  f.push_back({"smollm3", with({{"architectures", {"SmolLM3ForCausalLM"}}, {"model_type", "smollm3"},
                                {"no_rope_layers", {1, 0}}, {"pad_token_id", nullptr}}),
               DType::bf16});
  // Qwen3.5: a Gated DeltaNet layer, then a gated full-attention layer
  f.push_back({"qwen3_5", with({{"architectures", {"Qwen3_5ForCausalLM"}}, {"model_type", "qwen3_5_text"}, {"head_dim", 8},
                                {"tie_word_embeddings", false}, {"linear_num_key_heads", 1}, {"linear_num_value_heads", 2},
                                {"linear_key_head_dim", 4}, {"linear_value_head_dim", 3},
                                {"layer_types", {"linear_attention", "full_attention"}}}),
               DType::bf16});
  // Qwen3.5-MoE: every layer sparse, a shared expert; Qwen3-Next: fused projections, a dense layer
  f.push_back({"qwen3_5_moe", with({{"architectures", {"Qwen3_5MoeForCausalLM"}}, {"model_type", "qwen3_5_moe_text"},
                                    {"head_dim", 8}, {"tie_word_embeddings", false}, {"linear_num_key_heads", 1},
                                    {"linear_num_value_heads", 2}, {"linear_key_head_dim", 4}, {"linear_value_head_dim", 3},
                                    {"layer_types", {"linear_attention", "full_attention"}}, {"num_experts", 3},
                                    {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8},
                                    {"shared_expert_intermediate_size", 6}}),
               DType::bf16});
  f.push_back({"qwen3_next", with({{"architectures", {"Qwen3NextForCausalLM"}}, {"model_type", "qwen3_next"}, {"head_dim", 8},
                                   {"tie_word_embeddings", false}, {"linear_num_key_heads", 1}, {"linear_num_value_heads", 2},
                                   {"linear_key_head_dim", 4}, {"linear_value_head_dim", 3},
                                   {"layer_types", {"linear_attention", "full_attention"}}, {"num_experts", 3},
                                   {"num_experts_per_tok", 2}, {"moe_intermediate_size", 8},
                                   {"shared_expert_intermediate_size", 6}, {"mlp_only_layers", {1}}}),
               DType::bf16});
  return f;
}

/// The fixture a parsed config is checked against: the one of its family (for Llama, the variant
/// with biases, with a tied head, or the plain one).
std::string hf_fixture_for(const ModelConfig& c) {
  switch (c.architecture) {
    case Architecture::llama: return c.qkv_bias || c.mlp_bias ? "llama-bias" : c.tie_word_embeddings ? "llama-tied" : "llama";
    case Architecture::mistral: return "mistral";
    case Architecture::qwen2: return "qwen2";
    case Architecture::qwen3: return "qwen3";
    case Architecture::phi3: return "phi3";
    case Architecture::gemma3: return "gemma3";
    case Architecture::qwen3_moe: return "qwen3_moe";
    case Architecture::mixtral: return "mixtral";
    case Architecture::olmoe: return "olmoe";
    case Architecture::gpt_oss: return "gpt_oss";
    case Architecture::smollm3: return "smollm3";
    case Architecture::qwen3_5: return "qwen3_5";
    case Architecture::qwen3_5_moe: return "qwen3_5_moe";
    case Architecture::qwen3_next: return "qwen3_next";
  }
  return "llama";
}

StoreOptions tiny_store_options() {
  StoreOptions o;
  o.seed = 7;
  o.grad_ring_slots = 1;
  o.pinning = Pinning::never;
  o.host_memory_budget = std::size_t{1} << 30;
  return o;
}

/// Writes fixture `f` as a model folder `dir` (config.json + model.safetensors); dir's parent must exist.
void write_hf_fixture(const HfFixture& f, const std::filesystem::path& dir) {
  json written = f.config;
  if (f.head_equals_table) written["tie_word_embeddings"] = false;  // written untied, then declared tied
  const ModelConfig cfg = ModelConfig::from_json(written, f.name);
  HostParamStore<float> store(DecoderModel<>(cfg).units(), tiny_store_options());
  if (f.head_equals_table) {
    const auto table = store.master("model.embed_tokens.weight").span();
    const auto head = store.master("lm_head.weight").span();
    std::copy(table.begin(), table.end(), head.begin());
  }
  io::HfExportOptions o;
  o.dtype = f.dtype;
  o.config_json = written.dump(2);
  io::export_hf_model(store, cfg, dir, o);
  if (f.head_equals_table) {
    json declared = json::parse(read_file(dir / "config.json"));
    declared["tie_word_embeddings"] = true;
    write_file(dir / "config.json", declared.dump(2) + "\n");
  }
}

// ---- the train-state checkpoint ----------------------------------------------------------------
/// The model of the train-state fixture: a one-layer Llama, hidden 8, vocabulary 16.
ModelConfig train_fixture_model() {
  return ModelConfig::from_json(json{{"architectures", {"LlamaForCausalLM"}},
                                     {"hidden_size", 8},
                                     {"intermediate_size", 12},
                                     {"num_hidden_layers", 1},
                                     {"num_attention_heads", 2},
                                     {"num_key_value_heads", 1},
                                     {"vocab_size", 16},
                                     {"tie_word_embeddings", true}},
                                "train fixture");
}

/// The train state megatrain-train would save after step 3 of a run of that model.
TrainState train_fixture_state() {
  TrainState st;
  st.step = 3;
  st.last_grad_norm = 0.75;
  st.options.batch_rows = 2;
  st.options.seq_len = 8;
  st.options.micro_batches = 2;
  st.options.adamw = {3e-3, 0.9, 0.95, 1e-8, 0.1};
  st.options.schedule = {LrSchedule::Kind::warmup_cosine, 3e-3, 2, 60, 3e-4};
  st.options.clip_norm = 1.0;
  st.data = DataPosition{1, 0, 6, 40};
  st.model = train_fixture_model().to_json();
  st.megatrain_version = std::string(version());
  st.user = {{"program", "megatrain-train"},
             {"given", {{"--batch", "2"}, {"--seq", "8"}, {"--lr", "0.003"}, {"--data", "/data/train.bin"}}},
             {"data", {{"train_digest", "0123456789abcdef0123456789abcdef"}, {"train_tokens", 4096}, {"label", "train.bin"}}},
             {"backend", "cpu"},
             {"side_files", json::array({"tokenizer.json"})},
             {"run_dir", "/runs/fuzz"}};
  return st;
}

/// Writes the train-state fixture at `dir` (parent must exist): two tensor shards and their
/// index, train_state.json, config.json, tokenizer.json, checksums.xxh128.
void write_train_fixture(const std::filesystem::path& dir) {
  const ModelConfig cfg = train_fixture_model();
  HostParamStore<float> store(DecoderModel<>(cfg).units(), tiny_store_options());
  io::TrainCheckpointWriteOptions w;
  w.state = to_json(train_fixture_state());
  w.extra_files["config.json"] = cfg.to_json().dump(2) + "\n";
  w.extra_files["tokenizer.json"] = "{}\n";
  w.max_shard_bytes = 2048;
  io::write_train_checkpoint(dir, store, w);
}

HostParamStore<float> train_fixture_store() {
  return HostParamStore<float>(DecoderModel<>(train_fixture_model()).units(), tiny_store_options());
}

}  // namespace megatrain::fuzz
