// Data parallel over processes on GPUs (issue 19; docs/distributed.md): each process a rank with
// torchrun's variables (run_ranks.sh), one GPU each, the gradients summed over NCCL
// (dist::NcclHostComm). Each rank trains its share of every global batch and must follow one
// process training the whole batch on its GPU (run in the same process afterwards) within bf16
// rounding, every rank's replica the same bits. Exit 77 (skipped) where the host has fewer GPUs
// than ranks.
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <thread>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/dist/local.hpp"
#include "megatrain/dist/nccl.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "../dist/rank_checks.hpp"
#include "gpu_per_rank.hpp"

using namespace megatrain;

namespace {

ModelConfig tiny() {
  return ModelConfig::from_json(nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":128,
    "intermediate_size":344,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1001,
    "rope_theta":10000.0,"tie_word_embeddings":false})"));
}

struct Run {
  std::vector<float> initial, state;  // the masters (ZeRO-1: gathered on rank 0, whole there only)
  std::int64_t weights = 0;           // a checksum of the bf16 weights every rank streams
  std::vector<double> losses, norms;
};

Run train(dist::HostComm* comm, int device, std::int64_t rows, std::int64_t micro, int steps, bool shard = false,
          bool during_backward = true, GradientHome home = GradientHome::host,
          std::int64_t device_units = TrainerOptions::kAutoDeviceUnits, bool share_weights = false,
          bool gather_on_device = true) {
  const int world = comm ? comm->world() : 1, rank = comm ? comm->rank() : 0;
  const std::int64_t seq = 64, share = rows / world;
  const auto cfg = tiny();
  TrainerOptions o;
  o.batch_rows = share;
  o.seq_len = seq;
  o.micro_batches = micro;
  o.clip_norm = 1.0;
  o.gradient_home = home;  // (device: summed on the GPUs as completed, reduce-scattered where sharded)
  o.device_units = device_units;  // (auto: as many units' AdamW on the GPU as fit; with GradientHome::host none)
  o.adamw.lr = 1e-3;
  o.comm = comm;
  o.shard_optimizer = shard;  // (ZeRO-1: AdamW's moments and update in parts, the masters gathered)
  o.sum_during_backward = during_backward;  // (false: summed in host memory after the backward)
  o.share_host_weights = share_weights;  // (the bf16 weights one copy that the processes map together)
  o.gather_weights_on_device = gather_on_device;  // (each process uploads its part; the GPUs gather the rest)
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = 5;
  HostParamStore<float> store(model.units(), Trainer<CudaBackend>::store_options(o, so));
  test::rank_check(store.weights_shared() == (share_weights && shard && comm != nullptr && comm->world() > 1),
                   "the store shares the bf16 weights as asked", rank);
  const bool parts = shard && comm != nullptr && comm->world() > 1 && !share_weights && gather_on_device &&
                     !(home == GradientHome::host && during_backward);
  test::rank_check(store.weights_in_parts() == parts, "the store keeps its part of the bf16 weights current as asked", rank);
  if (parts)  // (its part of each unit page-locked, for DMA; the rest, which holds no memory, not)
    for (const auto& u : store.units()) {
      const auto [lo, hi] = u.owned();
      const std::span<const bf16> all(u.compute()), mine = all.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo));
      test::rank_check(host_pages_locked(mine.data(), mine.size_bytes()) && !host_pages_locked(all.data(), all.size_bytes()),
                       "a copy held in parts: its part alone page-locked", rank);
    }
  CudaBackendOptions copt;
  copt.device = device;
  CudaBackend be(copt);
  Trainer<CudaBackend> t(model, store, be, o);
  std::mt19937 rng(99);
  Run r;
  for (const auto& u : store.units()) r.initial.insert(r.initial.end(), u.master().begin(), u.master().end());
  for (int s = 0; s < steps; ++s) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows * seq)), labels(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<std::int32_t>(rng() % 1001);
      labels[i] = rng() % 5 == 0 ? kIgnoreIndex : static_cast<std::int32_t>(rng() % 1001);
    }
    const auto first = static_cast<std::ptrdiff_t>(rank * share * seq), n = static_cast<std::ptrdiff_t>(share * seq);
    const std::vector<std::int32_t> mine(ids.begin() + first, ids.begin() + first + n),
        my_labels(labels.begin() + first, labels.begin() + first + n);
    const StepStats st = t.step(mine, my_labels);
    r.losses.push_back(st.loss);
    r.norms.push_back(st.grad_norm);
  }
  t.finish_update();
  const auto weights = [&] {  // (a checksum of the bf16 weights this process holds whole)
    std::vector<float> w;
    for (const auto& u : store.units())
      for (const bf16 x : u.compute()) w.push_back(static_cast<float>(x));
    return test::checksum(w);
  };
  r.weights = weights();
  if (parts) {  // (held in parts: brought whole to each process in turn, which then sums it alone)
    test::rank_check(!store.weights_whole(), "a copy held in parts is not whole after an update", rank);
    for (int root = 0; root < world; ++root) {
      store.gather_weights(*comm, root);
      if (rank == root) r.weights = weights();
      store.release_unowned_state();
    }
  }
  if (shard) store.gather_state(*comm, 0);  // (the masters too: each process keeps its part of them)
  for (const auto& u : store.units()) r.state.insert(r.state.end(), u.master().begin(), u.master().end());
  return r;
}

