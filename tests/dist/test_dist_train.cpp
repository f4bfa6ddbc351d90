// Data parallel over several processes (issue 19; docs/distributed.md), on the CPU backend over
// MPI: run by CTest as `mpirun -np 2` and `-np 3`. Every rank trains its share of each global
// batch (TrainerOptions::comm) and must end with the weights and AdamW state of one process
// training the whole global batch (computed on every rank alongside), to fp32 rounding, with
// every rank's replica the same bits; with exact clipping, micro-batches, and the loss's mean over
// the global batch's labelled tokens however they fall on the ranks.
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

#include "../train/trainer_test_util.hpp"
#if MEGATRAIN_TEST_LOCAL_RANKS
#include <exception>
#include <thread>

#include "megatrain/dist/local.hpp"
#else
#include "megatrain/dist/mpi.hpp"
#endif
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "rank_checks.hpp"

using namespace megatrain;
using namespace megatrain::test;

#if MEGATRAIN_TEST_LOCAL_RANKS
// The same tests with the ranks as threads of one process (dist::LocalComm: one process driving
// several GPUs, on the CPU backend), MEGATRAIN_TEST_RANKS of them (default 2): each test case's
// body runs on every rank's thread at once, as it runs in every process under mpirun.
namespace {
constexpr bool kOneProcess = true;
thread_local dist::HostComm* t_comm = nullptr;
dist::HostComm& comm() { return *t_comm; }

void on_each_rank(void (*body)()) {
  const char* env = std::getenv("MEGATRAIN_TEST_RANKS");
  const int world = env ? std::atoi(env) : 2;
  REQUIRE(world >= 2);
  auto comms = dist::LocalComm::group(world, std::chrono::seconds(120));
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      t_comm = comms[static_cast<std::size_t>(r)].get();
      try {
        body();
      } catch (...) {  // (a failed REQUIRE, or an error: the others stop at their next collective)
        failed[static_cast<std::size_t>(r)] = std::current_exception();
        t_comm->abort(1);
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);
}
}  // namespace
#define DIST_TEST_CASE_IMPL(name, body) \
  static void body();                   \
  TEST_CASE(name) { on_each_rank(body); } \
  static void body()
#else
namespace {
constexpr bool kOneProcess = false;
dist::MpiComm& comm() {
  static dist::MpiComm c;
  return c;
}
}  // namespace
#define DIST_TEST_CASE_IMPL(name, body) TEST_CASE(name)
#endif
// A test case that every rank runs (every process under mpirun; every rank's thread in one process).
#define DIST_TEST_CASE(name) DIST_TEST_CASE_IMPL(name, DOCTEST_CAT(dist_test_body_, __LINE__))

namespace {

/// rel ||a - b|| / ||b - base||: the difference against the size of what training changed.
double rel_to_change(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& base) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += (static_cast<double>(b[i]) - base[i]) * (static_cast<double>(b[i]) - base[i]);
  }
  return std::sqrt(num / den);
}

struct Run {
  std::vector<float> state;    // masters and moments (sharded: whole on rank 0 only, gathered there)
  std::vector<float> masters;  // every rank's
  std::vector<double> losses, norms, aux;
  std::vector<std::int64_t> loads;  // every step's sparse layers' fewest and most tokens per expert
};

/// A mixture of experts with the auxiliary load-balancing loss: a dense layer between two sparse
/// ones, renormalised top 2 of 5.
ModelConfig moe_aux() {
  return ModelConfig::from_json(nlohmann::json::parse(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":40,"moe_intermediate_size":24,
          "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
          "num_experts":5,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],
          "output_router_logits":true,"router_aux_loss_coef":0.3})"), "moe aux test");
}

std::vector<float> masters_of(const HostParamStore<float>& store) {
  std::vector<float> out;
  for (const auto& u : store.units()) out.insert(out.end(), u.master().begin(), u.master().end());
  return out;
}

/// `steps` steps of a tiny model on global batches of `rows` rows; this rank's share where
/// `distributed`, else the whole batch in one process.
/// With `moe`, moe_aux() on rows that end in padding, with their attention mask.
Run train(bool distributed, bool tied, std::int64_t rows, std::int64_t micro, double clip, int steps, bool shard = false,
          bool during_backward = true, GradientHome home = GradientHome::host, std::int64_t device_units = 0,
          bool moe = false) {
  const int world = distributed ? comm().world() : 1, rank = distributed ? comm().rank() : 0;
  const std::int64_t seq = 13, share = rows / world;
  const auto cfg = moe ? moe_aux() : tiny(tied);
  TrainerOptions o = options(share, seq);
  o.micro_batches = micro;
  o.clip_norm = clip;
  o.gradient_home = home;
  o.device_units = device_units;  // (the first units' AdamW in backend memory: each process its part)
  o.comm = distributed ? &comm() : nullptr;
  o.shard_optimizer = shard;
  o.sum_during_backward = during_backward;
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> t(model, store, be, o);
  // (ZeRO-1, the gradients waiting in backend memory, one pass: each block's part of the sum alone
  // waits there, beside one whole block's buffer, and the store lands only parts)
  const bool parts = distributed && shard && home == GradientHome::device && micro == 1 && clip > 0 && world > 1;
  CHECK(plan::keeps_gradient_parts(t.options()) == parts);
  CHECK((t.memory_plan().buffers.grad_whole > 0) == parts);
  if (parts) {
    CHECK(t.memory_plan().buffers.block_acc[1] < static_cast<std::size_t>(store.unit(1).numel()));
    CHECK(store.grad_slot_numel() < store.unit(1).numel());
  }
  std::mt19937 rng(1234);
  Run r;
  for (int s = 0; s < steps; ++s) {
    Batch b = random_batch(rng, rows, seq, static_cast<std::int32_t>(cfg.vocab_size));
    std::vector<std::uint8_t> mask(moe ? b.ids.size() : 0, 1);
    for (std::int64_t row = 0; moe && row < rows; ++row)  // (row r ends in (3 r + s) % 5 tokens of padding)
      for (std::int64_t c = seq - (3 * row + s) % 5; c < seq; ++c) {
        mask[static_cast<std::size_t>(row * seq + c)] = 0;
        b.labels[static_cast<std::size_t>(row * seq + c)] = kIgnoreIndex;
      }
    const auto first = static_cast<std::size_t>(rank * share * seq), n = static_cast<std::size_t>(share * seq);
    const std::vector<std::int32_t> ids(b.ids.begin() + first, b.ids.begin() + first + n),
        labels(b.labels.begin() + first, b.labels.begin() + first + n);
    const std::span<const std::uint8_t> my_mask = moe ? std::span<const std::uint8_t>(mask).subspan(first, n)
                                                      : std::span<const std::uint8_t>();
    const StepStats st = t.step(ids, labels, {}, my_mask);
    CHECK(st.tokens == rows * seq);
    r.losses.push_back(st.loss);
    r.norms.push_back(st.grad_norm);
    r.aux.push_back(st.aux_loss);
    for (const auto& l : st.expert_load) r.loads.insert(r.loads.end(), {l.min, l.max});
  }
  t.finish_update();
  r.masters = masters_of(store);
  if (shard) store.gather_state(comm(), 0);
  r.state = state_of(store);
  return r;
}

