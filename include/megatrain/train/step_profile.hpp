// TrainerOptions::profile: what each stage of a step spent working (the compute executor's busy
// time, the copy engines' transfer times, the optimizer's), the bytes copied, and the compute
// stream's items in order for a timeline; read after a drain, then cleared.
#pragma once

#include <cstddef>

#include "megatrain/train/train_item.hpp"

namespace megatrain {

/// The stages' timings for the step (the pipeline's stages 0, 1 and 2, and its last: prefetch,
/// compute, offload, optimizer), then cleared.
template <class Exec, class Pipeline, std::size_t OptimizerStage>
StepStats::Profile collect_profile(Pipeline& pipeline) {
  StepStats::Profile p;
  auto& pre = pipeline.template stage<0>();
  auto& cmp = pipeline.template stage<1>();
  auto& off = pipeline.template stage<2>();
  auto& opt = pipeline.template stage<OptimizerStage>();
  p.upload_s = pre.timings.seconds();
  p.upload_bytes = pre.timings.bytes;
  p.compute_s = cmp.timings.seconds();
  for (std::size_t i = 0; i < cmp.timings.spans.size() && i < cmp.timed_items.size(); ++i) {
    const auto& [a, b] = cmp.timings.spans[i];
    p.compute_items.push_back(cmp.timed_items[i]);
    p.compute_items.back().start_s = Exec::seconds(cmp.timings.spans[0].first, a);
    p.compute_items.back().seconds = Exec::seconds(a, b);
  }
  cmp.timed_items.clear();
  p.download_s = off.timings.seconds();
  p.download_bytes = off.timings.bytes;
  p.optimizer_s = opt.timings.seconds();
  pre.timings.reset(pre.exec);
  cmp.timings.reset(cmp.exec);
  off.timings.reset(off.exec);
  opt.timings.reset(opt.exec);
  return p;
}

}  // namespace megatrain
