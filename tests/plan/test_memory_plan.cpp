// The step planner (plan/): the memory plan is the trainer's memory, byte for byte, checked
// against the allocators' own accounting (CpuBackend::allocated_bytes for backend memory,
// host_buffer_bytes for the pinned host buffers) in every mode; its decisions (checkpoints in
// host memory, device units) are the trainer's and give the same training; a configuration that
// does not fit is refused before anything is allocated, with suggestions that do fit; memory is
// affine in the sequence length; the cost model's FLOPs agree with the documented figures.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <random>
#include <string>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/dist/local.hpp"
#include "megatrain/plan/mixer_cost.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;

namespace {

ModelConfig small(bool tied, std::int64_t layers = 3, std::int64_t vocab = 61) {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":40,"intermediate_size":88,
    "num_attention_heads":5,"num_key_value_heads":1,"rope_theta":10000.0})");
  j["tie_word_embeddings"] = tied;
  j["vocab_size"] = vocab;
  j["num_hidden_layers"] = layers;
  return ModelConfig::from_json(j);
}

TrainerOptions opts(std::int64_t rows, std::int64_t seq) {
  TrainerOptions o;
  o.batch_rows = rows;
  o.seq_len = seq;
  o.adamw.lr = 2e-3;
  o.schedule.lr = 2e-3;
  return o;
}

StoreOptions store_opts(const TrainerOptions& o) {
  StoreOptions s;
  s.seed = 3;
  s.pinning = Pinning::never;
  return plan::store_options(o, s);
}

// The losses of `steps` steps, then one master weight of every unit (every_weight: all of them).
std::vector<double> train(const ModelConfig& cfg, const TrainerOptions& o, CpuBackend<float>& be, int steps,
                          std::size_t* spilled = nullptr, std::size_t* kept = nullptr, bool every_weight = false) {
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  Trainer<CpuBackend<float>> t(model, store, be, o);
  if (spilled) *spilled = t.spilled_checkpoints();
  if (kept) *kept = t.memory_plan().buffers.kept_blocks;
  std::mt19937 rng(11);
  std::vector<double> losses;
  const auto n = static_cast<std::size_t>(o.batch_rows * o.seq_len);
  for (int s = 0; s < steps; ++s) {
    std::vector<std::int32_t> ids(n), labels(n);
    for (std::size_t i = 0; i < n; ++i) {
      ids[i] = static_cast<std::int32_t>(rng() % static_cast<unsigned>(cfg.vocab_size));
      labels[i] = static_cast<std::int32_t>(rng() % static_cast<unsigned>(cfg.vocab_size));
    }
    losses.push_back(t.step(ids, labels).loss);
  }
  t.finish_update();
  for (const auto& u : store.units()) {
    if (every_weight) losses.insert(losses.end(), u.master().begin(), u.master().end());
    else losses.push_back(static_cast<double>(u.master()[3]));
  }
  return losses;
}

// Layouts of a step that must train the same bits (each with its number of blocks).
struct LayoutCase {
  const char* name;
  std::int64_t layers;
  std::function<void(TrainerOptions&)> set;
};
std::vector<LayoutCase> layout_cases() {
  return {
      {"no clipping, 4 blocks", 4, [](TrainerOptions& o) { o.clip_norm = 0; }},
      {"exact clipping, 5 blocks", 5, [](TrainerOptions& o) { o.clip_norm = 0.5; }},
      {"stale clipping, 3 blocks", 3,
       [](TrainerOptions& o) {
         o.clip_norm = 0.5;
         o.clip_mode = ClipMode::stale;
       }},
      {"micro-batches in host memory, 5 blocks", 5,
       [](TrainerOptions& o) {
         o.micro_batches = 2;
         o.gradient_home = GradientHome::host;
       }},
      {"chunks and token blocks, 3 blocks", 3,
       [](TrainerOptions& o) {
         o.chunk_rows = 1;
         o.token_chunk = 8;
       }},
      {"chunks (one of them shorter) and token blocks, 3 blocks", 3,
       [](TrainerOptions& o) {
         o.batch_rows = 3;
         o.chunk_rows = 2;
         o.token_chunk = 8;
       }},
      {"device units (3), 4 blocks", 4, [](TrainerOptions& o) { o.device_units = 3; }},
  };
}

// Builds a trainer for (cfg, o) on `be` and checks that its memory plan is what it allocated.
void check_plan_is_allocation(const ModelConfig& cfg, const TrainerOptions& o, CpuBackend<float>& be) {
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  const std::size_t dev0 = be.allocated_bytes(), host0 = host_buffer_bytes();
  Trainer<CpuBackend<float>> t(model, store, be, o);
  const plan::MemoryPlan& p = t.memory_plan();
  CHECK(p.fits);
  CHECK(be.allocated_bytes() - dev0 == p.device_total());
  CHECK(t.device_bytes() == p.device_total());
  // host: the trainer's pinned buffers (the store's were there before; on this backend its
  // buffers are host memory too, but not HostBuffers)
  CHECK(host_buffer_bytes() - host0 == p.host_total() - p.store_bytes - p.device_total());
  CHECK(p.store_bytes == store.bytes());
  CHECK(t.spilled_checkpoints() == p.buffers.checkpoints_in_host());
  CHECK(t.device_units() == p.buffers.device_units);
  // The plan computed before anything exists (what megatrain-train prints) is the same plan.
  CpuBackend<float> fresh;
  fresh.memory_limit = be.memory_limit;
  const plan::MemoryPlan before = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(fresh),
                                                                       {store.host_budget(), "test"});
  CHECK(before.device_total() == p.device_total());
  CHECK(before.host_total() == p.host_total());
}

}  // namespace

TEST_CASE("the memory plan is the trainer's allocation, byte for byte, in every mode") {
  struct Case {
    const char* name;
    bool tied;
    std::int64_t rows, seq;
    std::function<void(TrainerOptions&)> set;
  };
  const std::vector<Case> cases{
      {"streamed (no clipping), tied", true, 3, 19, [](TrainerOptions& o) { o.clip_norm = 0; }},
      {"streamed, untied", false, 3, 19, [](TrainerOptions& o) { o.clip_norm = 0; }},
      {"exact clipping, gradients on the device", false, 2, 23, [](TrainerOptions& o) { o.clip_norm = 1; }},
      {"exact clipping, gradients in host memory", true, 2, 23,
       [](TrainerOptions& o) {
         o.clip_norm = 1;
         o.gradient_home = GradientHome::host;
       }},
      {"micro-batches added up in host memory", false, 4, 17,
       [](TrainerOptions& o) {
         o.micro_batches = 2;
         o.gradient_home = GradientHome::host;
       }},
      {"chunks and token blocks", true, 4, 33,
       [](TrainerOptions& o) {
         o.chunk_rows = 3;
         o.token_chunk = 20;
       }},
      {"packed rows", false, 2, 29, [](TrainerOptions& o) { o.packed = true; }},
      {"device units (2)", false, 2, 21, [](TrainerOptions& o) { o.device_units = 2; }},
      {"every unit on the device, tied", true, 2, 21, [](TrainerOptions& o) { o.device_units = 5; }},
      {"no bf16 copy in host memory, exact clipping, device units (2)", false, 2, 21,
       [](TrainerOptions& o) {
         o.clip_norm = 1;
         o.host_bf16_copy = false;
         o.device_units = 2;
       }},
      {"three weight slots, four gradient slots", false, 3, 13,
       [](TrainerOptions& o) {
         o.clip_norm = 0;
         o.weight_slots = 3;
         o.grad_slots = 4;
       }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    TrainerOptions o = opts(c.rows, c.seq);
    c.set(o);
    CpuBackend<float> be;
    check_plan_is_allocation(small(c.tied), o, be);
    CHECK(be.allocated_bytes() == 0);  // (everything given back with the trainer)
  }
}

TEST_CASE("checkpoints that do not fit the backend's cap go to host memory, as planned, and train the same") {
  const ModelConfig cfg = small(false, 4);
  TrainerOptions o = opts(3, 37);
  o.clip_norm = 0;
  DecoderModel<> model(cfg);
  CpuBackend<float> probe;
  const plan::HostBudget host{std::size_t{1} << 34, "test"};
  const auto all = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), host);
  REQUIRE(all.fits);
  REQUIRE(all.buffers.checkpoints_in_host() == 0);
  const std::size_t ckpt = all.buffers.checkpoint_bytes();
  std::size_t ckpt_total = 0;
  for (const auto& l : all.device)
    if (l.what.find("activation checkpoints") != std::string::npos) ckpt_total = l.bytes;
  REQUIRE(ckpt_total == all.buffers.checkpoints * ckpt);
  const std::size_t fixed = all.device_total() - ckpt_total;
  // Caps that leave room for 0 to all of the checkpoints (the staging buffers take two; a 1/32
  // reserve is kept).
  for (std::size_t room : {std::size_t{2}, std::size_t{3}, std::size_t{4}, std::size_t{5}}) {
    CAPTURE(room);
    CpuBackend<float> be;
    be.memory_limit = fixed + room * ckpt * 34 / 32;
    const auto p = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), host);
    REQUIRE(p.fits);
    CHECK(p.buffers.checkpoints_on_device == (room < 5 ? room - 2 : 5));
    CHECK(p.device_total() <= *be.memory_limit);
    check_plan_is_allocation(cfg, o, be);
    std::size_t spilled = 0;
    CpuBackend<float> unlimited;
    const auto a = train(cfg, o, unlimited, 3), b = train(cfg, o, be, 3, &spilled);
    CHECK(spilled == p.buffers.checkpoints_in_host());
    CHECK(a == b);  // the same bits: where a checkpoint waits changes nothing
  }
}