std::vector<float> initial_state(bool tied, bool moe = false) {
  const auto cfg = moe ? moe_aux() : tiny(tied);
  TrainerOptions o = options(6, 13);
  o.gradient_home = GradientHome::host;
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  return state_of(store);
}

void check_same_run(bool tied, std::int64_t rows, std::int64_t micro_per_rank, double clip, bool shard = false,
                    bool during_backward = true, GradientHome home = GradientHome::host,
                    std::int64_t device_units = 0, bool moe = false) {
  const int world = comm().world();
  CAPTURE(device_units);
  CAPTURE(shard);
  CAPTURE(home == GradientHome::device);
  CAPTURE(during_backward);
  CAPTURE(world);
  CAPTURE(tied);
  CAPTURE(rows);
  CAPTURE(micro_per_rank);
  CAPTURE(clip);
  const int steps = 4;
  CAPTURE(moe);
  const Run dist = train(true, tied, rows, micro_per_rank, clip, steps, shard, during_backward, home, device_units, moe);
  // one process, the whole global batch, as many micro-batches in all
  const Run one = train(false, tied, rows, micro_per_rank * world, clip, steps, false, true, GradientHome::host, 0, moe);
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    CHECK(dist.losses[static_cast<std::size_t>(s)] == doctest::Approx(one.losses[static_cast<std::size_t>(s)]).epsilon(1e-5));
    CHECK(dist.norms[static_cast<std::size_t>(s)] == doctest::Approx(one.norms[static_cast<std::size_t>(s)]).epsilon(1e-5));
    CHECK(dist.aux[static_cast<std::size_t>(s)] == doctest::Approx(one.aux[static_cast<std::size_t>(s)]).epsilon(1e-5));
  }
  // (the tokens per expert of the global batch: the first step's exactly, from the same weights;
  // later a token's routing may turn on the rounding the two runs differ by)
  REQUIRE(dist.loads.size() == one.loads.size());
  const auto first_step = static_cast<std::ptrdiff_t>(dist.loads.size() / steps);
  CHECK(std::equal(dist.loads.begin(), dist.loads.begin() + first_step, one.loads.begin()));
  // (sharded: the moments gathered on rank 0)
  if (!shard || comm().rank() == 0) {
    const double rel = rel_to_change(dist.state, one.state, initial_state(tied, moe));
    MESSAGE("world " << world << std::string(shard ? " sharded" : "") << ": the state differs from one process's by " << rel
                     << " of what training changed");
    CHECK(rel < 1e-4);
  }
  // every rank's masters the same bits (and, not sharded, its whole replica)
  std::int64_t sum[1] = {checksum(shard ? dist.masters : dist.state)};
  const std::int64_t mine = sum[0];
  comm().all_reduce_sum(sum);
  CHECK(sum[0] == mine * world);
}

}  // namespace

DIST_TEST_CASE("data parallel over MPI processes equals one process training the global batch") {
  const std::int64_t w = comm().world();
  REQUIRE(w >= 2);
  check_same_run(false, 2 * w, 1, 1.0);        // exact clipping, one micro-batch per rank
  check_same_run(true, 4 * w, 2, 1.0);         // tied, two micro-batches per rank
  check_same_run(false, 2 * w, 2, 0.0);        // no clipping: micro-batches keep the gradient resident
  check_same_run(true, 3 * w, 1, 0.05);        // clipping that binds
}

DIST_TEST_CASE("data parallel with a mixture of experts' auxiliary loss (padded rows, their attention mask): each process's "
          "micro-batches are the step's, as one process's with as many in all") {
  const std::int64_t w = comm().world();
  check_same_run(false, 2 * w, 1, 1.0, false, true, GradientHome::host, 0, true);
  check_same_run(false, 4 * w, 2, 1.0, true, true, GradientHome::device, 0, true);  // (ZeRO-1, gradients on the device)
}

DIST_TEST_CASE("data parallel: the gradients summed after the backward instead (sum_during_backward false), the same run") {
  const std::int64_t w = comm().world();
  check_same_run(false, 2 * w, 1, 1.0, false, false);
  check_same_run(true, 4 * w, 2, 1.0, false, false);
  check_same_run(false, 2 * w, 1, 1.0, true, false);
  check_same_run(true, 4 * w, 2, 0.05, true, false);
}

