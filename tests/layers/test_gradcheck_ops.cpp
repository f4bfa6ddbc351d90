// The shipped layer ops on the CPU reference backend in float64: each op's backward against
// central differences of its forward (method and tolerances in gradcheck.hpp), for the block's
// input and every weight tensor of its layout, then a whole tiny model, where the tied
// embedding table collects gradients from both ends.
//
// Blocks: Llama without biases, Qwen2 (q/k/v biases), Llama with attention_bias (q/k/v and o
// biases) and mlp_bias; GQA ratios 1, 2, 4 and 7; head_dim 6, 10, 12, 24; hidden sizes that are
// not heads * head_dim; 1, 5, 7 and 13 tokens per sequence, several sequences per chunk.
// Weight gradients start random: the ops must accumulate (+=) into them.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// One GradTensor per tensor of `layout`: values in `slab`, gradient increments grad - grad0.
void add_tensors(std::vector<GradTensor>& out, const UnitLayout& layout, Vec& slab, const Vec& increments,
                 bool (*may_vanish)(const std::string&) = nullptr) {
  for (const auto& e : layout.entries()) {
    const auto off = static_cast<std::size_t>(e.offset), n = static_cast<std::size_t>(e.numel());
    out.push_back({e.spec.name, std::span<double>(slab).subspan(off, n),
                   std::span<const double>(increments).subspan(off, n),
                   may_vanish != nullptr && may_vanish(e.spec.name)});
  }
}

std::vector<std::int32_t> random_ids(std::int64_t n, std::int64_t vocab, Random& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = static_cast<std::int32_t>(rng.index(vocab));
  return ids;
}
View<const std::int32_t> ids_view(const std::vector<std::int32_t>& ids) {
  return View<const std::int32_t>(std::span<const std::int32_t>(ids), Shape{static_cast<std::int64_t>(ids.size())});
}

/// Labels over the whole vocabulary, about a quarter ignored; returns how many count.
std::int64_t random_labels(std::vector<std::int32_t>& labels, std::int64_t vocab, Random& rng) {
  std::int64_t counted = 0;
  for (auto& l : labels) {
    l = rng.uniform(0, 1) < 0.25 ? kIgnoreIndex : static_cast<std::int32_t>(rng.index(vocab));
    counted += l != kIgnoreIndex;
  }
  if (counted == 0) labels.front() = static_cast<std::int32_t>(vocab - 1), counted = 1;
  return counted;
}

bool q_or_k(const std::string& name) {
  return name.find("q_proj") != std::string::npos || name.find("k_proj") != std::string::npos;
}

// Gradcheck of a [tokens, hidden] -> [tokens, hidden] op (a LayerOp): the input and every weight.
template <class Op>
void check_layer(const TestModel& shape, ChunkShape c, std::uint64_t seed, const char* what = "block") {
  const LayerTemplate<Op> block{Op(make_config(shape), 0)};
  // With one token per sequence attention returns v: q and k do not matter.
  gradcheck_layer(block, c, seed,
                  fmt::format("{} {}, {}/{} heads of {}, {}x{} tokens", shape.arch, what, shape.heads, shape.kv_heads,
                              shape.head_dim, c.rows, c.seq),
                  c.seq == 1 ? q_or_k : nullptr);
}

void check_block(const TestModel& shape, ChunkShape c, std::uint64_t seed) { check_layer<DecoderBlock>(shape, c, seed); }

}  // namespace

TEST_CASE("gradcheck: self-attention op (grouped-query, rotary, biases) on its own") {
  check_layer<SelfAttention>({"LlamaForCausalLM", 12, 20, 2, 2, 6}, {2, 7}, 1400, "attention");           // ratio 1
  check_layer<SelfAttention>({"Qwen2ForCausalLM", 20, 28, 4, 2, 10}, {2, 13}, 1401, "attention");         // q/k/v bias
  check_layer<SelfAttention>({"LlamaForCausalLM", 16, 24, 4, 1, 12, true, false}, {3, 5}, 1402, "attention");  // o bias too
  check_layer<SelfAttention>({"MistralForCausalLM", 14, 30, 14, 2, 6, false, false, 50.0}, {2, 5}, 1403, "attention");  // ratio 7
}

