// megatrain-train's progress: one line that redraws itself on a terminal, plain lines otherwise;
// and the lines of its own (a save, a warning) that the next update does not overwrite.
#pragma once

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "megatrain/train/train_item.hpp"

namespace megatrain::app {

// One line that redraws itself on a terminal; plain lines otherwise.
class Progress {
 public:
  /// Prints to `out` (the first rank's stdout; the others' /dev/null).
  Progress(std::int64_t first_step, std::int64_t steps, std::FILE* out)
      : first_(first_step), steps_(steps), out_(out), tty_(out == stdout && isatty(STDOUT_FILENO) != 0) {}
  /// What the validation figure is called ("val_loss" unless told).
  void name_validation(std::string name) { val_name_ = std::move(name); }
  /// Words after the loss on each line (a GRPO run's mean reward), until changed.
  void set_extra(std::string words) { extra_ = std::move(words); }
  void update(const StepStats& s, double tok_per_s, double elapsed, std::optional<double> val, std::int64_t log_every) {
    const double eta = elapsed / static_cast<double>(s.step - first_ + 1) * static_cast<double>(steps_ - s.step);
    if (tty_) {
      const int width = 24;
      const int filled = static_cast<int>(width * s.step / steps_);
      std::string bar(static_cast<std::size_t>(filled), '=');
      if (filled < width) bar += '>';
      bar.resize(width, ' ');
      std::fprintf(out_, "\r\033[Kstep %lld/%lld [%s] loss %.4f%s | %.0f tok/s | ETA %s%s", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), bar.c_str(), s.loss, extra_.c_str(), tok_per_s, clock(eta).c_str(),
                   val ? fmt::format(" | val {:.4f}", *val).c_str() : "");
      if (s.step == steps_ || val) std::fputc('\n', out_);
      std::fflush(out_);
    } else if (s.step % log_every == 0 || s.step == steps_ || val || s.skipped) {
      std::fprintf(out_, "step %lld/%lld loss %.4f%s lr %.3g grad_norm %.3f tok/s %.0f%s%s%s\n", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), s.loss, extra_.c_str(), s.lr, s.grad_norm, tok_per_s,
                   val ? fmt::format(" {} {:.4f}", val_name_, *val).c_str() : "", experts(s).c_str(),
                   s.skipped ? " (skipped: not finite)" : "");
      std::fflush(out_);
    }
  }
  /// A mixture of experts: the auxiliary loss and the least and most loaded expert of any layer.
  static std::string experts(const StepStats& s) {
    if (s.expert_load.empty()) return {};
    std::int64_t lo = s.expert_load[0].min, hi = s.expert_load[0].max;
    for (const auto& l : s.expert_load) lo = std::min(lo, l.min), hi = std::max(hi, l.max);
    return fmt::format(" aux_loss {:.4f} tokens/expert {}..{}", s.aux_loss, lo, hi);
  }
  /// A line of its own (a save, a warning), not overwritten by the next update.
  void note(const std::string& line, FILE* to = nullptr) {
    if (tty_) std::fputs("\r\033[K", out_);
    std::fflush(out_);
    if (to == nullptr) to = out_;
    std::fprintf(to, "%s\n", line.c_str());
    std::fflush(to);
  }

 private:
  static std::string clock(double secs) {
    const auto t = static_cast<long long>(std::max(0.0, secs));
    return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  }
  std::int64_t first_, steps_;
  std::FILE* out_;
  bool tty_;
  std::string val_name_ = "val_loss", extra_;
};

}  // namespace megatrain::app
