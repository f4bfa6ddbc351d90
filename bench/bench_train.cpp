// Training throughput of the streaming trainer on a model shape, with random tokens (like the
// peers in shared/DESIGN.md): tokens/s, the GPU's busy fraction, achieved PCIe rates, peak host
// and GPU memory (GPU: the largest device total - free seen after any step), and the step
// planner's plan (docs/planner.md: its memory against what was allocated, its predicted step
// against the measured one).
//
//   bench_train --preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 8
//
// Steps before --skip are warm-up (plans, first-touch of host pages) and are not averaged.
//
// Checkpoint cost (docs/checkpointing.md): --save-dir DIR saves the train state after step
// --save-at, overlapped with the next steps, and reports its size, write time, how long the
// optimizer waited for the writer and how much slower the steps it overlapped were; then the
// files are dropped from the page cache and the checkpoint is opened (every checksum read from
// disk) and loaded into the store, timed.
//
//   bench_train --preset qwen2.5-1.5b --batch 32 --seq 1024 --steps 10 --save-dir /tmp/ck --save-at 5
#include <map>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <tuple>
#include <type_traits>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#endif

using namespace megatrain;

namespace {

struct Args {
  std::string preset = "qwen2.5-1.5b", backend = "auto", clip_mode = "none", gpu_memory, save_dir, gradients = "device";
  std::int64_t batch = 32, seq = 1024, steps = 8, skip = 3, chunk = 0, layers = 0, save_at = 0;
  std::int64_t device_units = TrainerOptions::kAutoDeviceUnits, checkpoint_every = 0, kept_blocks = TrainerOptions::kAutoKeptBlocks;
  std::int64_t spilled_blocks = TrainerOptions::kAutoSpilledBlocks;
  std::size_t weight_slots = 2;  // --weight-slots: the ring of block weight slots (TrainerOptions::weight_slots)
  bool overlap_update = true;
  bool host_bf16_copy = true;  // --host-bf16-copy: host memory keeps a bf16 copy of the weights (TrainerOptions)
  std::int64_t logits_block = 0;  // --logits-block: tokens per block of the head's logits (0: CudaBackendOptions' default)
  bool gemm_tuning = true;  // --gemm-tuning: cuBLASLt's algorithms timed over the first step (CudaBackendOptions)
  bool timeline = false;  // --timeline: the last step's compute items, summed by kind
  std::string machine;  // --machine FILE: the cost model's rates (default: the reference H200 host)
};

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

/// The compute stream's items of one step summed by kind (embedding, blocks, head; forward,
/// backward, updates of device units, recomputed outputs), and the idle time between them.
void print_timeline(const StepStats::Profile& p, std::size_t blocks, double step_s) {
  using K = TrainItem::Kind;
  std::map<std::string, std::tuple<int, double, double>> by;
  double gaps = 0, end = 0;
  for (const auto& it : p.compute_items) {
    const auto kind = static_cast<K>(it.kind);
    const char* what = it.unit == 0 ? "embedding" : it.unit > blocks ? "head" : "block";
    const char* how = kind == K::forward ? "forward" : kind == K::head ? "forward+backward" : kind == K::backward ? "backward"
                    : kind == K::refill ? "recompute" : kind == K::optimize ? "AdamW (device unit)" : "other";
    auto& e = by[fmt::format("{} {}", what, how)];
    ++std::get<0>(e);
    std::get<1>(e) += it.seconds;
    std::get<2>(e) += it.host_s;
    if (it.start_s > end) gaps += it.start_s - end;
    end = std::max(end, it.start_s + it.seconds);
  }
  std::printf("\n| compute item (last step) | count | total | mean | host's time to enqueue (mean) |\n| --- | --- | --- | --- | --- |\n");
  for (const auto& [k, v] : by) {
    const auto& [count, gpu, host] = v;
    std::printf("| %s | %d | %.1f ms | %.3f ms | %.3f ms |\n", k.c_str(), count, 1e3 * gpu, 1e3 * gpu / count, 1e3 * host / count);
  }
  std::printf("| idle between items | | %.1f ms | |\n| from the first item's start to the last's end; the step | | %.1f ms; %.1f ms | |\n",
              1e3 * gaps, 1e3 * end, 1e3 * step_s);
}

/// GPU memory in use on the whole device now (total - free, what cudaMemGetInfo reports: every
/// process's allocations and the CUDA context included); 0 for the CPU backend.
template <class B>
std::size_t gpu_memory_in_use() {
#if MEGATRAIN_HAS_CUDA
  if constexpr (std::is_same_v<B, CudaBackend>) {
    std::size_t free = 0, total = 0;
    MT_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return total - free;
  }
#endif
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Drops a folder's files from the page cache (they are fsync'd, so clean), so that reading
/// them again comes from the disk.
void evict_from_page_cache(const std::filesystem::path& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

/// The backend's dense bf16 GEMM rate (TFLOP/s): y = x W^T with x, W, y of 8192 x 8192, the
/// best of 20 timed calls after 3 warm-up calls (0 on a backend without a device).
template <class B>
double measured_gemm_tflops(B& be) {
  if constexpr (!B::kDevice) {
    return 0.0;
  } else {
    const std::int64_t n = 8192;
    auto x = be.template alloc<typename B::Act>(static_cast<std::size_t>(n * n));
    auto w = be.template alloc<typename B::Weight>(static_cast<std::size_t>(n * n));
    auto y = be.template alloc<typename B::Act>(static_cast<std::size_t>(n * n));
    // (the contents do not matter to the rate: whatever the allocation holds)
    const View<const typename B::Act> xv(std::span<const typename B::Act>(x.span()), Shape{n, n});
    const View<const typename B::Weight> wv(std::span<const typename B::Weight>(w.span()), Shape{n, n});
    const View<typename B::Act> yv(y.span(), Shape{n, n});
    double best = 1e30;
    for (int i = 0; i < 23; ++i) {
      be.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      be.linear(xv, wv, View<const typename B::Weight>{}, yv);
      be.synchronize();
      if (i >= 3) best = std::min(best, seconds_since(t0));
    }
    return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best / 1e12;
  }
}

template <class B>
int run(B& be, const char* name, const Args& a) {
  const double gemm_measured = measured_gemm_tflops(be);  // (before the trainer takes the memory)
  plan::MachineFigures machine = plan::machine_figures();  // (a probe's, else the reference host's)
  if (!a.machine.empty()) {
    std::ifstream f(a.machine);
    MT_CHECK(f.good(), "--machine '{}': cannot open it", a.machine);
    machine = plan::machine_figures_from_json(nlohmann::json::parse(f), a.machine);
  }
  ModelConfig cfg = ModelConfig::preset(a.preset);
  if (a.layers > 0) cfg = cfg.with_layers(a.layers);
  TrainerOptions opt;
  opt.batch_rows = a.batch;
  opt.seq_len = a.seq;
  opt.chunk_rows = a.chunk;
  opt.profile = true;
  opt.overlap_update = a.overlap_update;
  opt.device_units = a.device_units;
  opt.checkpoint_every = a.checkpoint_every;
  opt.kept_blocks = a.kept_blocks;
  opt.spilled_blocks = a.spilled_blocks;
  opt.weight_slots = a.weight_slots;
  opt.host_bf16_copy = a.host_bf16_copy;
  MT_CHECK(a.gradients == "device" || a.gradients == "host", "--gradients must be device or host");
  opt.gradient_home = a.gradients == "host" ? GradientHome::host : GradientHome::device;
  opt.adamw.lr = 1e-4;
  opt.schedule.lr = 1e-4;
  if (a.clip_mode != "none") {
    opt.clip_norm = 1.0;
    opt.clip_mode = a.clip_mode == "exact" ? ClipMode::exact : ClipMode::stale;
  }
  DecoderModel<> model(cfg);
  // (what the process holds before the model: the libraries, the GPU's context and the backend's
  // host side; the plan counts the store and the trainer's buffers, the peak RSS both)
  const double rss_before_store = peak_rss_bytes();
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt));
  Trainer<B> trainer(model, store, be, opt);
  std::printf("%s", plan::format_summary({cfg, trainer.options(), trainer.memory_plan(),
                                          plan::predict_step(cfg, trainer.options(), trainer.memory_plan(), machine), machine,
                                          std::nullopt}).c_str());
  const double N = static_cast<double>(cfg.param_count());
  const double T = static_cast<double>(a.batch * a.seq);
  std::printf("%s: %s shape, %d layers, %.3fB parameters, %lld tokens per step (%lld x %lld), chunk %lld rows, "
              "clipping %s, backend %s\n",
              a.preset.c_str(), std::string(cfg.architecture_name()).c_str(), static_cast<int>(cfg.num_hidden_layers), N / 1e9,
              static_cast<long long>(a.batch * a.seq), static_cast<long long>(a.batch), static_cast<long long>(a.seq),
              static_cast<long long>(a.chunk), a.clip_mode.c_str(), name);
  std::printf("host store %s, trainer device buffers %s, spilled checkpoints %zu, blocks keeping their activations %zu, "
              "spilling them to host memory %zu\n",
              format_bytes(store.bytes()).c_str(), format_bytes(trainer.device_bytes()).c_str(), trainer.spilled_checkpoints(),
              trainer.memory_plan().buffers.kept_blocks, trainer.memory_plan().buffers.spilled_blocks);
  // Parameters whose AdamW runs on the device (device units) and on the host.
  double n_dev = 0;
  for (std::size_t u = 0; u < trainer.device_units(); ++u) n_dev += static_cast<double>(store.unit(u).param_count());
  const double n_host = N - n_dev;
  std::printf("AdamW on the device for %zu of %zu units (%.3fB parameters), on the host for %.3fB; gradients wait in %s memory\n",
              trainer.device_units(), store.num_units(), n_dev / 1e9, n_host / 1e9, opt.resident_gradients() ? a.gradients.c_str() : "no");

