// Learning-rate schedules, as functions of the 1-based step.
//
//   constant:      lr(t) = lr
//   warmup_cosine: lr(t) = lr * t / warmup                                    for t <= warmup
//                  lr(t) = floor + (lr - floor) * (1 + cos(pi * p)) / 2,      p = (t - warmup) / (total - warmup)
//                  and lr(t) = floor once t >= total.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>

#include "megatrain/core/error.hpp"

namespace megatrain {

struct LrSchedule {
  enum class Kind { constant, warmup_cosine } kind = Kind::constant;
  double lr = 1e-3;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;  ///< where the cosine reaches the floor
  double min_lr = 0.0;           ///< the floor

  void validate() const {
    MT_CHECK(std::isfinite(lr) && lr >= 0, "learning rate must be finite and >= 0 (got {})", lr);
    MT_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr, "min_lr must be in [0, lr] (got {} with lr {})", min_lr, lr);
    MT_CHECK(warmup_steps >= 0, "warmup steps must be >= 0 (got {})", warmup_steps);
    if (kind == Kind::warmup_cosine)
      MT_CHECK(total_steps > warmup_steps, "cosine schedule: total steps {} must exceed warm-up steps {}", total_steps,
               warmup_steps);
  }

  double at(std::int64_t step) const {
    MT_CHECK(step >= 1, "steps count from 1 (got {})", step);
    if (kind == Kind::constant) return lr;
    if (step <= warmup_steps) return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
    if (step >= total_steps) return min_lr;
    const double p = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  }
};

}  // namespace megatrain
