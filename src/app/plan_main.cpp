// megatrain-plan (programs.hpp): will a training configuration fit, and how fast will it go? Prints the step
// planner's plan (plan/planner.hpp, docs/planner.md) before anything is allocated: every buffer
// in GPU and host memory, the placement decisions (activation checkpoints on the GPU or in host
// memory, AdamW on the GPU or the CPU), the step time term by term with its bottleneck, and the
// longest sequence and the largest micro-batch that fit.
//
//   megatrain-plan --preset qwen2.5-7b --batch 1 --seq 262144 --host-memory 120G
//   megatrain-plan --model-config config.json --tokens-per-step 32768 --seq 1024 --gpu-memory 139G
//   megatrain-plan --preset qwen2.5-14b --tokens-per-step 65536 --seq 1024 --gpus 2   (data parallel: per GPU, per host)
//
// The options are megatrain-train's (model, step shape, clipping, memory). On a machine with a
// GPU (megatrain built with CUDA) the plan is that GPU's (its free memory, cuDNN's workspaces);
// elsewhere --backend cuda plans a GPU of --gpu-memory (default: an H200's 139 GiB) with the
// workspaces estimated. Exit status: 0 when it fits, 2 when it does not, 1 on bad options.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/dist/comm.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/plan/probe.hpp"
#include "options.hpp"
#include "parse.hpp"
#include "programs.hpp"
#include "sampling_memory.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#endif

namespace megatrain::app {

namespace {

// The processes of a data-parallel run, planned and not run: the planner reads only how many there
// are and which this is (the first, which writes the checkpoints); it calls no collective.
class PlannedProcesses final : public dist::HostComm {
 public:
  explicit PlannedProcesses(int world) : world_(world) {}
  int rank() const override { return 0; }
  int world() const override { return world_; }
  void all_reduce_sum(std::span<float>) override { none(); }
  void all_reduce_sum(std::span<double>) override { none(); }
  void all_reduce_sum(std::span<std::int64_t>) override { none(); }
  void reduce_scatter_sum(std::span<float>, std::span<const std::int64_t>) override { none(); }
  void all_gather(std::span<float>, std::span<const std::int64_t>) override { none(); }
  void all_gather(std::span<bf16>, std::span<const std::int64_t>) override { none(); }
  void gather(std::span<float>, std::span<const std::int64_t>, int) override { none(); }
  void gather(std::span<bf16>, std::span<const std::int64_t>, int) override { none(); }
  bool can_sum_backend_memory(bool) const override { return true; }  // (as NCCL on GPUs, MPI on CPUs)
  void abort(int) noexcept override {}

