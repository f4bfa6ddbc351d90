#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"

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