DIST_TEST_CASE("ZeRO-1: each process keeps and steps its part of the optimizer state, equal to one process") {
  const std::int64_t w = comm().world();
  check_same_run(false, 2 * w, 1, 1.0, true);
  check_same_run(true, 4 * w, 2, 1.0, true);
  check_same_run(false, 2 * w, 2, 0.0, true);
  check_same_run(true, 3 * w, 1, 0.05, true);
}

DIST_TEST_CASE("data parallel with the gradients waiting in backend memory (GradientHome::device): summed there as each is "
          "completed, each process downloading and stepping its part where sharded") {
  const std::int64_t w = comm().world();
  for (const bool shard : {false, true}) {
    check_same_run(false, 2 * w, 1, 1.0, shard, true, GradientHome::device);
    check_same_run(true, 4 * w, 2, 1.0, shard, true, GradientHome::device);
    check_same_run(false, 2 * w, 2, 0.0, shard, true, GradientHome::device);
    check_same_run(true, 3 * w, 1, 0.05, shard, true, GradientHome::device);
  }
}

DIST_TEST_CASE("data parallel with device units (AdamW in backend memory for the first units): each process steps its "
          "part there and the parts are gathered there, equal to one process") {
  const std::int64_t w = comm().world();
  for (const bool shard : {false, true}) {
    check_same_run(false, 2 * w, 1, 1.0, shard, true, GradientHome::device, 2);
    check_same_run(true, 4 * w, 2, 1.0, shard, true, GradientHome::device, 3);
    check_same_run(false, 3 * w, 1, 0.05, shard, true, GradientHome::device, 5);  // (every unit: the head too)
  }
}

namespace {
/// Pages of [data, data + bytes) that hold memory (mincore), counting whole pages inside only.
std::size_t resident_pages(const void* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(page - 1);
  if (end <= begin) return 0;
  std::vector<unsigned char> in((end - begin) / page);
  REQUIRE(::mincore(reinterpret_cast<void*>(begin), end - begin, in.data()) == 0);
  return static_cast<std::size_t>(std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; }));
}
/// Resident pages of the moments outside each unit's part, and the whole pages there.
std::pair<std::size_t, std::size_t> unowned_moment_pages(const HostParamStore<float>& store) {
  std::size_t resident = 0, pages = 0;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& u : store.units()) {
    const auto [lo, hi] = u.owned();
    for (const std::span<float> slab : {u.adam_m(), u.adam_v()}) {
      for (const auto& [a, b] : {std::pair{std::int64_t{0}, lo}, std::pair{hi, u.numel()}}) {
        const auto bytes = static_cast<std::size_t>(b - a) * sizeof(float);
        resident += resident_pages(slab.data() + a, bytes);
        pages += bytes / page > 0 ? bytes / page - 1 : 0;
      }
    }
  }
  return {resident, pages};
}
}  // namespace