 private:
  [[noreturn]] static void none() { MT_FAIL("megatrain-plan plans processes and runs no collective"); }
  int world_;
};

struct PlanArgs {
  std::int64_t tokens_per_step = 0;
  int gpus = 1;   // --gpus: processes, one a GPU
  int hosts = 1;  // --hosts: the --gpus processes spread over this many hosts
  std::string machine;  // --machine FILE
  bool json = false;
  bool probe = false;   // --probe: measure the machine's rates, keep them
  bool auto_gradients = false;  // --gradients auto
  bool auto_copy = false;       // --host-bf16-copy auto
  bool grpo = false;            // --objective grpo: the sampling's memory beside the step's
};

// The plan as JSON (--json).
void print_json(const plan::StepPlan& p, const plan::Suggestions& lim, const plan::MachineFigures& machine,
                const std::string& where) {
  nlohmann::json j{{"fits", p.memory.fits},
                   {"gpu_bytes", p.memory.device_total() + p.memory.device_before},
                   {"host_bytes", p.memory.host_total()},
                   {"checkpoints_on_gpu", p.memory.buffers.checkpoints_on_device},
                   {"checkpoints", p.memory.buffers.checkpoints},
                   {"device_units", p.memory.buffers.device_units},
                   {"kept_blocks", p.memory.buffers.kept_blocks},
                   {"spilled_blocks", p.memory.buffers.spilled_blocks},
                   {"gradients", !p.options.resident_gradients() ? "none"
                                 : p.options.gradient_home == GradientHome::host || p.memory.host_lines_include_device ? "host"
                                                                                                                     : "device"},
                   {"host_bf16_copy", p.options.host_bf16_copy},
                   {"units", p.memory.buffers.units},
                   {"step_s", p.time.step_s},
                   {"tokens_per_s", p.time.tokens_per_s()},
                   {"bottleneck", p.time.bottleneck},
                   {"gpu_bound_from_tokens", p.time.busy_tokens},
                   {"model_flops", p.time.model_flops},
                   {"executed_flops", p.time.executed_flops},
                   {"longest_seq", lim.seq ? nlohmann::json(*lim.seq) : nlohmann::json()},
                   {"largest_micro_batch", lim.micro_rows ? nlohmann::json(*lim.micro_rows) : nlohmann::json()},
                   {"machine", plan::to_json(machine)},
                   {"where", where}};
  for (const auto& t : p.time.terms) j["terms"][t.what] = t.seconds;
  for (const auto& l : p.memory.device) j["gpu_lines"][l.what] = l.bytes;
  for (const auto& l : p.memory.host) j["host_lines"][l.what] = l.bytes;
  if (!p.memory.fits) j["refusal"] = p.refusal();
  if (p.options.log_prob_objective) j["reference_pass_s"] = p.time.scoring_s;  // (--objective dpo: a batch of pairs)
  std::printf("%s\n", j.dump(2).c_str());
}

template <class B>
int report(const DecoderModel<>& model, TrainerOptions topt, const plan::DeviceBudget& device_in, const plan::HostBudget& host,
           const plan::MachineFigures& machine, const PlanArgs& a, const std::string& where) {
  // (--objective grpo: the sampling's memory left free, as megatrain-train leaves it)
  plan::DeviceBudget device = device_in;
  if (a.grpo) {
    topt.reserved_device_bytes = sampling_bytes<B>(model, topt.batch_rows, topt.seq_len, topt.resolved().micro_rows());
    device.allocated += topt.reserved_device_bytes;
  }
  // (--host-bf16-copy auto and --gradients auto: as megatrain-train decides them)
  if (a.auto_copy) topt.host_bf16_copy = plan::choose_bf16_copy<B>(model, topt, device, host, machine, a.auto_gradients);
  if (a.auto_gradients) topt.gradient_home = plan::choose_gradient_home<B>(model, topt, device, host, machine).home;
  const plan::StepPlan p = plan::plan_step<B>(model, topt, device, host, machine);
  // The longest sequence and the largest micro-batch that fit (searched up or down from these).
  const plan::Suggestions lim = p.suggestions ? *p.suggestions : plan::suggest<B>(model, p.options, device, host);
  if (a.json) {
    print_json(p, lim, machine, where);
    return p.memory.fits ? 0 : 2;
  }
  std::printf("%s\n", where.c_str());
  std::printf("%s", plan::format_plan(p).c_str());
  if (a.grpo) std::printf("\n%s", sampling_line(topt).substr(6).c_str());
  if (topt.distributed()) {  // (the plan above is one process's: one GPU's; its host holds `per_host` of them)
    const int per_host = topt.comm->world() / a.hosts;
    const double params = static_cast<double>(model.config().param_count());
    std::printf("data parallel: %d ranks, one a GPU (threads of one process, megatrain-train --gpus, or processes), %d a "
                "host on %d host(s); each trains %lld sequences of the "
                "global batch%s. Per GPU: the plan above. Per host: %s of host memory (%.2f bytes a parameter)%s\n",
                topt.comm->world(), per_host, a.hosts, static_cast<long long>(topt.batch_rows),
                topt.sharded() ? fmt::format(", holds 1/{} of the optimizer state (ZeRO-1{})", topt.comm->world(),
                                             topt.share_host_weights ? "; the bf16 weights one copy the host's processes map"
                                             : topt.weights_in_parts(std::is_same_v<typename B::Weight, bf16>)
                                                 ? "; each its part of the bf16 weights, the GPUs gather the rest"
                                                 : "").c_str()
                               : " and the whole optimizer state",
                format_bytes(p.memory.host_total() * static_cast<std::size_t>(per_host)).c_str(),
                static_cast<double>(p.memory.host_total()) * per_host / params,
                p.memory.fits ? "" : " (does not fit: see above)");
  }
  if (p.memory.fits) {
    std::printf("largest that fit: --seq %s at this batch; %s sequences per micro-batch at --seq %lld (%s tokens; more per "
                "step through --micro-batches)\n",
                lim.seq ? fmt::format("{}", *lim.seq).c_str() : "?", lim.micro_rows ? fmt::format("{}", *lim.micro_rows).c_str() : "?",
                static_cast<long long>(topt.seq_len),
                lim.micro_rows ? fmt::format("{}", *lim.micro_rows * topt.seq_len).c_str() : "?");
  }
  return p.memory.fits ? 0 : 2;
}

// The model: --model DIR reads DIR/config.json (no weights are opened).
ModelConfig planned_model(const Settings& s, const CLI::App& app) {
  if (s.model_dir.empty()) return model_config(s, app, 256, nullptr);
  const std::filesystem::path f = std::filesystem::path(s.model_dir) / "config.json";
  MT_CHECK(std::filesystem::exists(f), "--model '{}': no config.json there", s.model_dir);
  return ModelConfig::from_file(f);
}

// The step as megatrain-train would run it. Data parallel (--gpus N over --hosts H): one process's
// plan, for its share of the global batch and of its host's memory.
TrainerOptions planned_options(const Settings& s, const PlanArgs& a, const ModelConfig& cfg) {
  MT_CHECK(s.seq > 0, "--seq must be > 0 (got {})", s.seq);
  TrainerOptions topt = step_layout(s, cfg.num_hidden_layers);
  if (a.tokens_per_step > 0) {
    MT_CHECK(!s.origins.given("--batch"), "--tokens-per-step and --batch both set the batch; pass one");
    MT_CHECK(a.tokens_per_step % s.seq == 0, "--tokens-per-step {} is not a whole number of --seq {} sequences",
             a.tokens_per_step, s.seq);
    topt.batch_rows = a.tokens_per_step / s.seq;
  }
  // (a preference run: the head's second forward priced, its pairs whole on each rank)
  const std::int64_t batch = topt.batch_rows;
  check_objective_options(s, batch);
  if (s.objective == "dpo") check_pairs_batch(batch, a.gpus);
  MT_CHECK(s.objective != "grpo" || a.gpus == 1, "--objective grpo runs on one GPU: drop --gpus {}", a.gpus);
  // (dpo and grpo weigh each token from its log-probabilities)
  topt.token_weights = topt.log_prob_objective = s.objective != "sft";
  const bool pairs = s.objective == "dpo";
  topt.clip_norm = s.clip;
  topt.clip_mode = s.clip_mode == "stale" ? ClipMode::stale : ClipMode::exact;
  static std::optional<PlannedProcesses> processes;
  const int gpus = a.gpus;
  MT_CHECK(a.hosts >= 1 && gpus % a.hosts == 0, "--hosts {}: the {} processes (--gpus) must spread evenly over the hosts",
           a.hosts, gpus);
  MT_CHECK(s.share_weights != "true" || a.hosts == 1, "--share-weights true: the processes of several hosts (--hosts {}) "
           "cannot map one copy; drop it", a.hosts);
  if (gpus == 1) {
    MT_CHECK(a.hosts == 1, "--hosts {} plans several processes: give --gpus too", a.hosts);
    topt.validate();
    if (pairs) check_pairs_micro_batches(topt, batch);
    return topt;
  }
  MT_CHECK(topt.batch_rows % gpus == 0, "--batch {} (the global batch) must be a multiple of the {} processes (--gpus)",
           topt.batch_rows, gpus);
  MT_CHECK(topt.micro_batches == 1 || topt.micro_batches % gpus == 0,
           "--micro-batches {} (the passes of the global batch) must be 1 or a multiple of the {} processes (--gpus)",
           topt.micro_batches, gpus);
  processes.emplace(gpus);
  topt.batch_rows /= gpus;
  topt.micro_batches = std::max<std::int64_t>(1, topt.micro_batches / gpus);
  topt.comm = &*processes;
  topt.shard_optimizer = s.shard_optimizer;
  topt.share_host_weights = share_weights(s, a.hosts == 1);
  topt.host_processes = gpus / a.hosts;  // (sharing each host's CPU)
  topt.gather_weights_on_device = s.gather_weights == "gpus";
  check_bf16_copy_option(s, topt.sharded(), gpus);
  topt.validate();
  if (pairs) check_pairs_micro_batches(topt, batch);
  return topt;
}

// --probe: this machine's rates measured at this model's shapes, kept in `out`.
plan::MachineFigures probe_and_keep(const Settings& s, const ModelConfig& cfg, const std::filesystem::path& out) {
  plan::MachineFigures machine;
#if MEGATRAIN_HAS_CUDA
  MT_CHECK(s.backend != "cpu" && cuda_device_present(), "--probe measures this machine's GPU, and there is none here{}",
           s.backend == "cpu" ? " (--backend cpu)" : "");
  {
    CudaBackendOptions popt;
    popt.gemm_tuning = true;  // (megatrain-train's default: the rates of tuned products)
    CudaBackend pbe(popt);    // (its own: the plan's backend starts with nothing allocated)
    cudaDeviceProp prop{};
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::fprintf(stderr, "megatrain-plan: probing this machine (%s) at the shapes of this model, --seq %lld ...\n", prop.name,
                 static_cast<long long>(s.seq));
    machine = plan::probe_machine(pbe, cfg, s.seq, fmt::format("probed: {}, {} at --seq {}", prop.name, cfg.architecture_name(), s.seq));
  }
#else
  (void)s, (void)cfg;
  MT_FAIL("--probe measures this machine's GPU: this build of megatrain has no CUDA");
#endif
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path());
  const std::filesystem::path tmp = out.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << plan::to_json(machine).dump(2) << "\n";
    MT_CHECK(f.good(), "--probe: cannot write '{}'", tmp.string());
  }
  std::filesystem::rename(tmp, out);
  std::fprintf(stderr, "megatrain-plan: the figures are kept in %s (used from now on; --machine FILE for others)\n%s\n",
               out.c_str(), plan::to_json(machine).dump(2).c_str());
  return machine;
}

