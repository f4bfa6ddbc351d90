// A run folder's lock and claim (io/run_folder.hpp), metrics.jsonl without torn lines
// (io/metrics_log.hpp), and the fault hooks that make writes fail (core/fault_injection.hpp).
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "io_test_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/io/metrics_log.hpp"
#include "megatrain/io/run_folder.hpp"

using namespace megatrain;
namespace fs = std::filesystem;

namespace {

struct Faults {  // arms MEGATRAIN_FAULTS for a scope
  explicit Faults(const char* spec) { ::setenv(fault::kVariable, spec, 1); }
  ~Faults() { ::unsetenv(fault::kVariable); }
};

std::string slurp(const fs::path& p) { return fs::exists(p) ? test::read_file(p) : std::string(); }

}  // namespace

TEST_CASE("fault hooks: counts, ranges, errno names; unarmed nothing happens") {
  CHECK(fault::failure("write:metrics") == 0);
  {
    const Faults f("fail@write:metrics#2..3=ENOSPC,delay@x=5,set@host=elsewhere");
    CHECK(fault::failure("write:metrics") == 0);       // 1st
    CHECK(fault::failure("write:metrics") == ENOSPC);  // 2nd
    CHECK(fault::failure("write:metrics") == ENOSPC);  // 3rd
    CHECK(fault::failure("write:metrics") == 0);       // 4th: room again
    CHECK(fault::failure("write:export") == 0);
    CHECK(fault::delay_of("x") == 5);
    CHECK(fault::setting("host") == "elsewhere");
    CHECK(!fault::setting("other"));
  }
  {
    const Faults f("fail@write:report");  // (no errno named: EIO)
    CHECK(fault::write_failure() == 0);   // (no scope: not a report's write)
    const fault::WriteScope scope("report");
    CHECK(fault::write_failure() == EIO);
    {
      const fault::WriteScope inner("metrics");
      CHECK(fault::write_failure() == 0);
    }
    CHECK(fault::write_failure() == EIO);
  }
  CHECK(fault::failure("write:report") == 0);
}