DIST_TEST_CASE("ZeRO-1: the moments outside a process's part take no memory; a checkpoint gathers them and resumes on any number") {
  const int w = comm().world(), r = comm().rank();
  // (units of several pages each, so that the parts other processes own span whole pages)
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":128,"intermediate_size":352,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300,"tie_word_embeddings":false})");
  const ModelConfig cfg = ModelConfig::from_json(j);
  const std::int64_t seq = 16, share = 2;
  TrainerOptions o = options(share, seq);
  o.clip_norm = 1.0;
  o.gradient_home = GradientHome::host;
  o.comm = &comm();
  o.shard_optimizer = true;
  DecoderModel<> model(cfg);
  const StoreOptions so = store_opts(o);
  REQUIRE(so.shard.count == w);
  REQUIRE(so.shard.index == r);
  HostParamStore<float> store(model.units(), so);
  CHECK(store.footprint().adam_bytes < HostParamStore<float>::footprint(model.units(), store_opts(options(share, seq))).adam_bytes);
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> t(model, store, be, o);
  std::mt19937 rng(99);
  for (int s = 0; s < 3; ++s) {
    const Batch b = random_batch(rng, share * w, seq, static_cast<std::int32_t>(cfg.vocab_size));
    const auto first = static_cast<std::size_t>(r * share * seq), n = static_cast<std::size_t>(share * seq);
    (void)t.step(std::span(b.ids).subspan(first, n), std::span(b.labels).subspan(first, n));
  }
  t.finish_update();
  const auto [resident, pages] = unowned_moment_pages(store);
  MESSAGE("rank " << r << ": " << resident << " of " << pages << " pages of the other processes' moments hold memory");
  CHECK(pages > 16);
  CHECK(resident == 0);

  // A checkpoint: refused before the moments are gathered; then written whole by rank 0.
  std::int64_t pid[1] = {r == 0 ? static_cast<std::int64_t>(::getpid()) : 0};  // (rank 0's: the folder's name)
  comm().all_reduce_sum(pid);
  const auto root = std::filesystem::temp_directory_path() / fmt::format("megatrain-zero1-{}", pid[0]);
  const auto dir = root / "ckpt";
  if (r == 0) {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root);
    std::string what;
    try {
      (void)io::write_train_checkpoint(dir, store, {});
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(what.find("gather_state") != std::string::npos);
  }
  store.gather_state(comm(), 0);
  CHECK(store.state_whole() == (r == 0));
  if (r == 0) {
    io::TrainCheckpointWriteOptions wo;
    wo.state = {{"what", "zero1"}};
    (void)io::write_train_checkpoint(dir, store, wo);
  }
  const std::vector<float> whole = state_of(store);  // (rank 0: everything)
  if (r == 0) {
    CHECK(unowned_moment_pages(store).first > 0);  // (what was gathered holds memory until released)
    store.release_unowned_state();
    CHECK(unowned_moment_pages(store).first == 0);
    CHECK(!store.state_whole());
  }
  std::int64_t barrier[1] = {0};
  comm().all_reduce_sum(barrier);

  // Loaded by one process (a store that is not sharded): the whole state, bit for bit.
  const auto ckpt = io::TrainCheckpoint::open(dir);
  HostParamStore<float> one(model.units(), store_opts(options(share, seq)));
  ckpt.load_into(one);
  if (r == 0) CHECK(same_bits(state_of(one), whole));

  // Written by every process, each its part, into one folder, nothing gathered: the same state,
  // in files of every process (pieces where a tensor straddles two parts).
  const auto parted = root / "parted";
  io::TrainCheckpointWriteOptions po;
  po.state = {{"what", "zero1, every process its part"}};
  po.max_shard_bytes = 100'000;  // (several files a process)
  const auto files = io::write_train_checkpoint(parted, store, po, comm());
  std::vector<std::string> shards;
  for (const auto& f : files)
    if (f.name.ends_with(".safetensors")) shards.push_back(f.name);
  CHECK(shards.size() >= static_cast<std::size_t>(2 * w));
  std::size_t pieces = 0;
  for (const auto& name : io::SafetensorsCheckpoint::open(parted / "train-state.safetensors.index.json").names())
    pieces += name.find(io::kPieceSeparator) != std::string::npos ? 1 : 0;
  CHECK((pieces > 0) == (w > 1));
  {
    HostParamStore<float> loaded(model.units(), store_opts(options(share, seq)));
    io::TrainCheckpoint::open(parted).load_into(loaded);
    CHECK(same_bits(state_of(loaded), state_of(one)));
  }
  // A process that cannot write its part (its last file is already there): every process fails
  // alike, naming it, and the complete checkpoint at that name is left as it was.
  {
    io::PartedCheckpointWrite pw(parted, store, po, comm());
    if (r == 0) {
      int staged = 0;
      for (const auto& e : std::filesystem::directory_iterator(root))
        if (e.path().filename().string().starts_with("parted.partial-")) {
          std::ofstream(e.path() / shards.back()) << "in the way";
          ++staged;
        }
      CHECK(staged == 1);
    }
    comm().all_reduce_sum(barrier);
    pw.write_part();
    std::string what;
    bool elsewhere = false;
    try {
      (void)pw.finish();
    } catch (const io::OtherProcessFailed& e) {
      what = e.what();
      elsewhere = true;
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK(elsewhere == (r != w - 1));  // (its own failure only where it happened)
    if (r == w - 1)
      CHECK_MESSAGE(what.find("cannot create") != std::string::npos, what);
    else
      CHECK_MESSAGE(what.find(fmt::format("process(es) {} could not write their part", w - 1)) != std::string::npos, what);
  }
  comm().all_reduce_sum(barrier);
  CHECK(io::TrainCheckpoint::open(parted).state().at("what") == "zero1, every process its part");
  if (r == 0)
    for (const auto& e : std::filesystem::directory_iterator(root))
      CHECK_MESSAGE(e.path().filename().string().find(".partial-") == std::string::npos, e.path().string());
  // Loaded by this run's processes again: the masters whole, each process's moments of its part.
  HostParamStore<float> again(model.units(), so);
  ckpt.load_into(again);
  CHECK(same_bits(masters_of(again), masters_of(one)));
  for (std::size_t u = 0; u < again.num_units(); ++u) {
    const auto [lo, hi] = again.unit(u).owned();
    for (const auto& [a, b] : {std::pair{again.unit(u).adam_m(), one.unit(u).adam_m()},
                               std::pair{again.unit(u).adam_v(), one.unit(u).adam_v()}})
      CHECK(std::equal(a.begin() + lo, a.begin() + hi, b.begin() + lo));
  }
  CHECK(unowned_moment_pages(again).first == 0);
  comm().all_reduce_sum(barrier);
  if (r == 0) std::filesystem::remove_all(root);
}

namespace {
/// Resident pages of each unit's masters outside what this process keeps (its part and the
/// ranges kept whole), and the whole pages there.
std::pair<std::size_t, std::size_t> unheld_master_pages(const HostParamStore<float>& store) {
  std::size_t resident = 0, pages = 0;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& u : store.units()) {
    std::vector<std::pair<std::int64_t, std::int64_t>> keep(u.whole_masters().begin(), u.whole_masters().end());
    keep.push_back(u.owned());
    std::sort(keep.begin(), keep.end());
    std::int64_t at = 0;
    const auto count = [&](std::int64_t a, std::int64_t b) {
      if (b <= a) return;
      const auto bytes = static_cast<std::size_t>(b - a) * sizeof(float);
      resident += resident_pages(u.master().data() + a, bytes);
      pages += bytes / page > 0 ? bytes / page - 1 : 0;
    };
    for (const auto& [a, b] : keep) {
      count(at, a);
      at = std::max(at, b);
    }
    count(at, u.numel());
  }
  return {resident, pages};
}
// The same for the bf16 copy outside this process's part (a copy held in parts).
std::pair<std::size_t, std::size_t> unheld_weight_pages(const HostParamStore<float>& store) {
  std::size_t resident = 0, pages = 0;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& u : store.units())
    for (const auto& [a, b] : {std::pair<std::int64_t, std::int64_t>{0, u.owned().first}, {u.owned().second, u.numel()}}) {
      if (b <= a) continue;
      const auto bytes = static_cast<std::size_t>(b - a) * sizeof(bf16);
      resident += resident_pages(u.compute().data() + a, bytes);
      pages += bytes / page > 0 ? bytes / page - 1 : 0;
    }
  return {resident, pages};
}
}  // namespace

