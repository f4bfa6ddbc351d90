// Data parallel training over several processes (docs/distributed.md), on the CPU backend over MPI:
//
//     mpirun --bind-to none -np 2 ./build/release/examples/example-data-parallel
//
// Every process builds the same model (the same seed), takes its share of each global batch (here
// a repeating pattern of tokens, which a small model learns in a few dozen steps), and trains with
// TrainerOptions::comm: the gradients are summed over the processes before exact clipping and
// AdamW, so every process holds the same weights after every step; with shard_optimizer (ZeRO-1)
// each process keeps AdamW's moments of its part of the model only. Rank 0 prints the global
// batch's loss; the program fails if the loss did not fall by half. Checkpoints: every process
// writes its part of each one (a Checkpointer given the communicator, saving after steps 20 and
// 40 while the next steps train); at the end each process loads the last one into a fresh store
// and checks that it holds the trained weights, bit for bit. On GPUs, use dist::NcclHostComm and
// a CudaBackend on the process's GPU instead (distributed.md).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/dist/mpi.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;

int main() {
  try {
    dist::MpiComm comm;
    const std::int64_t global_rows = 8, seq = 32, vocab = 64;
    if (global_rows % comm.world() != 0) {
      std::fprintf(stderr, "run it on a number of processes that divides %lld\n", static_cast<long long>(global_rows));
      return 2;
    }
    const auto cfg = ModelConfig::from_json(nlohmann::json{
        {"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 160},
        {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", vocab}});
    TrainerOptions o;
    o.batch_rows = global_rows / comm.world();  // this process's share
    o.seq_len = seq;
    o.clip_norm = 1.0;                          // exact clipping: the whole gradient held for the step
                                                // (in backend memory, summed there as it is completed)
    o.adamw.lr = 3e-3;
    o.comm = &comm;
    o.shard_optimizer = true;                   // ZeRO-1: each process keeps and steps 1/N of AdamW's state
    DecoderModel<> model(cfg);
    StoreOptions so;
    so.seed = 1;  // the same initial weights on every process
    HostParamStore<float> store(model.units(), Trainer<CpuBackend<float>>::store_options(o, so));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    // Checkpoints into one folder (rank 0's process id names it), every process writing its part;
    // save, poll and wait are called by every process at the same steps.
    std::int64_t pid[1] = {comm.rank() == 0 ? static_cast<std::int64_t>(::getpid()) : 0};
    comm.all_reduce_sum(pid);
    const auto folder = std::filesystem::temp_directory_path() / ("megatrain-data-parallel-" + std::to_string(pid[0]));
    CheckpointerOptions co;
    co.comm = &comm;
    std::optional<Checkpointer> checkpoints(std::in_place, folder, co);
    const auto report = [&](const std::vector<SaveResult>& done) {
      for (const SaveResult& r : done) {
        if (!r.ok) throw std::runtime_error("the checkpoint of step " + std::to_string(r.step) + " failed: " + r.error);
        if (comm.rank() == 0) std::printf("saved step %lld (every process its part) to %s\n", static_cast<long long>(r.step), r.dir.c_str());
      }
    };

    double first = 0, last = 0;
    for (int step = 1; step <= 40; ++step) {
      // The global batch: row r starts the pattern at an offset; this process takes its rows.
      std::vector<std::int32_t> ids, labels;
      for (std::int64_t r = comm.rank() * o.batch_rows; r < (comm.rank() + 1) * o.batch_rows; ++r)
        for (std::int64_t t = 0; t < seq; ++t) {
          ids.push_back(static_cast<std::int32_t>((3 * (r + step) + 5 * t) % vocab));
          labels.push_back(static_cast<std::int32_t>((3 * (r + step) + 5 * (t + 1)) % vocab));
        }
      const StepStats s = trainer.step(ids, labels);
      if (step == 1) first = s.loss;
      last = s.loss;
      if (comm.rank() == 0 && (step == 1 || step % 10 == 0))
        std::printf("step %2d: loss %.4f, gradient norm %.3f, %lld tokens over %d processes\n", step, s.loss,
                    s.grad_norm, static_cast<long long>(s.tokens), comm.world());
      report(checkpoints->poll());
      if (step % 20 == 0) checkpoints->save(trainer, store);
    }
    report(checkpoints->wait());
    checkpoints.reset();
    // Resumed: a fresh store and trainer on every process load the last checkpoint (each its part).
    HostParamStore<float> again(model.units(), Trainer<CpuBackend<float>>::store_options(o, so));
    Trainer<CpuBackend<float>> resumed(model, again, be, o);
    const TrainState st = load_train_state(io::CheckpointFolder(folder).path_for(40), resumed, again);
    for (std::size_t u = 0; u < store.num_units(); ++u)
      if (std::memcmp(store.unit(u).master().data(), again.unit(u).master().data(), store.unit(u).master().size_bytes()) != 0) {
        std::fprintf(stderr, "rank %d: unit %zu loaded from the checkpoint differs from the trained one\n", comm.rank(), u);
        return 1;
      }
    if (comm.rank() == 0) std::printf("resumed from step %lld: the trained weights, bit for bit\n", static_cast<long long>(st.step));
    comm.all_reduce_sum(pid);  // (every process has loaded it before the first removes it)
    if (comm.rank() == 0) std::filesystem::remove_all(folder);
    if (last > 0.5 * first) {
      std::fprintf(stderr, "rank %d: the loss fell from %.4f to %.4f only\n", comm.rank(), first, last);
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example-data-parallel: %s\n", e.what());
    return 1;
  }
}
