// Completions (generate/generator.hpp) over the CPU trainer's next_logits: the logits against a
// plain forward of the whole sequence (every unit resident, the head's logits at every position)
// for a dense and a hybrid (Gated DeltaNet) model; greedy completions token for token as that
// forward's argmax; more prompts than slots giving what each prompt gives alone; streamed weights
// giving the tokens of resident ones; a seed that repeats and another that does not; each way a completion ends; the log-probabilities as the
// trainer's scoring pass gives them; and what is refused before the first step.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "../train/reference_loop.hpp"
#include "../train/trainer_test_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/generate/generator.hpp"

using namespace megatrain;
using megatrain::generate::Finish;
using megatrain::generate::GenerationOptions;
using megatrain::generate::SlotShape;
using megatrain::generate::finish_name;

namespace {

/// Three layers: linear attention, gated full attention, linear attention (Qwen3.5).
ModelConfig hybrid() {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen3_5ForCausalLM"],"hidden_size":24,"intermediate_size":40,
    "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":59,
    "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":6,"linear_value_head_dim":5,
    "layer_types":["linear_attention","full_attention","linear_attention"],"tie_word_embeddings":false})");
  return ModelConfig::from_json(j, "hybrid test");
}

/// A model, its store (random weights, seed 17) and a CPU trainer of `rows` rows of `seq` tokens.
struct Setup {
  /// `resident`: every unit's weights kept in backend memory (device units), else streamed.
  /// `state`: the store keeps AdamW's moments (StoreOptions::optimizer_state).
  /// `chunk_rows`: rows a chunk of the trainer's work (0: the micro-batch's).
  Setup(const ModelConfig& c, std::int64_t rows, std::int64_t seq, bool resident = false, bool state = true,
        std::int64_t chunk_rows = 0)
      : cfg(c), opt(with_units(test::options(rows, seq), resident ? c.num_hidden_layers + 2 : 0, chunk_rows)), model(cfg),
        store(model.units(), with_state(test::store_opts(opt), state)),
        trainer(std::make_unique<Trainer<CpuBackend<float>>>(model, store, be, opt)) {}
  static TrainerOptions with_units(TrainerOptions o, std::int64_t units, std::int64_t chunk_rows) {
    o.device_units = units;
    o.chunk_rows = chunk_rows;
    return o;
  }
  static StoreOptions with_state(StoreOptions o, bool state) {
    o.optimizer_state = state;
    return o;
  }
  SlotShape shape() const { return {opt.batch_rows, opt.seq_len, cfg.vocab_size, 0}; }
  ModelConfig cfg;
  TrainerOptions opt;
  DecoderModel<> model;
  HostParamStore<float> store;
  CpuBackend<float> be;
  std::unique_ptr<Trainer<CpuBackend<float>>> trainer;
};

/// The logits after every position of one sequence, from a plain forward (ReferenceLoop) over a
/// row of exactly its tokens.
std::vector<float> plain_logits(Setup& s, const std::vector<std::int32_t>& seq) {
  const auto n = static_cast<std::int64_t>(seq.size());
  test::ReferenceLoop ref{s.model, s.store, {}, {}, 0, 1, n, {}};
  std::vector<float> logits;
  ref.logits = &logits;
  std::vector<std::int32_t> labels(seq.begin() + 1, seq.end());
  labels.push_back(kIgnoreIndex);
  std::vector<std::vector<float>> grads;
  (void)ref.gradients(seq, labels, grads);
  return logits;
}

std::vector<std::vector<std::int32_t>> random_prompts(std::mt19937& g, std::size_t count, std::int64_t longest, std::int64_t vocab) {
  std::vector<std::vector<std::int32_t>> p(count);
  for (auto& one : p) {
    one.resize(static_cast<std::size_t>(1 + g() % static_cast<unsigned>(longest)));
    for (auto& id : one) id = static_cast<std::int32_t>(g() % static_cast<unsigned>(vocab));
  }
  return p;
}

double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

double max_abs(std::span<const float> a) {
  double m = 0;
  for (const float x : a) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

/// Sampled completions (8 tokens each, `temperature`, `seed`) of `prompts` from two setups agree
/// token for token, and so do their log-probabilities.
void same_completions(Setup& x, Setup& y, const std::vector<std::vector<std::int32_t>>& prompts, double temperature,
                      std::uint64_t seed) {
  GenerationOptions o;
  o.max_new_tokens = 8;
  o.sampling.temperature = temperature;
  o.sampling.seed = seed;
  const auto a = generate::generate(*x.trainer, x.shape(), prompts, o);
  const auto b = generate::generate(*y.trainer, y.shape(), prompts, o);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CHECK(a[i].tokens == b[i].tokens);
    CHECK(a[i].log_probs == b[i].log_probs);
  }
}

