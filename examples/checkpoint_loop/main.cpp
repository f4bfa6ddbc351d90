// example-checkpoint-loop: your own training loop, saved and resumed with the library.
//
// Trains a small Llama-shaped model for 6 steps on the built-in text and saves the whole train
// state after step 3 with a Checkpointer: the save is written while steps 4 to 6 train. Then, as
// a new process would, it builds a fresh store (initialised from another seed) and trainer,
// loads the newest checkpoint with load_train_state, and trains steps 4 to 6 again, reading the
// data from the position the checkpoint recorded. The resumed steps must give the same losses,
// and end with the same master weights and Adam moments, bit for bit, as the run that went
// straight through; the program exits with status 1 otherwise. See docs/checkpointing.md.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;
namespace fs = std::filesystem;
using CpuTrainer = Trainer<CpuBackend<float>>;

namespace {

// What a training process builds at its start: the model, its state in host memory, a trainer.
struct Session {
  DecoderModel<> model;
  HostParamStore<float> store;
  CpuBackend<float> backend;
  CpuTrainer trainer;
  Session(const ModelConfig& cfg, const TrainerOptions& opt, std::uint64_t init_seed)
      : model(cfg), store(model.units(), CpuTrainer::store_options(opt, seeded(init_seed))), trainer(model, store, backend, opt) {}
  static StoreOptions seeded(std::uint64_t seed) {
    StoreOptions so;
    so.seed = seed;
    return so;
  }

  // One optimizer step on the batch that starts `first_window` windows into the shuffled order.
  StepStats step(const TokenDataset& data, std::int64_t first_window) {
    const TrainerOptions& o = trainer.options();
    std::vector<std::int32_t> ids(static_cast<std::size_t>(o.batch_rows * o.seq_len)), labels(ids.size());
    data.train_batch(first_window, o.batch_rows, ids, labels);
    return trainer.step(ids, labels);
  }

  // Every master weight and both Adam moments, unit after unit.
  std::vector<float> state() {
    trainer.finish_update();  // (the last step's AdamW pass may still run in the background)
    std::vector<float> out;
    for (const auto& u : store.units())
      for (auto s : {u.master(), u.adam_m(), u.adam_v()}) out.insert(out.end(), s.begin(), s.end());
    return out;
  }
};

// A finished save, as poll() and wait() hand it back. (A loop that can go on without it would warn
// and carry on: a failed save leaves the previous checkpoint as it was.)
void report(const SaveResult& r) {
  if (!r.ok) throw std::runtime_error("the save of step " + std::to_string(r.step) + " failed: " + r.error);
  std::printf("saved step %lld to %s (%llu bytes; training waited %.3f s for it)\n", static_cast<long long>(r.step),
              r.dir.string().c_str(), static_cast<unsigned long long>(r.bytes), r.stall_seconds);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

int main() try {
  const ModelConfig cfg = ModelConfig::from_json(
      nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 160},
                     {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                     {"vocab_size", 256}, {"tie_word_embeddings", true}},
      "example");
  TrainerOptions opt;
  opt.batch_rows = 4;
  opt.seq_len = 32;
  opt.adamw = {3e-3, 0.9, 0.95, 1e-8, 0.1};
  opt.schedule = {LrSchedule::Kind::warmup_cosine, 3e-3, 2, 6, 3e-4};  // warm-up 2 steps, cosine to step 6
  opt.clip_norm = 1.0;                                                  // exact clipping (PyTorch's)
  DatasetOptions dopt;
  dopt.vocab_size = cfg.vocab_size;
  dopt.seq_len = opt.seq_len;
  dopt.seed = 42;  // the shuffle of the training windows
  const TokenDataset data(TokenSource::from_text(builtin_text(1 << 18), "built-in text"), dopt);
  const fs::path folder = fs::temp_directory_path() / ("megatrain-checkpoint-loop-" + std::to_string(::getpid()));

  // ---- the run that goes straight through, saving after step 3 --------------------------------
  std::vector<StepStats> straight;
  std::vector<float> straight_final;
  {
    Session run(cfg, opt, /*init_seed=*/1);
    Checkpointer checkpoints(folder, {});  // keep 2, overlapped with the next steps
    for (std::int64_t step = 1; step <= 6; ++step) {
      straight.push_back(run.step(data, (step - 1) * opt.batch_rows));
      std::printf("step %lld  loss %.6f\n", static_cast<long long>(step), straight.back().loss);
      if (step == 3)  // where the next step's data starts, and fields of our own for train_state.json
        checkpoints.save(run.trainer, run.store, data.position(step * opt.batch_rows), {{"example", "checkpoint_loop"}});
      for (const SaveResult& r : checkpoints.poll()) report(r);  // saves that finished meanwhile
    }
    for (const SaveResult& r : checkpoints.wait()) report(r);  // a save still being written ends here
    straight_final = run.state();
  }

  // ---- a fresh process: load the newest checkpoint and continue to step 6 -----------------------
  Session resumed(cfg, opt, /*init_seed=*/999);  // another initialisation: everything must come from the file
  const std::optional<fs::path> latest = io::CheckpointFolder(folder).latest();  // `latest`, or the highest step
  if (!latest) throw std::runtime_error("no checkpoint in " + folder.string());
  const fs::path& dir = *latest;
  const TrainState st = load_train_state(dir, resumed.trainer, resumed.store);  // checks every file's checksum
  // The data order is the caller's: continue it only if it is the one the checkpoint was saved with.
  if (!st.data || st.data->seed != dopt.seed || st.data->windows_per_epoch != data.train_windows())
    throw std::runtime_error("the checkpoint was saved with another data order");
  std::printf("resumed from %s: step %lld, next window %lld, user fields %s\n", dir.string().c_str(),
              static_cast<long long>(st.step), static_cast<long long>(st.data->windows_consumed()), st.user.dump().c_str());
  bool same = true;
  std::int64_t window = st.data->windows_consumed();
  for (std::int64_t step = st.step + 1; step <= 6; ++step, window += opt.batch_rows) {
    const StepStats s = resumed.step(data, window);
    const StepStats& want = straight[static_cast<std::size_t>(step - 1)];
    const bool ok = s.step == want.step && same_bits(s.loss, want.loss) && same_bits(s.grad_norm, want.grad_norm);
    std::printf("step %lld  loss %.6f  %s\n", static_cast<long long>(step), s.loss, ok ? "(same bits)" : "DIFFERS");
    same = same && ok;
  }
  const std::vector<float> resumed_final = resumed.state();
  const bool same_state = resumed_final.size() == straight_final.size() &&
                          std::memcmp(resumed_final.data(), straight_final.data(), resumed_final.size() * sizeof(float)) == 0;
  std::printf("final master weights and Adam moments (%zu floats): %s\n", resumed_final.size(),
              same_state ? "the same bits as the uninterrupted run" : "DIFFER from the uninterrupted run");
  fs::remove_all(folder);
  return same && same_state ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "example-checkpoint-loop: %s\n", e.what());
  return 1;
}
