// megatrain-train's main (programs.hpp): the command line parsed (a resume takes over its
// checkpoint's options first), then one rank's run (train_setup.hpp) in this process, or --gpus N
// ranks (threads of this process, or processes it starts), each failure said once and named.
#include <signal.h>

#include <fmt/format.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "gpus.hpp"
#include "options.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/io/run_folder.hpp"
#include "parse.hpp"
#include "programs.hpp"
#include "ranks.hpp"
#include "resume.hpp"
#include "stop_signals.hpp"
#include "train_setup.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;

namespace {

// Who this thread's warnings come from ("megatrain-train (rank 1 of 2)"; empty: the program's),
// and this process's (one of several processes: every thread's, a trainer's stages too).
thread_local std::string t_who;
std::string g_who;
// --gpus N: the rank whose failure made this process abort the others' communicators (-1: none).
std::atomic<int> g_failed_rank{-1};
// --gpus N on GPUs: aborts every running rank's communicator (set by run_gpu_ranks; empty otherwise).
std::function<void()> g_abort_others;

// Resuming: the checkpoint's run options come first, under the config file and the command line.
// With --steps 0 (evaluate or export) only the data options are taken over. Parses `p` again.
void take_over_checkpoint(Parsed& p, RunPlan& plan, const std::vector<std::string>& args) {
  const Settings& first = *p.settings;
  Resume r = open_resume(first);
  const fs::path dir = r.ckpt.dir();
  StopSignals::check("while opening the checkpoint");
  const bool eval_only = first.origins.given("--steps") && first.steps == 0;
  const std::set<std::string> data_only{"--data",      "--data-format", "--val-data",       "--val-fraction",
                                        "--batch",     "--seq",         "--seed",           "--train-on",
                                        "--tokenizer", "--chat-format", "--skip-bad-lines", "--pack"};
  std::string out = first.out;
  if (out.empty() && dir.parent_path().filename() == "checkpoints") out = dir.parent_path().parent_path().string();
  MT_CHECK(!out.empty() || eval_only, "--resume '{}': give --out (the run folder to continue in)", dir.string());
  // A branch (a run folder of its own) is another run: it does not export into the folder of the
  // run it came from unless told to.
  const bool branch = !eval_only && !continues_run(dir, out);
  const std::set<std::string> export_options{"--export", "--export-every", "--export-dtype", "--shard-size",
                                             "--export-language-model"};
  std::vector<std::string> before =
      replay_args(r.given, eval_only ? data_only : std::set<std::string>{}, branch ? export_options : std::set<std::string>{});
  if (!out.empty() && first.out.empty()) before.insert(before.end(), {"--out", out});
  if (branch && r.given.contains("--export") && !first.origins.given_now("--export"))
    plan.notes.push_back(fmt::format("note: this run branches from '{}' into '{}': the export of the run it comes from "
                                     "('{}') is not taken over; give --export to export this one", dir.string(), out,
                                     r.given["--export"].get<std::string>()));
  if (!branch) plan.run_id = r.state.user.value("run_id", plan.run_id);
  plan.branch = branch;
  p = Parsed{};
  parse(p, args, before);
  plan.resume = std::move(r);
}

// A rank failed: said (once, where the ranks are threads of this process), the others told.
int rank_failed(Ranks& ranks, const char* error) {
  const std::string who = ranks.several() ? fmt::format(" ({} {} of {})", ranks.noun(), ranks.rank(), ranks.world()) : "";
  // (--gpus N: the first rank to fail is the one the others name; once training has started, a
  // rank stopped because another failed says that, not what its aborted collective said)
  int failed = -1;  // (after the exchange: the rank that failed first, where another did)
  const bool first = !ranks.threads() || g_failed_rank.compare_exchange_strong(failed, ranks.rank());
  const std::string stopped = fmt::format("stopped: rank {} of {} failed (its message says why)", failed, ranks.world());
  const char* what = !first && ranks.started() && !std::getenv("MEGATRAIN_DEBUG") ? stopped.c_str() : error;
  // (ranks that are threads of this process print a message once, not once a rank: the same
  // command fails every rank alike)
  static std::mutex printed_mutex;
  static std::set<std::string> printed;
  {
    const std::lock_guard lock(printed_mutex);
    if (!ranks.threads() || printed.insert(what).second) std::fprintf(stderr, "megatrain-train%s: error: %s\n", who.c_str(), what);
    std::fflush(stderr);
  }
  ranks.fail(1);  // (the others are told: every rank stops)
  // (--gpus N, training: the other ranks' communicators aborted now, not once this rank has cleaned
  // up, so that they stop at once instead of waiting in a collective for it)
  if (first && ranks.threads() && ranks.started() && g_abort_others) g_abort_others();
  return 1;
}

// One rank: this process's place in the run, its messages, its training. `join` makes `ranks`
// join the run (a launcher's processes) or gives it (a thread of --gpus N).
int rank_main(const Parsed& p, Ranks& ranks, const std::function<void(Ranks&)>& join, RunPlan plan) {
  try {
    join(ranks);
    t_who = ranks.several() ? fmt::format("megatrain-train ({} {} of {})", ranks.noun(), ranks.rank(), ranks.world())
                            : std::string();
    return run_train(*p.settings, *p.app, std::move(plan), ranks);
  } catch (const StoppedBeforeTraining& e) {  // (as asked: no error; every rank stops alike)
    if (ranks.lead()) std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
    return 128 + e.signal();
  } catch (const megatrain::Error& e) {
    // What went wrong and what to do, in the user's terms (the library's function and source line
    // are in e.what(), for a bug report: MEGATRAIN_DEBUG=1 prints them).
    return rank_failed(ranks, std::getenv("MEGATRAIN_DEBUG") ? e.what() : e.reason().c_str());
  } catch (const std::exception& e) {
    return rank_failed(ranks, e.what());
  }
}

// --gpus N: this process drives N GPUs, a rank (thread) each, as N processes would
// (docs/distributed.md#one-process-several-gpus); the first rank alone prints and writes the run
// folder. Where one fails, the others' communicators are aborted at once.
int run_gpu_ranks(const Parsed& p, const RunPlan& plan, int gpus, bool use_cuda) {
  const Settings& s = *p.settings;
  if (!s.host_memory.empty()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);  // (before the threads)
  if (use_cuda && std::getenv("NCCL_NVLS_ENABLE") == nullptr) setenv("NCCL_NVLS_ENABLE", "0", 1);
  int port = 0;
  std::vector<std::unique_ptr<dist::LocalComm>> local(static_cast<std::size_t>(gpus));  // (cpu backend)
  try {
    if (use_cuda) port = dist::free_local_port();
    else local = dist::LocalComm::group(gpus, Ranks::collective_timeout());
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.reason().c_str());
    return 1;
  }
  std::mutex live_mutex;
  std::vector<dist::HostComm*> live(static_cast<std::size_t>(gpus), nullptr);  // (each rank's, while it runs)
  int first_ended = -1;  // (the first rank that ended with a nonzero status)
  bool aborted = false;
  // (NCCL's communicators are one a rank: where one rank fails, the others' are aborted; the cpu
  // backend's group was aborted by the rank that failed, naming it)
  const auto abort_live = [&] {
    const std::lock_guard lock(live_mutex);
    if (aborted || g_failed_rank.load() < 0 || !use_cuda) return;
    aborted = true;
    for (auto* c : live)
      if (c != nullptr) c->abort(1);
  };
  g_abort_others = abort_live;
  const auto one_rank = [&](int r) {
    Ranks ranks;
    RunPlan mine;  // (what main has filled in; the rest is each rank's own)
    mine.resume = plan.resume;
    mine.given = plan.given;
    mine.run_id = plan.run_id;
    mine.notes = plan.notes;
    mine.branch = plan.branch;
    const int st = rank_main(p, ranks, [&](Ranks& me) {
      me = Ranks::local(r, gpus, use_cuda, port, std::move(local[static_cast<std::size_t>(r)]), s.rendezvous_timeout);
      const std::lock_guard lock(live_mutex);
      live[static_cast<std::size_t>(r)] = me.comm();
    }, std::move(mine));
    const std::lock_guard lock(live_mutex);
    live[static_cast<std::size_t>(r)] = nullptr;
    return st;
  };
  const auto status = dist::run_local_ranks(gpus, one_rank, [&](int ended) {
    // (a rank ended with a nonzero status: where one failed, the others stop now)
    if (first_ended < 0) first_ended = ended;
    abort_live();  // (a stop signal, where none failed: every rank stops alike, nothing aborted)
  });
  g_abort_others = nullptr;
  // (the exit status: the failed rank's, else the first to end's: a stop signal's 128 + its number)
  if (const int f = g_failed_rank.load(); f >= 0 && status[static_cast<std::size_t>(f)] != 0)
    return status[static_cast<std::size_t>(f)];
  if (first_ended >= 0) return status[static_cast<std::size_t>(first_ended)];
  return 0;
}

