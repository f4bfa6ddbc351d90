#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;

static_assert(Backend<CpuBackend<float>>);
static_assert(Backend<CpuBackend<double>>);
static_assert(LayerOp<DecoderBlock, CpuBackend<double>>);
static_assert(EmbeddingOp<Embedding, CpuBackend<double>>);
static_assert(HeadOp<LmHead, CpuBackend<float>>);

TEST_CASE("smoke: a tiny model runs forward and backward on the CPU backend") {
  auto cfg = ModelConfig::from_json(nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":24,
    "intermediate_size":40,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":37,
    "tie_word_embeddings":true})"));
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.pinning = Pinning::never;
  HostParamStore<double> store(model.units(), so);
  CpuBackend<double> be;
  ChunkShape c{2, 5};
  std::vector<std::int32_t> ids(10), labels(10);
  for (int i = 0; i < 10; ++i) ids[i] = labels[i] = (i * 7) % 37;
  std::vector<double> x(10 * 24), y(10 * 24), dx(10 * 24), loss(10);
  std::vector<std::byte> mem(1 << 20);
  Arena arena{std::span<std::byte>(mem)};
  View<const std::int32_t> idv(std::span<const std::int32_t>(ids), Shape{10});
  View<double> xv(std::span<double>(x), Shape{10, 24}), yv(std::span<double>(y), Shape{10, 24}), dxv(std::span<double>(dx), Shape{10, 24});
  auto& eu = store.unit(0);
  auto we = model.embedding().bind(std::span<const double>(eu.master()));
  model.embedding().op().forward(be, c, we, idv, xv, arena);
  auto wb = model.block(0).bind(std::span<const double>(store.unit(1).master()));
  model.block(0).op().forward(be, c, wb, View<const double>(xv), yv, arena);
  std::vector<double> grad(static_cast<std::size_t>(store.unit(1).numel()));
  auto gb = model.block(0).bind(std::span<double>(grad));
  model.block(0).op().backward(be, c, wb, View<const double>(xv), View<const double>(yv), dxv, gb, arena);
  auto wh = model.head().bind(std::span<const double>(store.unit(3).master()),
                              {{&model.embedding().layout(), std::span<const double>(eu.master())}});
  model.head().op().forward(be, c, wh, View<const double>(yv), View<const std::int32_t>(std::span<const std::int32_t>(labels), Shape{10}),
                            View<double>(std::span<double>(loss), Shape{10}), arena);
  double mean = 0;
  for (double l : loss) mean += l / 10;
  // Near-uniform predictions from a freshly initialised model.
  CHECK(mean > 0.5 * std::log(37.0));
  CHECK(mean < 1.5 * std::log(37.0));
  CHECK(model.block(0).op().scratch_bytes<CpuBackend<double>>(c) > 0);
}

TEST_CASE("smoke: DecoderModel refuses a block index out of range with megatrain::Error") {
  auto cfg = ModelConfig::from_json(nlohmann::json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":16,
    "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":2,"vocab_size":11})"));
  const DecoderModel<> model(cfg);
  REQUIRE(model.num_blocks() == 3);
  CHECK_NOTHROW((void)model.block(2));
  for (std::size_t i : {std::size_t{3}, std::size_t{4}, std::numeric_limits<std::size_t>::max()}) {
    CAPTURE(i);
    // Error, not std::out_of_range (which CHECK_THROWS_AS would not accept).
    CHECK_THROWS_AS((void)model.block(i), Error);
    try {
      (void)model.block(i);
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("block " + std::to_string(i) + " out of range (the model has 3 blocks: 0 to 2)") !=
            std::string::npos);
    }
  }
  // An empty factory is refused the same way, not with std::bad_function_call.
  CHECK_THROWS_WITH_AS(DecoderModel<>(cfg, DecoderModel<>::BlockFactory{}),
                       doctest::Contains("the block factory is empty"), Error);
}