constexpr double kEps = std::numeric_limits<float>::epsilon();

}  // namespace

TEST_CASE("next_logits: each row's logits after its position, as a plain forward of the row gives them") {
  std::mt19937 g(3);
  for (const ModelConfig& cfg : {test::tiny(false, 61), test::tiny(true, 53), hybrid()}) {
    CAPTURE(cfg.architecture_name());
    Setup s(cfg, 3, 11);
    const auto V = static_cast<std::size_t>(cfg.vocab_size);
    std::vector<std::int32_t> ids(3 * 11);
    for (auto& id : ids) id = static_cast<std::int32_t>(g() % V);
    const std::vector<std::int64_t> at{10, 0, 6};  // (the row's end, its start, an awkward middle)
    const std::vector<float> z = s.trainer->next_logits(ids, 3, at);
    REQUIRE(z.size() == 3 * V);
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      // the row up to its position alone: what follows it must change nothing
      const std::vector<std::int32_t> prefix(ids.begin() + static_cast<std::ptrdiff_t>(r * 11),
                                             ids.begin() + static_cast<std::ptrdiff_t>(r * 11 + at[r] + 1));
      const std::vector<float> all = plain_logits(s, prefix);
      const auto want = std::span<const float>(all).subspan(static_cast<std::size_t>(at[r]) * V, V);
      CHECK(max_abs_diff(std::span<const float>(z).subspan(r * V, V), want) <= 64 * kEps * std::max(1.0, max_abs(want)));
    }
  }
}

TEST_CASE("greedy completions are the plain forward's argmax, token for token; more prompts than slots") {
  std::mt19937 g(11);
  for (const ModelConfig& cfg : {test::tiny(false, 61), hybrid()}) {
    CAPTURE(cfg.architecture_name());
    Setup s(cfg, 2, 17);
    const auto prompts = random_prompts(g, 5, 9, cfg.vocab_size);
    GenerationOptions o;
    o.max_new_tokens = 6;
    o.sampling.temperature = 0;
    o.cache = false;  // (each step a token for every slot: the steps below are counted)
    std::int64_t steps = 0, last_made = 0, last_ended = 0;
    const auto out = generate::generate(*s.trainer, s.shape(), prompts, o, {}, [&](std::int64_t made, std::int64_t ended) {
      ++steps;
      CHECK(made > last_made);
      CHECK(ended >= last_ended);
      last_made = made, last_ended = ended;
    });
    REQUIRE(out.size() == prompts.size());
    CHECK(last_made == 5 * 6);
    CHECK(last_ended == 5);
    CHECK(steps == 18);  // (2 slots: prompts 0 and 1, then 2 and 3, then 4, six steps each)
    const auto V = static_cast<std::size_t>(cfg.vocab_size);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      CAPTURE(i);
      const generate::Completion& c = out[i];
      CHECK(c.finish == Finish::length);
      REQUIRE(c.tokens.size() == 6);
      std::vector<std::int32_t> seq = prompts[i];
      seq.insert(seq.end(), c.tokens.begin(), c.tokens.end());
      const std::vector<float> all = plain_logits(s, seq);
      for (std::size_t t = 0; t < c.tokens.size(); ++t) {
        const auto z = std::span<const float>(all).subspan((prompts[i].size() - 1 + t) * V, V);
        const auto best = static_cast<std::int32_t>(std::max_element(z.begin(), z.end()) - z.begin());
        CHECK(c.tokens[t] == best);
        double top = -1e300, sum = 0;
        for (const float x : z) top = std::max(top, static_cast<double>(x));
        for (const float x : z) sum += std::exp(x - top);
        CHECK(c.log_probs[t] == doctest::Approx(z[static_cast<std::size_t>(best)] - top - std::log(sum)).epsilon(1e-4));
      }
    }
    // each prompt alone, in one slot: the same completions
    Setup one(cfg, 1, 17);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const auto alone = generate::generate(*one.trainer, one.shape(), std::span(prompts).subspan(i, 1), o);
      CHECK(alone[0].tokens == out[i].tokens);
    }
  }
}