// The ranks --gpus asks for in this process (1 where a launcher started it, or with no --gpus);
// --gpus N --gpu-ranks processes starts them here instead and returns their status in `launched`.
int ranks_here(const Settings& s, char** argv, std::optional<int>& launched) {
  // --gpus N: N ranks, one GPU each: threads of this process (--gpu-ranks threads, the default),
  // or one process per GPU started here as torchrun would (gpus.hpp).
  int gpus = gpus_wanted(s.gpus, s.backend, s.gpu_ranks);
  MT_CHECK(gpus > 1 || !s.origins.given_now("--gpu-ranks"), "--gpu-ranks applies with --gpus N (N > 1); drop it");
  if (gpus <= 1) return 1;
  const auto env = dist::launch_from_env();
  if (env.world <= 1 && s.gpu_ranks == "processes") {
    StopSignals::uninstall();  // (the launcher forwards signals to its processes itself)
    launched = launch_gpus(gpus, argv);
    return 0;
  }
  MT_CHECK(env.world <= 1 || (std::getenv("MEGATRAIN_GPUS_LAUNCHED") != nullptr && env.world == gpus),
           "--gpus {}: this is process {} of {} that {} launched, one GPU each: drop --gpus (the launcher says how many)",
           s.gpus, env.rank, env.world, env.launcher);
  return env.world > 1 ? 1 : gpus;  // (a process that --gpu-ranks processes started: one rank)
}

}  // namespace