namespace {

/// The mean cross-entropy over the tokens whose label is not -100, in float64: the blocks'
/// outputs from the library's ops (run in double on the fp32 masters), then the final RMSNorm,
/// the logits and log-sum-exp written out here, independently of LmHead and the backend's
/// lm_head_loss. `all_tokens` receives the same sum divided by every token instead.
double labelled_mean_f64(const DecoderModel<>& model, const HostParamStore<float>& store, std::int64_t rows,
                         std::int64_t seq, const std::vector<std::int32_t>& ids, const std::vector<std::int32_t>& labels,
                         double& all_tokens) {
  const ModelConfig& cfg = model.config();
  const std::int64_t M = rows * seq, d = cfg.hidden_size, V = cfg.vocab_size;
  auto master = [&](std::size_t u) {
    const auto m = store.unit(u).master();
    return std::vector<double>(m.begin(), m.end());
  };
  CpuBackend<double> be;
  const ChunkShape c{rows, seq};
  std::vector<std::byte> mem(model.block(0).op().scratch_bytes<CpuBackend<double>>(c));
  Arena arena{std::span<std::byte>(mem)};
  std::vector<double> x(static_cast<std::size_t>(M * d)), y(x.size());
  const auto emb = master(0);
  model.embedding().op().forward(be, c, model.embedding().bind(std::span<const double>(emb)),
                                 View<const std::int32_t>(std::span<const std::int32_t>(ids), Shape{M}),
                                 View<double>(std::span<double>(x), Shape{M, d}), arena);
  for (std::size_t l = 0; l < model.num_blocks(); ++l) {
    const auto w = master(l + 1);
    model.block(l).op().forward(be, c, model.block(l).bind(std::span<const double>(w)),
                                View<const double>(std::span<const double>(x), Shape{M, d}),
                                View<double>(std::span<double>(y), Shape{M, d}), arena);
    std::swap(x, y);
  }
  // The head's tensors, found by their Hugging Face names.
  const auto head = master(model.head_unit());
  const double* norm = head.data() + model.head().layout().find("model.norm.weight")->offset;
  const double* table = cfg.tie_word_embeddings
                            ? emb.data() + model.embedding().layout().find("model.embed_tokens.weight")->offset
                            : head.data() + model.head().layout().find("lm_head.weight")->offset;
  double sum = 0;
  std::int64_t labelled = 0;
  for (std::int64_t t = 0; t < M; ++t) {
    const std::int32_t label = labels[static_cast<std::size_t>(t)];
    if (label == -100) continue;
    const double* xt = x.data() + t * d;
    double ms = 0;
    for (std::int64_t i = 0; i < d; ++i) ms += xt[i] * xt[i] / static_cast<double>(d);
    std::vector<double> n(static_cast<std::size_t>(d)), z(static_cast<std::size_t>(V));
    for (std::int64_t i = 0; i < d; ++i) n[i] = xt[i] / std::sqrt(ms + cfg.rms_norm_eps) * norm[i];
    for (std::int64_t v = 0; v < V; ++v)
      for (std::int64_t i = 0; i < d; ++i) z[v] += n[i] * table[v * d + i];
    double zmax = z[0], se = 0;
    for (double zv : z) zmax = std::max(zmax, zv);
    for (double zv : z) se += std::exp(zv - zmax);
    sum += zmax + std::log(se) - z[label];
    ++labelled;
  }
  all_tokens = sum / static_cast<double>(M);
  return sum / static_cast<double>(labelled);
}

}  // namespace

