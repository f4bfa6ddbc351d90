// Fault injection for tests: one facility, armed by one environment variable.
//
// Production code marks the places where the world can fail it (a write, a pin, a crash between
// two renames) with a named point; tests arm a point to make it fail there as the world would.
// Unarmed (the variable unset: every user's run), a point costs one getenv.
//
//   MEGATRAIN_FAULTS="ACTION@POINT[#N][=VALUE],..."
//
//   crash@write:tensor#2        SIGKILL the process the 2nd time it reaches write:tensor
//   delay@train:step=150000     sleep 150,000 microseconds at each train:step
//   fail@write:metrics=ENOSPC   writes under the metrics scope fail with ENOSPC (a full disk)
//   fail@write:export#3=ENOSPC  the same from the 3rd write of an export on
//   fail@write:metrics#4..6     the 4th to the 6th metrics writes fail (then there is room again)
//   fail@pin                    every attempt to page-lock host memory fails
//   set@host=other              a setting a test reads (here: claim to run on another host)
//
// `#N` counts the times the point is reached, from 1: the action applies from the N-th on (a
// crash happens once); `#N..M` from the N-th to the M-th. The variable is read at each point, so a test may change it between
// cases; a new value starts the counts again. docs/reliability.md lists every point.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace megatrain::fault {

/// The environment variable that arms the points.
inline constexpr const char* kVariable = "MEGATRAIN_FAULTS";

/// Kills the process with SIGKILL where `crash@point` is armed (a power cut, an OOM kill).
void crash_point(std::string_view point);

/// Sleeps where `delay@point=MICROSECONDS` is armed (a slow disk, a slow step).
void delay_point(std::string_view point);

/// The delay armed for `point`, in microseconds, counted as a hit (0: none); for places that
/// hold work back on a stream rather than sleep.
std::int64_t delay_of(std::string_view point);

/// The errno a failure armed at `point` gives (`fail@point=ENOSPC`; EIO without a value), 0
/// where none is armed.
int failure(std::string_view point);

/// The value of `set@name=VALUE`, where one is armed.
std::optional<std::string> setting(std::string_view name);

/// Names the writes of this thread for `fail@write:SCOPE` while it lives ("metrics",
/// "export", "checkpoint", "report"); scopes nest, the innermost wins.
class WriteScope {
 public:
  explicit WriteScope(const char* scope);
  ~WriteScope();
  WriteScope(const WriteScope&) = delete;
  WriteScope& operator=(const WriteScope&) = delete;

 private:
  const char* previous_;
};

/// The errno that a write of this thread fails with (`fail@write:SCOPE`), 0 where none is armed.
int write_failure();

}  // namespace megatrain::fault