// The store of a trainer whose weights are bf16 (GPUs; the CPU backend streams the fp32 masters
// themselves, so its trainer keeps them whole): each process keeps the masters of its part only,
// beside the embedding's and the norm gains' (read at fp32), and the bf16 copy whole.
namespace {
// ZeRO-1 over this run's processes with exact clipping; `share`: the bf16 copy mapped by the
// processes together (StoreShard::shared_weights); `parts`: not shared, each process's copy held in
// its part (StoreShard::weights_in_parts, what a GPU trainer that gathers the weights on the GPUs asks for).
TrainerOptions zero1_options(bool share, bool parts = false) {
  TrainerOptions o = options(2, 16);
  o.clip_norm = 1.0;
  o.comm = &comm();
  o.shard_optimizer = true;
  o.share_host_weights = share;
  o.gather_weights_on_device = parts;
  return o;
}

void sharded_masters_case(bool share, bool parts = false) {
  const int w = comm().world(), r = comm().rank();
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":128,"intermediate_size":352,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":300,"tie_word_embeddings":false})");
  const ModelConfig cfg = ModelConfig::from_json(j);
  DecoderModel<> model(cfg);
  const TrainerOptions o = zero1_options(share, parts);
  const StoreOptions so = plan::store_options(o, {}, true);
  REQUIRE(so.shard.masters);
  REQUIRE(so.shard.shares_weights() == share);
  REQUIRE(so.shard.keeps_weight_parts() == parts);
  const std::size_t mapped_before = host_buffer_bytes();
  HostParamStore<float> store(model.units(), so);
  const std::size_t mapped = host_buffer_bytes() - mapped_before;
  HostParamStore<float> one(model.units(), plan::store_options(options(2, 16), {}, true));  // (the same seed: whole)
  const std::size_t mapped_one = host_buffer_bytes() - mapped_before - mapped;
  CHECK(store.masters_sharded());
  CHECK(store.weights_shared() == share);
  CHECK(store.weights_in_parts() == parts);
  CHECK(!store.weights_whole() == parts);
  // (the bf16 copy: this process's share of the one the host's processes map, or a whole copy)
  const std::size_t whole_copy = one.footprint().compute_bytes;
  if (share) {
    CHECK(store.footprint().compute_bytes == (whole_copy + static_cast<std::size_t>(w) - 1) / static_cast<std::size_t>(w));
  } else if (parts) {  // (its part of each unit)
    std::size_t held = 0;
    for (const auto& u : store.units()) held += static_cast<std::size_t>(u.owned().second - u.owned().first) * sizeof(bf16);
    CHECK(held < whole_copy / static_cast<std::size_t>(w) + 64 * store.num_units());
    CHECK(store.footprint().compute_bytes == held);
  } else {
    CHECK(store.footprint().compute_bytes == whole_copy);
  }
  // (what the allocator counts for this store beyond a whole one's: the footprint's difference, within
  // the rounding to pages; the masters' and moments' address ranges are whole in both)
  // (shared: also this process's share of the embedding's masters, which the processes map together
  // beside the masters' whole address range)
  const auto counted = [&](const HostParamStore<float>& x) {
    const std::size_t shared_masters = x.weights_shared() ? x.unit(0).numel() * sizeof(float) / static_cast<std::size_t>(w) : 0;
    // (a copy held in parts: its whole address range, as the masters')
    const std::size_t copy = x.weights_in_parts() ? whole_copy : x.footprint().compute_bytes;
    return static_cast<long long>(copy + x.footprint().resident_grad_bytes + shared_masters);
  };
  // (the allocator's count is the process's: with the ranks as threads of one, the others' allocations mix in)
  if (!kOneProcess)
    CHECK(std::llabs(static_cast<long long>(mapped) - static_cast<long long>(mapped_one) - (counted(store) - counted(one))) <=
          4 * static_cast<long long>(host_page_size()));
  CHECK(store.footprint().master_bytes < one.footprint().master_bytes);
  // (+ kept whole: the norm gains, and where not mapped together the embedding's)
  CHECK(store.footprint().master_bytes >= one.footprint().master_bytes / static_cast<std::size_t>(w));
  if (!share)
    CHECK(store.footprint().master_bytes >=
          one.footprint().master_bytes / static_cast<std::size_t>(w) + store.unit(0).numel() * sizeof(float) / 2);
  // Built (and initialised): the other processes' masters take no memory; the bf16 copy is whole.
  auto [resident, pages] = unheld_master_pages(store);
  MESSAGE("rank " << r << ": " << resident << " of " << pages << " pages of the other processes' masters hold memory");
  CHECK(pages > 16);
  CHECK(resident == 0);
  const auto bits = [](std::span<const bf16> a, std::span<const bf16> b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
  };
  // (held in parts: its part; the others' hold no memory)
  const auto held = [](const HostParamStore<float>::Unit& u) {
    const auto [a, b] = u.held_weights();
    return std::span<const bf16>(u.compute()).subspan(static_cast<std::size_t>(a), static_cast<std::size_t>(b - a));
  };
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    CHECK(bits(held(store.unit(u)), held(one.unit(u)).subspan(static_cast<std::size_t>(store.unit(u).held_weights().first),
                                                             held(store.unit(u)).size())));
    CHECK((store.unit(u).held_weights() == std::pair<std::int64_t, std::int64_t>{0, store.unit(u).numel()}) == !parts);
  }
  if (parts) {
    const auto [resident_w, pages_w] = unheld_weight_pages(store);
    CHECK(pages_w > 16);
    CHECK(resident_w == 0);
  }
  CHECK(store.unit(0).whole_masters().size() == 1);  // (the embedding: kept whole)
  if (share) {  // (... and mapped together: its share of them counted, the others' not)
    const auto embedding = static_cast<std::size_t>(store.unit(0).numel()) * sizeof(float);
    CHECK(one.footprint().master_bytes - store.footprint().master_bytes >=
          embedding - (embedding + static_cast<std::size_t>(w) - 1) / static_cast<std::size_t>(w));
  }
  CHECK(!store.unit(1).whole_masters().empty());      // (a block: its norm gains)

  if (share) {  // (every process has compared the copy before any changes its part of the pages they map)
    std::int64_t one_each = 1;
    comm().all_reduce_sum(std::span<std::int64_t>(&one_each, 1));
  }
  // An update: each process changes its part (masters, moments, bf16 copy), as AdamW does;
  // `one` all of it. Then the parts gathered: the same bf16 copy and kept masters everywhere.
  const auto changed = [](std::size_t u, std::int64_t i) { return 0.001f * static_cast<float>((i * 7 + static_cast<std::int64_t>(u)) % 101) - 0.05f; };
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    const auto& a = store.unit(u);
    const auto& b = one.unit(u);
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      const auto k = static_cast<std::size_t>(i);
      b.master()[k] += changed(u, i);
      b.adam_m()[k] = changed(u, i);
      b.compute()[k] = bf16(b.master()[k]);
      if (i >= a.owned().first && i < a.owned().second) {
        a.master()[k] += changed(u, i);
        a.adam_m()[k] = changed(u, i);
        a.compute()[k] = bf16(a.master()[k]);
      }
    }
  }
  // (shared: the other processes' parts reach this one through the pages they map together, for
  // nothing is gathered; gather_updated waits for every process to have written its part)
  store.gather_updated(comm());
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    CAPTURE(u);
    const auto& a = store.unit(u);
    const auto& b = one.unit(u);
    const auto [wa, wb] = a.held_weights();  // (held in parts: its part, left as it is by gather_updated)
    CHECK(bits(held(a), std::span<const bf16>(b.compute()).subspan(static_cast<std::size_t>(wa), static_cast<std::size_t>(wb - wa))));
    for (const auto& [lo, hi] : a.whole_masters())
      CHECK(std::equal(a.master().begin() + lo, a.master().begin() + hi, b.master().begin() + lo));
    CHECK(std::equal(a.master().begin() + a.owned().first, a.master().begin() + a.owned().second,
                     b.master().begin() + a.owned().first));
  }
  CHECK(unheld_master_pages(store).first == 0);
  if (parts) CHECK(unheld_weight_pages(store).first == 0);
  // Held in parts: an export needs the whole copy on the process that writes it (gather_weights
  // to it as the root; the others keep their parts), which release_unowned_state gives back.
  if (parts) {
    const auto dir = std::filesystem::temp_directory_path() / fmt::format("megatrain-export-refused-{}-{}", ::getpid(), r);
    std::string what;
    try {
      io::export_hf_model(store, cfg, dir, {});
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK_MESSAGE(what.find("HostParamStore::gather_weights") != std::string::npos, what);
    CHECK(!std::filesystem::exists(dir));
    store.gather_weights(comm(), 0);
    CHECK(store.weights_whole() == (r == 0));
    if (r == 0)
      for (std::size_t u = 0; u < store.num_units(); ++u) CHECK(bits(store.unit(u).compute(), one.unit(u).compute()));
    else
      CHECK(unheld_weight_pages(store).first == 0);
  }
  // A bf16 export of this process's store, nothing gathered (from the bf16 copy, which is the
  // masters rounded as the export rounds them): the same bytes as the whole store's; an fp32 one
  // refused until the masters are gathered.
  {
    const auto dir = std::filesystem::temp_directory_path() / fmt::format("megatrain-export-{}-{}", ::getpid(), r);
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    if (!parts || r == 0) {  // (held in parts: the root of the gather alone holds the whole copy)
      io::export_hf_model(store, cfg, dir / "parts", {});
      io::export_hf_model(one, cfg, dir / "whole", {});
      const auto bytes = [](const std::filesystem::path& f) {
        std::ifstream in(f, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(in), {});
      };
      const std::string a = bytes(dir / "parts" / "model.safetensors");
      CHECK(a.size() > 100'000);
      CHECK(a == bytes(dir / "whole" / "model.safetensors"));
    }
    io::HfExportOptions f32;
    f32.dtype = DType::f32;
    std::string what;
    try {
      io::export_hf_model(store, cfg, dir / "f32", f32);
    } catch (const Error& e) {
      what = e.what();
    }
    CHECK_MESSAGE(what.find("export as bf16") != std::string::npos, what);
    std::filesystem::remove_all(dir);
  }
  // What a checkpoint needs: the whole state on rank 0, and the memory given back after.
  store.gather_state(comm(), 0);
  CHECK(store.state_whole() == (r == 0));
  if (r == 0) {
    CHECK(same_bits(masters_of(store), masters_of(one)));
    for (std::size_t u = 0; u < store.num_units(); ++u)
      CHECK(std::equal(store.unit(u).adam_m().begin(), store.unit(u).adam_m().end(), one.unit(u).adam_m().begin()));
    CHECK(unheld_master_pages(store).first > 0);
  }
  store.release_unowned_state();
  CHECK(unheld_master_pages(store).first == 0);
  CHECK(!store.state_whole());
  if (parts) {
    CHECK(unheld_weight_pages(store).first == 0);
    CHECK(!store.weights_whole());
  }
  // A trainer whose weights are fp32 (the CPU backend's) refuses a store whose masters are sharded.
  std::string what;
  try {
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> t(model, store, be, o);
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("Trainer::store_options") != std::string::npos, what);
}
}  // namespace