TEST_CASE("smoke: the trainer's loss is the mean over the tokens whose label is not -100 (CPU, fp32 vs float64)") {
  // 3 sequences of 6 tokens; -100 on 4 tokens of the first, none of the second, 1 of the third
  // (the first and last tokens included), so a mean over all tokens, or a mean of per-sequence
  // or per-micro-batch means, would each give a different number.
  const std::int64_t rows = 3, seq = 6;
  std::vector<std::int32_t> ids(rows * seq), labels(ids.size());
  for (std::size_t t = 0; t < ids.size(); ++t) {
    ids[t] = static_cast<std::int32_t>((t * 11 + 3) % 29);
    labels[t] = static_cast<std::int32_t>((t * 7 + 5) % 29);
  }
  for (std::size_t t : {0, 2, 3, 5, 17}) labels[t] = -100;
  for (const bool tied : {false, true}) {
    for (const std::int64_t micro : {1, 3}) {
      CAPTURE(tied);
      CAPTURE(micro);
      auto j = nlohmann::json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":16,"intermediate_size":24,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":29})");
      j["tie_word_embeddings"] = tied;
      const auto cfg = ModelConfig::from_json(j);
      DecoderModel<> model(cfg);
      TrainerOptions o;
      o.batch_rows = rows;
      o.seq_len = seq;
      o.micro_batches = micro;
      StoreOptions so;
      so.seed = 3;
      so.pinning = Pinning::never;
      HostParamStore<float> store(model.units(), Trainer<CpuBackend<float>>::store_options(o, so));
      // Spread the logits (the initial std of 0.02 makes every token's loss about log(vocab),
      // where a mean over the wrong tokens would go unnoticed): the losses now spread over many nats.
      const auto table = store.master(tied ? "model.embed_tokens.weight" : "lm_head.weight");
      for (float& w : std::span<float>(table.data(), static_cast<std::size_t>(table.numel()))) w *= 40.0f;
      for (std::size_t u : {std::size_t{0}, model.head_unit()}) store.sync_compute(store.unit(u));
      double all_tokens = 0;
      const double want = labelled_mean_f64(model, store, rows, seq, ids, labels, all_tokens);
      REQUIRE(std::abs(want - all_tokens) > 0.1 * want);  // the two means are told apart

      CpuBackend<float> be;
      Trainer<CpuBackend<float>> trainer(model, store, be, o);
      CHECK(trainer.evaluate(ids, labels, rows) == doctest::Approx(want).epsilon(1e-5));
      const StepStats st = trainer.step(ids, labels);  // the loss before the update
      CHECK(st.loss == doctest::Approx(want).epsilon(1e-5));
    }
  }
}

TEST_CASE("blocks composed per layer: each layer's mixers are the config's (layer_types, the experts' layers)") {
  // Qwen3-MoE with decoder_sparse_step 2 and mlp_only_layers [3]: experts on layer 1 alone.
  const auto moe = ModelConfig::from_file(std::string(MEGATRAIN_TEST_FIXTURES) + "/qwen3_moe_step2/config.json");
  const DecoderModel<> model(moe);
  for (std::size_t l = 0; l < model.num_blocks(); ++l) {
    CAPTURE(l);
    const bool experts = l == 1;
    CHECK(moe.layer_kind(static_cast<std::int64_t>(l)) ==
          LayerKind{TokenMixerKind::full_attention, experts ? ChannelMixerKind::experts : ChannelMixerKind::dense_mlp});
    CHECK(std::holds_alternative<MoeMlp>(model.block(l).op().channel_mixer()) == experts);
    CHECK(std::holds_alternative<SelfAttention>(model.block(l).op().token_mixer()));
  }
  // Gemma 3: sliding and full attention layers, one token mixer for both.
  const auto gemma = ModelConfig::from_file(std::string(MEGATRAIN_TEST_FIXTURES) + "/gemma3/config.json");
  for (std::int64_t l = 0; l < 3; ++l)
    CHECK(gemma.layer_kind(l).token_mixer == (l == 1 ? TokenMixerKind::full_attention : TokenMixerKind::sliding_attention));
  // A block whose lists have no mixer for a layer's kind is refused, naming the layer.
  using DenseOnly = ComposedBlock<std::variant<SelfAttention>, std::variant<SwiGluMlp>>;
  try {
    const DecoderModel<DenseOnly> dense(moe);
    FAIL("a sparse layer was built without a mixture-of-experts mixer");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("layer 1 (full_attention, experts): this block has no channel mixer that builds it") !=
          std::string::npos);
  }
}