TEST_CASE("a configuration that does not fit is refused before anything is allocated, with what fits") {
  const ModelConfig cfg = small(true, 2);
  const TrainerOptions o = opts(2, 96);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  const plan::HostBudget host{store.host_budget(), "test"};
  // A cap that holds the whole step at half the sequence length, not the step's buffers at this one.
  TrainerOptions half = o;
  half.seq_len = 48;
  CpuBackend<float> probe;
  CpuBackend<float> be;
  be.memory_limit = plan::plan_memory<CpuBackend<float>>(model, half, plan::device_budget(probe), host).device_total();
  REQUIRE_FALSE(plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), host).fits);
  const std::size_t host0 = host_buffer_bytes();
  std::string message;
  try {
    Trainer<CpuBackend<float>> t(model, store, be, o);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(be.allocated_bytes() == 0);
  CHECK(host_buffer_bytes() == host0);
  CHECK(message.find("this configuration does not fit: the step's buffers need") != std::string::npos);
  CHECK(message.find("What fits: --seq ") != std::string::npos);
  // The suggestions fit, and a step beyond them does not.
  const auto s = plan::suggest<CpuBackend<float>>(model, o, plan::device_budget(be), host);
  REQUIRE(s.seq.has_value());
  CHECK(*s.seq >= 48);
  CHECK(*s.seq < o.seq_len);
  CHECK(message.find(fmt::format("What fits: --seq {} ", *s.seq)) != std::string::npos);
  TrainerOptions shorter = o;
  shorter.seq_len = *s.seq;
  CHECK(plan::plan_memory<CpuBackend<float>>(model, shorter, plan::device_budget(be), host).fits);
  shorter.seq_len = *s.seq + 1;  // (seq_step is 1 below 256 tokens)
  CHECK_FALSE(plan::plan_memory<CpuBackend<float>>(model, shorter, plan::device_budget(be), host).fits);
  shorter.seq_len = *s.seq;
  Trainer<CpuBackend<float>> ok(model, store, be, shorter);
  CHECK(ok.memory_plan().fits);
  if (s.micro_rows) {
    TrainerOptions micro = o;
    micro.max_micro_rows = *s.micro_rows;
    CpuBackend<float> capped;
    capped.memory_limit = be.memory_limit;
    CHECK(plan::plan_memory<CpuBackend<float>>(model, micro, plan::device_budget(capped), host).fits);
  }
}

TEST_CASE("host memory: checkpoints that fit neither the GPU nor the host are refused; the store alone too") {
  const ModelConfig cfg = small(false, 3);
  TrainerOptions o = opts(2, 64);
  o.checkpoint_every = 1;  // (0 would fit with fewer checkpoints: the test below)
  DecoderModel<> model(cfg);
  CpuBackend<float> probe;
  const auto p = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), {std::size_t{1} << 34, "test"});
  // The CPU backend's memory is host memory: its buffers count against the host budget.
  const plan::HostBudget tight{p.host_total() - 1, "--host-memory"};
  const auto q = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), tight);
  CHECK_FALSE(q.fits);
  CHECK(q.refusal.find("host memory") != std::string::npos);
  CHECK(q.refusal.find("(--host-memory)") != std::string::npos);
  const auto s = plan::suggest<CpuBackend<float>>(model, o, plan::device_budget(probe), tight);
  REQUIRE(s.seq.has_value());
  CHECK(*s.seq < 64);
  const plan::HostBudget tiny{p.store_bytes - 1, "--host-memory"};
  const auto t = plan::suggest<CpuBackend<float>>(model, o, plan::device_budget(probe), tiny);
  CHECK(t.store_alone_too_large);
  CHECK(plan::refusal_message(plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), tiny), t)
            .find("The model's state alone") != std::string::npos);
}

TEST_CASE("memory is affine in the sequence length (token blocks fixed)") {
  for (bool cuda_types : {false, true}) {
    CAPTURE(cuda_types);
    const ModelConfig cfg = small(false, 2, 1000);
    DecoderModel<> model(cfg);
    const auto at = [&](std::int64_t seq) {
      TrainerOptions o = opts(1, seq);
      o.token_chunk = 64;
      plan::DeviceBudget d;
      d.prepare_bytes = [](const WorkspacePlan& w) { return plan::cuda_prepare_estimate(w, 0); };  // (the linear dQ workspace)
      const plan::HostBudget host{std::size_t{1} << 40, "test"};
      const auto p = cuda_types ? plan::plan_memory<plan::CudaTypes>(model, o, d, host)
                                : plan::plan_memory<CpuBackend<float>>(model, o, plan::DeviceBudget{}, host);
      return static_cast<double>(p.device_total() + p.host_total());
    };
    // Sequences of more tokens than the vocabulary (the batch's distinct rows are then capped)
    // and token blocks much shorter than the sequence; allocations are 256-byte aligned, hence
    // the small tolerance.
    const double a = at(4096), b = at(8192), c = at(12288), d = at(16384);
    CHECK(b - a == doctest::Approx(c - b).epsilon(1e-3));
    CHECK(c - b == doctest::Approx(d - c).epsilon(1e-3));
    CHECK(b - a > 0);
  }
}

TEST_CASE("the largest-that-fits search") {
  // monotone predicates: the answer is the last value that fits, on the grid of step
  CHECK(plan::detail::largest(1, 100, 1, [](std::int64_t v) { return v <= 37; }) == 37);
  CHECK(plan::detail::largest(64, 4096, 64, [](std::int64_t v) { return v <= 1000; }) == 960);
  CHECK_FALSE(plan::detail::largest(64, 4096, 64, [](std::int64_t v) { return v < 64; }).has_value());
  CHECK(plan::detail::largest_near(1024, 1024, 1 << 20, [](std::int64_t v) { return v <= 300000; }) == 299008);
  CHECK(plan::detail::largest_near(8192, 1024, 1 << 20, [](std::int64_t v) { return v <= 5000; }) == 4096);
  CHECK(plan::detail::largest_near(3, 1, 1 << 20, [](std::int64_t) { return true; }) == (1 << 20));
}

TEST_CASE("the cost model's model FLOPs are bench_train's (docs/performance.md)") {
  // 6 x matmul parameters per token + causal attention 6 x seq x q_dim per token and layer; the
  // 7B shape at 32k tokens per sequence: 444.4 model TFLOP/s at 7,150 tokens/s (an H200).
  const ModelConfig cfg = ModelConfig::preset("qwen2.5-7b");
  const double per_token = plan::model_flops(cfg, 1, 32768);
  CHECK(per_token * 7150 / 1e12 == doctest::Approx(444.4).epsilon(1e-3));
  // A sliding layer's attention over its window only: GPT-OSS's every other layer sees 128 keys
  // (w (w + 1) / 2 + (S - w) w keys in all over S queries), the others the whole causal row.
  const ModelConfig g = ModelConfig::preset("gpt-oss-20b").with_layers(2);
  const double S = 1024, w = 128, span = S + 2 * (w * (w + 1) / 2 + (S - w) * w) / S;
  CHECK(plan::attention_span(g, S) == doctest::Approx(span));
  const double matmul = static_cast<double>(g.active_param_count() - g.vocab_size * g.hidden_size);
  CHECK(plan::model_flops(g, 1, S) == doctest::Approx(6 * matmul + 6 * static_cast<double>(g.q_dim()) * span));
  CHECK(plan::attention_span(g, 100) == doctest::Approx(200.0));  // (a window as long as the rows: full)
  CHECK(plan::attention_span(cfg, 32768) == doctest::Approx(32768.0 * 28));
  // A step with every unit on the device moves no weights over PCIe but the batch's rows.
  DecoderModel<> model(small(false, 2));
  TrainerOptions o = opts(2, 32);
  o.device_units = 4;
  CpuBackend<float> be;
  const auto p = plan::plan_step<CpuBackend<float>>(model, o, plan::device_budget(be), {std::size_t{1} << 34, "test"});
  for (const auto& t : p.time.terms) {
    if (t.what == "PCIe D2H" || t.what == "CPU AdamW") CHECK(t.seconds == 0);
  }
}