// One rank: a process (run_ranks.sh) or a thread of this one (MEGATRAIN_TEST_THREADS).
int rank_main(const dist::LaunchInfo& me) {
  try {
    dist::NcclHostComm comm(me, me.local_rank, dist::rendezvous_timeout(60.0));
    const int W = comm.world(), r = comm.rank();
    std::fprintf(stderr, "rank %d of %d: joined on GPU %d\n", r, W, me.local_rank);
    {  // the collectives alone first (a failure here is the transport's, not the trainer's)
      std::int64_t one[1] = {r + 1};
      std::vector<float> f(3000017, static_cast<float>(r + 1));
      comm.all_reduce_sum(one);
      comm.all_reduce_sum(f);
      test::rank_check(one[0] == W * (W + 1) / 2 && f.back() == static_cast<float>(W * (W + 1) / 2), "the collectives' sums", r);
      std::fprintf(stderr, "rank %d: collectives ok\n", r);
    }
    // killed_rank_nccl.sh: one rank dies by SIGKILL (or, with MEGATRAIN_TEST_STUCK_RANK, stays alive
    // without joining the collectives for 20 s); the other must stop with a message saying so,
    // instead of waiting forever: at once where the rank's process has ended, at the collective
    // timeout where it lives. A gradient's sum on the GPU (the watchdog aborts the communicator),
    // then a collective of host memory.
    // With MEGATRAIN_TEST_NCCL_ERROR, the rank fails in NCCL instead: a gradient's sum given host
    // memory, which NCCL refuses where it checks pointers (NCCL_CHECK_POINTERS=1); the rank
    // reports the error and ends, as megatrain-train's rank would.
    if (const char* victim = std::getenv("MEGATRAIN_TEST_KILL_RANK"); victim != nullptr && me.launcher != "threads") {
      if (r == std::atoi(victim)) {
        if (std::getenv("MEGATRAIN_TEST_NCCL_ERROR") != nullptr) {
          std::vector<float> host(1000, 1.0f);
          cudaStream_t st = nullptr;
          (void)cudaStreamCreate(&st);
          try {
            comm.sum_backend_memory(host.data(), host.size(), st);
            (void)cudaStreamSynchronize(st);
          } catch (const Error& e) {
            std::fprintf(stderr, "rank %d: failed in NCCL: %s %s\n", r, e.call().c_str(), e.reason().c_str());
            std::_Exit(1);
          }
          std::fprintf(stderr, "rank %d: NCCL summed host memory without an error\n", r);
          std::_Exit(3);
        }
        if (std::getenv("MEGATRAIN_TEST_STUCK_RANK") == nullptr) std::raise(SIGKILL);
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      }
      {
        float* d = nullptr;
        cudaStream_t st = nullptr;
        (void)cudaMalloc(&d, 1000 * sizeof(float));
        (void)cudaStreamCreate(&st);
        const auto t0 = std::chrono::steady_clock::now();
        comm.sum_backend_memory(d, 1000, st);
        const cudaError_t e = cudaStreamSynchronize(st);
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: the gradient's sum on the GPU ended after %.1f s (%s)\n", r, waited, cudaGetErrorString(e));
        test::rank_check(waited < 30, "the gradient's sum on the GPU was not aborted", r);
      }
      try {
        std::vector<float> g(1000, 1.0f);
        comm.all_reduce_sum(g);
        test::rank_check(false, "a collective completed without the killed rank", r);
      } catch (const Error& e) {
        std::printf("rank %d: stopped as it should: %s\n", r, e.reason().c_str());
      }
      return test::rank_failures() == 0 ? 0 : 1;
    }
    const int steps = 4;
    struct Case {
      std::int64_t micro;
      bool shard, during_backward;
      GradientHome home;
      std::int64_t device_units = TrainerOptions::kAutoDeviceUnits;
      bool share = false;  // (the bf16 weights mapped by the processes together: the same bits as without)
    };
    constexpr auto host = GradientHome::host, device = GradientHome::device;
    // (device homes: auto places every unit of this small model on the GPU; 0 none, 2 some)
    for (const Case& c : {Case{1, false, true, host}, Case{2, false, true, host}, Case{1, true, true, host},
                          Case{2, true, true, host}, Case{1, false, false, host}, Case{2, true, false, host},
                          Case{1, false, true, device, 0}, Case{1, true, true, device, 0}, Case{2, true, true, device, 2},
                          Case{1, false, true, device}, Case{1, true, true, device}, Case{2, true, true, device},
                          Case{1, true, true, device, 0, true}, Case{2, true, true, device, 2, true}}) {
      const auto [micro, shard, during_backward, home, device_units, share] = c;
      const std::int64_t rows = 4 * W;
      const Run d = train(&comm, me.local_rank, rows, micro, steps, shard, during_backward, home, device_units, share);
      if (share) {  // the same bits as each process with its own copy
        const Run own = train(&comm, me.local_rank, rows, micro, steps, shard, during_backward, home, device_units);
        test::rank_check(d.losses == own.losses && d.norms == own.norms && d.weights == own.weights &&
                             (r != 0 || d.state == own.state),
                         "shared bf16 weights: not the same bits as a copy a process", r);
      } else if (shard) {  // each process's part uploaded and the rest gathered on the GPUs: the same bits as gathered on the host
        const Run host_gather =
            train(&comm, me.local_rank, rows, micro, steps, shard, during_backward, home, device_units, false, false);
        test::rank_check(d.losses == host_gather.losses && d.norms == host_gather.norms && d.weights == host_gather.weights &&
                             (r != 0 || d.state == host_gather.state),
                         "the weights gathered on the GPUs: not the same bits as gathered in host memory", r);
      }
      const Run one = train(nullptr, me.local_rank, rows, micro * W, steps);
      for (int s = 0; s < steps; ++s) {
        const auto i = static_cast<std::size_t>(s);
        test::rank_check(std::abs(d.losses[i] - one.losses[i]) <= 2e-3 * std::abs(one.losses[i]),
              "loss " + std::to_string(d.losses[i]) + " vs one process " + std::to_string(one.losses[i]), r);
        test::rank_check(std::abs(d.norms[i] - one.norms[i]) <= 2e-2 * std::abs(one.norms[i]),
              "gradient norm " + std::to_string(d.norms[i]) + " vs one process " + std::to_string(one.norms[i]), r);
      }
      double diff = 0, size = 0;
      for (std::size_t i = 0; i < d.state.size(); ++i) {
        diff += (static_cast<double>(d.state[i]) - one.state[i]) * (static_cast<double>(d.state[i]) - one.state[i]);
        size += (static_cast<double>(one.state[i]) - one.initial[i]) * (static_cast<double>(one.state[i]) - one.initial[i]);
      }
      if (!shard || r == 0)  // (ZeRO-1: the masters whole on rank 0 only)
        std::printf("rank %d of %d%s%s%s%s (device units %lld), %lld micro-batch(es) each: losses %.6f .. %.6f (one process %.6f .. %.6f), weights "
                  "within %.3g of what training changed from one process's\n", r, W, shard ? " (ZeRO-1)" : "",
                  during_backward ? "" : " (summed after the backward)",
                  home == device ? " (gradients on the GPUs)" : "", share ? " (bf16 weights shared)" : "",
                  static_cast<long long>(device_units),
                  static_cast<long long>(micro), d.losses.front(), d.losses.back(),
                  one.losses.front(), one.losses.back(), std::sqrt(diff / size));
      // (bf16 products, the same rows per micro-batch: only the fp32 sums' order differs, which
      // AdamW's first steps amplify where a gradient is near zero)
      if (!shard || r == 0) test::rank_check(std::sqrt(diff / size) < 3e-2, "the weights differ from one process's", r);
      std::int64_t sum[1] = {d.weights};
      const std::int64_t mine = sum[0];
      comm.all_reduce_sum(sum);
      test::rank_check(sum[0] == mine * W, "the ranks' replicas differ", r);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", me.rank, e.what());
    return 1;
  }
  return test::rank_failures() == 0 ? 0 : 1;
}

}  // namespace

// Processes (run_ranks.sh sets torchrun's variables), or with MEGATRAIN_TEST_THREADS=N the ranks
// as N threads of this process, one GPU each (one process driving several GPUs: --gpus N).
int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  if (const char* threads = std::getenv("MEGATRAIN_TEST_THREADS")) {
    const int n = std::atoi(threads);
    if (!test::gpu_per_rank(dist::local_launch(0, n, 0))) return test::kSkipped;
    const int port = dist::free_local_port();
    const auto status = dist::run_local_ranks(n, [&](int r) { return rank_main(dist::local_launch(r, n, port)); });
    for (const int st : status)
      if (st != 0) return st;
    return 0;
  }
  const dist::LaunchInfo me = dist::launch_from_env();
  if (!test::gpu_per_rank(me)) return test::kSkipped;
  return rank_main(me);
}