TEST_CASE("gradcheck: SwiGLU MLP op on its own") {
  check_layer<SwiGluMlp>({"LlamaForCausalLM", 12, 20, 2, 2, 6}, {2, 7}, 1500, "MLP");
  check_layer<SwiGluMlp>({"LlamaForCausalLM", 16, 24, 4, 1, 12, true, true}, {3, 5}, 1501, "MLP");  // with biases
}

TEST_CASE("gradcheck: decoder block, Llama without biases") {
  check_block({"LlamaForCausalLM", 12, 20, 2, 2, 6}, {2, 7}, 1000);                       // GQA ratio 1
  check_block({"LlamaForCausalLM", 16, 24, 7, 1, 6, false, false, 100.0}, {2, 7}, 1001);  // ratio 7
}

TEST_CASE("gradcheck: decoder block, Qwen2 (q/k/v biases)") {
  const TestModel qwen{"Qwen2ForCausalLM", 20, 28, 4, 2, 10};
  const ModelConfig cfg = make_config(qwen);
  const LayerTemplate<DecoderBlock> block{DecoderBlock(cfg, 0)};
  CHECK(block.layout().find("model.layers.0.self_attn.q_proj.bias") != nullptr);
  CHECK(block.layout().find("model.layers.0.self_attn.v_proj.bias") != nullptr);
  CHECK(block.layout().find("model.layers.0.self_attn.o_proj.bias") == nullptr);
  check_block(qwen, {2, 13}, 1100);                                   // ratio 2
  check_block({"Qwen2ForCausalLM", 24, 16, 2, 1, 24}, {3, 1}, 1101);  // ratio 2, one token per sequence
  check_block({"Qwen2ForCausalLM", 14, 30, 14, 2, 6, false, false, 50.0}, {2, 5}, 1102);  // ratio 7, two kv heads
}

TEST_CASE("gradcheck: decoder block, Llama with attention_bias and mlp_bias") {
  const TestModel llama{"LlamaForCausalLM", 16, 24, 4, 1, 12, true, true};
  const ModelConfig cfg = make_config(llama);
  const LayerTemplate<DecoderBlock> block{DecoderBlock(cfg, 0)};
  CHECK(block.layout().find("model.layers.0.self_attn.o_proj.bias") != nullptr);
  CHECK(block.layout().find("model.layers.0.mlp.down_proj.bias") != nullptr);
  check_block(llama, {3, 5}, 1200);                                                       // ratio 4
  check_block({"LlamaForCausalLM", 18, 22, 6, 3, 10, true, false, 100.0}, {2, 7}, 1201);  // ratio 2, three kv heads
}

TEST_CASE("gradcheck: decoder block, Mistral") {
  check_block({"MistralForCausalLM", 10, 12, 4, 1, 6}, {1, 13}, 1300);  // ratio 4, one long sequence
}

TEST_CASE("gradcheck: embedding op") {
  Random rng(test_seed(1400));
  Be be;
  const ModelConfig cfg = make_config({"LlamaForCausalLM", 10, 12, 2, 2, 6, false, false, 1e4, 37});
  const LayerTemplate<Embedding> emb{Embedding(cfg)};
  const ChunkShape c{3, 5};
  const std::int64_t M = c.tokens(), d = cfg.hidden_size, V = cfg.vocab_size;
  std::vector<std::int32_t> ids = random_ids(M, 6, rng);  // repeats
  ids[3] = static_cast<std::int32_t>(V - 1);
  Vec slab = random_weights(emb.layout(), rng);
  const Vec r = rng.vector(M * d, -1, 1);
  Arena arena;  // the embedding needs no scratch
  const auto w = emb.bind(std::span<const double>(slab));
  Vec y(static_cast<std::size_t>(M * d));
  auto objective = [&] {
    emb.op().forward(be, c, w, ids_view(ids), view(y, {M, d}), arena);
    return contract(y, r);
  };
  const Vec g0 = rng.vector(emb.layout().numel(), -1, 1);
  Vec g = g0;
  emb.op().backward(be, c, ids_view(ids), cview(r, {M, d}), emb.bind(std::span<double>(g)), arena);
  const Vec inc = minus(g, g0);
  std::vector<GradTensor> t;
  add_tensors(t, emb.layout(), slab, inc);
  GradcheckOptions opt;
  opt.exhaustive_limit = V * d;  // 370 coordinates: all of them, used rows and unused
  report("embedding op", gradcheck(objective, t, rng, opt));
}