TEST_CASE("machine figures from JSON: fields checked by name and value") {
  const auto m = plan::machine_figures_from_json(nlohmann::json::parse(R"({"gemm_tflops": 650, "h2d_gbs": 50, "pass_copies_gbs": 40})"), "figures.json");
  CHECK(m.gemm_tflops == 650);
  CHECK(m.h2d_gbs == 50);
  CHECK(m.pass_copies_gbs == 40);
  // (a file a probe wrote before the field: the reference value)
  CHECK(plan::machine_figures_from_json(nlohmann::json::parse(R"({"gemm_tflops": 650})"), "old.json").pass_copies_gbs ==
        plan::MachineFigures{}.pass_copies_gbs);
  CHECK(m.d2h_gbs == plan::MachineFigures{}.d2h_gbs);
  CHECK_THROWS_WITH_AS(plan::machine_figures_from_json(nlohmann::json::parse(R"({"gemm_tflop": 650})"), "figures.json"),
                       doctest::Contains("figures.json: unknown field 'gemm_tflop'"), Error);
  CHECK_THROWS_WITH_AS(plan::machine_figures_from_json(nlohmann::json::parse(R"({"hbm_gbs": -1})"), "figures.json"),
                       doctest::Contains("'hbm_gbs' must be a positive number"), Error);
  const auto back = plan::machine_figures_from_json(plan::to_json(m), "again");
  CHECK(plan::to_json(back) == plan::to_json(m));
}

TEST_CASE("where exact clipping's waiting gradients are what does not fit, the refusal names stale clipping") {
  const ModelConfig cfg = small(false, 4);
  TrainerOptions exact = opts(2, 64);
  exact.clip_norm = 1;  // exact clipping, gradients waiting on the device (here: the CPU backend's memory)
  TrainerOptions stale = exact;
  stale.clip_mode = ClipMode::stale;
  DecoderModel<> model(cfg);
  CpuBackend<float> be;
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  const auto need_exact = plan::plan_memory<CpuBackend<float>>(model, exact, plan::device_budget(be), lots).host_total();
  const auto need_stale = plan::plan_memory<CpuBackend<float>>(model, stale, plan::device_budget(be), lots).host_total();
  REQUIRE(need_stale < need_exact);
  const plan::HostBudget between{(need_stale + need_exact) / 2, "--host-memory"};
  const auto p = plan::plan_memory<CpuBackend<float>>(model, exact, plan::device_budget(be), between);
  REQUIRE_FALSE(p.fits);
  const auto s = plan::suggest<CpuBackend<float>>(model, exact, plan::device_budget(be), between);
  CHECK(s.stale_fits);
  CHECK_FALSE(s.host_gradients_fit);  // (on this backend both homes are host memory)
  CHECK(plan::refusal_message(p, s).find("--clip-mode stale") != std::string::npos);
}

TEST_CASE("checkpoints every k blocks: the same bits as every unit's, in every mode, as planned") {
  // The outputs between checkpoints are recomputed before the backward from the checkpoint
  // below them: the same function of the same bits, so the run is the same to the bit.
  bool any_spilled = false;
  for (const LayoutCase& c : layout_cases()) {
    CAPTURE(c.name);
    const ModelConfig cfg = small(false, c.layers);
    TrainerOptions base = opts(2, 21);
    c.set(base);
    base.checkpoint_every = 1;
    CpuBackend<float> ref_be;
    const auto ref = train(cfg, base, ref_be, 3);
    for (std::int64_t k : {2, 3, 4}) {
      CAPTURE(k);
      TrainerOptions o = base;
      o.checkpoint_every = k;
      CpuBackend<float> be;
      check_plan_is_allocation(cfg, o, be);
      DecoderModel<> model(cfg);
      const auto p = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), {std::size_t{1} << 34, "t"});
      CHECK(p.buffers.checkpoints == static_cast<std::size_t>((c.layers - 1) / k + 1));
      CHECK(p.buffers.recompute_buffers == static_cast<std::size_t>(k - 1));
      CHECK(train(cfg, o, be, 3) == ref);
      // ... and with the checkpoints in host memory where more than two of them (a cap that holds
      // the staging buffers and no checkpoint beside them)
      CpuBackend<float> capped;
      std::size_t ckpt_lines = 0;
      for (const auto& l : p.device)
        if (l.what.find("activation checkpoints on the GPU") != std::string::npos) ckpt_lines = l.bytes;
      capped.memory_limit = p.device_total() - ckpt_lines + 2 * p.buffers.checkpoint_bytes() * 34 / 32;
      const auto pc = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(capped), {std::size_t{1} << 34, "t"});
      CAPTURE(pc.refusal);
      REQUIRE(pc.fits);
      CHECK(pc.buffers.checkpoints_in_host() == (pc.buffers.checkpoints > 2 ? pc.buffers.checkpoints : 0));
      std::size_t spilled = 0;
      const auto got = train(cfg, o, capped, 3, &spilled);
      CHECK(spilled == pc.buffers.checkpoints_in_host());
      any_spilled = any_spilled || spilled > 0;
      CHECK(got == ref);
    }
  }
  CHECK(any_spilled);
}

// The shipped ops keep activations (CarvedOp with a kept arena); the concept is what the trainer
// asks of a block.
static_assert(KeepingLayerOp<DecoderBlock, CpuBackend<float>>);
static_assert(plan::keeps_activations<CpuBackend<float>, DecoderBlock>);
static_assert(plan::keeps_activations<plan::CudaTypes, DecoderBlock>);

// layout_cases() and exact clipping beside device units.
std::vector<LayoutCase> layout_cases_and_exact_device_units() {
  auto cases = layout_cases();
  cases.push_back({"exact clipping, device units (3), 5 blocks", 5, [](TrainerOptions& o) {
                     o.clip_norm = 0.5;
                     o.device_units = 3;
                   }});
  return cases;
}

TEST_CASE("kept and spilled activations: the same bits as recomputing, in every mode, as planned") {
  // A block that keeps its activations runs no forward product again in the backward; what it
  // recomputes (norms, SwiGLU's product) is the same function of the same bits. (With exact
  // clipping they lie over the gradients of the blocks below: device units' too.) A spilled
  // block keeps them in host memory from its forward to its backward, through two staging
  // buffers: the backward it runs is a kept block's.
  const auto cases = layout_cases_and_exact_device_units();
  for (const LayoutCase& c : cases) {
    CAPTURE(c.name);
    const ModelConfig cfg = small(false, c.layers);
    TrainerOptions base = opts(2, 21);
    c.set(base);
    base.kept_blocks = 0;
    base.spilled_blocks = 0;
    CpuBackend<float> ref_be;
    std::size_t kept = 0;
    const auto ref = train(cfg, base, ref_be, 3, nullptr, &kept, true);
    REQUIRE(kept == 0);
    constexpr std::int64_t kAuto = TrainerOptions::kAutoKeptBlocks;
    const std::pair<std::int64_t, std::int64_t> layouts[] = {  // kept, spilled
        {1, 0}, {c.layers, 0}, {kAuto, 0}, {0, 1}, {0, 2}, {0, c.layers}, {1, c.layers - 1}, {2, 1}};
    for (const auto& [n, spilled] : layouts) {
      CAPTURE(n);
      CAPTURE(spilled);
      TrainerOptions o = base;
      o.kept_blocks = n;
      o.spilled_blocks = spilled;
      CpuBackend<float> be;
      check_plan_is_allocation(cfg, o, be);
      {
        DecoderModel<> model(cfg);
        HostParamStore<float> store(model.units(), store_opts(o));
        Trainer<CpuBackend<float>> t(model, store, be, o);
        CHECK(t.memory_plan().buffers.spilled_blocks == static_cast<std::size_t>(spilled));
        CHECK(t.options().spilled_blocks == spilled);
      }
      CHECK(train(cfg, o, be, 3, nullptr, &kept, true) == ref);
      // (auto: the trainer's choice on the reference figures, whatever it is)
      if (n != kAuto) CHECK(kept == static_cast<std::size_t>(n));
    }
  }
}

