// A unit run over a batch chunk by chunk equals one call over the whole batch: the same
// outputs and input gradients, and the same weight gradients accumulated across the chunks
// (what the trainer relies on when a batch does not fit one chunk). Float64 and float.
// And the CPU backend's results do not depend on the number of TBB threads: bit for bit.
//
// Tolerances: chunking changes only the order of sums (weight gradients are summed over
// tokens chunk by chunk; a GEMM over fewer rows may block its inner products differently), so
// results agree to a few ulps of the summands. Each element is compared as
//     |chunked - whole| <= rtol (|whole| + rms(whole tensor)),
// the rms term absorbing cancellation in sums of mixed signs, with rtol = 1e-12 in float64
// and 2^7 FLT_EPSILON (1.5e-5) in float: the measured errors stay below 1/10 of these
// (MEGATRAIN_TEST_VERBOSE=1 prints each comparison's worst error / tolerance).
#include <doctest/doctest.h>
#include <oneapi/tbb/global_control.h>

#include <cfloat>
#include <cstring>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

template <class T>
constexpr double kChunkRtol = std::is_same_v<T, double> ? 1e-12 : 128.0 * FLT_EPSILON;

/// Chunked against whole, elementwise, with the tolerance above.
template <class T>
void check_same(const std::string& what, const std::vector<T>& chunked, const std::vector<T>& whole) {
  const double rtol = kChunkRtol<T>;
  const double worst = check_close(what, chunked, whole, rtol, rtol * rms(whole));
  if (std::getenv("MEGATRAIN_TEST_VERBOSE") != nullptr)
    MESSAGE(fmt::format("{}: worst error / tolerance {:.3g}", what, worst));
}

/// Chunks of whole sequences: 2, 1 and 3 of the batch's 6.
constexpr std::int64_t kChunkRows[] = {2, 1, 3};
constexpr std::int64_t kBatchRows = 6;

/// Everything one pass of a tiny model's units leaves behind: outputs, input gradients,
/// weight gradients.
template <class T>
struct Results {
  std::vector<T> emb_out, block_out, block_dx, head_loss, head_dx;
  std::vector<T> emb_grad, block_grad, head_grad;
};

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
template <class T>
void check_bitwise_equal(const Results<T>& a, const Results<T>& b) {
  CHECK(bitwise_equal(a.emb_out, b.emb_out));
  CHECK(bitwise_equal(a.block_out, b.block_out));
  CHECK(bitwise_equal(a.block_dx, b.block_dx));
  CHECK(bitwise_equal(a.head_loss, b.head_loss));
  CHECK(bitwise_equal(a.head_dx, b.head_dx));
  CHECK(bitwise_equal(a.emb_grad, b.emb_grad));
  CHECK(bitwise_equal(a.block_grad, b.block_grad));
  CHECK(bitwise_equal(a.head_grad, b.head_grad));
}

/// A tiny tied model: the embedding, one block and the head, run forward and backward over a
/// batch of `rows` sequences of `seq` tokens, in chunks of `chunks` sequences each.
template <class T>
class Harness {
 public:
  using Be = CpuBackend<T>;

  Harness(const TestModel& shape, std::int64_t rows, std::int64_t seq, std::uint64_t seed)
      : cfg_(make_config(shape)), model_(cfg_), rows_(rows), seq_(seq), rng_(test_seed(seed)) {
    const std::int64_t M = rows * seq, d = cfg_.hidden_size;
    emb_w_ = random_weights<T>(model_.embedding().layout(), rng_);
    block_w_ = random_weights<T>(model_.block(0).layout(), rng_);
    head_w_ = random_weights<T>(model_.head().layout(), rng_);
    ids_.resize(static_cast<std::size_t>(M));
    labels_.resize(ids_.size());
    std::int64_t counted = 0;
    for (std::size_t t = 0; t < ids_.size(); ++t) {
      ids_[t] = static_cast<std::int32_t>(rng_.index(cfg_.vocab_size));
      labels_[t] = rng_.uniform(0, 1) < 0.2 ? kIgnoreIndex : static_cast<std::int32_t>(rng_.index(cfg_.vocab_size));
      counted += labels_[t] != kIgnoreIndex;
    }
    loss_scale_ = 1.0 / static_cast<double>(std::max<std::int64_t>(counted, 1));
    x_ = rng_.template vector<T>(M * d, -1, 1);   // the block's input
    dy_ = rng_.template vector<T>(M * d, -1, 1);  // the gradient of its output
  }

