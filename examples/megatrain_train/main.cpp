// megatrain-train: trains a decoder-only model from the command line.
//
// With no arguments it trains a small Llama-shaped model on the built-in text (byte-level
// tokens) on whatever backend this machine has. Every option can also come from a JSON file
// (--config FILE: an object whose keys are the long option names without the dashes); options
// given on the command line win over the file. Unknown or contradictory options are errors.
// Output: <out>/metrics.jsonl (one JSON object per step), <out>/config.json (the model shape),
// <out>/options.json (every option as resolved).
//
// Hugging Face models: --model DIR fine-tunes a model directory (config.json + safetensors);
// --export DIR writes the trained weights as such a directory at the end (and every
// --export-every N steps), atomically. --steps 0 evaluates only: the validation loss of the
// model on --val-data (or the held-out tail of --data) is printed as one JSON line on stdout,
// and nothing is written (docs/huggingface.md).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/train/trainer.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#endif

using namespace megatrain;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Where each option was given: on the command line or in the --config file (long names, "--x").
struct Origins {
  std::set<std::string> cli, file;
  /// Whether option x, beside option y (which makes x irrelevant or contradicts it), is an
  /// error: unless x comes only from the config file and y from the command line — there the
  /// command line overrides the file, as a value on the command line does.
  bool conflicts(const std::string& x, const std::string& y) const {
    return cli.count(x) > 0 || (file.count(x) > 0 && cli.count(y) == 0);
  }
};

struct Settings {
  Origins origins;
  // model
  std::string model_dir, model_config, preset;
  bool allow_dtype_mismatch = false;
  std::int64_t hidden = 128, layers = 4, heads = 4, kv_heads = 2, intermediate = 352, vocab = 0, head_dim = 0;
  double rope_theta = 10000.0, norm_eps = 1e-5;
  bool tie_embeddings = true;
  // data
  std::string data, val_data, data_format = "u16";
  double val_fraction = 0.05;
  // schedule and optimizer
  std::int64_t batch = 8, seq = 128, micro_batches = 1, max_micro_batch = 0, chunk = 0, steps = 60;
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0;
  std::int64_t warmup = -1;  // default: min(10, steps / 5)
  // Stale clipping by default: each unit's optimizer step starts the moment its gradient lands
  // (exact clipping must wait for the whole backward; see docs/training.md).
  std::string schedule = "cosine", clip_mode = "stale";
  // run
  std::uint64_t seed = 1;
  std::string out, backend = "auto", host_memory, gpu_memory;
  std::int64_t eval_every = 20, eval_batches = 4, log_every = 1;
  bool overwrite = false;
  // Hugging Face export
  std::string export_dir, export_dtype = "bf16", shard_size = "5GB";
  std::int64_t export_every = 0;
};