TEST_CASE("kept activations: the plan trades them against device units by the predicted step") {
  const ModelConfig cfg = small(false, 6);
  DecoderModel<> model(cfg);
  TrainerOptions o = opts(2, 64);
  CpuBackend<float> probe;
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  TrainerOptions none = o, all = o;
  none.kept_blocks = 0;
  all.kept_blocks = 6;
  const auto p0 = plan::plan_memory<CpuBackend<float>>(model, none, plan::device_budget(probe), lots);
  const auto p6 = plan::plan_memory<CpuBackend<float>>(model, all, plan::device_budget(probe), lots);
  REQUIRE(p6.buffers.kept_blocks == 6);
  std::size_t kept_line = 0;
  for (const auto& l : p6.device)
    if (l.what.find("activations kept for the backward (6 of 6 blocks") != std::string::npos) kept_line = l.bytes;
  std::size_t sum = 0;
  for (std::size_t n : p6.buffers.kept_bytes) sum += n;
  CHECK(kept_line == sum);  // (no gradient waits for the norm: none to lie over)
  CHECK(p6.buffers.kept_over_gradients == 0);
  CHECK(kept_line > 0);
  // Keeping removes the recompute: fewer executed FLOPs, the same model FLOPs, and on a machine
  // where this tiny step is GPU-bound (a slow GPU), a shorter step.
  plan::MachineFigures slow_gpu;
  slow_gpu.gemm_tflops = slow_gpu.attention_fwd_tflops = slow_gpu.attention_bwd_tflops = 1e-6;
  const auto t0 = plan::predict_step(cfg, none, p0, slow_gpu), t6 = plan::predict_step(cfg, all, p6, slow_gpu);
  CHECK(t6.executed_flops < t0.executed_flops);
  CHECK(t6.model_flops == t0.model_flops);
  CHECK(t6.step_s < t0.step_s);
  // A cap with room for some blocks' activations: auto keeps as many as fit there, and asking
  // for one more is refused by name
  CpuBackend<float> capped;
  capped.memory_limit = p0.device_total() + 5 * kept_line / 12;  // (2 blocks, less their smaller scratch)
  const auto pc = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(capped), lots, std::nullopt, slow_gpu);
  REQUIRE(pc.fits);
  CHECK(pc.buffers.kept_blocks >= 2);
  CHECK(pc.buffers.kept_blocks < 6);
  TrainerOptions more = o;
  more.kept_blocks = static_cast<std::int64_t>(pc.buffers.kept_blocks) + 1;
  const auto refused = plan::plan_memory<CpuBackend<float>>(model, more, plan::device_budget(capped), lots);
  CHECK_FALSE(refused.fits);
  CHECK(refused.refusal.find("--keep-activations") != std::string::npos);
  // Exact clipping on a GPU with room for every unit's AdamW state or for kept activations, not
  // both (a shape whose blocks' activations weigh about what their state does): a slow CPU (the
  // AdamW pass the bound) gets the device units and keeps nothing for nothing; a slow GPU keeps
  // activations and leaves units on the host.
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":1024,"intermediate_size":2816,
    "num_attention_heads":8,"num_key_value_heads":2,"num_hidden_layers":4,"vocab_size":1000,"rope_theta":10000.0})");
  DecoderModel<> mid(ModelConfig::from_json(j));
  TrainerOptions exact = opts(4, 4096);
  exact.clip_norm = 1.0;
  TrainerOptions every_unit = exact;
  every_unit.kept_blocks = 0;
  every_unit.device_units = static_cast<std::int64_t>(mid.num_units());
  plan::DeviceBudget units;
  units.auto_device_units = true;
  units.cap = plan::plan_memory<plan::CudaTypes>(mid, every_unit, units, lots).device_total() + (std::size_t{1} << 30) +
              (std::size_t{1} << 26);
  plan::MachineFigures slow_cpu;
  slow_cpu.adamw_dma_gparams = slow_cpu.adamw_gparams = 1e-3;
  const auto pe = plan::plan_memory<plan::CudaTypes>(mid, exact, units, lots, std::nullopt, slow_cpu);
  REQUIRE(pe.fits);
  CHECK(pe.buffers.kept_blocks == 0);
  CHECK(pe.buffers.device_units == mid.num_units());
  const auto pg = plan::plan_memory<plan::CudaTypes>(mid, exact, units, lots, std::nullopt, slow_gpu);
  REQUIRE(pg.fits);
  CHECK(pg.buffers.kept_blocks > 0);
  CHECK(pg.buffers.device_units < mid.num_units());
}

TEST_CASE("kept activations lie over the waiting gradients of the blocks below them, and cost only the rest") {
  // Exact clipping: every block's gradient waits on the device for the norm. Block j's kept
  // activations live from its forward to its backward; block b's gradient from its backward to
  // its update, before its next forward. They may share memory only where b < j.
  const ModelConfig cfg = small(false, 6);
  DecoderModel<> model(cfg);
  CpuBackend<float> probe;
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  TrainerOptions o = opts(1, 13);  // (a block's activations: about a third of its gradient)
  o.clip_norm = 1.0;
  o.kept_blocks = 6;
  const auto p = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), lots);
  REQUIRE(p.fits);
  const plan::TrainerBuffers& b = p.buffers;
  REQUIRE(b.kept_blocks == 6);
  CHECK(b.kept_over_gradients == 5);  // (block 1 has no gradient below it)
  std::size_t kept_line = 0, grad_line = 0, extra = 0;
  for (const auto& l : p.device) {
    if (l.what.rfind("activations kept for the backward", 0) == 0) kept_line = l.bytes;
    if (l.what.rfind("block gradients", 0) == 0) grad_line = l.bytes;
  }
  // (an untied embedding's gradient is the pool's first part: made by the backward's last item)
  CHECK(b.embed_acc_in_pool);
  CHECK(b.acc_at[0] == 0);
  CHECK(b.pool_embed_bytes() >= b.embed_acc * b.sizes.acc);
  CHECK(b.acc_at[1] == b.pool_embed_bytes());
  CHECK(grad_line == b.pool_grad_bytes - b.pool_embed_bytes());
  CHECK(kept_line == b.pool_bytes - b.pool_grad_bytes);
  for (std::size_t j = 1; j <= 6; ++j) {
    CAPTURE(j);
    const std::size_t lo = b.kept_at[j], hi = lo + b.kept_bytes[j];
    CHECK(lo % 256 == 0);
    CHECK(hi <= b.pool_bytes);
    if (lo < b.pool_grad_bytes) CHECK(hi <= b.acc_at[j]);  // over gradients of blocks below j only
    else extra += b.kept_bytes[j];
    for (std::size_t k = j + 1; k <= 6; ++k)  // no two blocks' activations overlap
      CHECK((hi <= b.kept_at[k] || b.kept_at[k] + b.kept_bytes[k] <= lo));
    CHECK(b.acc_at[j] + b.block_acc[j] * b.sizes.acc <= b.pool_grad_bytes);
  }
  CHECK(kept_line >= extra);
  CHECK(kept_line < extra + 256 * 6);
  // With two passes a step the gradients add up across both: nothing lies over them.
  TrainerOptions two = o;
  two.batch_rows = 2;
  two.micro_batches = 2;
  const auto p2 = plan::plan_memory<CpuBackend<float>>(model, two, plan::device_budget(probe), lots);
  REQUIRE(p2.fits);
  CHECK(p2.buffers.kept_over_gradients == 0);
  std::size_t sum = 0;
  for (std::size_t n : p2.buffers.kept_bytes) sum += (n + 255) / 256 * 256;
  CHECK(p2.buffers.kept_extra_bytes() == sum);
  // A cap that holds the gradients and two blocks' activations beside them: every block keeps
  // its activations, where without sharing two would.
  TrainerOptions none = o;
  none.kept_blocks = 0;
  const auto p0 = plan::plan_memory<CpuBackend<float>>(model, none, plan::device_budget(probe), lots);
  CpuBackend<float> capped;
  capped.memory_limit = p0.device_total() + 2 * p2.buffers.kept_bytes[6] + p2.buffers.kept_bytes[6] / 2;
  const auto pc = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(capped), lots);
  CHECK(pc.fits);
  // and the trainer allocates what the plan says, and steps the same bits as recomputing
  CpuBackend<float> be, ref_be;
  check_plan_is_allocation(cfg, o, be);
  CHECK(train(cfg, o, be, 4, nullptr, nullptr, true) == train(cfg, none, ref_be, 4, nullptr, nullptr, true));
  // A tied head adds to the embedding's gradient at the backward's start: it has its own buffer.
  const ModelConfig tied = small(true, 6);
  DecoderModel<> tied_model(tied);
  const auto pt = plan::plan_memory<CpuBackend<float>>(tied_model, o, plan::device_budget(probe), lots);
  REQUIRE(pt.fits);
  CHECK_FALSE(pt.buffers.embed_acc_in_pool);
  CHECK(pt.buffers.kept_over_gradients >= 4);
  CpuBackend<float> tbe, tref_be;
  check_plan_is_allocation(tied, o, tbe);
  CHECK(train(tied, o, tbe, 4, nullptr, nullptr, true) == train(tied, none, tref_be, 4, nullptr, nullptr, true));
}

TEST_CASE("the plan keeps checkpoints every k blocks only where every unit's do not fit") {
  const ModelConfig cfg = small(false, 9);
  DecoderModel<> model(cfg);
  TrainerOptions o = opts(2, 64);
  CpuBackend<float> probe;
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  const auto all = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), lots);
  REQUIRE(all.buffers.checkpoint_every == 1);
  TrainerOptions two = o;
  two.checkpoint_every = 2;
  const auto grouped = plan::plan_memory<CpuBackend<float>>(model, two, plan::device_budget(probe), lots);
  REQUIRE(grouped.host_total() < all.host_total());
  // A host budget between the two: auto picks a checkpoint every 2 blocks (every 3 would fit too)
  const plan::HostBudget between{(grouped.host_total() + all.host_total()) / 2, "--host-memory"};
  const auto p = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(probe), between);
  CHECK(p.fits);
  CHECK(p.buffers.checkpoint_every == 2);
  // The cost model counts the recompute: more executed FLOPs, the same model FLOPs.
  const auto t1 = plan::predict_step(cfg, o, all, plan::MachineFigures{});
  const auto t2 = plan::predict_step(cfg, two, grouped, plan::MachineFigures{});
  CHECK(t2.executed_flops > t1.executed_flops);
  CHECK(t2.model_flops == t1.model_flops);
}

