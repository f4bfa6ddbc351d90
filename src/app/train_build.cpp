// The parts of megatrain-train's planning and building that do not depend on the backend
// (train_build.hpp).
#include "train_build.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace megatrain::app {

std::string model_label(const Settings& s, const RunPlan& plan) {
  return plan.resume               ? plan.resume->ckpt.dir().string()
         : !s.model_dir.empty()    ? s.model_dir
         : !s.model_config.empty() ? s.model_config
         : !s.preset.empty()       ? "--preset " + s.preset
                                   : std::string("the command-line shape");
}

plan::HostBudget rank_host_budget(const Settings& s, const Ranks& ranks) {
  plan::HostBudget budget = host_budget(s);
  // (--host-memory reaches here as MEGATRAIN_HOST_MEMORY, set by run_train; --gpus N as threads of
  // this process, as N processes on one host: --host-memory is each rank's, else each plans for its
  // share of what is available)
  if (ranks.several() && ranks.info().local_world > 1 && std::getenv("MEGATRAIN_HOST_MEMORY") == nullptr) {
    budget.bytes /= static_cast<std::size_t>(ranks.info().local_world);
    budget.source = fmt::format("available host memory / {} {} on this host", ranks.info().local_world,
                                ranks.threads() ? "ranks (--gpus)" : "processes");
  }
  return budget;
}

void check_weight_options(const Settings& s, const TrainerOptions& topt, bool bf16_weights, const char* backend_name) {
  MT_CHECK(s.share_weights != "true" || bf16_weights,
           "--share-weights true shares the bf16 weights of GPU processes; the {} backend streams none: drop it", backend_name);
  MT_CHECK(!s.origins.given_now("--gather-weights") || (bf16_weights && topt.shard_optimizer && !topt.share_host_weights),
           "--gather-weights applies where GPU processes with --shard-optimizer each keep their own bf16 copy "
           "(--share-weights false, or processes on several hosts); {}: drop it",
           !bf16_weights            ? fmt::format("the {} backend streams no bf16 weights", backend_name)
           : !topt.shard_optimizer ? std::string("--shard-optimizer is false")
                                   : std::string("this host's processes share one copy"));
}

std::string data_parallel_line(const Settings& s, const TrainerOptions& topt, const Ranks& ranks, bool bf16_weights) {
  const std::string who = ranks.threads()
                              ? fmt::format("{} GPUs driven by this process, a rank each (--gpus)", ranks.world())
                              : fmt::format("{} processes ({}), {} on this host", ranks.world(), ranks.info().launcher,
                                            std::max(1, ranks.info().local_world));
  const std::string weights =
      topt.share_host_weights
          ? fmt::format("1/{} of the bf16 weights (one copy, which this host's {} map together: --share-weights)",
                        ranks.world(), ranks.threads() ? "ranks" : "processes")
          : std::string("the bf16 weights");
  const std::string holds = !topt.shard_optimizer ? std::string("the whole train state")
                            : bf16_weights ? fmt::format("{} and 1/{} of the fp32 masters and AdamW's moments", weights,
                                                         ranks.world())
                                           : fmt::format("the fp32 masters and 1/{} of AdamW's moments", ranks.world());
  return fmt::format("data parallel: {}; each trains {} of the global batch's {} sequences, holds {}{}: the plan above is "
                     "one {} (one GPU's), this {} holds {} times its host memory",
                     who, topt.batch_rows, s.batch, holds, topt.shard_optimizer ? " (ZeRO-1; --shard-optimizer)" : "",
                     ranks.threads() ? "rank's" : "process's", ranks.threads() ? "process" : "host",
                     std::max(1, ranks.info().local_world));
}

}  // namespace megatrain::app