  std::mt19937 rng(1);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T)), labels(ids.size());
  std::vector<StepStats> stats;
  // Peak GPU memory: sampled once the trainer has allocated everything it keeps, and after every
  // step (megatrain allocates nothing inside a step, so what a step uses is still there when it
  // returns; a library's transient allocation inside a step and freed before it ends is not seen).
  std::size_t gpu_peak = gpu_memory_in_use<B>();
  std::optional<Checkpointer> ckpt;
  if (!a.save_dir.empty()) {
    MT_CHECK(a.save_at >= 1 && a.save_at < a.steps, "--save-at must be in [1, --steps)");
    CheckpointerOptions co;
    co.keep = 1;
    ckpt.emplace(a.save_dir, co);
  }
  std::vector<char> overlapped;  // per step: a save was being written while it ran
  for (std::int64_t s = 0; s < a.steps; ++s) {
    for (auto& t : ids) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(cfg.vocab_size));
    for (auto& t : labels) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(cfg.vocab_size));
    const bool writing = ckpt && ckpt->in_flight();
    stats.push_back(trainer.step(ids, labels));
    overlapped.push_back(writing ? 1 : 0);
    if (ckpt && s + 1 == a.save_at) ckpt->save(trainer, store);
    gpu_peak = std::max(gpu_peak, gpu_memory_in_use<B>());
    const auto& st = stats.back();
    const auto& p = *st.profile;
    std::printf("step %lld: %.3f s, %.0f tok/s, loss %.4f | compute %.3f s (%.0f%% busy), H2D %.2f GB in %.3f s, D2H %.2f GB "
                "in %.3f s, optimizer %.3f s\n",
                static_cast<long long>(st.step), st.seconds, static_cast<double>(st.tokens) / st.seconds, st.loss, p.compute_s,
                100 * p.compute_s / st.seconds, static_cast<double>(p.upload_bytes) / 1e9, p.upload_s,
                static_cast<double>(p.download_bytes) / 1e9, p.download_s, p.optimizer_s);
    std::fflush(stdout);
  }
  // Averages over the measured steps (those that overlapped a save apart).
  double t = 0, busy = 0, up_b = 0, up_s = 0, dn_b = 0, dn_s = 0, optim = 0, t_saving = 0;
  int n = 0, n_saving = 0;
  for (std::size_t i = static_cast<std::size_t>(std::min(a.skip, a.steps - 1)); i < stats.size(); ++i) {
    if (overlapped[i]) {
      t_saving += stats[i].seconds;
      ++n_saving;
      continue;
    }
    ++n;
    const auto& p = *stats[i].profile;
    t += stats[i].seconds;
    busy += p.compute_s;
    up_b += static_cast<double>(p.upload_bytes);
    up_s += p.upload_s;
    dn_b += static_cast<double>(p.download_bytes);
    dn_s += p.download_s;
    optim += p.optimizer_s;
  }
  t /= n;
  if (a.timeline) print_timeline(*stats.back().profile, trainer.model().num_blocks(), stats.back().seconds);
  // The planner's prediction for this very plan (plan/cost_model.hpp: the one cost model).
  const plan::StepTime pred = plan::predict_step(cfg, trainer.options(), trainer.memory_plan(), machine);
  std::printf("\n| metric | value |\n| --- | --- |\n");
  std::printf("| tokens/s (mean of %d steps) | %.0f |\n", n, T / t);
  std::printf("| step time | %.3f s |\n", t);
  std::printf("| GPU busy (compute stream) | %.0f%% |\n", 100 * busy / n / t);
  for (const auto& [dir, bytes, secs] : {std::tuple{"H2D", up_b, up_s}, std::tuple{"D2H", dn_b, dn_s}}) {
    if (bytes > 0) std::printf("| %s while copying / over the step | %.1f GB/s / %.1f GB/s |\n", dir, bytes / secs / 1e9, bytes / n / t / 1e9);
    else std::printf("| %s | none (every unit on the device) |\n", dir);
  }
  if (n_host > 0) std::printf("| CPU optimizer per step | %.3f s (%.2f Gparam/s) |\n", optim / n, n_host / (optim / n) / 1e9);
  std::printf("| peak host memory (RSS) | %s (%.2f bytes/parameter) |\n", format_bytes(static_cast<std::size_t>(peak_rss_bytes())).c_str(),
              peak_rss_bytes() / N);
  std::printf("| peak GPU memory (device total - free, sampled after every step) | %s |\n", format_bytes(gpu_peak).c_str());
  std::string terms;
  for (const auto& term : pred.terms) terms += fmt::format("{} {:.3f} s, ", term.what, term.seconds);
  std::printf("| plan: %s+ %.3f s not overlapped | predicted %.3f s = %.0f tok/s (%s-bound); measured / predicted %.3f |\n",
              terms.c_str(), pred.exposed_s, pred.step_s, pred.tokens_per_s(), pred.bottleneck.c_str(), t / pred.step_s);
  const plan::MemoryPlan& mp = trainer.memory_plan();
  std::printf("| plan: GPU memory (the trainer's buffers; + the backend's own) | %s planned, %s allocated (+ %s) |\n",
              format_bytes(mp.device_total()).c_str(), format_bytes(trainer.device_bytes()).c_str(),
              format_bytes(mp.device_before).c_str());
  std::printf("| plan: host memory (store and trainer buffers; + the process before the store) | %s planned (+ %s: the libraries, "
              "the GPU's context); peak RSS / (planned + that) %.3f |\n",
              format_bytes(mp.host_total()).c_str(), format_bytes(static_cast<std::size_t>(rss_before_store)).c_str(),
              peak_rss_bytes() / (static_cast<double>(mp.host_total()) + rss_before_store));
  const double model_flops = plan::model_flops(cfg, T, static_cast<double>(a.seq));
  std::printf("| model TFLOP/s (6 x matmul parameters + causal attention, per token) | %.1f |\n", model_flops / t / 1e12);
  std::printf("| executed TFLOP/s (with the recompute) | %.1f |\n", pred.executed_flops / t / 1e12);
  if (gemm_measured > 0)
    std::printf("| MFU (against the measured dense bf16 GEMM rate, %.0f TFLOP/s at 8192^3) | %.1f%% |\n", gemm_measured,
                100 * model_flops / t / 1e12 / gemm_measured);
  if (!ckpt) return 0;

  // ---- the checkpoint ----------------------------------------------------------------------------
  auto done = ckpt->wait();
  MT_CHECK(done.size() == 1 && done[0].ok, "the checkpoint failed: {}", done.empty() ? "no result" : done[0].error);
  const SaveResult& r = done[0];
  std::printf("| checkpoint of step %lld | %s in %.1f s (%.2f GB/s, fsync'd); the optimizer waited %.2f s for it |\n",
              static_cast<long long>(r.step), format_bytes(r.bytes).c_str(), r.seconds, static_cast<double>(r.bytes) / r.seconds / 1e9,
              r.stall_seconds);
  if (n_saving > 0)
    std::printf("| steps while it was written | %d, %.3f s each (the others %.3f s): training lost %.1f s to the save |\n",
                n_saving, t_saving / n_saving, t, t_saving - n_saving * t);
  else
    std::printf("| steps while it was written | none measured (raise --steps) |\n");
  trainer.finish_update();  // (the store is loaded below: the trainer hands it over first)
  evict_from_page_cache(r.dir);
  auto t0 = std::chrono::steady_clock::now();
  const io::TrainCheckpoint opened = io::TrainCheckpoint::open(r.dir);
  const double open_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  opened.load_into(store);
  const double load_s = seconds_since(t0);
  std::printf("| load: open with every checksum (from disk) + into the store | %.1f s (%.2f GB/s) + %.1f s = %.1f s |\n", open_s,
              static_cast<double>(r.bytes) / open_s / 1e9, load_s, open_s + load_s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_train: streaming-trainer throughput on a model shape with random tokens"};
  Args a;
  app.add_option("--preset", a.preset, "Model shape")->capture_default_str();
  app.add_option("--layers", a.layers, "Override the number of layers (0: the preset's)");
  app.add_option("--batch", a.batch, "Sequences per step")->capture_default_str();
  app.add_option("--seq", a.seq, "Tokens per sequence")->capture_default_str();
  app.add_option("--chunk", a.chunk, "Sequences per compute chunk (0: all)")->capture_default_str();
  app.add_option("--steps", a.steps, "Steps")->capture_default_str();
  app.add_option("--skip", a.skip, "Warm-up steps left out of the averages")->capture_default_str();
  app.add_option("--clip-mode", a.clip_mode, "none, stale or exact")->capture_default_str();
  app.add_option("--backend", a.backend, "auto, cpu or cuda")->capture_default_str();
  app.add_option("--gpu-memory", a.gpu_memory, "GPU memory cap, e.g. 40G");
  app.add_option("--overlap-update", a.overlap_update,
                 "Exact clipping: run the AdamW pass of step t ahead of step t+1's forward (true/false)")
      ->capture_default_str();
  app.add_option("--device-units", a.device_units,
                 "Units whose AdamW state lives on the device, the first in forward order (-1: as many as fit)")
      ->capture_default_str();
  app.add_option("--weight-slots", a.weight_slots, "Slots of the ring of block weights (>= 2; the plan counts them)")
      ->capture_default_str();
  app.add_option("--keep-activations", a.kept_blocks,
                 "The last N blocks keep their activations for the backward, no recompute (-1: the plan's choice)")
      ->capture_default_str();
  app.add_option("--spill-activations", a.spilled_blocks,
                 "N blocks among the others spill their activations to host memory, no recompute (-1: the plan's choice)")
      ->capture_default_str();
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "Activation checkpoints every N blocks (0: as the plan needs, docs/planner.md)")
      ->capture_default_str();
  app.add_option("--gradients", a.gradients, "Where gradients wait for the norm (exact clipping): device or host")
      ->capture_default_str();
  app.add_option("--host-bf16-copy", a.host_bf16_copy,
                 "Host memory keeps a bf16 copy of the weights to stream (false: the fp32 masters stream and the GPU rounds them)")
      ->capture_default_str();
  app.add_option("--save-dir", a.save_dir, "Save a train-state checkpoint here (overlapped) and time it, and its load");
  app.add_option("--save-at", a.save_at, "The step after which --save-dir saves")->capture_default_str();
  app.add_option("--logits-block", a.logits_block, "Tokens per block of the LM head's fp32 logits (0: the backend's default)")
      ->capture_default_str();
  app.add_option("--gemm-tuning", a.gemm_tuning,
                 "Time cuBLASLt's first algorithms for each matrix product over the first step and keep the fastest")
      ->capture_default_str();
  app.add_flag("--timeline", a.timeline, "Print the last step's compute-stream items summed by kind, and the gaps between them");
  app.add_option("--machine", a.machine, "JSON file of the machine's rates for the plan's prediction (docs/planner.md)");
  CLI11_PARSE(app, argc, argv);
  try {
#if MEGATRAIN_HAS_CUDA
    if (a.backend != "cpu" && cuda_device_present()) {
      CudaBackendOptions o;
      if (!a.gpu_memory.empty()) o.memory_limit = parse_byte_size(a.gpu_memory.c_str());
      o.gemm_tuning = a.gemm_tuning;
      if (a.logits_block > 0) o.logits_block = a.logits_block;
      CudaBackend be(o);
      return run(be, "cuda", a);
    }
#endif
    MT_CHECK(a.backend != "cuda", "no CUDA backend here");
    CpuBackend<float> be;
    return run(be, "cpu", a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train: %s\n", e.what());
    return 1;
  }
}