// The machine's rates: measured now (--probe, kept in --machine FILE or the default file), read
// from --machine FILE, from the default file a probe left, or the reference H200 host's.
plan::MachineFigures planned_machine(const Settings& s, const PlanArgs& a, const ModelConfig& cfg) {
  if (a.probe) {
    const std::filesystem::path out = a.machine.empty() ? plan::default_machine_file() : std::filesystem::path(a.machine);
    MT_CHECK(!out.empty(), "--probe: there is no default place for the figures (HOME is not set); pass --machine FILE");
    return probe_and_keep(s, cfg, out);
  }
  if (!a.machine.empty()) return plan::read_machine_figures(a.machine, fmt::format("--machine '{}'", a.machine));
  return plan::machine_figures();  // (a probe's, else the reference host's)
}

// Several processes on a host share its memory, as in megatrain-train: each plans with its part
// unless --host-memory gives each its own.
plan::HostBudget planned_host(const Settings& s, const PlanArgs& a) {
  plan::HostBudget host = host_budget(s);
  if (const int per_host = a.gpus / a.hosts;
      per_host > 1 && s.host_memory.empty() && std::getenv("MEGATRAIN_HOST_MEMORY") == nullptr) {
    host.bytes /= static_cast<std::size_t>(per_host);
    host.source = fmt::format("available host memory / {} processes on a host", per_host);
  }
  return host;
}

