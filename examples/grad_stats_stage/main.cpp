// A user-defined pipeline stage: per-unit gradient statistics.
//
// The trainer's pipeline is prefetch -> compute -> offload -> [your stages] -> optimizer. A stage
// placed after offload sees each unit's gradient the moment it has landed in host memory, before
// the optimizer consumes it, on a thread of its own, without slowing the others down (the
// pipeline orders it; it never waits by hand). This one records the norm and the largest
// magnitude of every unit's gradient and prints them per step.
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;

/// Records (norm, max |g|) per unit per step.
class GradStatsStage {
 public:
  struct Record {
    double sumsq = 0, max_abs = 0;  // the norm is sqrt(sumsq)
  };
  struct Log {
    std::mutex m;
    std::map<std::int64_t, std::map<std::string, Record>> steps;
  };

  explicit GradStatsStage(GradientView view) : view_(std::move(view)) {}

  // The Stage concept (megatrain/pipeline/stream_pipeline.hpp):
  HostExecutor& executor() { return exec_; }  // a host thread of its own
  bool applies(const TrainItem& it) const { return it.carries_gradient(); }  // items that land a gradient
  std::size_t ring_slots() const { return 0; }                  // writes no buffer of its own
  UnitAccess unit_access() const { return UnitAccess::none; }   // does not touch the weights
  // A unit's gradient may land in several pieces (view_.placement(it) says which elements):
  // the embedding's rows and a large head come in parts. Accumulate over them.
  void run(const TrainItem& it, const StageSlots& slots) {
    const std::span<const float> g = view_.gradient(it, slots);
    double sumsq = 0, max_abs = 0;
    for (float x : g) {
      sumsq += static_cast<double>(x) * x;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
    }
    std::lock_guard lock(log->m);
    Record& r = log->steps[view_.step()][view_.unit_name(it.unit)];
    r.sumsq += sumsq;
    r.max_abs = std::max(r.max_abs, max_abs);
  }

  static inline std::shared_ptr<Log> log = std::make_shared<Log>();

 private:
  GradientView view_;
  HostExecutor exec_;
};

int main() {
  const ModelConfig cfg = ModelConfig::from_json(
      nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 176}, {"num_hidden_layers", 3},
       {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"vocab_size", 256}, {"tie_word_embeddings", true}},
      "example");
  TrainerOptions opt;
  opt.batch_rows = 4;
  opt.seq_len = 64;
  opt.adamw.lr = 3e-3;
  opt.schedule.lr = 3e-3;
  DatasetOptions dopt;
  dopt.vocab_size = 256;
  dopt.seq_len = opt.seq_len;
  TokenDataset data(TokenSource::from_text(builtin_text(1 << 18), "built-in text"), dopt);

  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = 1;
  HostParamStore<float> store(model.units(), Trainer<CpuBackend<float>>::store_options(opt, so));
  CpuBackend<float> be;
  // The stage goes in the trainer's type: it is constructed with a GradientView.
  Trainer<CpuBackend<float>, DecoderBlock, GradStatsStage> trainer(model, store, be, opt);

  std::vector<std::int32_t> ids(static_cast<std::size_t>(opt.batch_rows * opt.seq_len)), labels(ids.size());
  for (std::int64_t step = 1; step <= 5; ++step) {
    data.train_batch((step - 1) * opt.batch_rows, opt.batch_rows, ids, labels);
    const StepStats s = trainer.step(ids, labels);
    std::printf("step %lld  loss %.4f  global grad norm %.4f\n", static_cast<long long>(s.step), s.loss, s.grad_norm);
    std::lock_guard lock(GradStatsStage::log->m);
    double total = 0;
    for (const auto& [unit, r] : GradStatsStage::log->steps[s.step]) {
      std::printf("    %-10s norm %9.5f  max |g| %9.6f\n", unit.c_str(), std::sqrt(r.sumsq), r.max_abs);
      total += r.sumsq;
    }
    // The stage saw every unit's whole gradient: its norms make up the trainer's global norm.
    const std::size_t seen = GradStatsStage::log->steps[s.step].size();
    if (seen != store.num_units() || std::fabs(std::sqrt(total) - s.grad_norm) > 1e-6 * s.grad_norm) {
      std::fprintf(stderr, "step %lld: the stage saw %zu of %zu units, norm %.9g against the trainer's %.9g\n",
                   static_cast<long long>(s.step), seen, store.num_units(), std::sqrt(total), s.grad_norm);
      return 1;
    }
  }
  return 0;
}