/// The layers a cache must serve: a sliding window (Gemma 3), attention sinks with a window and
/// experts (GPT-OSS), fused linear attention with experts (Qwen3-Next).
ModelConfig gemma3() {
  auto j = nlohmann::json::parse(R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":32,"intermediate_size":48,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":61,
    "query_pre_attn_scalar":8,"sliding_window":4,"layer_types":["sliding_attention","full_attention"]})");
  return ModelConfig::from_json(j, "gemma3 test");
}
ModelConfig gpt_oss() {
  auto j = nlohmann::json::parse(R"({"architectures":["GptOssForCausalLM"],"hidden_size":32,"intermediate_size":24,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":61,
    "num_local_experts":4,"num_experts_per_tok":2,"sliding_window":3})");
  return ModelConfig::from_json(j, "gpt-oss test");
}
ModelConfig qwen3_next() {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen3NextForCausalLM"],"hidden_size":24,"intermediate_size":40,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":59,
    "linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":6,"linear_value_head_dim":5,
    "layer_types":["linear_attention","full_attention"],"num_experts":4,"num_experts_per_tok":2,
    "moe_intermediate_size":16,"shared_expert_intermediate_size":16,"partial_rotary_factor":0.25})");
  return ModelConfig::from_json(j, "qwen3-next test");
}

TEST_CASE("the KV cache: each token's logits as recomputing its whole prefix gives them; rows restart at position 0") {
  // Three rows decode side by side, each through sequences of its own length (13, 9 and 5 tokens,
  // from its own step: before it, a new one-token sequence each step), so the rows sit at
  // different positions and restart at different steps.
  std::mt19937 g(31);
  for (const ModelConfig& cfg : {test::tiny(false, 61), test::tiny(true, 53), hybrid(), gemma3(), gpt_oss(), qwen3_next()}) {
    CAPTURE(cfg.architecture_name());
    Setup s(cfg, 3, 13);
    REQUIRE(s.trainer->decodes());
    const auto V = static_cast<std::size_t>(cfg.vocab_size);
    const std::int64_t period[3] = {13, 9, 5}, offset[3] = {0, 3, 1};
    std::vector<std::vector<std::int32_t>> rows(3, std::vector<std::int32_t>(13));
    double worst = 0;
    for (std::int64_t t = 0; t < 20; ++t) {
      std::vector<std::int32_t> ids(3), positions(3);
      for (std::size_t r = 0; r < 3; ++r) {
        const std::int64_t p = t < offset[r] ? 0 : (t - offset[r]) % period[r];  // (before its start: a new sequence each step)
        if (p == 0)  // (a new sequence)
          for (auto& id : rows[r]) id = static_cast<std::int32_t>(g() % V);
        ids[r] = rows[r][static_cast<std::size_t>(p)];
        positions[r] = static_cast<std::int32_t>(p);
      }
      const std::vector<float> got = s.trainer->decode_logits(ids, positions, 13);
      std::vector<std::int32_t> whole;
      for (const auto& row : rows) whole.insert(whole.end(), row.begin(), row.end());
      const std::vector<float> want = s.trainer->next_logits(whole, 3, std::vector<std::int64_t>(positions.begin(), positions.end()));
      REQUIRE(got.size() == want.size());
      for (std::size_t r = 0; r < 3; ++r) {
        const auto a = std::span<const float>(got).subspan(r * V, V), b = std::span<const float>(want).subspan(r * V, V);
        CHECK(max_abs(b) > 0);
        worst = std::max(worst, max_abs_diff(a, b) / (kEps * std::max(1.0, max_abs(b))));
      }
    }
    MESSAGE(cfg.architecture_name() << ": the cache's logits within " << worst << " float epsilons of recomputing's");
    CHECK(worst <= 32);
    // rows in chunks of 2 (TrainerOptions::chunk_rows): the same logits, each row's cache its own
    Setup chunked(cfg, 3, 13, false, true, 2);
    std::vector<std::int32_t> ids(3), positions(3);
    for (std::int32_t p = 0; p < 4; ++p) {
      for (std::size_t r = 0; r < 3; ++r) ids[r] = static_cast<std::int32_t>((7 * r + 3 * static_cast<std::size_t>(p)) % V);
      positions.assign(3, p);
      const auto a = chunked.trainer->decode_logits(ids, positions, 13), b = s.trainer->decode_logits(ids, positions, 13);
      CHECK(max_abs_diff(a, b) <= 4 * kEps * std::max(1.0, max_abs(b)));
    }
    // completions: the same tokens with and without the cache, greedy and sampled
    for (const double temperature : {0.0, 0.9}) {
      GenerationOptions o;
      o.max_new_tokens = 7;
      o.sampling.temperature = temperature;
      o.sampling.seed = 5;
      const auto prompts = random_prompts(g, 5, 6, cfg.vocab_size);
      const auto cached = generate::generate(*s.trainer, s.shape(), prompts, o);
      o.cache = false;
      const auto again = generate::generate(*s.trainer, s.shape(), prompts, o);
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        CHECK(cached[i].tokens == again[i].tokens);
        for (std::size_t k = 0; k < std::min(cached[i].log_probs.size(), again[i].log_probs.size()); ++k)
          CHECK(cached[i].log_probs[k] == doctest::Approx(again[i].log_probs[k]).epsilon(1e-4));
      }
    }
  }
}