// The plan on this machine's GPU, on a GPU of --gpu-memory (none here), or on the CPU backend.
int plan_on_backend(const Settings& s, const DecoderModel<>& model, const TrainerOptions& topt, const plan::HostBudget& host,
                    const plan::MachineFigures& machine, const PlanArgs& a) {
  const bool want_cuda = s.backend != "cpu";
#if MEGATRAIN_HAS_CUDA
  if (want_cuda && cuda_device_present()) {
    CudaBackendOptions copt;
    if (!s.gpu_memory.empty()) copt.memory_limit = parse_byte_size(s.gpu_memory.c_str());
    CudaBackend be(copt);
    cudaDeviceProp prop{};
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    return report<CudaBackend>(model, topt, plan::device_budget(be), host, machine, a,
                               fmt::format("megatrain-plan: on this machine's GPU ({}, cap {}), host memory {} ({})", prop.name,
                                           format_bytes(be.memory_limit()), format_bytes(host.bytes), host.source));
  }
#endif
  if (want_cuda) {
    plan::DeviceBudget d;
    d.cap = s.gpu_memory.empty() ? std::size_t{139} << 30 : parse_byte_size(s.gpu_memory.c_str());
    d.allocated = std::size_t{32} << 20;  // cuBLASLt's workspace (CudaBackendOptions::gemm_workspace)
    d.prepare_bytes = [](const WorkspacePlan& w) { return plan::cuda_prepare_estimate(w); };
    d.auto_device_units = true;
    return report<plan::CudaTypes>(model, topt, d, host, machine, a,
                                   fmt::format("megatrain-plan: for a GPU of {}{} (no GPU here: cuDNN's workspaces "
                                               "estimated), host memory {} ({})",
                                               format_bytes(*d.cap), s.gpu_memory.empty() ? " (an H200's; --gpu-memory)" : "",
                                               format_bytes(host.bytes), host.source));
  }
  CpuBackend<float> be;
  return report<CpuBackend<float>>(model, topt, plan::device_budget(be), host, machine, a,
                                   fmt::format("megatrain-plan: on the CPU backend, host memory {} ({})", format_bytes(host.bytes),
                                               host.source));
}