TEST_CASE("gradcheck: LM head, untied and tied") {
  std::uint64_t seed = 1500;
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    Random rng(test_seed(++seed));
    Be be;
    be.logits_block = 5;  // several logits blocks per chunk
    const ModelConfig cfg =
        make_config({"Qwen2ForCausalLM", 12, 16, 2, 1, 6, false, false, 1e4, tied ? 37 : 101, tied});
    const LayerTemplate<Embedding> emb{Embedding(cfg)};
    const LayerTemplate<LmHead> head{LmHead(cfg)};
    CHECK((head.layout().find(LmHead::kHead) != nullptr) == !tied);
    const ChunkShape c{2, 7};
    const std::int64_t M = c.tokens(), d = cfg.hidden_size;
    Vec emb_slab = random_weights(emb.layout(), rng), head_slab = random_weights(head.layout(), rng);
    Vec x = rng.vector(M * d, -1, 1);
    std::vector<std::int32_t> labels(static_cast<std::size_t>(M));
    const double scale = 1.0 / static_cast<double>(random_labels(labels, cfg.vocab_size, rng));
    const Vec r(static_cast<std::size_t>(M), scale);  // L = scale * sum_t loss_t, what forward_backward differentiates
    std::vector<std::byte> mem(head.op().scratch_bytes<Be>(c));
    Arena arena{std::span<std::byte>(mem)};
    const auto w = head.bind(std::span<const double>(head_slab), {{&emb.layout(), std::span<const double>(emb_slab)}});
    Vec loss(static_cast<std::size_t>(M));
    auto objective = [&] {
      head.op().forward(be, c, w, cview(x, {M, d}), ids_view(labels), view(loss, {M}), arena);
      return contract(loss, r);
    };
    objective();
    const Vec eval_loss = loss;
    const Vec hg0 = rng.vector(head.layout().numel(), -1, 1), eg0 = rng.vector(emb.layout().numel(), -1, 1);
    Vec hg = hg0, eg = eg0, dx(x.size(), kNaN);
    head.op().forward_backward(be, c, w, cview(x, {M, d}), ids_view(labels), scale, view(loss, {M}), view(dx, {M, d}),
                               head.bind(std::span<double>(hg), {{&emb.layout(), std::span<double>(eg)}}), arena);
    check_close("training losses = evaluation losses", loss, eval_loss, 0.0, 0.0);
    const Vec hinc = minus(hg, hg0), einc = minus(eg, eg0);
    std::vector<GradTensor> t{{"x", x, dx}};
    add_tensors(t, head.layout(), head_slab, hinc);
    if (tied)
      add_tensors(t, emb.layout(), emb_slab, einc);
    else
      CHECK(einc == Vec(einc.size(), 0.0));  // untied: the embedding's gradient is not touched
    report(tied ? "tied LM head" : "untied LM head", gradcheck(objective, t, rng));
  }
}

