// The closing line of a run a stop signal ended (train_loop.hpp).
#include "train_loop.hpp"

#include <fmt/format.h>

namespace megatrain::app {

std::string stopped_line(const char* name, std::int64_t done, std::int64_t steps, std::int64_t saved_step,
                         const std::string& saved_path, const std::filesystem::path& out) {
  std::string what;
  if (done == 0) what = "no step had finished: nothing to save";
  else if (saved_step == done) what = fmt::format("checkpoint {}. Resume with: megatrain-train --resume --out {}", saved_path, out.string());
  else
    what = fmt::format("its checkpoint could not be written (see above){}",
                       saved_step > 0 ? fmt::format("; the newest complete one is step {}", saved_step) : std::string());
  return fmt::format("megatrain-train: stopped by {} after step {} of {}; {}", name, done, steps, what);
}

}  // namespace megatrain::app