TEST_CASE("RunLock: one holder; a second is refused naming it; a dead holder's lock is taken over") {
  const test::TempDir tmp("megatrain-run-lock");
  const fs::path& dir = tmp.path();
  io::RunLock a = io::RunLock::take(dir, "test");
  CHECK(a.held());
  CHECK(a.taken_over_from().empty());
  const auto holder = nlohmann::json::parse(slurp(dir / io::kRunLockFile));
  CHECK(holder["pid"] == static_cast<long long>(::getpid()));
  CHECK(holder["program"] == "test");
  // Another process cannot take it (flock: a lock of another open file description).
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    try {
      (void)io::RunLock::take(dir, "second");
      ::_exit(1);
    } catch (const Error& e) {
      ::_exit(e.reason().find(fmt::format("is in use by process {} on host", ::getppid())) != std::string::npos ? 0 : 2);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  a.release();
  CHECK(slurp(dir / io::kRunLockFile).empty());  // (a clean end leaves nothing to take over)
  // A holder that died: its file still names it; the next taker says so.
  const pid_t dead = ::fork();
  REQUIRE(dead >= 0);
  if (dead == 0) {
    io::RunLock mine = io::RunLock::take(dir, "dies");
    ::_exit(0);  // (no destructor: as a kill would)
  }
  ::waitpid(dead, &status, 0);
  io::RunLock b = io::RunLock::take(dir, "test");
  CHECK(b.taken_over_from().find(fmt::format("process {}", dead)) != std::string::npos);
  CHECK(b.taken_over_from().find("dies") != std::string::npos);
}

TEST_CASE("RunFolder: a run refused without --overwrite; --overwrite moves it aside, then drops or restores it") {
  const test::TempDir tmp("megatrain-run-folder");
  const fs::path& root = tmp.path();
  const fs::path run = root / "run";
  fs::create_directories(run / "checkpoints" / "step-00000003");
  std::ofstream(run / "metrics.jsonl") << "{\"step\": 1}\n";
  CHECK(io::holds_run(run));
  io::RunClaimOptions o;
  CHECK_THROWS_WITH_AS(io::RunFolder::claim(run, o), doctest::Contains("already holds a run"), Error);
  CHECK(fs::exists(run / "metrics.jsonl"));
  o.overwrite = true;
  {
    io::RunFolder f = io::RunFolder::claim(run, o);
    REQUIRE(f.replaced());
    CHECK(!io::holds_run(run));
    CHECK(fs::exists(*f.replaced() / "metrics.jsonl"));
    // (destroyed before its first step: the previous run comes back)
  }
  CHECK(slurp(run / "metrics.jsonl") == "{\"step\": 1}\n");
  CHECK(fs::is_directory(run / "checkpoints" / "step-00000003"));
  {
    io::RunFolder f = io::RunFolder::claim(run, o);
    f.mark_started();
    const fs::path gone = f.drop_replaced();
    CHECK(!gone.empty());
    CHECK(!fs::exists(gone));
  }
  CHECK(!fs::exists(run / "metrics.jsonl"));
  // Inputs inside the folder: refused before anything moves.
  std::ofstream(run / "metrics.jsonl") << "{\"step\": 1}\n";
  std::ofstream(run / "data.txt") << "text";
  o.inputs = {run / "data.txt"};
  CHECK_THROWS_WITH_AS(io::RunFolder::claim(run, o), doctest::Contains("which this run reads"), Error);
  CHECK(fs::exists(run / "data.txt"));
  // A file is no folder; a fresh folder refused before its first step leaves nothing.
  std::ofstream(root / "file") << "x";
  CHECK_THROWS_WITH_AS(io::RunFolder::claim(root / "file", {}), doctest::Contains("is a file, not a folder"), Error);
  { io::RunFolder f = io::RunFolder::claim(root / "new", {}); }
  CHECK(!fs::exists(root / "new"));
  // claim_new: a folder of its own even where two runs start in the same second.
  io::RunFolder n1 = io::RunFolder::claim_new(root / "runs", {});
  io::RunFolder n2 = io::RunFolder::claim_new(root / "runs", {});
  CHECK(n1.path() != n2.path());
  CHECK(n2.path().filename().string().ends_with("-2"));
}

TEST_CASE("MetricsLog: a failed write leaves no torn line, the line pending; written first once there is room") {
  const test::TempDir tmp("megatrain-metrics-log");
  const fs::path file = tmp / "metrics.jsonl";
  {
    io::MetricsLog m(file, -1);
    CHECK(m.append(R"({"step": 1})").empty());
    {
      const Faults f("fail@write:metrics#1..2=ENOSPC");
      const std::string e = m.append(R"({"step": 2})");
      CHECK(e.find("No space left on device") != std::string::npos);
      CHECK(e.find(file.string()) != std::string::npos);
      CHECK(!m.append(R"({"step": 3})").empty());
      CHECK(m.pending().size() == 2);
      CHECK(slurp(file) == "{\"step\": 1}\n");
      CHECK(m.append(R"({"step": 4})").empty());  // (the 3rd write: room again, the pending ones first)
    }
    CHECK(m.pending().empty());
  }
  CHECK(slurp(file) == "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3}\n{\"step\": 4}\n");
  // A resumed run keeps the steps through its checkpoint; a torn line is dropped.
  std::ofstream(file, std::ios::app) << "{\"step\": 5, \"lo";
  io::MetricsLog r(file, 3);
  CHECK(r.kept_through() == 3);
  CHECK(slurp(file) == "{\"step\": 1}\n{\"step\": 2}\n{\"step\": 3}\n");
  CHECK(io::metrics_step(R"({"step": 7, "loss": 1})") == 7);
  CHECK(io::metrics_step("not json") == -1);
}
