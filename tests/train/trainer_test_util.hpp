// What the trainer tests share: a tiny model, random batches, options and the store's options.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/cpu_trainer.hpp"

namespace megatrain::test {

inline ModelConfig tiny(bool tied, std::int64_t vocab = 53) {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":32,"intermediate_size":72,
    "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"rope_theta":10000.0})");
  j["tie_word_embeddings"] = tied;
  j["vocab_size"] = vocab;
  return ModelConfig::from_json(j);
}

struct Batch {
  std::vector<std::int32_t> ids, labels;
  std::vector<std::uint8_t> mask = {};  ///< an attention mask (Trainer::step; empty: none)
};
inline Batch random_batch(std::mt19937& rng, std::int64_t rows, std::int64_t seq, std::int32_t vocab) {
  Batch b;
  for (std::int64_t i = 0; i < rows * seq; ++i) {
    b.ids.push_back(static_cast<std::int32_t>(rng() % vocab));
    b.labels.push_back(rng() % 7 == 0 ? kIgnoreIndex : static_cast<std::int32_t>(rng() % vocab));
  }
  return b;
}

inline TrainerOptions options(std::int64_t rows, std::int64_t seq) {
  TrainerOptions o;
  o.batch_rows = rows;
  o.seq_len = seq;
  o.adamw.lr = 3e-3;
  o.adamw.weight_decay = 0.1;
  o.schedule = {LrSchedule::Kind::warmup_cosine, 3e-3, 2, 10, 3e-4};
  return o;
}

inline StoreOptions store_opts(const TrainerOptions& o) {
  StoreOptions s;
  s.seed = 17;
  s.pinning = Pinning::never;
  return Trainer<CpuBackend<float>>::store_options(o, s);
}

/// master, m and v of every unit, concatenated.
inline std::vector<float> state_of(const HostParamStore<float>& store) {
  store.check_settled("reading the store in a test");
  std::vector<float> out;
  for (const auto& u : store.units())
    for (auto s : {u.master(), u.adam_m(), u.adam_v()}) out.insert(out.end(), s.begin(), s.end());
  return out;
}

/// Bit for bit (NaN included).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace megatrain::test
