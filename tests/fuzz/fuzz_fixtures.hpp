// The small valid files the fuzz targets put the fuzzed file beside, written by megatrain's own
// writers (so they are what a user's folder holds): a tiny Hugging Face checkpoint per model
// family (model_config) and a tiny train-state checkpoint as megatrain-train writes it
// (train_manifest). A few KB each; also the seed generator's source of real files.
// (Defined in fuzz_fixtures.cpp, compiled once.)
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/core/dtype.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/train/checkpointer.hpp"

namespace megatrain::fuzz {

using json = nlohmann::json;

struct HfFixture {
  std::string name;
  json config;
  DType dtype = DType::bf16;
  /// tie_word_embeddings true with lm_head.weight present and equal to the embedding table
  /// (what some exporters write).
  bool head_equals_table = false;
};

/// One tiny checkpoint per family and variant (hidden 8, 1 or 2 layers, vocabulary 16).
std::vector<HfFixture> hf_fixtures();
/// The fixture a parsed config is checked against: the one of its family (for Llama, the variant
/// with biases, with a tied head, or the plain one).
std::string hf_fixture_for(const ModelConfig& c);
/// A store's options for the fixtures' tiny models (no pinning, 1 GiB budget).
StoreOptions tiny_store_options();
/// Writes fixture `f` as a model folder `dir` (config.json + model.safetensors); dir's parent must exist.
void write_hf_fixture(const HfFixture& f, const std::filesystem::path& dir);

/// The model of the train-state fixture: a one-layer Llama, hidden 8, vocabulary 16.
ModelConfig train_fixture_model();
/// The train state megatrain-train would save after step 3 of a run of that model.
TrainState train_fixture_state();
/// Writes the train-state fixture at `dir` (parent must exist): two tensor shards and their
/// index, train_state.json, config.json, tokenizer.json, checksums.xxh128.
void write_train_fixture(const std::filesystem::path& dir);
/// A fresh store of the train-state fixture's model.
HostParamStore<float> train_fixture_store();

}  // namespace megatrain::fuzz