TEST_CASE("the KV cache refuses what it cannot do, before it changes anything") {
  Setup s(test::tiny(false, 61), 2, 8);
  CHECK_THROWS_WITH_AS(s.trainer->decode_logits(std::vector<std::int32_t>{1, 2, 3}, std::vector<std::int32_t>{0, 0, 0}, 8),
                       doctest::Contains("a positive multiple of the 2 rows"), Error);
  CHECK_THROWS_WITH_AS(s.trainer->decode_logits(std::vector<std::int32_t>{1, 2}, std::vector<std::int32_t>{0, 8}, 8),
                       doctest::Contains("row 1's position 8 is outside its cache of 8 tokens"), Error);
  CHECK_THROWS_WITH_AS(s.trainer->decode_logits(std::vector<std::int32_t>{1, 61}, std::vector<std::int32_t>{0, 0}, 8),
                       doctest::Contains("row 1's id 61 is outside the vocabulary"), Error);
}

TEST_CASE("streamed weights (a model larger than the GPU) give the tokens of resident weights") {
  std::mt19937 g(13);
  for (const ModelConfig& cfg : {test::tiny(true, 61), hybrid()}) {
    CAPTURE(cfg.architecture_name());
    Setup streamed(cfg, 2, 20), resident(cfg, 2, 20, true);
    REQUIRE(resident.trainer->device_units() == static_cast<std::size_t>(cfg.num_hidden_layers + 2));
    REQUIRE(streamed.trainer->device_units() == 0);
    same_completions(streamed, resident, random_prompts(g, 3, 8, cfg.vocab_size), 0.9, 3);
  }
}

TEST_CASE("a store without the optimizer state (6 bytes a parameter) samples as one with it; it is never stepped") {
  std::mt19937 g(29);
  for (const ModelConfig& cfg : {test::tiny(true, 61), hybrid()}) {
    for (const bool resident : {false, true}) {
      CAPTURE(cfg.architecture_name());
      CAPTURE(resident);
      Setup full(cfg, 2, 20, resident), bare(cfg, 2, 20, resident, false);
      CHECK(bare.store.footprint().adam_bytes == 0);
      CHECK(full.store.footprint().total_bytes() - bare.store.footprint().total_bytes() ==
            2 * sizeof(float) * static_cast<std::size_t>(full.store.footprint().slab_elements));  // (with the alignment gaps)
      CHECK_FALSE(bare.store.has_optimizer_state());
      CHECK(bare.store.unit(1).adam_m().empty());
      same_completions(full, bare, random_prompts(g, 3, 8, cfg.vocab_size), 0.8, 9);
      // a step is refused before anything changes
      const std::vector<float> before(bare.store.unit(1).master().begin(), bare.store.unit(1).master().end());
      std::vector<std::int32_t> ids(40, 1), labels(40, 2);
      CHECK_THROWS_WITH_AS(bare.trainer->step(ids, labels), doctest::Contains("StoreOptions::optimizer_state false"), Error);
      CHECK(std::equal(before.begin(), before.end(), bare.store.unit(1).master().begin()));
      CHECK(bare.trainer->steps_done() == 0);
    }
  }
}

TEST_CASE("a seed repeats its completions; another seed draws others; the log-probabilities are the scoring pass's") {
  std::mt19937 g(5);
  Setup s(test::tiny(false, 61), 2, 24);
  const auto prompts = random_prompts(g, 3, 6, 61);
  GenerationOptions o;
  o.max_new_tokens = 12;
  o.sampling.temperature = 1.3;  // (flatter than the model: many tokens likely)
  o.sampling.seed = 42;
  const auto a = generate::generate(*s.trainer, s.shape(), prompts, o);
  const auto b = generate::generate(*s.trainer, s.shape(), prompts, o);
  o.sampling.seed = 43;
  const auto c = generate::generate(*s.trainer, s.shape(), prompts, o);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CHECK(a[i].tokens == b[i].tokens);
    CHECK(a[i].log_probs == b[i].log_probs);
    differ += a[i].tokens != c[i].tokens;
  }
  CHECK(differ > 0);
  // The trainer scores each prompt + completion: its labels' log-probabilities are the completion's.
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    std::vector<std::int32_t> ids(2 * 24, 0), labels(2 * 24, kIgnoreIndex);
    std::vector<std::int32_t> seq = prompts[i];
    seq.insert(seq.end(), a[i].tokens.begin(), a[i].tokens.end());
    std::copy(seq.begin(), seq.end(), ids.begin());
    for (std::size_t t = prompts[i].size(); t < seq.size(); ++t) labels[t - 1] = seq[t];
    const auto lp = s.trainer->score(ids, labels, 2);
    for (std::size_t t = 0; t < a[i].tokens.size(); ++t)
      CHECK(a[i].log_probs[t] == doctest::Approx(lp[prompts[i].size() - 1 + t]).epsilon(1e-4));
  }
}