  /// Runs every unit over the batch in chunks of `chunk_rows` sequences (summing to rows).
  Results<T> run(std::span<const std::int64_t> chunk_rows, std::int64_t logits_block = 256, std::int64_t token_block = 0) const {
    Be be;
    be.logits_block = logits_block;
    const std::int64_t M = rows_ * seq_, d = cfg_.hidden_size;
    const auto& emb = model_.embedding();
    const auto& block = model_.block(0);
    const auto& head = model_.head();
    Results<T> res;
    res.emb_out.resize(static_cast<std::size_t>(M * d));
    res.block_out.resize(res.emb_out.size());
    res.block_dx.resize(res.emb_out.size());
    res.head_dx.resize(res.emb_out.size());
    res.head_loss.resize(static_cast<std::size_t>(M));
    res.emb_grad.assign(emb_w_.size(), T(0));
    res.block_grad.assign(block_w_.size(), T(0));
    res.head_grad.assign(head_w_.size(), T(0));
    const auto we = emb.bind(std::span<const T>(emb_w_));
    const auto wb = block.bind(std::span<const T>(block_w_));
    const auto wh = head.bind(std::span<const T>(head_w_), {{&emb.layout(), std::span<const T>(emb_w_)}});
    const auto ge = emb.bind(std::span<T>(res.emb_grad));
    const auto gb = block.bind(std::span<T>(res.block_grad));
    const auto gh = head.bind(std::span<T>(res.head_grad), {{&emb.layout(), std::span<T>(res.emb_grad)}});
    std::int64_t row0 = 0;
    for (const std::int64_t rows : chunk_rows) {
      const ChunkShape c{rows, seq_, {}, token_block};
      const std::int64_t t0 = row0 * seq_, n = c.tokens();
      std::vector<std::byte> mem(
          std::max(block.op().template scratch_bytes<Be>(c), head.op().template scratch_bytes<Be>(c)));
      Arena arena{std::span<std::byte>(mem)};
      const auto ids = View<const std::int32_t>(
          std::span<const std::int32_t>(ids_).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(n)),
          Shape{n});
      const auto labels = View<const std::int32_t>(
          std::span<const std::int32_t>(labels_).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(n)),
          Shape{n});
      emb.op().forward(be, c, we, ids, view_at(res.emb_out, t0 * d, {n, d}), arena);
      emb.op().backward(be, c, ids, cview_at(dy_, t0 * d, {n, d}), ge, arena);
      block.op().forward(be, c, wb, cview_at(x_, t0 * d, {n, d}), view_at(res.block_out, t0 * d, {n, d}), arena);
      block.op().backward(be, c, wb, cview_at(x_, t0 * d, {n, d}), cview_at(dy_, t0 * d, {n, d}),
                          view_at(res.block_dx, t0 * d, {n, d}), gb, arena);
      head.op().forward_backward(be, c, wh, cview_at(x_, t0 * d, {n, d}), labels, loss_scale_,
                                 view_at(res.head_loss, t0, {n}), view_at(res.head_dx, t0 * d, {n, d}), gh, arena);
      row0 += rows;
    }
    REQUIRE(row0 == rows_);
    return res;
  }

 private:
  ModelConfig cfg_;
  DecoderModel<> model_;
  std::int64_t rows_, seq_;
  Random rng_;
  std::vector<T> emb_w_, block_w_, head_w_, x_, dy_;
  std::vector<std::int32_t> ids_, labels_;
  double loss_scale_ = 1;
};

template <class T>
void check_chunking(const TestModel& shape, std::int64_t seq, std::uint64_t seed) {
  const Harness<T> h(shape, kBatchRows, seq, seed);
  const std::int64_t whole_rows[] = {kBatchRows};
  const Results<T> whole = h.run(whole_rows);
  const Results<T> chunked = h.run(kChunkRows, 5);  // small logits blocks too: the head must not care
  check_same("embedding output", chunked.emb_out, whole.emb_out);
  check_same("block output", chunked.block_out, whole.block_out);
  check_same("block dx", chunked.block_dx, whole.block_dx);
  check_same("head losses", chunked.head_loss, whole.head_loss);
  check_same("head dx", chunked.head_dx, whole.head_dx);
  check_same("embedding gradient (embedding + tied head)", chunked.emb_grad, whole.emb_grad);
  check_same("block gradient", chunked.block_grad, whole.block_grad);
  check_same("head gradient", chunked.head_grad, whole.head_grad);
}