std::string default_out_dir() {
  char buf[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}

// Turns the JSON config into "--key value" arguments placed before the command line, so the
// command line (parsed later, last value wins) overrides the file.
std::vector<std::string> config_args(const std::string& path, const CLI::App& app) {
  std::ifstream f(path);
  MT_CHECK(f.good(), "cannot open config file '{}'", path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::parse_error& e) {
    MT_FAIL("config file '{}': malformed JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "config file '{}' must hold a JSON object of option names and values", path);
  std::vector<std::string> args;
  for (const auto& [key, value] : j.items()) {
    MT_CHECK(key != "config", "config file '{}' cannot name another config file", path);
    const CLI::Option* opt = nullptr;
    try {
      opt = app.get_option("--" + key);
    } catch (const CLI::OptionNotFound&) {
      MT_FAIL("config file '{}': unknown option '{}' (see megatrain-train --help)", path, key);
    }
    (void)opt;
    args.push_back("--" + key);
    if (value.is_string()) args.push_back(value.get<std::string>());
    else if (value.is_boolean()) args.push_back(value.get<bool>() ? "true" : "false");
    else if (value.is_number()) args.push_back(value.dump());
    else MT_FAIL("config file '{}': option '{}' must be a string, number or boolean, not {}", path, key, value.dump());
  }
  return args;
}

// Where the model's shape comes from: at most one of --model, --model-config, --preset, and no
// shape flag beside it. Checked before anything is opened.
void check_model_source(const Settings& s) {
  const char* shape_flags[] = {"--hidden", "--layers", "--heads", "--kv-heads", "--intermediate", "--head-dim", "--rope-theta", "--norm-eps", "--tie-embeddings"};
  std::vector<std::string> sources;
  if (!s.model_dir.empty()) sources.emplace_back("--model");
  if (!s.model_config.empty()) sources.emplace_back("--model-config");
  if (!s.preset.empty()) sources.emplace_back("--preset");
  MT_CHECK(sources.size() <= 1, "{} and {} both give the model shape; pass one", sources[0], sources[1]);
  if (sources.empty()) return;
  for (const char* f : shape_flags)
    MT_CHECK(!s.origins.conflicts(f, sources[0]), "{} contradicts {}: the shape comes from there; drop one", f, sources[0]);
}

ModelConfig model_config(const Settings& s, const CLI::App& app, std::int64_t data_vocab, const io::HfCheckpoint* hf) {
  if (hf != nullptr || !s.model_config.empty() || !s.preset.empty()) {
    ModelConfig c = hf != nullptr              ? hf->config()
                    : s.model_config.empty() ? ModelConfig::preset(s.preset)
                                             : ModelConfig::from_file(s.model_config);
    if (app.get_option("--vocab")->count() > 0)
      MT_CHECK(s.vocab == c.vocab_size, "--vocab {} contradicts the model's vocab_size {}", s.vocab, c.vocab_size);
    return c;
  }
  json j{{"architectures", {"LlamaForCausalLM"}},
         {"hidden_size", s.hidden},
         {"intermediate_size", s.intermediate},
         {"num_hidden_layers", s.layers},
         {"num_attention_heads", s.heads},
         {"num_key_value_heads", s.kv_heads},
         {"vocab_size", s.vocab > 0 ? s.vocab : data_vocab},
         {"max_position_embeddings", std::max<std::int64_t>(s.seq, 2048)},
         {"rms_norm_eps", s.norm_eps},
         {"rope_theta", s.rope_theta},
         {"tie_word_embeddings", s.tie_embeddings}};
  if (s.head_dim > 0) j["head_dim"] = s.head_dim;
  return ModelConfig::from_json(j, "command-line model shape");
}

// One line that redraws itself on a terminal; plain lines otherwise.
class Progress {
 public:
  Progress(std::int64_t steps, bool tty) : steps_(steps), tty_(tty) {}
  void update(const StepStats& s, double tok_per_s, double elapsed, std::optional<double> val, std::int64_t log_every) {
    const double eta = elapsed / static_cast<double>(s.step) * static_cast<double>(steps_ - s.step);
    if (tty_) {
      const int width = 24;
      const int filled = static_cast<int>(width * s.step / steps_);
      std::string bar(static_cast<std::size_t>(filled), '=');
      if (filled < width) bar += '>';
      bar.resize(width, ' ');
      std::fprintf(stdout, "\r\033[Kstep %lld/%lld [%s] loss %.4f | %.0f tok/s | ETA %s%s", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), bar.c_str(), s.loss, tok_per_s, clock(eta).c_str(),
                   val ? fmt::format(" | val {:.4f}", *val).c_str() : "");
      if (s.step == steps_ || val) std::fputc('\n', stdout);
      std::fflush(stdout);
    } else if (s.step % log_every == 0 || s.step == steps_ || val) {
      std::fprintf(stdout, "step %lld/%lld loss %.4f lr %.3g grad_norm %.3f tok/s %.0f%s\n", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), s.loss, s.lr, s.grad_norm, tok_per_s,
                   val ? fmt::format(" val_loss {:.4f}", *val).c_str() : "");
      std::fflush(stdout);
    }
  }

 private:
  static std::string clock(double secs) {
    const auto t = static_cast<long long>(std::max(0.0, secs));
    return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  }
  std::int64_t steps_;
  bool tty_;
};

// What train() needs besides the trainer's options.
struct RunPlan {
  std::optional<io::HfCheckpoint> hf;    // --model: weights to load (released once loaded)
  fs::path out;                          // run directory (none when evaluating only)
  bool eval_only = false;                // --steps 0
  std::int64_t eval_rows = 0;            // eval_only: validation windows to evaluate
  std::optional<io::HfExportOptions> export_options;  // --export
};

template <class B>
int train(B& be, const char* backend_name, const Settings& s, const CLI::App& app, const ModelConfig& cfg,
          const TokenDataset& data, const TrainerOptions& topt, RunPlan& plan);

int run(const Settings& s, const CLI::App& app) {
  // ---- validate everything before touching anything ------------------------------------------
  MT_CHECK(s.backend == "auto" || s.backend == "cpu" || s.backend == "cuda", "--backend must be auto, cpu or cuda (got '{}')",
           s.backend);
  MT_CHECK(!(s.backend == "cuda" && !MEGATRAIN_HAS_CUDA), "--backend cuda: megatrain was built without CUDA");
  MT_CHECK(!(s.backend == "cuda" && !cuda_device_present()), "--backend cuda: no usable GPU was found");
  const bool use_cuda = s.backend == "cuda" || (s.backend == "auto" && cuda_device_present());
  MT_CHECK(s.gpu_memory.empty() || use_cuda, "--gpu-memory needs the cuda backend");
  MT_CHECK(s.schedule == "constant" || s.schedule == "cosine", "--schedule must be constant or cosine (got '{}')", s.schedule);
  MT_CHECK(!(s.schedule == "constant" && s.origins.conflicts("--warmup", "--schedule") && s.warmup > 0),
           "--warmup needs --schedule cosine (a constant schedule has no warm-up)");
  MT_CHECK(!(s.schedule == "constant" && s.origins.conflicts("--min-lr", "--schedule")),
           "--min-lr needs --schedule cosine (a constant schedule has no floor)");
  MT_CHECK(s.clip_mode == "exact" || s.clip_mode == "stale", "--clip-mode must be exact or stale (got '{}')", s.clip_mode);
  MT_CHECK(!(s.clip == 0 && s.origins.conflicts("--clip-mode", "--clip")), "--clip-mode given but clipping is off (--clip 0)");
  MT_CHECK(s.data_format == "u16" || s.data_format == "u32", "--data-format must be u16 or u32 (got '{}')", s.data_format);
  MT_CHECK(s.val_data.empty() || !s.origins.conflicts("--val-fraction", "--val-data"),
           "--val-fraction contradicts --val-data: validation comes from that file; drop one");
  MT_CHECK(s.steps >= 0, "--steps must be >= 0 (got {}; 0 evaluates only)", s.steps);
  const bool eval_only = s.steps == 0;
  MT_CHECK(s.eval_every >= 0 && s.eval_batches > 0 && s.log_every > 0, "--eval-every >= 0, --eval-batches > 0, --log-every > 0");
  MT_CHECK(!(s.data.empty() && !s.val_data.empty()) || eval_only,
           "--val-data needs --data (except with --steps 0, which evaluates on --val-data alone)");
  MT_CHECK(!(eval_only && !s.out.empty()),
           "--steps 0 evaluates only and writes no run directory: drop --out (the loss is printed as JSON)");
  if (eval_only)  // options that only shape training would be ignored: refuse them
    for (const char* f : {"--lr", "--min-lr", "--warmup", "--schedule", "--weight-decay", "--beta1", "--beta2", "--eps", "--clip",
                          "--clip-mode", "--micro-batches", "--overwrite", "--eval-every", "--log-every"})
      MT_CHECK(!s.origins.conflicts(f, "--steps"), "{} has no effect with --steps 0 (evaluation only); drop it", f);
  check_model_source(s);

  // Export: every contradiction is found now, not after hours of training.
  RunPlan plan;
  plan.eval_only = eval_only;
  MT_CHECK(!s.model_dir.empty() || !s.origins.conflicts("--allow-dtype-mismatch", "--model"),
           "--allow-dtype-mismatch needs --model DIR");
  for (const char* f : {"--export-every", "--export-dtype", "--shard-size"})
    MT_CHECK(!s.export_dir.empty() || !s.origins.conflicts(f, "--export"), "{} needs --export DIR", f);
  MT_CHECK(s.export_every >= 0, "--export-every must be >= 0 (got {}; 0 exports only at the end)", s.export_every);
  MT_CHECK(!(eval_only && s.export_every > 0), "--export-every needs training steps (--steps 0 exports once)");
  if (!s.export_dir.empty()) {
    io::HfExportOptions e;
    MT_CHECK(s.export_dtype == "bf16" || s.export_dtype == "f16" || s.export_dtype == "f32",
             "--export-dtype must be bf16, f16 or f32 (got '{}')", s.export_dtype);
    e.dtype = s.export_dtype == "f32" ? DType::f32 : s.export_dtype == "f16" ? DType::f16 : DType::bf16;
    e.max_shard_bytes = io::parse_shard_size(s.shard_size);
    io::check_hf_export_target(s.export_dir);
    plan.export_options = std::move(e);
  }
  if (!s.host_memory.empty()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);

  // A Hugging Face model is opened and checked against its config.json before anything else.
  if (!s.model_dir.empty()) {
    io::HfOpenOptions open_options;
    open_options.allow_dtype_mismatch = s.allow_dtype_mismatch;
    plan.hf = io::HfCheckpoint::open(s.model_dir, open_options);
    if (plan.export_options) {
      plan.export_options->config_json = plan.hf->config_text();
      plan.export_options->extra_files = io::hf_side_files(s.model_dir);
    }
  }

  // Data first: its vocabulary sizes a model given on the command line.
  const TokenFormat fmt_bin = s.data_format == "u32" ? TokenFormat::u32 : TokenFormat::u16;
  TokenSource train_src = !s.data.empty()                       ? TokenSource::open(s.data, fmt_bin)
                          : (eval_only && !s.val_data.empty()) ? TokenSource::open(s.val_data, fmt_bin)
                                                               : TokenSource::from_text(builtin_text(1 << 20, 1), "built-in text");
  MT_CHECK(train_src.format() != TokenFormat::text || !s.origins.conflicts("--data-format", "--data"),
           "--data-format applies to .bin token files, but the data is text ({}), tokenised by bytes",
           s.data.empty() ? "the built-in text" : s.data);
  const std::int64_t data_vocab = train_src.format() == TokenFormat::text ? 256 : (fmt_bin == TokenFormat::u16 ? 65536 : 0);
  MT_CHECK(train_src.format() == TokenFormat::text || s.vocab > 0 || plan.hf || !s.model_config.empty() || !s.preset.empty(),
           "--data '{}' holds token ids: give the vocabulary (--vocab, --model, --model-config or --preset)",
           s.data.empty() ? s.val_data : s.data);
  const ModelConfig cfg = model_config(s, app, data_vocab, plan.hf ? &*plan.hf : nullptr);
  MT_CHECK(train_src.format() != TokenFormat::text || cfg.vocab_size >= 256,
           "text data is tokenised by bytes (vocabulary 256) but the model's vocab_size is {}", cfg.vocab_size);
  std::optional<TokenSource> val_src;
  if (!s.val_data.empty()) {
    val_src = TokenSource::open(s.val_data, fmt_bin);
    MT_CHECK((val_src->format() == TokenFormat::text) == (train_src.format() == TokenFormat::text),
             "--val-data '{}' is {} but --data '{}' is {}: both must be token files, or both text", s.val_data,
             val_src->format() == TokenFormat::text ? "text" : "a token file", s.data,
             train_src.format() == TokenFormat::text ? "text" : "a token file");
  }
  DatasetOptions dopt;
  dopt.vocab_size = cfg.vocab_size;
  dopt.seq_len = s.seq;
  dopt.val_fraction = s.val_fraction;
  dopt.seed = s.seed;
  TokenDataset data(std::move(train_src), dopt, std::move(val_src));

  TrainerOptions topt;
  topt.batch_rows = s.batch;
  topt.seq_len = s.seq;
  topt.micro_batches = s.micro_batches;
  topt.max_micro_rows = s.max_micro_batch;
  topt.chunk_rows = s.chunk;
  topt.adamw = {s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
  if (eval_only) {
    // Every validation window once (at most --eval-batches x --batch when --eval-batches is given),
    // in batches of at most --batch sequences; no optimizer state is needed.
    plan.eval_rows = data.val_windows();
    if (app.get_option("--eval-batches")->count() > 0) plan.eval_rows = std::min(plan.eval_rows, s.eval_batches * s.batch);
    topt.batch_rows = std::min(s.batch, plan.eval_rows);
    topt.micro_batches = 1;  // (--max-micro-batch still splits each evaluation batch)
    topt.schedule = {LrSchedule::Kind::constant, s.lr, 0, 1, 0.0};
  } else {
    const std::int64_t warmup = s.warmup >= 0 ? s.warmup : std::min<std::int64_t>(10, s.steps / 5);
    topt.schedule = {s.schedule == "cosine" ? LrSchedule::Kind::warmup_cosine : LrSchedule::Kind::constant, s.lr,
                     s.schedule == "cosine" ? warmup : 0, s.steps, s.schedule == "cosine" ? s.min_lr : 0.0};
    if (topt.schedule.kind == LrSchedule::Kind::warmup_cosine && s.steps <= warmup)
      MT_FAIL("--warmup {} leaves no steps for the cosine decay of --steps {}", warmup, s.steps);
    topt.clip_norm = s.clip;
    topt.clip_mode = s.clip_mode == "stale" ? ClipMode::stale : ClipMode::exact;
  }
  topt.validate();
  MT_CHECK(!s.origins.conflicts("--micro-batches", "--max-micro-batch") || topt.resolved().micro_batches == topt.micro_batches,
           "--micro-batches {} contradicts --max-micro-batch {}: parts of {} sequences are more than {}; pass one of them",
           s.micro_batches, s.max_micro_batch, s.batch / std::max<std::int64_t>(s.micro_batches, 1), s.max_micro_batch);

  if (!eval_only) {
    plan.out = s.out.empty() ? fs::path(default_out_dir()) : fs::path(s.out);
    MT_CHECK(s.overwrite || !fs::exists(plan.out / "metrics.jsonl"),
             "'{}' already holds a run (metrics.jsonl); choose another --out or pass --overwrite to replace it",
             plan.out.string());
  }
  if (plan.export_options && !plan.out.empty()) {
    // The export directory is replaced as a whole: it must not be, or hold, the run directory.
    const auto resolved = [](const fs::path& p) {
      fs::path r = fs::weakly_canonical(fs::absolute(p));
      return r.has_filename() ? r : r.parent_path();  // "dir/" -> "dir"
    };
    const fs::path e = resolved(s.export_dir), o = resolved(plan.out);
    MT_CHECK(std::mismatch(e.begin(), e.end(), o.begin(), o.end()).first != e.end(),
             "--export '{}' would replace the run directory '{}' (it is, or holds, --out); export elsewhere", s.export_dir,
             plan.out.string());
  }
  if (use_cuda) {
#if MEGATRAIN_HAS_CUDA
    CudaBackendOptions copt;
    if (!s.gpu_memory.empty()) copt.memory_limit = parse_byte_size(s.gpu_memory.c_str());
    CudaBackend be(copt);
    return train(be, "cuda", s, app, cfg, data, topt, plan);
#endif
  }
  CpuBackend<float> be;
  return train(be, "cpu", s, app, cfg, data, topt, plan);
}

// The validation loss over plan.eval_rows windows, in batches of the trainer's batch size (a
// short last batch is padded with rows whose labels are ignored): the mean over every labelled
// token, as transformers' loss with labels = input_ids over the same windows.
template <class T>
std::pair<double, std::int64_t> evaluate_all(T& trainer, const TokenDataset& data, std::int64_t rows, std::int64_t batch,
                                             std::int64_t seq) {
  const auto n = static_cast<std::size_t>(batch * seq);
  std::vector<std::int32_t> ids(n), labels(n);
  double total = 0;
  std::int64_t tokens = 0;
  for (std::int64_t first = 0; first < rows; first += batch) {
    const std::int64_t take = std::min(batch, rows - first);
    std::fill(ids.begin(), ids.end(), 0);
    std::fill(labels.begin(), labels.end(), kIgnoreIndex);
    const auto used = static_cast<std::size_t>(take * seq);
    data.val_batch(first, take, std::span(ids).first(used), std::span(labels).first(used));
    const auto valid = static_cast<std::int64_t>(std::count_if(labels.begin(), labels.end(),
                                                               [](std::int32_t l) { return l != kIgnoreIndex; }));
    total += trainer.evaluate(ids, labels, batch) * static_cast<double>(valid);
    tokens += valid;
  }
  return {total / static_cast<double>(tokens), tokens};
}

template <class B>
int train(B& be, const char* backend_name, const Settings& s, const CLI::App& app, const ModelConfig& cfg,
          const TokenDataset& data, const TrainerOptions& topt, RunPlan& plan) {
  // ---- build ----------------------------------------------------------------------------------
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = s.seed;
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(topt, so));
  Trainer<B> trainer(model, store, be, topt);
  // Evaluating only, everything but the JSON result goes to stderr.
  FILE* const info = plan.eval_only ? stderr : stdout;
  const std::string model_label = !s.model_dir.empty()      ? s.model_dir
                                  : !s.model_config.empty() ? s.model_config
                                  : !s.preset.empty()       ? s.preset
                                                            : std::string("command-line shape");
  if (plan.hf) {
    const auto t0 = std::chrono::steady_clock::now();
    plan.hf->load_into(store);
    std::fprintf(info, "loaded %s (%lld parameters) in %.1f s%s\n", s.model_dir.c_str(),
                 static_cast<long long>(store.param_count()),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 plan.hf->ignored().empty() ? "" : fmt::format("; not loaded: {}", fmt::join(plan.hf->ignored(), ", ")).c_str());
    plan.hf.reset();  // unmap the files: an export may replace that very directory
  }
  const auto export_model = [&](std::int64_t step) {
    const auto t0 = std::chrono::steady_clock::now();
    const fs::path dir(s.export_dir);
    if (dir.has_parent_path()) fs::create_directories(dir.parent_path());
    io::export_hf_model(store, cfg, dir, *plan.export_options);
    std::fprintf(info, "exported step %lld to %s (%s) in %.1f s\n", static_cast<long long>(step), s.export_dir.c_str(),
                 std::string(io::torch_dtype_name(plan.export_options->dtype)).c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(info);
  };
  constexpr const char* compute_dtype = std::is_same_v<typename B::Weight, float> ? "float32" : "bfloat16";

  if (plan.eval_only) {
    std::fprintf(info, "megatrain-train: evaluating %s (%s, %lld parameters) on %lld sequences of %lld tokens, backend %s (%s)\n",
                 model_label.c_str(), std::string(cfg.architecture_name()).c_str(),
                 static_cast<long long>(cfg.param_count()), static_cast<long long>(plan.eval_rows),
                 static_cast<long long>(s.seq), backend_name, compute_dtype);
    const auto [loss, tokens] = evaluate_all(trainer, data, plan.eval_rows, topt.batch_rows, s.seq);
    json r{{"val_loss", loss},        {"tokens", tokens},         {"sequences", plan.eval_rows}, {"seq", s.seq},
           {"backend", backend_name}, {"compute_dtype", compute_dtype}, {"model", model_label}};
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);
    if (plan.export_options) export_model(0);
    return 0;
  }

  const fs::path& out = plan.out;
  fs::create_directories(out);
  {
    std::ofstream(out / "config.json") << cfg.to_json().dump(2) << '\n';
    json o;
    std::vector<const CLI::Option*> opts = app.get_options();
    for (const CLI::App* group : app.get_subcommands([](const CLI::App*) { return true; }))
      for (const CLI::Option* opt : group->get_options()) opts.push_back(opt);
    for (const CLI::Option* opt : opts)
      if (!opt->get_lnames().empty() && opt->get_lnames().front() != "help" && opt->get_lnames().front() != "config")
        o[opt->get_lnames().front()] = opt->count() > 0 ? opt->as<std::string>() : opt->get_default_str();
    std::ofstream(out / "options.json") << o.dump(2) << '\n';
  }
  std::ofstream metrics(out / "metrics.jsonl", std::ios::trunc);
  MT_CHECK(metrics.good(), "cannot write '{}'", (out / "metrics.jsonl").string());

  std::printf("megatrain-train: %s, %lld parameters (%lld layers, hidden %lld, vocab %lld), backend %s, data %s "
              "(%lld training tokens, %lld validation)\n",
              std::string(cfg.architecture_name()).c_str(), static_cast<long long>(cfg.param_count()),
              static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(cfg.hidden_size),
              static_cast<long long>(cfg.vocab_size), backend_name, s.data.empty() ? "built-in text" : s.data.c_str(),
              static_cast<long long>(data.train_tokens()), static_cast<long long>(data.val_tokens()));
  const std::int64_t micro = trainer.options().micro_batches;
  std::printf("batch %lld x %lld tokens%s, %lld steps, host memory %s, writing %s\n", static_cast<long long>(s.batch),
              static_cast<long long>(s.seq),
              micro > 1 ? fmt::format(" in {} micro-batches of {}", micro, s.batch / micro).c_str() : "",
              static_cast<long long>(s.steps), format_bytes(store.bytes()).c_str(), out.string().c_str());
  std::fflush(stdout);

  // ---- train ----------------------------------------------------------------------------------
  const auto n = static_cast<std::size_t>(s.batch * s.seq);
  std::vector<std::int32_t> ids(n), labels(n);
  Progress progress(s.steps, isatty(STDOUT_FILENO) != 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto validation = [&] {
    const std::int64_t rows = s.eval_batches * s.batch;
    std::vector<std::int32_t> vi(static_cast<std::size_t>(rows * s.seq)), vl(vi.size());
    data.val_batch(0, rows, vi, vl);
    return trainer.evaluate(vi, vl, rows);
  };
  for (std::int64_t step = 1; step <= s.steps; ++step) {
    data.train_batch((step - 1) * s.batch, s.batch, ids, labels);
    const StepStats st = trainer.step(ids, labels);
    const double tok_s = static_cast<double>(st.tokens) / st.seconds;
    std::optional<double> val;
    if ((s.eval_every > 0 && step % s.eval_every == 0) || step == s.steps) val = validation();
    json m{{"step", st.step},           {"loss", st.loss},         {"lr", st.lr},
           {"grad_norm", st.grad_norm}, {"clip_coef", st.clip_coef}, {"tokens", st.tokens},
           {"tokens_per_s", tok_s},     {"step_time_s", st.seconds}};
    if (val) m["val_loss"] = *val;
    metrics << m.dump() << '\n' << std::flush;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    progress.update(st, tok_s, elapsed, val, s.log_every);
    if (plan.export_options && (step == s.steps || (s.export_every > 0 && step % s.export_every == 0))) export_model(step);
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("done: %lld steps in %.1f s; metrics in %s\n", static_cast<long long>(s.steps), total,
              (out / "metrics.jsonl").string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatrain-train: train a decoder-only language model (Llama / Mistral / Qwen2 family)"};
  app.set_help_flag("-h,--help", "Print this help and exit");
  // An option may come from the config file and again from the command line: the last wins.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  Settings s;
  std::string config_file;
  app.add_option("--config", config_file, "JSON file of options (keys: long option names); the command line wins");

  auto* model = app.add_option_group("model", "Model shape (default: a small Llama)");
  model->add_option("--model", s.model_dir,
                    "Hugging Face model directory (config.json + safetensors) to fine-tune: shape and weights from there");
  model->add_option("--allow-dtype-mismatch", s.allow_dtype_mismatch,
                    "--model: load tensors stored in another float dtype than config.json declares (true/false)")
      ->capture_default_str();
  model->add_option("--model-config", s.model_config, "Hugging Face config.json giving the model shape");
  model->add_option("--preset", s.preset, "Built-in shape: " + fmt::format("{}", fmt::join(ModelConfig::preset_names(), ", ")));
  model->add_option("--hidden", s.hidden, "Hidden size")->capture_default_str();
  model->add_option("--layers", s.layers, "Decoder layers")->capture_default_str();
  model->add_option("--heads", s.heads, "Attention heads")->capture_default_str();
  model->add_option("--kv-heads", s.kv_heads, "Key/value heads (grouped-query attention)")->capture_default_str();
  model->add_option("--intermediate", s.intermediate, "MLP intermediate size")->capture_default_str();
  model->add_option("--head-dim", s.head_dim, "Head dimension (default hidden / heads)");
  model->add_option("--vocab", s.vocab, "Vocabulary size (default: 256 for text data)");
  model->add_option("--rope-theta", s.rope_theta, "Rotary base")->capture_default_str();
  model->add_option("--norm-eps", s.norm_eps, "RMSNorm epsilon")->capture_default_str();
  model->add_option("--tie-embeddings", s.tie_embeddings, "Share the embedding and LM head (true/false)")->capture_default_str();

  auto* data = app.add_option_group("data", "Data (default: the built-in text)");
  data->add_option("--data", s.data, "Token file (.bin: uint16/uint32 ids or llm.c format) or a text file (byte tokens)");
  data->add_option("--data-format", s.data_format, "Token width of .bin files: u16 or u32")->capture_default_str();
  data->add_option("--val-data", s.val_data, "Separate validation token file (default: hold out the tail of --data)");
  data->add_option("--val-fraction", s.val_fraction, "Fraction of the data held out for validation")->capture_default_str();

  auto* train = app.add_option_group("training", "Batch, schedule and optimizer");
  train->add_option("--batch", s.batch, "Sequences per optimizer step")->capture_default_str();
  train->add_option("--seq", s.seq, "Tokens per sequence")->capture_default_str();
  train->add_option("--steps", s.steps, "Optimizer steps (0: evaluate only: print the validation loss as JSON)")->capture_default_str();
  train->add_option("--micro-batches", s.micro_batches, "Gradient accumulation: split each batch into this many parts")->capture_default_str();
  train->add_option("--max-micro-batch", s.max_micro_batch,
                    "Most sequences on the device at once; a larger --batch runs as gradient accumulation over "
                    "micro-batches (0: no limit)")
      ->capture_default_str();
  train->add_option("--chunk", s.chunk, "Sequences per compute chunk (0: a whole micro-batch)")->capture_default_str();
  train->add_option("--lr", s.lr, "Peak learning rate")->capture_default_str();
  train->add_option("--min-lr", s.min_lr, "Floor of the cosine schedule")->capture_default_str();
  train->add_option("--warmup", s.warmup, "Linear warm-up steps (cosine schedule; default min(10, steps / 5))");
  train->add_option("--schedule", s.schedule, "constant, or cosine (warm-up then cosine decay to --min-lr)")->capture_default_str();
  train->add_option("--weight-decay", s.weight_decay, "AdamW decoupled weight decay (matrices only)")->capture_default_str();
  train->add_option("--beta1", s.beta1, "AdamW beta1")->capture_default_str();
  train->add_option("--beta2", s.beta2, "AdamW beta2")->capture_default_str();
  train->add_option("--eps", s.eps, "AdamW epsilon")->capture_default_str();
  train->add_option("--clip", s.clip, "Max global gradient norm (0: no clipping)")->capture_default_str();
  train->add_option("--clip-mode", s.clip_mode, "stale (clip with the previous step's global norm; the optimizer overlaps the backward) or exact "
                    "(PyTorch's clip_grad_norm_ over this step's gradients; the optimizer waits for the backward)")->capture_default_str();

  auto* runo = app.add_option_group("run", "Run");
  runo->add_option("--seed", s.seed, "Seed for initialisation and data order")->check(CLI::NonNegativeNumber)->capture_default_str();
  runo->add_option("--out", s.out, "Output directory (default: runs/<date-time>)");
  runo->add_option("--overwrite", s.overwrite, "Replace a previous run in --out (true/false)")->capture_default_str();
  runo->add_option("--backend", s.backend, "auto, cpu or cuda")->capture_default_str();
  runo->add_option("--eval-every", s.eval_every, "Validation loss every N steps (0: only at the end)")->capture_default_str();
  runo->add_option("--eval-batches", s.eval_batches, "Batches per validation")->capture_default_str();
  runo->add_option("--log-every", s.log_every, "Print every N steps when not on a terminal")->capture_default_str();
  runo->add_option("--host-memory", s.host_memory, "Host memory megatrain may use, e.g. 120G (default: what is free)");
  runo->add_option("--gpu-memory", s.gpu_memory, "GPU memory megatrain may use, e.g. 20G (default: what is free less 1 GiB)");

  auto* exp = app.add_option_group("export", "Hugging Face export (default: none)");
  exp->add_option("--export", s.export_dir, "Write the trained model as a Hugging Face directory here at the end (atomically)");
  exp->add_option("--export-every", s.export_every, "Also export every N steps (0: only at the end)")->capture_default_str();
  exp->add_option("--export-dtype", s.export_dtype, "Exported weights: bf16, f16 or f32")->capture_default_str();
  exp->add_option("--shard-size", s.shard_size, "Largest safetensors shard, e.g. 5GB (decimal), 2GiB")->capture_default_str();

  try {
    // First pass: find --config; then parse the file's options followed by the command line.
    std::vector<std::string> args(argv + 1, argv + argc);
    std::vector<std::string> all;
    for (std::size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--config" && i + 1 < args.size()) {
        config_file = args[i + 1];
      } else if (args[i].rfind("--config=", 0) == 0) {
        config_file = args[i].substr(9);
      }
    }
    // An option may appear once on the command line (a value there overrides the config file's).
    for (const auto& a : args) {
      if (a.rfind("--", 0) != 0 || a.size() == 2) continue;
      const std::string name = a.substr(0, a.find('='));
      MT_CHECK(s.origins.cli.insert(name).second, "{} is given more than once; pass it once", name);
    }
    if (!config_file.empty()) all = config_args(config_file, app);
    for (const auto& a : all)
      if (a.rfind("--", 0) == 0) s.origins.file.insert(a);
    all.insert(all.end(), args.begin(), args.end());
    std::reverse(all.begin(), all.end());  // CLI11 parses a vector given in reverse order
    app.parse(all);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: %s\n", e.what());
    return 2;
  }
  try {
    return run(s, app);
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.what());
    return 1;
  }
}