TEST_CASE("the cost model prices a mixture of experts' active experts at their own rate, recomputed") {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":96,
    "moe_intermediate_size":24,"num_experts":16,"num_experts_per_tok":4,"num_attention_heads":4,"num_key_value_heads":2,
    "head_dim":16,"num_hidden_layers":3,"mlp_only_layers":[1],"vocab_size":211,"rope_theta":10000.0})");
  const ModelConfig cfg = ModelConfig::from_json(j);
  REQUIRE(cfg.moe_layer_count() == 2);
  DecoderModel<> model(cfg);
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  plan::DeviceBudget gpu;
  gpu.cap = std::size_t{1} << 36;
  for (const std::int64_t kept : {std::int64_t{0}, std::int64_t{3}}) {
    CAPTURE(kept);
    TrainerOptions o = opts(2, 32);
    o.kept_blocks = kept;
    const auto p = plan::plan_memory<plan::CudaTypes>(model, o, gpu, lots);
    REQUIRE(p.fits);
    REQUIRE(p.buffers.kept_blocks == static_cast<std::size_t>(kept));
    // the experts a token runs (k of E on each sparse layer) 8 x: recomputed even in a kept block
    const double T = 64, d = 64, V = 211, L = 3, S = 32;
    const double experts = 2 * 4 * 3 * d * 24;
    const double active = static_cast<double>(cfg.active_param_count()) - 2 * V * d - d;  // (untied)
    const double k = static_cast<double>(kept) / L;
    const double att_fwd = 2 * T * S * static_cast<double>(cfg.q_dim()) * L;
    const double want = (8 - 2 * k) * (active - experts) * T + 8 * experts * T + 6 * V * d * T + (4.5 - k) * att_fwd;
    plan::MachineFigures m;
    const auto t = plan::predict_step(cfg, o, p, m);
    CHECK(t.executed_flops == doctest::Approx(want).epsilon(1e-12));
    // the model FLOPs count active parameters (a token's k experts), no recompute
    CHECK(t.model_flops == doctest::Approx(6 * (active + V * d + d) * T + 6 * T * S * static_cast<double>(cfg.q_dim()) * L));
    // the experts' rate moves the GPU term by their FLOPs alone
    plan::MachineFigures fast = m;
    fast.moe_gemm_tflops = 2 * m.moe_gemm_tflops;
    const auto tf = plan::predict_step(cfg, o, p, fast);
    const double expert_s = 8 * experts * T / (m.moe_gemm_tflops * 1e12);
    CHECK(t.terms[0].seconds - tf.terms[0].seconds == doctest::Approx(expert_s / 2).epsilon(1e-9));
  }
  // a dense model does not read the experts' rate
  const ModelConfig dense = small(false, 3);
  DecoderModel<> dm(dense);
  const auto pd = plan::plan_memory<plan::CudaTypes>(dm, opts(2, 32), gpu, lots);
  plan::MachineFigures slow;
  slow.moe_gemm_tflops = 1e-9;
  CHECK(plan::predict_step(dense, opts(2, 32), pd, slow).step_s == plan::predict_step(dense, opts(2, 32), pd, {}).step_s);
}

TEST_CASE("the cost model prices Gated DeltaNet's mixing at its own rates, linear in the sequence") {
  // Qwen3.5: layers 0 and 2 linear attention, 1 full attention
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text","hidden_size":64,
    "intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,
    "vocab_size":211,"linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":16,
    "linear_value_head_dim":12,"layer_types":["linear_attention","full_attention","linear_attention"]})");
  const ModelConfig cfg = ModelConfig::from_json(j);
  const double S = 96, T = 2 * S, qd = static_cast<double>(cfg.q_dim());
  const double linear = plan::attention_span(cfg, S, true), full = plan::attention_span(cfg, S, false);
  CHECK(full == doctest::Approx(S));  // (the one full layer)
  CHECK(linear == doctest::Approx(plan::mixing_span(cfg, 0, S) + plan::mixing_span(cfg, 2, S)));
  CHECK(linear + full == doctest::Approx(plan::attention_span(cfg, S)));
  // linear in the sequence: the same span a token at 96 tokens and at 960 (chunks of 64 either way)
  CHECK(plan::attention_span(cfg, 10 * S, true) == doctest::Approx(linear));
  DecoderModel<> model(cfg);
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  plan::DeviceBudget gpu;
  gpu.cap = std::size_t{1} << 36;
  const TrainerOptions o = opts(2, static_cast<std::int64_t>(S));
  const auto p = plan::plan_memory<plan::CudaTypes>(model, o, gpu, lots);
  REQUIRE(p.fits);
  REQUIRE(p.buffers.kept_blocks == 0);
  plan::MachineFigures m;
  const auto t = plan::predict_step(cfg, o, p, m);
  // the mixing's time moves with its rates alone, by its FLOPs: (2 + 2.5) x the forward's, recomputed once
  const double delta_fwd = 2 * T * qd * linear;
  plan::MachineFigures fast = m;
  fast.delta_rule_fwd_tflops = 2 * m.delta_rule_fwd_tflops;
  fast.delta_rule_bwd_tflops = 2 * m.delta_rule_bwd_tflops;
  const double delta_s = 2 * delta_fwd / (m.delta_rule_fwd_tflops * 1e12) + 2.5 * delta_fwd / (m.delta_rule_bwd_tflops * 1e12);
  CHECK(t.terms[0].seconds - plan::predict_step(cfg, o, p, fast).terms[0].seconds == doctest::Approx(delta_s / 2).epsilon(1e-9));
  CHECK(t.terms[0].detail.find("Gated DeltaNet's mixing") != std::string::npos);
  // attention's rates do not price it: slower attention moves the GPU term by the full layer's alone
  plan::MachineFigures slow_attention = m;
  slow_attention.attention_fwd_tflops = m.attention_fwd_tflops / 2;
  slow_attention.attention_bwd_tflops = m.attention_bwd_tflops / 2;
  const double att_fwd = 2 * T * qd * full;
  const double att_s = 2 * att_fwd / (m.attention_fwd_tflops * 1e12) + 2.5 * att_fwd / (m.attention_bwd_tflops * 1e12);
  CHECK(plan::predict_step(cfg, o, p, slow_attention).terms[0].seconds - t.terms[0].seconds ==
        doctest::Approx(att_s).epsilon(1e-9));
  // the executed FLOPs count both kinds, recomputed once
  plan::MachineFigures any = m;
  any.delta_rule_fwd_tflops = 1;
  CHECK(plan::predict_step(cfg, o, p, any).executed_flops == t.executed_flops);
  // a model without linear layers does not read the mixing's rates
  const ModelConfig dense = small(false, 3);
  DecoderModel<> dm(dense);
  const auto pd = plan::plan_memory<plan::CudaTypes>(dm, opts(2, 32), gpu, lots);
  plan::MachineFigures slow;
  slow.delta_rule_fwd_tflops = slow.delta_rule_bwd_tflops = 1e-9;
  CHECK(plan::predict_step(dense, opts(2, 32), pd, slow).step_s == plan::predict_step(dense, opts(2, 32), pd, {}).step_s);
  // the figures' JSON carries them
  const auto back = plan::machine_figures_from_json(plan::to_json(fast), "test");
  CHECK(back.delta_rule_fwd_tflops == fast.delta_rule_fwd_tflops);
  CHECK(back.delta_rule_bwd_tflops == fast.delta_rule_bwd_tflops);
}

TEST_CASE("an objective that reads the log-probabilities costs the head's forward once more; its reference pass is priced") {
  const ModelConfig cfg = small(false, 3);
  DecoderModel<> model(cfg);
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  plan::DeviceBudget gpu;
  gpu.cap = std::size_t{1} << 36;
  TrainerOptions o = opts(6, 40);
  o.micro_batches = 3;
  o.token_weights = true;
  const auto p = plan::plan_memory<plan::CudaTypes>(model, o, gpu, lots);
  REQUIRE(p.fits);
  const plan::MachineFigures m;
  const auto ce = plan::predict_step(cfg, o, p, m);
  TrainerOptions dpo = o;
  dpo.log_prob_objective = true;
  const auto t = plan::predict_step(cfg, dpo, p, m);
  // the head's product forward (2 V d a token) and the loss's forward over the logits, every token
  const double T = 6 * 40, V = static_cast<double>(cfg.vocab_size), d = static_cast<double>(cfg.hidden_size);
  const double more = 2 * V * d * T / (m.gemm_tflops * 1e12) + plan::kLossForwardBytesPerLogit * T * V / (m.hbm_gbs * 1e9);
  CHECK(t.terms[0].seconds - ce.terms[0].seconds == doctest::Approx(more).epsilon(1e-9));
  CHECK(t.executed_flops - ce.executed_flops == doctest::Approx(2 * V * d * T).epsilon(1e-12));
  CHECK(t.terms[0].detail.find("the head's forward twice") != std::string::npos);
  CHECK(ce.terms[0].detail.find("the head's forward twice") == std::string::npos);
  // the reference pass: a forward, less than the step, at least its head's product and the uploads of the forward
  CHECK(t.scoring_s > 2 * V * d * T / (m.gemm_tflops * 1e12));
  CHECK(t.scoring_s < t.step_s);
  CHECK(t.scoring_s == ce.scoring_s);
  // the trainer refuses log_prob_objective without the token weights' buffer
  dpo.token_weights = false;
  CHECK_THROWS_WITH_AS(dpo.validate(), doctest::Contains("set token_weights too"), Error);
}