const TestModel kQwen{"Qwen2ForCausalLM", 20, 36, 4, 2, 10, false, false, 100.0, 37, true};
const TestModel kLlama{"LlamaForCausalLM", 24, 40, 7, 1, 6, true, true, 10000.0, 101, true};

}  // namespace

TEST_CASE("chunking: units over 2 + 1 + 3 sequences equal one call over 6, float64") {
  check_chunking<double>(kQwen, 7, 2000);
  check_chunking<double>(kLlama, 13, 2001);
}

TEST_CASE("chunking: units over 2 + 1 + 3 sequences equal one call over 6, float") {
  check_chunking<float>(kQwen, 7, 2002);
  check_chunking<float>(kLlama, 13, 2003);
}

TEST_CASE("token blocks: a block's norms, projections and MLP a few tokens at a time equal one call") {
  // Blocks of 5 and 9 tokens cut across rows of 7 and 13; attention still sees whole rows.
  for (const std::int64_t block : {5, 9}) {
    CAPTURE(block);
    const Harness<double> h(kQwen, kBatchRows, 7, 2200);
    const std::int64_t whole_rows[] = {kBatchRows};
    const Results<double> whole = h.run(whole_rows);
    const Results<double> blocked = h.run(kChunkRows, 256, block);
    check_same("block output", blocked.block_out, whole.block_out);
    check_same("block dx", blocked.block_dx, whole.block_dx);
    check_same("block gradient", blocked.block_grad, whole.block_grad);
    const Harness<float> f(kLlama, kBatchRows, 13, 2201);
    const Results<float> fw = f.run(whole_rows), fb = f.run(kChunkRows, 256, block);
    check_same("block output (float)", fb.block_out, fw.block_out);
    check_same("block dx (float)", fb.block_dx, fw.block_dx);
    check_same("block gradient (float)", fb.block_grad, fw.block_grad);
  }
}

TEST_CASE("token blocks: a block's scratch grows linearly with the sequence length") {
  // With the token-wise work in blocks of 64 tokens, only the attention's buffers and h grow
  // with the row: the scratch is affine in the sequence length (equal steps for equal growth).
  const auto cfg = make_config(kQwen);
  DecoderModel<> model(cfg);
  const auto& op = model.block(0).op();
  std::vector<double> bytes;
  for (const std::int64_t seq : {1024, 2048, 3072, 4096})
    bytes.push_back(static_cast<double>(op.scratch_bytes<CpuBackend<float>>(ChunkShape{1, seq, {}, 64})));
  const double step = bytes[1] - bytes[0];
  CHECK(step > 0);
  for (std::size_t i = 2; i < bytes.size(); ++i) CHECK(bytes[i] - bytes[i - 1] == doctest::Approx(step).epsilon(0.01));
  // and without blocks, the MLP's buffers grow with it too: more per token
  const auto whole = static_cast<double>(op.scratch_bytes<CpuBackend<float>>(ChunkShape{1, 4096}));
  CHECK(whole > bytes[3]);
}

TEST_CASE("threads: results do not depend on the number of TBB threads, bit for bit") {
  // Large enough that every parallel loop of the backend splits: a chunk of 260 tokens (> the
  // 256-row reduction blocks of bias and norm gradients, > 64-row GEMM blocks), hidden 72
  // (> 64 embedding-gradient columns); Qwen2, so the q/k/v bias gradients are reduced too.
  const TestModel shape{"Qwen2ForCausalLM", 72, 80, 4, 2, 18, false, false, 10000.0, 45, true};
  const Harness<float> h(shape, 5, 65, 2100);
  const std::int64_t chunks[] = {4, 1};
  auto run_with = [&](std::size_t threads) {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
    return h.run(chunks, 64);
  };
  const Results<float> one = run_with(1);
  const Results<float> all = h.run(chunks, 64);  // the default: every core
  const Results<float> many = run_with(7);       // more threads than cores
  const Results<float> again = h.run(chunks, 64);
  check_bitwise_equal(all, one);
  check_bitwise_equal(many, one);
  check_bitwise_equal(again, one);
}