DIST_TEST_CASE("ZeRO-1 with the masters sharded too: only this process's part holds memory; the update gathered as bf16; a "
          "checkpoint gathers the masters") {
  sharded_masters_case(false);
}

DIST_TEST_CASE("ZeRO-1 with the bf16 weights shared by the processes of the host: one copy, each process's part of the "
          "update seen by every other without a gather") {
  sharded_masters_case(true);
}

DIST_TEST_CASE("ZeRO-1 with each process's bf16 copy held in its part (the weights gathered on the GPUs): the rest holds no "
          "memory; an export gathers it whole to one process and gives it back after") {
  sharded_masters_case(false, true);
}

DIST_TEST_CASE("shared bf16 weights are refused, by every process alike, where a process runs on another host") {
  if (kOneProcess) return;  // (the ranks of one process run on one host)
  const int w = comm().world(), r = comm().rank();
  const ModelConfig cfg = ModelConfig::from_json(nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],
    "hidden_size":64,"intermediate_size":96,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
    "vocab_size":100})"));
  DecoderModel<> model(cfg);
  const TrainerOptions o = zero1_options(true);
  if (r == w - 1) setenv("MEGATRAIN_FAULTS", "set@host=elsewhere", 1);  // (the last process claims another host)
  const std::size_t mapped_before = host_buffer_bytes();
  std::string what;
  try {
    HostParamStore<float> store(model.units(), plan::store_options(o, {}, true));
  } catch (const Error& e) {
    what = e.what();
  }
  unsetenv("MEGATRAIN_FAULTS");
  CHECK_MESSAGE(what.find(fmt::format("process(es) {} of {} run on another host than process 0", w - 1, w)) !=
                    std::string::npos, what);
  CHECK(what.find("--share-weights") != std::string::npos);
  CHECK(host_buffer_bytes() == mapped_before);  // (nothing kept of what the store had allocated)
}