int run(const Settings& s, const CLI::App& app, PlanArgs a) {
  check_model_source(s);
  a.auto_gradients = s.gradients == "auto";
  a.auto_copy = s.host_bf16_copy == "auto" && a.gpus == 1;  // (several ranks keep it, as in megatrain-train)
  a.grpo = s.objective == "grpo";
  if (!s.host_memory.empty()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);
  const ModelConfig cfg = planned_model(s, app);
  const TrainerOptions topt = planned_options(s, a, cfg);
  const plan::MachineFigures machine = planned_machine(s, a, cfg);
  const plan::HostBudget host = planned_host(s, a);
  // (from the config alone, before its blocks are built: a config of 10^9 layers is refused here;
  // a model too large for the host does not fit: exit 2, as any plan that does not)
  try {
    plan::check_state_fits_host(cfg, host,
                                !s.model_dir.empty()      ? (std::filesystem::path(s.model_dir) / "config.json").string()
                                : !s.model_config.empty() ? s.model_config
                                : !s.preset.empty()       ? "--preset " + s.preset
                                                          : std::string("the command-line shape"),
                                plan::store_options(topt, {}, s.backend != "cpu").shard,
                                topt.host_bf16_copy && !(a.auto_copy && s.backend != "cpu"));
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-plan: %s\n", std::getenv("MEGATRAIN_DEBUG") ? e.what() : e.reason().c_str());
    return 2;
  }
  return plan_on_backend(s, DecoderModel<>(cfg), topt, host, machine, a);
}

}  // namespace