TEST_CASE("the plan says from how many tokens per step the GPU is the bound") {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":256,"intermediate_size":704,
    "num_attention_heads":4,"num_key_value_heads":2,"num_hidden_layers":4,"vocab_size":1000,"rope_theta":10000.0})");
  const ModelConfig cfg = ModelConfig::from_json(j);
  DecoderModel<> model(cfg);
  const plan::HostBudget lots{std::size_t{1} << 34, "test"};
  plan::DeviceBudget gpu;
  gpu.cap = std::size_t{1} << 40;
  plan::MachineFigures slow_cpu;  // (the CPU's AdamW of the host units is what a small step waits on)
  slow_cpu.adamw_dma_gparams = slow_cpu.adamw_gparams = 0.05;
  slow_cpu.gemm_tflops = slow_cpu.moe_gemm_tflops = 0.5;
  slow_cpu.attention_fwd_tflops = slow_cpu.attention_bwd_tflops = 0.5;
  for (const double clip : {0.0, 1.0}) {
    CAPTURE(clip);
    const auto at = [&](std::int64_t rows) {
      TrainerOptions o = opts(rows, 64);
      o.clip_norm = clip;
      o.device_units = 0;
      o.kept_blocks = 0;
      o.spilled_blocks = 0;
      const auto p = plan::plan_memory<plan::CudaTypes>(model, o, gpu, lots, std::nullopt, slow_cpu);
      REQUIRE(p.fits);
      return plan::predict_step(cfg, o, p, slow_cpu);
    };
    const auto small_step = at(2);
    REQUIRE(small_step.busy_tokens > small_step.tokens);  // (this step waits on the CPU)
    CHECK(small_step.bottleneck == "CPU AdamW");
    CHECK(small_step.exposed_s > 0);
    CHECK_FALSE(small_step.exposed_detail.empty());
    // at that many tokens (whole sequences, rounded up) the GPU is the bound and the CPU's AdamW
    // hides behind it (what stays exposed is fixed: the first weights, the last unit's update);
    // at half of them the step still waits on it
    const auto rows = static_cast<std::int64_t>(std::ceil(small_step.busy_tokens / 64 * 1.001));
    const auto busy = at(rows);
    CHECK(busy.bottleneck == "GPU");
    CHECK(busy.exposed_detail.empty());
    CHECK(busy.busy_tokens == doctest::Approx(small_step.busy_tokens).epsilon(0.02));
    const auto half = at(std::max<std::int64_t>(3, rows / 2));
    CHECK_FALSE(half.exposed_detail.empty());
  }
}

TEST_CASE("spilled activations: the blocks spread over those that do not keep theirs") {
  plan::TrainerBuffers b;
  b.blocks = 28;
  const auto spilled = [&] {
    std::vector<std::size_t> v;
    for (std::size_t u = 0; u <= b.blocks + 1; ++u)
      if (b.spills(u)) v.push_back(u);
    return v;
  };
  b.kept_blocks = 14;
  b.spilled_blocks = 0;
  CHECK(spilled().empty());
  b.spilled_blocks = 5;
  CHECK(spilled() == std::vector<std::size_t>{1, 3, 5, 7, 9});  // (every (28 - 14) / 5 = 2nd, rounded down)
  for (std::size_t u : spilled()) CHECK(!b.keeps(u));
  b.spilled_blocks = 14;
  CHECK(spilled().size() == 14);
  CHECK(spilled().back() == 14);
  b.kept_blocks = 0;
  b.spilled_blocks = 9;
  CHECK(spilled() == std::vector<std::size_t>{1, 4, 7, 10, 13, 16, 19, 22, 25});
  // the staging buffers alternate along the spilled blocks
  for (std::size_t u : spilled()) CHECK(b.spill_index(u) == (u - 1) / 3);
}

TEST_CASE("spilled activations: planned in host memory and two staging buffers; refused where the host has no room") {
  const ModelConfig cfg = small(false, 6);
  DecoderModel<> model(cfg);
  TrainerOptions o = opts(4, 33);
  o.kept_blocks = 0;
  o.spilled_blocks = 0;
  CpuBackend<float> be;
  const plan::HostBudget roomy{std::size_t{1} << 34, "test"};
  const plan::MemoryPlan none = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), roomy);
  o.spilled_blocks = 3;
  const plan::MemoryPlan three = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), roomy);
  REQUIRE(three.fits);
  const plan::TrainerBuffers& b = three.buffers;
  CHECK(b.spilled_blocks == 3);
  CHECK(b.spill_stride() == 2);
  std::size_t host = 0;
  for (std::size_t u = 1; u <= 6; ++u)
    if (b.spills(u)) {
      CHECK(b.kept_bytes[u] > 0);
      CHECK(b.kept_bytes[u] == b.spill_slot_bytes);
      host += plan::host_pages(b.kept_bytes[u]);
    }
  CHECK(b.spilled_host_bytes() == host);
  // (on this backend the staging buffers are host memory too)
  CHECK(three.device_total() - none.device_total() == 2 * b.spill_slot_bytes + (three.buffers.scratch_bytes - none.buffers.scratch_bytes));
  CHECK(three.host_total() - none.host_total() == host + (three.device_total() - none.device_total()));
  // Predicted: none of the spilled blocks' forward again; their bytes over PCIe both ways.
  const plan::StepTime t0 = plan::predict_step(cfg, o, none, {}), t3 = plan::predict_step(cfg, o, three, {});
  CHECK(t3.executed_flops < t0.executed_flops);
  CHECK(t3.terms[1].seconds > t0.terms[1].seconds);  // PCIe H2D
  CHECK(t3.terms[2].seconds > t0.terms[2].seconds);  // PCIe D2H
  // A host without room for them: refused, naming the option.
  const plan::HostBudget tight{none.host_total() + host / 2, "test"};
  const plan::MemoryPlan refused = plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), tight);
  CHECK_FALSE(refused.fits);
  CHECK(refused.refusal.find("--spill-activations") != std::string::npos);
  // Auto on a backend whose memory is host memory: none.
  o.spilled_blocks = TrainerOptions::kAutoSpilledBlocks;
  CHECK(plan::plan_memory<CpuBackend<float>>(model, o, plan::device_budget(be), roomy).buffers.spilled_blocks == 0);
}

// The reference H200 (139 GiB), planned without one, as megatrain-plan --backend cuda does.
static plan::DeviceBudget h200() {
  plan::DeviceBudget gpu;
  gpu.cap = std::size_t{139} << 30;
  gpu.allocated = std::size_t{32} << 20;  // (cuBLASLt's workspace)
  gpu.prepare_bytes = [](const WorkspacePlan& w) { return plan::cuda_prepare_estimate(w); };
  gpu.auto_device_units = true;
  return gpu;
}

TEST_CASE("the plan spills activations on its own only where it predicts them at least 3% faster") {
  // The 7B shape with exact clipping on a 139 GiB GPU (the reference H200's figures). At 32k tokens
  // a step, measured on an H200 (docs/planner.md): 3, 5 and 7 spilled blocks were no faster than
  // none (their copies share PCIe with the AdamW pass's downloads beside a 24 ms forward a block),
  // and the plan agrees: none spill on a 120 or a 200 GiB host, and 5 or 7 asked for are predicted
  // no faster. A 65,536-token sequence (a block's forward 4 x as long, its attention the costlier
  // to recompute) on a 200 GiB host spills.
  DecoderModel<> model(ModelConfig::preset("qwen2.5-7b"));
  const plan::DeviceBudget gpu = h200();  // (as megatrain-plan plans for a GPU it does not have)
  const auto at = [&](std::int64_t batch, std::int64_t seq, std::size_t host_gib, std::int64_t spilled) {
    TrainerOptions q = opts(batch, seq);
    q.clip_norm = 1.0;
    q.spilled_blocks = spilled;
    const auto p = plan::plan_memory<plan::CudaTypes>(model, q, gpu, {host_gib << 30, "test"});
    REQUIRE(p.fits);
    return std::pair{p.buffers.spilled_blocks, plan::predict_step(model.config(), q, p, {}).step_s};
  };
  const auto [none120, t_none120] = at(32, 1024, 120, 0);
  const auto [auto120, t_auto120] = at(32, 1024, 120, TrainerOptions::kAutoSpilledBlocks);
  CHECK(none120 == 0);
  CHECK(auto120 == 0);
  CHECK(t_auto120 == t_none120);
  const auto [five, t_five] = at(32, 1024, 120, 5);  // (asked for: it fits; measured as fast as none)
  CHECK(five == 5);
  CHECK(t_five > t_none120 * (1 - plan::kSpillGain));
  CHECK(t_five < t_none120 * (1 + plan::kSpillGain));
  const auto [auto200, t_auto200] = at(32, 1024, 200, TrainerOptions::kAutoSpilledBlocks);
  const auto [none200, t_none200] = at(32, 1024, 200, 0);
  CHECK(auto200 == 0);
  CHECK(t_auto200 == t_none200);
  const auto [seven, t_seven] = at(32, 1024, 200, 7);  // (measured 11% slower than none, without the bf16 copy)
  CHECK(seven == 7);
  CHECK(t_seven > t_none200);
  const auto [long_auto, t_long_auto] = at(1, 65536, 200, TrainerOptions::kAutoSpilledBlocks);
  const auto [long_none, t_long_none] = at(1, 65536, 200, 0);
  CHECK(long_none == 0);
  CHECK(long_auto > 0);
  CHECK(t_long_auto < t_long_none * (1 - plan::kSpillGain));
}