int train_main(int argc, char** argv) {
  // A file-size limit (ulimit -f) must fail a write with a message, not kill the process.
  signal(SIGXFSZ, SIG_IGN);
  // SIGINT and SIGTERM from the first instant (stop_signals.hpp), before any other thread starts.
  StopSignals::install();
  const std::vector<std::string> args(argv + 1, argv + argc);
  Parsed p;
  RunPlan plan;
  try {
    parse(p, args);
    plan.run_id = io::new_run_id();
    if (p.settings->resume_given) take_over_checkpoint(p, plan, args);
  } catch (const CLI::ParseError& e) {
    return p.app ? p.app->exit(e) : 2;
  } catch (const StoppedBeforeTraining& e) {
    std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
    return 128 + e.signal();
  } catch (const BadOptionValue& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.reason().c_str());
    return 1;
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
    return 2;
  }
  const Settings& s = *p.settings;
  int gpus = 1;
  try {
    plan.given = recorded_options(p);
    std::optional<int> launched;
    gpus = ranks_here(s, argv, launched);
    if (launched) return *launched;
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.reason().c_str());
    return 1;
  }
  // (a warning says which rank it comes from, as an error does; from a thread of no rank of several
  // in this process, one of a trainer's stages, the library's own words)
  set_log_sink([](LogLevel level, std::string_view message) {
    const std::string& who = t_who.empty() ? g_who : t_who;
    std::fprintf(stderr, "%s%s %.*s\n", who.empty() ? "megatrain " : (who + ": ").c_str(),
                 level == LogLevel::warning ? "warning:" : "info:", static_cast<int>(message.size()), message.data());
  });
  const bool use_cuda = s.backend == "cuda" || (s.backend == "auto" && cuda_device_present());
  if (gpus > 1) return run_gpu_ranks(p, plan, gpus, use_cuda);
  // Launched as several processes (torchrun, mpirun, srun): data parallel, one process per GPU
  // (docs/distributed.md); the first process alone prints and writes the run folder.
  Ranks ranks;
  return rank_main(p, ranks, [&](Ranks& r) {
    r = Ranks::join(use_cuda, s.rendezvous_timeout);
    if (!r.lead()) (void)!std::freopen("/dev/null", "w", stdout);
    if (r.several()) g_who = fmt::format("megatrain-train (process {} of {})", r.rank(), r.world());
  }, std::move(plan));
}

}  // namespace megatrain::app