DIST_TEST_CASE("data parallel: the collectives sum over the ranks and give every rank the same bits") {
  const int w = comm().world(), r = comm().rank();
  std::vector<float> f(1000003);
  std::vector<double> d(7);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = 0.1f * static_cast<float>(r + 1) + static_cast<float>(i % 17);
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = 1e-3 * (r + 1) * static_cast<double>(i + 1);
  comm().all_reduce_sum(f);
  comm().all_reduce_sum(d);
  double ranks = 0;
  for (int q = 0; q < w; ++q) ranks += 0.1 * (q + 1);
  for (std::size_t i = 0; i < f.size(); i += 9973)
    CHECK(f[i] == doctest::Approx(ranks + static_cast<double>(w) * static_cast<double>(i % 17)).epsilon(1e-6));
  for (std::size_t i = 0; i < d.size(); ++i)
    CHECK(d[i] == doctest::Approx(1e-3 * static_cast<double>(i + 1) * w * (w + 1) / 2.0).epsilon(1e-12));
  std::int64_t sum[1] = {checksum(f)};
  const std::int64_t mine = sum[0];
  comm().all_reduce_sum(sum);
  CHECK(sum[0] == mine * w);
}

#if !MEGATRAIN_TEST_LOCAL_RANKS
// How processes that mpirun launched meet on GPUs: the NCCL unique id and the beacons' addresses
// through MPI (dist::Rendezvous), with no MASTER_ADDR to agree on.
TEST_CASE("MPI hands every rank every rank's blob, in rank order, whatever their lengths") {
  const int w = comm().world(), r = comm().rank();
  const auto blob_of = [](int q) {  // (rank 1's is empty; bytes of every value, a zero among them)
    std::string b;
    for (int i = 0; i < (q == 1 ? 0 : 1000 * q + 129); ++i) b.push_back(static_cast<char>((i * 37 + q) & 0xff));
    return b;
  };
  const auto all = comm().all_gather_blobs(blob_of(r));
  REQUIRE(static_cast<int>(all.size()) == w);
  for (int q = 0; q < w; ++q) CHECK(all[static_cast<std::size_t>(q)] == blob_of(q));
}
#endif