TEST_CASE("the cost model: spilled blocks' copies share PCIe with the AdamW pass beside the forward") {
  // The 7B shape at 32k tokens, exact clipping, 12 blocks kept and 20 units' AdamW on the GPU (as
  // measured on an H200, docs/planner.md): each spilled block's copies have the link for the time
  // of `stride` blocks, shared beside the forward with the pass's downloads of the host units'
  // gradients; and the pass's copies go at the rate copies keep while the CPU's AdamW runs.
  DecoderModel<> model(ModelConfig::preset("qwen2.5-7b"));
  const plan::DeviceBudget gpu = h200();
  const auto plan_with = [&](std::int64_t spilled, GradientHome home) {
    TrainerOptions q = opts(32, 1024);
    q.clip_norm = 1.0;
    q.kept_blocks = 12;
    q.device_units = 20;
    q.spilled_blocks = spilled;
    q.gradient_home = home;
    auto p = plan::plan_memory<plan::CudaTypes>(model, q, gpu, {std::size_t{400} << 30, "test"});
    REQUIRE(p.fits);
    REQUIRE(p.buffers.spilled_blocks == static_cast<std::size_t>(spilled));
    return std::pair{q, p};
  };
  const auto [q0, p0] = plan_with(0, GradientHome::device);
  const auto [q7, p7] = plan_with(7, GradientHome::device);
  REQUIRE(p7.buffers.spill_stride() == 2);
  const plan::MachineFigures ref;
  const plan::StepTime t0 = plan::predict_step(model.config(), q0, p0, ref), t7 = plan::predict_step(model.config(), q7, p7, ref);
  // 7 blocks' forwards not recomputed (the GPU term falls), but their copies (3.49 GB each, at
  // 55.3 - 10.6 GB / 0.67 s of the download link: 88 ms against 2 blocks' 48 ms forward) hold
  // the compute stream, and the pass's copies (44 GB at 63 GB/s) outlast the forward
  CHECK(t7.terms[0].seconds < t0.terms[0].seconds);
  CHECK(t7.exposed_s > t0.exposed_s + 0.25);
  CHECK(t7.step_s > t0.step_s);
  // with twice the link (each way, and while the CPU runs) the same spills pay
  plan::MachineFigures fast = ref;
  fast.h2d_gbs *= 2;
  fast.d2h_gbs *= 2;
  fast.duplex_gbs *= 2;
  fast.pass_copies_gbs *= 2;
  CHECK(plan::predict_step(model.config(), q7, p7, fast).step_s < plan::predict_step(model.config(), q0, p0, fast).step_s);
  // the pass's copies at a lower rate beside the CPU's AdamW: exposed beyond the forward
  plan::MachineFigures slow = ref;
  slow.pass_copies_gbs = 20;
  const plan::StepTime s0 = plan::predict_step(model.config(), q0, p0, slow);
  CHECK(s0.exposed_s > t0.exposed_s);
  CHECK(s0.exposed_detail.find("AdamW pass") != std::string::npos);
}

TEST_CASE("where gradients wait (--gradients auto): the GPU where that fits, else host memory where that fits") {
  // The reference H200 (139 GiB, planned without one) at 32k tokens, exact clipping: the 7B
  // shape's waiting gradients fit beside the rest on the GPU of a 120 GiB host; the 72B shape's
  // alone are 271 GiB, so they wait in a 1.5 TB host's memory, and on a 1 TB host in neither.
  const plan::DeviceBudget gpu = h200();
  TrainerOptions o = opts(32, 1024);
  o.clip_norm = 1.0;
  const auto fits = [&](const DecoderModel<>& m, GradientHome home, std::size_t host_gib) {
    TrainerOptions q = o;
    q.gradient_home = home;
    return plan::plan_memory<plan::CudaTypes>(m, q, gpu, {host_gib << 30, "test"}).fits;
  };
  const auto choose = [&](const DecoderModel<>& m, std::size_t host_gib, std::optional<GradientHome> prefer = std::nullopt,
                          const TrainerOptions* with = nullptr) {
    return plan::choose_gradient_home<plan::CudaTypes>(m, with ? *with : o, gpu, {host_gib << 30, "test"}, {}, prefer).home;
  };
  const DecoderModel<> m7(ModelConfig::preset("qwen2.5-7b"));
  REQUIRE(fits(m7, GradientHome::device, 120));
  CHECK(choose(m7, 120) == GradientHome::device);
  REQUIRE(fits(m7, GradientHome::host, 200));
  CHECK(choose(m7, 200) == GradientHome::device);                      // (both fit: the GPU)
  CHECK(choose(m7, 200, GradientHome::host) == GradientHome::host);    // (a resumed run's, where it fits)
  REQUIRE_FALSE(fits(m7, GradientHome::host, 120));
  CHECK(choose(m7, 120, GradientHome::host) == GradientHome::device);  // (... and where it does not)

  const DecoderModel<> m72(ModelConfig::preset("qwen2.5-72b"));
  REQUIRE_FALSE(fits(m72, GradientHome::device, 1500));
  REQUIRE(fits(m72, GradientHome::host, 1500));
  CHECK(choose(m72, 1500) == GradientHome::host);
  REQUIRE_FALSE(fits(m72, GradientHome::host, 1000));
  CHECK(choose(m72, 1000) == GradientHome::device);  // (neither: the GPU's refusal says what would fit)
  const plan::StepPlan refused = plan::plan_step<plan::CudaTypes>(m72, o, gpu, {std::size_t{1000} << 30, "test"});
  REQUIRE_FALSE(refused.memory.fits);

  // Both fit and host memory is predicted faster: the 14B shape on a 1.5 TB host (5.5%), whose
  // GPU memory then takes more device units; not where the gain is under 1%.
  const DecoderModel<> m14(ModelConfig::preset("qwen2.5-14b"));
  REQUIRE(fits(m14, GradientHome::device, 1500));
  REQUIRE(fits(m14, GradientHome::host, 1500));
  CHECK(choose(m14, 1500) == GradientHome::host);
  const auto c14 = plan::choose_gradient_home<plan::CudaTypes>(m14, o, gpu, {std::size_t{1500} << 30, "test"});
  CHECK((c14.device_fits && c14.host_fits));

  // Several ranks agree on a home that fits them all.
  using C = plan::GradientHomeChoice;
  const C dev_only{GradientHome::device, true, false}, host_faster{GradientHome::host, true, true},
      dev_both{GradientHome::device, true, true}, host_only{GradientHome::host, false, true};
  CHECK(C::agree(std::vector<C>{dev_both, dev_only}) == GradientHome::device);
  CHECK(C::agree(std::vector<C>{host_faster, host_faster}) == GradientHome::host);
  CHECK(C::agree(std::vector<C>{host_faster, dev_both}) == GradientHome::host);   // (fits both: one predicts it faster)
  CHECK(C::agree(std::vector<C>{host_faster, dev_only}) == GradientHome::device);  // (not host where only the GPU fits)
  CHECK(C::agree(std::vector<C>{host_only, host_only}) == GradientHome::host);
  CHECK(C::agree(std::vector<C>{host_only, dev_only}) == GradientHome::device);    // (neither fits both: refused)

  // No gradient waits (stale clipping, one micro-batch): the option as given, whatever it says.
  TrainerOptions stale = o;
  stale.clip_mode = ClipMode::stale;
  stale.gradient_home = GradientHome::host;
  CHECK(choose(m72, 1000, std::nullopt, &stale) == GradientHome::host);
  stale.gradient_home = GradientHome::device;
  CHECK(choose(m72, 1000, std::nullopt, &stale) == GradientHome::device);
  // Micro-batches wait too: the 72B's at 4 x 8 sequences likewise in a 1.5 TB host's memory.
  TrainerOptions micro = o;
  micro.clip_norm = 0;
  micro.micro_batches = 4;
  CHECK(choose(m72, 1500, std::nullopt, &micro) == GradientHome::host);
}

TEST_CASE("the cost model: gradients waiting in host memory come down during the backward, each micro-batch's") {
  // On the GPU the AdamW pass waits for their copies; in host memory they came down during the
  // backward (a whole-step term, each micro-batch's, and the CPU adds them up), and the pass waits
  // for the CPU's AdamW alone.
  const DecoderModel<> model(ModelConfig::preset("qwen2.5-7b"));
  const plan::DeviceBudget gpu = h200();
  TrainerOptions o = opts(32, 1024);
  o.clip_norm = 1.0;
  o.spilled_blocks = 0;
  plan::MachineFigures slow;  // (copies down far slower than the CPU's AdamW)
  slow.d2h_gbs = 0.5;
  const auto term = [](const plan::StepTime& t, const std::string& what) {
    for (const auto& x : t.terms)
      if (x.what == what) return x.seconds;
    return -1.0;
  };
  for (const GradientHome home : {GradientHome::device, GradientHome::host}) {
    CAPTURE(home == GradientHome::host);
    TrainerOptions q = o;
    q.gradient_home = home;
    const auto p = plan::plan_memory<plan::CudaTypes>(model, q, gpu, {std::size_t{200} << 30, "test"}, std::nullopt, slow);
    REQUIRE(p.fits);
    q.device_units = static_cast<std::int64_t>(p.buffers.device_units);
    q.kept_blocks = static_cast<std::int64_t>(p.buffers.kept_blocks);
    const plan::StepTime one = plan::predict_step(model.config(), q, p, slow);
    TrainerOptions four = q;
    four.micro_batches = 4;
    const plan::StepTime t4 = plan::predict_step(model.config(), four, p, slow);
    const double d2h = term(one, "PCIe D2H");
    REQUIRE(d2h > term(one, "CPU AdamW"));
    if (home == GradientHome::device) {
      CHECK(one.bottleneck != "PCIe D2H");  // (in the pass: what it takes beyond the forward comes after the GPU's step)
      CHECK(one.step_s > d2h + term(one, "GPU") * 0.5);
      CHECK(term(t4, "PCIe D2H") == doctest::Approx(d2h).epsilon(1e-12));
      CHECK(term(t4, "CPU gradient sums") < 0);
    } else {
      REQUIRE(d2h > term(one, "GPU"));
      CHECK(one.bottleneck == "PCIe D2H");  // (the whole step's, beside the GPU's work)
      CHECK(one.step_s < d2h * 1.05);
      CHECK(term(t4, "PCIe D2H") == doctest::Approx(4 * d2h).epsilon(1e-12));
      CHECK(term(t4, "CPU gradient sums") > 0);
      CHECK(term(one, "CPU gradient sums") < 0);
    }
  }
}

