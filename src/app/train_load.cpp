// The resume's layout changes (train_load.hpp): what makes a continuation not bit for bit the
// uninterrupted run.
#include "train_load.hpp"

#include <fmt/format.h>

namespace megatrain::app {

std::vector<std::string> layout_changes(const TrainerOptions& now, const TrainState& st, const char* backend_name,
                                        int world) {
  std::vector<std::string> layout;
  const std::string was_backend = st.user.value("backend", "");
  if (!was_backend.empty() && was_backend != backend_name)
    layout.push_back(fmt::format("backend {} (checkpoint: {})", backend_name, was_backend));
  const std::int64_t was_processes = st.user.value("processes", std::int64_t{1});
  if (was_processes != world) layout.push_back(fmt::format("{} process(es) (checkpoint: {})", world, was_processes));
  // (the global batch's passes: each process's times the processes, as the train state records them)
  if (now.micro_batches * world != st.options.micro_batches)
    layout.push_back(fmt::format("{} micro-batches (checkpoint: {})", now.micro_batches * world, st.options.micro_batches));
  if (now.chunk_rows != st.options.chunk_rows)
    layout.push_back(fmt::format("--chunk {} (checkpoint: {})", now.chunk_rows, st.options.chunk_rows));
  // (placement changes no bit, except the order of a sum: stale clipping's norm, and micro-batches
  // added up in host memory instead of on the GPU or the other way round)
  const bool stale = now.clip_norm > 0 && now.clip_mode == ClipMode::stale;
  const char* const home_now = now.gradient_home == GradientHome::host ? "host" : "GPU";
  const char* const home_was = st.options.gradient_home == GradientHome::host ? "host" : "GPU";
  if (stale && now.device_units != st.options.device_units)
    layout.push_back(fmt::format("AdamW on the GPU for {} units (checkpoint: {}) with stale clipping", now.device_units,
                                 st.options.device_units));
  if (now.micro_batches > 1 && now.gradient_home != st.options.gradient_home)
    layout.push_back(fmt::format("micro-batches added up in {} memory (checkpoint: {})", home_now, home_was));
  // (in host memory, a device unit's micro-batches still add up on the GPU: measured on an H200,
  // another count of them changes the norm's last bits)
  else if (now.micro_batches > 1 && now.gradient_home == GradientHome::host && now.device_units != st.options.device_units)
    layout.push_back(fmt::format("AdamW on the GPU for {} units (checkpoint: {}) with micro-batches added up in host "
                                 "memory", now.device_units, st.options.device_units));
  return layout;
}

}  // namespace megatrain::app