DIST_TEST_CASE("data parallel refuses what it cannot sum exactly, before anything is allocated") {
  const auto cfg = tiny(false);
  DecoderModel<> model(cfg);
  TrainerOptions o = options(2, 13);
  o.comm = &comm();
  o.gradient_home = GradientHome::host;
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  std::string what;
  o.clip_norm = 0;  // streamed: each unit updated during the backward
  try {
    Trainer<CpuBackend<float>> t(model, store, be, o);
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK(what.find("exact clipping or micro-batches") != std::string::npos);
}

// Run by CTest as `test_dist_train_killed_rank` (MEGATRAIN_TEST_KILL_RANK=1, expected to fail):
// rank 1 dies by SIGKILL before its second step while rank 0 waits in that step's first collective;
// the whole run must stop (mpirun ends every rank and exits nonzero) instead of rank 0 hanging.
// Elsewhere (no such variable) it does nothing.
DIST_TEST_CASE("data parallel: a rank killed mid-run stops every rank") {
  const char* kill_rank = std::getenv("MEGATRAIN_TEST_KILL_RANK");
  if (kill_rank == nullptr) return;
  const int victim = std::atoi(kill_rank);
  const auto cfg = tiny(false);
  TrainerOptions o = options(2, 13);
  o.clip_norm = 1.0;
  o.gradient_home = GradientHome::host;
  o.comm = &comm();
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> t(model, store, be, o);
  std::mt19937 rng(7);
  for (int s = 0; s < 3; ++s) {
    if (s == 1 && comm().rank() == victim) std::raise(SIGKILL);
    const Batch b = random_batch(rng, 2, 13, static_cast<std::int32_t>(cfg.vocab_size));
    (void)t.step(b.ids, b.labels);
  }
  FAIL("every rank finished although rank " << victim << " was killed");
}

#if MEGATRAIN_TEST_LOCAL_RANKS
TEST_CASE("ranks as threads of one process: a rank that fails stops every other rank at once, naming it") {
  const int world = 3;
  auto comms = dist::LocalComm::group(world, std::chrono::seconds(120));
  const auto cfg = tiny(false);
  std::vector<std::string> said(world);
  std::vector<double> waited(world, 0);
  int told = -1;
  const auto status = dist::run_local_ranks(
      world,
      [&](int r) {
        TrainerOptions o = options(2, 13);
        o.clip_norm = 1.0;
        o.comm = comms[static_cast<std::size_t>(r)].get();
        DecoderModel<> model(cfg);
        HostParamStore<float> store(model.units(), store_opts(o));
        CpuBackend<float> be;
        Trainer<CpuBackend<float>> t(model, store, be, o);
        std::mt19937 rng(7);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          for (int s = 0; s < 3; ++s) {
            if (s == 1 && r == 1) throw std::runtime_error("rank 1 gives up");
            const Batch b = random_batch(rng, 2, 13, static_cast<std::int32_t>(cfg.vocab_size));
            (void)t.step(b.ids, b.labels);
          }
        } catch (const Error& e) {
          said[static_cast<std::size_t>(r)] = e.reason();
          waited[static_cast<std::size_t>(r)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          return 2;
        }
        return 0;
      },
      [&](int failed) {
        if (told >= 0) return;  // (the ranks it stopped end with nonzero statuses too)
        told = failed;
        comms[static_cast<std::size_t>(failed)]->abort(1);  // (the group's: every other rank's collective fails, naming it)
      });
  CHECK(told == 1);
  CHECK(status == std::vector<int>{2, 1, 2});  // (rank 1 threw: the thrown status; the others stopped)
  for (const int r : {0, 2}) {
    CAPTURE(r);
    CHECK_MESSAGE(said[static_cast<std::size_t>(r)].find("rank 1 of 3 failed") != std::string::npos,
                  said[static_cast<std::size_t>(r)]);
    CHECK(waited[static_cast<std::size_t>(r)] < 60);
  }
}

TEST_CASE("ranks as threads of one process: a rank whose peers never arrive gives up after the timeout, naming them; "
          "different collectives at once are refused") {
  {
    auto comms = dist::LocalComm::group(3, std::chrono::milliseconds(300));
    std::string what;
    std::thread other([&] {
      std::int64_t v[1] = {1};
      // (after rank 0, so that rank 0's wait ends first: it names rank 1, and rank 2 then hears that rank 0 gave up)
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      try {
        comms[2]->all_reduce_sum(v);
      } catch (const Error&) {
      }
    });
    try {
      std::int64_t v[1] = {1};
      comms[0]->all_reduce_sum(v);  // (rank 1 never comes)
    } catch (const Error& e) {
      what = e.reason();
    }
    other.join();
    CHECK_MESSAGE(what.find("rank(s) 1 did not reach the collective within 0.3 s") != std::string::npos, what);
  }
  {
    auto comms = dist::LocalComm::group(2, std::chrono::seconds(2));
    std::string a, b;
    std::thread other([&] {
      std::vector<float> v(5, 1.0f);
      try {
        comms[1]->all_reduce_sum(v);
      } catch (const Error& e) {
        b = e.reason();
      }
    });
    try {
      std::vector<float> v(4, 1.0f);
      comms[0]->all_reduce_sum(v);
    } catch (const Error& e) {
      a = e.reason();
    }
    other.join();
    CHECK_MESSAGE(a.find("called different collectives at once") != std::string::npos, a);
    CHECK_MESSAGE(b.find("called different collectives at once") != std::string::npos, b);
  }
  {  // (the gathers: each rank's part to every rank, or to the root alone)
    auto comms = dist::LocalComm::group(3);
    const std::vector<std::int64_t> bounds{0, 2, 5, 7};
    std::vector<std::vector<float>> all(3), to_root(3), scattered(3);
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r)
      ts.emplace_back([&, r] {
        const auto k = static_cast<std::size_t>(r);
        all[k].assign(7, -1.0f);
        to_root[k].assign(7, -1.0f);
        scattered[k].assign(7, 0.0f);
        for (std::size_t i = 0; i < 7; ++i) scattered[k][i] = static_cast<float>((r + 1) * 10 + static_cast<int>(i));
        for (auto i = bounds[k]; i < bounds[k + 1]; ++i) all[k][static_cast<std::size_t>(i)] = to_root[k][static_cast<std::size_t>(i)] = static_cast<float>(i);
        comms[k]->all_gather(all[k], bounds);
        comms[k]->gather(to_root[k], bounds, 1);
        comms[k]->reduce_scatter_sum(scattered[k], bounds);
      });
    for (auto& t : ts) t.join();
    for (std::size_t k = 0; k < 3; ++k) {
      CAPTURE(k);
      for (std::size_t i = 0; i < 7; ++i) {
        CHECK(all[k][i] == static_cast<float>(i));
        const bool own = static_cast<std::int64_t>(i) >= bounds[k] && static_cast<std::int64_t>(i) < bounds[k + 1];
        CHECK(to_root[k][i] == (k == 1 || own ? static_cast<float>(i) : -1.0f));
        if (own) CHECK(scattered[k][i] == static_cast<float>(60 + 3 * static_cast<int>(i)));
      }
    }
  }
}
#endif
