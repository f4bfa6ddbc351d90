// Learning-rate schedules, as functions of the 1-based step t.
//
// Every kind warms up linearly over the first `warmup_steps` steps (none when 0):
//   lr(t) = lr * t / warmup                                              for t <= warmup
// then
//   constant:      lr(t) = lr
//   warmup_cosine: lr(t) = floor + (lr - floor) * (1 + cos(pi * p)) / 2,    p = (t - warmup) / (total - warmup)
//   warmup_linear: lr(t) = floor + (lr - floor) * (1 - p)
// and the decaying kinds stay at the floor once t >= total.
//
// (Hugging Face's get_*_schedule_with_warmup count steps from 0, so their first step trains at
// lr 0 when warming up; here the first step trains at lr / warmup and step `warmup` at lr.)
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>

#include "megatrain/core/error.hpp"

namespace megatrain {

struct LrSchedule {
  enum class Kind { constant, warmup_cosine, warmup_linear } kind = Kind::constant;
  double lr = 1e-3;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;  ///< where a decaying schedule reaches the floor
  double min_lr = 0.0;           ///< the floor (decaying kinds)

  bool decays() const { return kind != Kind::constant; }

  /// "constant", "warmup_cosine" or "warmup_linear" (the names train states record).
  static const char* name(Kind k) {
    switch (k) {
      case Kind::constant: return "constant";
      case Kind::warmup_cosine: return "warmup_cosine";
      case Kind::warmup_linear: return "warmup_linear";
    }
    return "?";
  }
  /// The kind `name()` gave `s`; throws megatrain::Error naming `what` otherwise.
  static Kind kind_named(std::string_view s, std::string_view what) {
    for (Kind k : {Kind::constant, Kind::warmup_cosine, Kind::warmup_linear})
      if (s == name(k)) return k;
    MT_FAIL("{}: schedule kind '{}' is unknown (known: constant, warmup_cosine, warmup_linear)", what, s);
  }

  void validate() const {
    MT_CHECK(std::isfinite(lr) && lr >= 0, "learning rate must be finite and >= 0 (got {})", lr);
    MT_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr, "min_lr must be in [0, lr] (got {} with lr {})", min_lr, lr);
    MT_CHECK(warmup_steps >= 0, "warmup steps must be >= 0 (got {})", warmup_steps);
    if (decays())
      MT_CHECK(total_steps > warmup_steps, "{} schedule: total steps {} must exceed warm-up steps {}", name(kind), total_steps,
               warmup_steps);
  }

  double at(std::int64_t step) const {
    MT_CHECK(step >= 1, "steps count from 1 (got {})", step);
    if (step <= warmup_steps) return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
    if (kind == Kind::constant) return lr;
    if (step >= total_steps) return min_lr;
    const double p = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    const double f = kind == Kind::warmup_cosine ? 0.5 * (1.0 + std::cos(std::numbers::pi * p)) : 1.0 - p;
    return min_lr + (lr - min_lr) * f;
  }
};

}  // namespace megatrain