int plan_main(int argc, char** argv) {
  Settings s;
  PlanArgs a;
  CLI::App app{"megatrain-plan: the memory and the step time of a training configuration, before anything is allocated", "megatrain-plan"};
  app.set_version_flag("--version", "megatrain-plan " + std::string(megatrain::version()), "Print the version and exit");
  app.set_help_flag("-h,--help", "Print this help and exit");
  add_model_options(app, s);
  auto* step = app.add_option_group("step", "The step (megatrain-train's options)");
  add_step_options(*step, s);
  step->add_option("--tokens-per-step", a.tokens_per_step, "Tokens per optimizer step (instead of --batch: --batch = this / --seq)");
  add_clip_options(*step, s);
  add_objective_options(app, s);
  add_grpo_options(app, s);
  auto* mem = app.add_option_group("memory", "Where it runs (megatrain-train's options)");
  add_memory_options(*mem, s);
  mem->add_option("--machine", a.machine,
                  "JSON file of the machine's rates for the step time (h2d_gbs, d2h_gbs, duplex_gbs, gemm_tflops, "
                  "moe_gemm_tflops, attention_fwd_tflops, attention_bwd_tflops, delta_rule_fwd_tflops, delta_rule_bwd_tflops, hbm_gbs, adamw_gparams, adamw_dma_gparams, "
                  "pass_copies_gbs; default: the reference H200 host)");
  mem->add_flag("--probe", a.probe,
                "Measure this machine's rates at this model's shapes (GPU matrix products, attention and Gated DeltaNet's mixing, device memory, "
                "PCIe each way and both, the CPU's AdamW alone and under copies, the copies beside it) and keep them in --machine FILE, or by "
                "default in $MEGATRAIN_MACHINE, else ~/.cache/megatrain/machine.json, which later plans read");
  auto* procs = app.add_option_group("processes", "Data parallel (megatrain-train's options; docs/distributed.md)");
  procs->add_option("--gpus", a.gpus, "GPUs, a rank each (threads of one process or processes, default 1): the plan of "
                    "one of them, and what a host holds")
      ->check(at_least("--gpus", 1))
      ->capture_default_str();
  procs->add_option("--hosts", a.hosts, "Hosts the --gpus processes spread over, evenly (default 1)")
      ->check(at_least("--hosts", 1))
      ->capture_default_str();
  add_bool_option(procs, "--shard-optimizer", s.shard_optimizer, "ZeRO-1, as megatrain-train");
  procs->add_option("--share-weights", s.share_weights,
                    "The bf16 weights one copy a host's processes map (auto: where every process runs on one host)")
      ->check(choice("--share-weights", {"auto", "true", "false"}))
      ->capture_default_str();
  procs->add_option("--gather-weights", s.gather_weights,
                    "Each process with its own bf16 copy: gpus (it holds and uploads its part, the GPUs gather the rest) "
                    "or host (a whole copy, gathered after each update)")
      ->check(choice("--gather-weights", {"gpus", "host"}))
      ->capture_default_str();
  app.add_flag("--json", a.json, "Print the plan as JSON");
  try {
    refuse_empty_positionals(app, std::vector<std::string>(argv + 1, argv + argc), "megatrain-plan");
    parse_args(app, std::vector<std::string>(argv + 1, argv + argc));
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg.rfind("--", 0) == 0) s.origins.cli.insert(arg.substr(0, arg.find('=')));
    }
    return run(s, app, a);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const megatrain::Error& e) {  // (the reason; MEGATRAIN_DEBUG adds where it was raised)
    std::fprintf(stderr, "megatrain-plan: %s\n", std::getenv("MEGATRAIN_DEBUG") ? e.what() : e.reason().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-plan: %s\n", e.what());
    return 1;
  }
}

}  // namespace megatrain::app