TEST_CASE("the cost model: the ranks on one host share its CPU's AdamW") {
  const DecoderModel<> model(ModelConfig::preset("qwen2.5-7b"));
  auto ranks = dist::LocalComm::group(2, std::chrono::seconds(10));  // (only their number is read)
  TrainerOptions o = opts(16, 1024);  // (one rank's share of 32 sequences)
  o.clip_norm = 1.0;
  o.spilled_blocks = 0;
  o.comm = ranks[0].get();
  o.shard_optimizer = true;
  o.device_units = 0;  // (every unit's AdamW on the CPU)
  const auto p = plan::plan_memory<plan::CudaTypes>(model, o, h200(), {std::size_t{120} << 30, "test"}, std::nullopt, {});
  REQUIRE(p.fits);
  o.kept_blocks = static_cast<std::int64_t>(p.buffers.kept_blocks);
  const auto cpu = [&](int host_processes) {
    TrainerOptions q = o;
    q.host_processes = host_processes;
    q.validate();
    for (const auto& t : plan::predict_step(model.config(), q, p, {}).terms)
      if (t.what == "CPU AdamW") return t;
    FAIL("no CPU AdamW term");
    return plan::TimeTerm{};
  };
  const auto alone = cpu(1), shared = cpu(2), all = cpu(0);
  REQUIRE(alone.seconds > 0);
  CHECK(shared.seconds == doctest::Approx(2 * alone.seconds).epsilon(1e-12));
  CHECK(all.seconds == shared.seconds);  // (0: every rank on this host)
  CHECK(shared.detail.find("(the host's 4.20 shared by its 2 ranks)") != std::string::npos);
  CHECK(alone.detail.find("shared") == std::string::npos);
  TrainerOptions more = o;
  more.host_processes = 3;
  CHECK_THROWS_WITH_AS(more.validate(), doctest::Contains("host_processes 3"), Error);
}

TEST_CASE("without a bf16 copy in host memory: the same bits; only where it alone fits (--host-bf16-copy auto)") {
  // The CPU backend's weights are fp32 either way: what changes is the store (12 bytes a parameter
  // of state, not 14) and that the update writes no copy; every weight the same bits.
  for (const LayoutCase& c : layout_cases()) {
    CAPTURE(c.name);
    TrainerOptions o = opts(2, 13);
    c.set(o);
    TrainerOptions without = o;
    without.host_bf16_copy = false;
    CpuBackend<float> a, b;
    CHECK(train(small(false, c.layers), o, a, 3, nullptr, nullptr, true) ==
          train(small(false, c.layers), without, b, 3, nullptr, nullptr, true));
  }
  {  // a store that does not match the options is refused by name
    DecoderModel<> model(small(false));
    TrainerOptions o = opts(2, 13);
    HostParamStore<float> store(model.units(), store_opts(o));
    CpuBackend<float> be;
    o.host_bf16_copy = false;
    CHECK_THROWS_WITH_AS(Trainer<CpuBackend<float>>(model, store, be, o), doctest::Contains("host_bf16_copy"), Error);
  }

  // GPT-OSS-120B (116.8B parameters) on the reference H200 with a 1.5 TB host, 64k tokens a step:
  // its state with a bf16 copy (14 bytes a parameter) does not fit; without one (12) it does with
  // stale clipping or none; with exact clipping the waiting gradients (4 more) fit neither memory.
  const plan::DeviceBudget gpu = h200();
  const DecoderModel<> big(ModelConfig::preset("gpt-oss-120b"));
  const plan::HostBudget host{std::size_t{1500} << 30, "test"};
  TrainerOptions o = opts(64, 1024);
  o.clip_norm = 1.0;
  o.clip_mode = ClipMode::stale;
  const auto plan_of = [&](TrainerOptions q, bool copy) {
    q.host_bf16_copy = copy;
    return plan::plan_memory<plan::CudaTypes>(big, q, gpu, host);
  };
  REQUIRE_FALSE(plan_of(o, true).fits);
  const plan::MemoryPlan lean = plan_of(o, false);
  REQUIRE(lean.fits);
  const auto params = static_cast<std::size_t>(big.config().param_count());
  TrainerOptions kept = o;
  CHECK(lean.store_bytes + 2 * params <= HostParamStore<float>::footprint(big.units(), plan::store_options(kept, {}, true)).total_bytes());
  CHECK(lean.host_total() <= host.bytes);
  CHECK(lean.buffers.master_staging == plan::kMasterStagingElements);
  CHECK_FALSE(plan::choose_bf16_copy<plan::CudaTypes>(big, o, gpu, host));
  const plan::StepPlan refused = plan::plan_step<plan::CudaTypes>(big, o, gpu, host);
  REQUIRE_FALSE(refused.memory.fits);
  CHECK(refused.refusal().find("without the copy it fits: --host-bf16-copy false") != std::string::npos);
  TrainerOptions exact = o;
  exact.clip_mode = ClipMode::exact;
  CHECK(plan::choose_bf16_copy<plan::CudaTypes>(big, exact, gpu, host, {}, true));  // (neither fits: kept, refused)
  const plan::StepPlan exact_refused = plan::plan_step<plan::CudaTypes>(big, exact, gpu, host);
  REQUIRE_FALSE(exact_refused.memory.fits);
  CHECK(exact_refused.refusal().find("it fits with --clip-mode stale") != std::string::npos);
  CHECK(exact_refused.refusal().find("--host-bf16-copy false") != std::string::npos);

  // Where the copy fits, it is kept: the 7B shape with a 120 GiB host.
  const DecoderModel<> m7(ModelConfig::preset("qwen2.5-7b"));
  TrainerOptions o7 = opts(32, 1024);
  o7.clip_norm = 1.0;
  CHECK(plan::choose_bf16_copy<plan::CudaTypes>(m7, o7, gpu, {std::size_t{120} << 30, "test"}, {}, true));

  // The cost: the streamed weights cross PCIe as fp32 (twice the bytes), and a staging buffer on
  // the GPU; the host holds 2 bytes a parameter less.
  o7.device_units = 0;
  o7.kept_blocks = 0;
  o7.spilled_blocks = 0;
  const plan::HostBudget h200_host{std::size_t{200} << 30, "test"};
  TrainerOptions o7n = o7;
  o7n.host_bf16_copy = false;
  const auto p7 = plan::plan_memory<plan::CudaTypes>(m7, o7, gpu, h200_host);
  const auto p7n = plan::plan_memory<plan::CudaTypes>(m7, o7n, gpu, h200_host);
  REQUIRE((p7.fits && p7n.fits));
  CHECK(p7n.device_total() - p7.device_total() == plan::kMasterStagingElements * sizeof(float));
  // (every unit on the GPU: nothing streams, no staging)
  TrainerOptions all_on_gpu = o7n;
  all_on_gpu.device_units = static_cast<std::int64_t>(m7.units().size());
  const plan::HostBudget roomy{std::size_t{200} << 30, "test"};
  plan::DeviceBudget big_gpu = gpu;
  big_gpu.cap = std::size_t{400} << 30;
  const auto pa = plan::plan_memory<plan::CudaTypes>(m7, all_on_gpu, big_gpu, roomy);
  REQUIRE(pa.fits);
  CHECK(pa.buffers.master_staging == 0);
  CHECK(p7.store_bytes - p7n.store_bytes == HostParamStore<float>::footprint(m7.units(), plan::store_options(o7, {}, true)).compute_bytes);
  const auto h2d = [&](const TrainerOptions& q, const plan::MemoryPlan& p) {
    for (const auto& t : plan::predict_step(m7.config(), q, p, {}).terms)
      if (t.what == "PCIe H2D") return t.seconds;
    return -1.0;
  };
  const double ratio = h2d(o7n, p7n) / h2d(o7, p7);
  CHECK(ratio > 1.9);
  CHECK(ratio < 2.0);  // (the embedding's fp32 rows of the batch are fp32 either way)
}