TEST_CASE("gradcheck: a whole tiny model with tied embeddings") {
  // embedding -> 2 Qwen2 blocks -> head; the table's gradient sums the embedding's and the head's.
  Random rng(test_seed(1600));
  Be be;
  be.logits_block = 4;
  const ModelConfig cfg = make_config({"Qwen2ForCausalLM", 12, 20, 4, 2, 6, false, false, 100.0, 37, true, 2});
  const DecoderModel<> model(cfg);
  const ChunkShape c{2, 7};
  const std::int64_t M = c.tokens(), d = cfg.hidden_size;
  const std::size_t U = model.num_units();
  std::vector<Vec> slabs(U), grads(U), grads0(U);
  auto layout = [&](std::size_t u) -> const UnitLayout& {
    return u == 0                   ? model.embedding().layout()
           : u == model.head_unit() ? model.head().layout()
                                    : model.block(u - 1).layout();
  };
  for (std::size_t u = 0; u < U; ++u) {
    slabs[u] = random_weights(layout(u), rng);
    grads0[u] = rng.vector(layout(u).numel(), -1, 1);
    grads[u] = grads0[u];
  }
  const std::vector<std::int32_t> ids = random_ids(M, cfg.vocab_size, rng);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(M));
  const double scale = 1.0 / static_cast<double>(random_labels(labels, cfg.vocab_size, rng));
  std::size_t scratch = model.head().op().scratch_bytes<Be>(c);
  for (std::size_t l = 0; l < model.num_blocks(); ++l)
    scratch = std::max(scratch, model.block(l).op().scratch_bytes<Be>(c));
  std::vector<std::byte> mem(scratch);
  Arena arena{std::span<std::byte>(mem)};
  auto cspan = [](const Vec& v) { return std::span<const double>(v); };
  const auto we = model.embedding().bind(cspan(slabs[0]));
  const auto wh = model.head().bind(cspan(slabs[model.head_unit()]), {{&model.embedding().layout(), cspan(slabs[0])}});
  // acts[l] is block l's input; acts[num_blocks] the head's.
  std::vector<Vec> acts(model.num_blocks() + 1, Vec(static_cast<std::size_t>(M * d)));
  Vec loss(static_cast<std::size_t>(M));
  const Vec r(loss.size(), scale);
  auto objective = [&] {
    model.embedding().op().forward(be, c, we, ids_view(ids), view(acts[0], {M, d}), arena);
    for (std::size_t l = 0; l < model.num_blocks(); ++l)
      model.block(l).op().forward(be, c, model.block(l).bind(cspan(slabs[l + 1])), cview(acts[l], {M, d}),
                                  view(acts[l + 1], {M, d}), arena);
    model.head().op().forward(be, c, wh, cview(acts.back(), {M, d}), ids_view(labels), view(loss, {M}), arena);
    return contract(loss, r);
  };
  objective();
  Vec dy(static_cast<std::size_t>(M * d)), dx(dy.size());
  model.head().op().forward_backward(be, c, wh, cview(acts.back(), {M, d}), ids_view(labels), scale, view(loss, {M}),
                                     view(dy, {M, d}),
                                     model.head().bind(std::span<double>(grads[model.head_unit()]),
                                                       {{&model.embedding().layout(), std::span<double>(grads[0])}}),
                                     arena);
  for (std::size_t l = model.num_blocks(); l-- > 0;) {
    model.block(l).op().backward(be, c, model.block(l).bind(cspan(slabs[l + 1])), cview(acts[l], {M, d}),
                                 cview(dy, {M, d}), view(dx, {M, d}),
                                 model.block(l).bind(std::span<double>(grads[l + 1])), arena);
    std::swap(dx, dy);
  }
  model.embedding().op().backward(be, c, ids_view(ids), cview(dy, {M, d}),
                                  model.embedding().bind(std::span<double>(grads[0])), arena);
  std::vector<Vec> inc(U);
  std::vector<GradTensor> t;
  for (std::size_t u = 0; u < U; ++u) {
    inc[u] = minus(grads[u], grads0[u]);
    add_tensors(t, layout(u), slabs[u], inc[u]);
  }
  GradcheckOptions opt;
  opt.samples = 16;  // 33 tensors: fewer coordinates each
  report("tiny model", gradcheck(objective, t, rng, opt));
}