TEST_CASE("how completions end: an end-of-sequence id, a stop check, max_new_tokens, a full row") {
  std::mt19937 g(8);
  Setup s(test::tiny(false, 61), 2, 12);
  const auto prompts = random_prompts(g, 2, 5, 61);
  GenerationOptions o;
  o.max_new_tokens = 5;
  o.sampling.temperature = 0;
  const auto free_run = generate::generate(*s.trainer, s.shape(), prompts, o);
  // the third token of prompt 0's completion as the end-of-sequence id: it ends there, kept
  const std::int32_t eos = free_run[0].tokens[2];
  o.eos = {eos};
  const auto with_eos = generate::generate(*s.trainer, s.shape(), prompts, o);
  const auto first = static_cast<std::size_t>(std::find(free_run[0].tokens.begin(), free_run[0].tokens.end(), eos) -
                                              free_run[0].tokens.begin());
  CHECK(with_eos[0].finish == Finish::eos);
  CHECK(with_eos[0].tokens == std::vector<std::int32_t>(free_run[0].tokens.begin(), free_run[0].tokens.begin() + first + 1));
  // a stop check that ends prompt 1 at its second token and keeps the first
  o.eos.clear();
  const auto stopped = generate::generate(*s.trainer, s.shape(), prompts, o, [](std::size_t index, std::vector<std::int32_t>& t) {
    if (index != 1 || t.size() < 2) return false;
    t.resize(1);
    return true;
  });
  CHECK(stopped[1].finish == Finish::stop);
  CHECK(stopped[1].tokens == std::vector<std::int32_t>(1, free_run[1].tokens[0]));
  CHECK(stopped[1].log_probs.size() == 1);
  CHECK(stopped[0].tokens == free_run[0].tokens);
  CHECK(stopped[0].finish == Finish::length);
  // a prompt of 10 tokens in a row of 12: two tokens, then the row is full
  std::vector<std::vector<std::int32_t>> long_prompt{std::vector<std::int32_t>(10, 7)};
  o.max_new_tokens = 9;
  const auto full = generate::generate(*s.trainer, s.shape(), long_prompt, o);
  CHECK(full[0].finish == Finish::row);
  CHECK(full[0].tokens.size() == 2);
  CHECK(finish_name(Finish::row) == "row");
}

TEST_CASE("refused before the first step: prompts empty, too long or outside the vocabulary; options out of range") {
  Setup s(test::tiny(false, 61), 1, 8);
  GenerationOptions o;
  const auto refuses = [&](std::vector<std::vector<std::int32_t>> prompts, const GenerationOptions& opt, const char* what) {
    bool called = false;
    try {
      (void)generate::generate(*s.trainer, s.shape(), prompts, opt, [&](std::size_t, std::vector<std::int32_t>&) { return called = true; });
      FAIL("not refused");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
    CHECK(!called);
  };
  refuses({{1, 2}, {}}, o, "prompt 1 is empty");
  refuses({std::vector<std::int32_t>(8, 3)}, o, "prompt 0 has 8 tokens: a row holds 8");
  refuses({{1, 61}}, o, "holds the id 61, outside the model's vocabulary of 61");
  auto bad = o;
  bad.max_new_tokens = 0;
  refuses({{1}}, bad, "max_new_tokens must be at least 1");
  bad = o;
  bad.eos = {-1};
  refuses({{1}}, bad, "end-of-sequence id -1");
  bad = o;
  bad.sampling.top_p = 0;
  refuses({{1}}, bad, "top_p");
  CHECK_THROWS_WITH_AS(s.trainer->next_logits(std::vector<std::int32_t>(8, 1), 1, std::vector<std::int64_t>{8}),
                       doctest::Contains("position 8 outside a row of 8 tokens"), Error);
}
