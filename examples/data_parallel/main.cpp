// Data parallel training over several processes (docs/distributed.md), on the CPU backend over MPI:
//
//     mpirun --bind-to none -np 2 ./build/release/examples/example-data-parallel
//
// Every process builds the same model (the same seed), takes its share of each global batch (here
// a repeating pattern of tokens, which a small model learns in a few dozen steps), and trains with
// TrainerOptions::comm: the gradients are summed over the processes before exact clipping and
// AdamW, so every process holds the same weights after every step; with shard_optimizer (ZeRO-1)
// each process keeps AdamW's moments of its part of the model only. Rank 0 prints the global
// batch's loss; the program fails if the loss did not fall by half. On GPUs, use
// dist::NcclHostComm and a CudaBackend on the process's GPU instead (distributed.md).
#include <cstdio>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/dist/mpi.hpp"
#include "megatrain/train/trainer.hpp"

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
    }
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
