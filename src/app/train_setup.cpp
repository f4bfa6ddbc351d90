// megatrain-train from its options to its training (train_setup.hpp): every option checked before
// anything is touched, the model and the checkpoint opened, the run folder claimed, the data
// prepared and opened, the model and the trainer's options resolved, a resume checked to continue
// its run exactly; then the backend's training (train_run.hpp).
#include "train_setup.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/text/prepare.hpp"
#include "megatrain/text/tokenizer.hpp"
#include "options.hpp"
#include "parse.hpp"
#include "stop_signals.hpp"
#include "train_inputs.hpp"
#include "train_samples.hpp"
#include "grpo_plan.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#endif

namespace megatrain::app {

namespace fs = std::filesystem;

std::string config_text_of(const ModelConfig& cfg, const std::string& model_config, std::optional<std::int32_t> bos,
                           std::optional<std::int32_t> eos) {
  json j = cfg.to_json();
  json file = json::object();
  if (!model_config.empty()) file = json::parse(io::read_side_file(model_config));
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (file.contains(key) && !j.contains(key)) j[key] = file[key];
  if (bos && !j.contains("bos_token_id")) j["bos_token_id"] = *bos;
  if (eos && !j.contains("eos_token_id")) j["eos_token_id"] = *eos;
  return j.dump(2) + "\n";
}

namespace {

class TrainSetup {
 public:
  TrainSetup(const Settings& settings, const CLI::App& app, RunPlan& plan, Ranks& ranks)
      : s(settings), app_(app), plan_(plan), ranks_(ranks) {}

  int run() {
    validate_options();
    validate_ranks();
    validate_objective();
    validate_evaluation();
    validate_export();
    // (--gpus N: set once by main, before the ranks' threads start)
    if (!s.host_memory.empty() && !ranks_.threads()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);
    open_model_sources();
    plan_.samples = plan_samples(s, plan_, ranks_.several(), eval_only_);
    if (!eval_only_) plan_.grpo = plan_grpo(s, plan_);  // (its prompts: the run's data, not token windows)
    if (plan_.grpo) keep_tokenizer_files(run_tokenizer_source(s, plan_), *plan_.grpo->tokenizer);
    // Data first: text data's vocabulary (bytes) sizes a model given on the command line; token
    // files need the vocabulary given, which decides their width unless --data-format does.
    // (With --steps 0 --eval-batches 0 nothing is evaluated and no data is read.)
    need_data_ = !(eval_only_ && s.eval_batches == 0) && !plan_.grpo;
    if (!eval_only_) claim_run_folder();
    fault::delay_point("train:setup");  // (tests: a signal that lands before training starts)
    StopSignals::check("while starting");
    // (a GRPO run's checkpoint: its --data is prompts, which have no labels to evaluate)
    MT_CHECK(!(eval_only_ && need_data_ && plan_.resume && plan_.resume->state.user["data"].contains("prompts_digest") &&
               !s.origins.given_now("--data")),
             "--steps 0 evaluates the cross-entropy of token data, and this checkpoint's run (--objective grpo) trained on "
             "prompts ('{}'): add --eval-batches 0 to export only, or give --data of text or examples to evaluate",
             s.data);
    data_file_ = !s.data.empty() ? s.data : (eval_only_ ? s.val_data : std::string());
    val_file_ = s.val_data;
    if (need_data_ && !data_file_.empty()) prepare_data();
    open_token_sources();
    resolve_model();
    build_dataset();
    build_trainer_options();
    if (plan_.resume && !eval_only_) check_resume_continues();
    if (plan_.export_options) check_export_paths();
    StopSignals::check("while preparing the run");
    return train_on_backend();
  }

 private:
  // ---- options alone ---------------------------------------------------------------------------
  void validate_options() {
    MT_CHECK(!(s.backend == "cuda" && !MEGATRAIN_HAS_CUDA), "--backend cuda: megatrain was built without CUDA");
    MT_CHECK(!(s.backend == "cuda" && !cuda_device_present()), "--backend cuda: no usable GPU was found");
    use_cuda_ = s.backend == "cuda" || (s.backend == "auto" && cuda_device_present());
    MT_CHECK(s.gpu_memory.empty() || use_cuda_, "--gpu-memory needs the cuda backend");
    for (const char* f : {"--min-lr", "--min-lr-ratio"})
      MT_CHECK(!(s.schedule == "constant" && s.origins.conflicts(f, "--schedule")),
               "{} needs --schedule cosine or linear (a constant schedule has no floor)", f);
    MT_CHECK(!s.origins.given("--min-lr-ratio") || (s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1),
             "--min-lr-ratio must be in [0, 1] (got {})", s.min_lr_ratio);
    MT_CHECK(!s.origins.given("--min-lr") || (s.min_lr >= 0 && s.min_lr <= s.lr),
             "--min-lr must be in [0, --lr] (got {} with --lr {}); --min-lr-ratio sets it relative to --lr", s.min_lr, s.lr);
    MT_CHECK(!s.origins.given("--warmup-ratio") || (s.warmup_ratio >= 0 && s.warmup_ratio < 1),
             "--warmup-ratio must be in [0, 1) (got {})", s.warmup_ratio);
    MT_CHECK(!s.origins.given("--warmup") || s.warmup >= 0, "--warmup must be >= 0 (got {})", s.warmup);
    MT_CHECK(s.max_nonfinite_skips >= 1, "--max-nonfinite-skips must be >= 1 (got {})", s.max_nonfinite_skips);
    MT_CHECK(!(s.clip == 0 && s.origins.conflicts("--clip-mode", "--clip")), "--clip-mode given but clipping is off (--clip 0)");
    MT_CHECK(s.val_data.empty() || !s.origins.conflicts("--val-fraction", "--val-data"),
             "--val-fraction contradicts --val-data: validation comes from that file; drop one");
    MT_CHECK(s.steps >= 0, "--steps must be >= 0 (got {}; 0 evaluates only)", s.steps);
    MT_CHECK(!s.origins.given("--out") || !s.out.empty(), "--out is empty: give the folder for the run (without --out: "
             "runs/<date-time>)");
    eval_only_ = s.steps == 0;
  }

  // What is evaluated, logged and saved; what --steps 0 (evaluation only) refuses.
  void validate_evaluation() {
    MT_CHECK(s.eval_every >= 0 && s.log_every > 0, "--eval-every >= 0, --log-every > 0");
    MT_CHECK(s.eval_batches > 0 || (eval_only_ && s.eval_batches == 0),
             "--eval-batches must be > 0 (0, no evaluation, only with --steps 0)");
    MT_CHECK(s.save_every >= 0 && s.keep >= 0, "--save-every and --keep must be >= 0 (got {} and {})", s.save_every, s.keep);
    MT_CHECK(!(s.data.empty() && !s.val_data.empty()) || eval_only_,
             "--val-data needs --data (except with --steps 0, which evaluates on --val-data alone)");
    MT_CHECK(!(eval_only_ && !s.out.empty() && !plan_.resume),
             "--steps 0 evaluates only and writes no run directory: drop --out (the loss is printed as JSON)");
    if (eval_only_)  // options that only shape training would be ignored: refuse them
      for (const char* f : {"--lr", "--min-lr", "--min-lr-ratio", "--warmup", "--warmup-ratio", "--schedule", "--weight-decay",
                            "--beta1", "--beta2", "--eps", "--clip", "--clip-mode", "--micro-batches", "--overwrite",
                            "--eval-every", "--log-every", "--save-every", "--keep", "--device-units", "--keep-activations",
                            "--spill-activations", "--gradients", "--gemm-tuning", "--on-metrics-error"})
        MT_CHECK(!s.origins.conflicts(f, "--steps"), "{} has no effect with --steps 0 (evaluation only); drop it", f);
    check_model_source(s);
    plan_.eval_only = eval_only_;
  }

  // Several processes (docs/distributed.md): --batch and --micro-batches are the global batch's.
  void validate_ranks() {
    for (const char* flag : {"--shard-optimizer", "--share-weights", "--gather-weights"})
      MT_CHECK(ranks_.several() || !s.origins.given_now(flag),
               "{} applies to several processes (launched by torchrun, mpirun or srun, or --gpus); drop it", flag);
    MT_CHECK(s.share_weights != "true" || s.shard_optimizer,
             "--share-weights true shares the weights of processes that each step 1/N of them: it needs --shard-optimizer "
             "true");
    if (!ranks_.several()) return;
    MT_CHECK(!eval_only_, "{}", ranks_.threads()
                                    ? fmt::format("--steps 0 (evaluate or export) runs on one GPU: drop --gpus {}", s.gpus)
                                    : fmt::format("--steps 0 (evaluate or export) runs in one process, and this is process {} "
                                                  "of {} ({} launched them): run it once", ranks_.rank(), ranks_.world(),
                                                  ranks_.info().launcher));
    const char* what = ranks_.threads() ? "GPUs (--gpus)" : "processes";
    MT_CHECK(s.batch % ranks_.world() == 0, "--batch {} (the global batch) must be a multiple of the {} {}: each trains "
             "--batch / {} of its sequences", s.batch, ranks_.world(), what, ranks_.world());
    MT_CHECK(s.micro_batches == 1 || s.micro_batches % ranks_.world() == 0,
             "--micro-batches {} (the passes of the global batch) must be 1 or a multiple of the {} {}: each runs "
             "--micro-batches / {} of them", s.micro_batches, ranks_.world(), what, ranks_.world());
  }

  // --objective dpo (docs/preference.md): what its pairs and reference need, checked before anything starts.
  void validate_objective() {
    check_objective_options(s);
    if (s.objective == "sft") return;
    MT_CHECK(!eval_only_ || !s.origins.given_now("--objective"),
             "--steps 0 evaluates the cross-entropy of the validation data: drop --objective {}", s.objective);
    if (eval_only_) return;
    if (s.objective == "grpo") {
      MT_CHECK(!ranks_.several(), "--objective grpo runs on one GPU (one process) for now: drop --gpus, or launch one process");
      for (const char* f : {"--pack", "--train-on", "--data-format", "--skip-bad-lines"})
        MT_CHECK(!s.origins.conflicts(f, "--objective"), "{} applies to training data; --objective grpo samples its own "
                 "completions of --data's prompts: drop it", f);
      return;
    }
    if (!s.pack) check_pairs_batch(s.batch, ranks_.world());  // (packed: each row holds whole pairs)
    MT_CHECK(s.train_on == "completion", "--objective dpo compares the answers' log-probabilities: drop --train-on {}",
             s.train_on);
  }

  // Export: every contradiction is found now, not after hours of training.
  void validate_export() {
    MT_CHECK(!s.model_dir.empty() || !s.origins.conflicts("--allow-dtype-mismatch", "--model"),
             "--allow-dtype-mismatch needs --model DIR");
    for (const char* f : {"--export-every", "--export-dtype", "--shard-size", "--export-language-model"})
      MT_CHECK(!s.export_dir.empty() || !s.origins.conflicts(f, "--export"), "{} needs --export DIR", f);
    MT_CHECK(s.export_every >= 0, "--export-every must be >= 0 (got {}; 0 exports only at the end)", s.export_every);
    MT_CHECK(!(eval_only_ && s.export_every > 0 && s.origins.conflicts("--export-every", "--steps")),
             "--export-every needs training steps (--steps 0 exports once)");
    MT_CHECK(!(eval_only_ && s.eval_batches == 0 && s.export_dir.empty()),
             "--steps 0 --eval-batches 0 does nothing: add --export DIR (export without evaluating)");
    if (s.export_dir.empty()) return;
    io::HfExportOptions e;
    e.dtype = s.export_dtype == "f32" ? DType::f32 : s.export_dtype == "f16" ? DType::f16 : DType::bf16;
    e.max_shard_bytes = io::parse_shard_size(s.shard_size);
    io::check_hf_export_target(s.export_dir, plan_.run_id);
    e.owner = plan_.run_id;
    plan_.export_options = std::move(e);
  }

  // ---- the model, the run folder, the data ---------------------------------------------------------
  // A resumed run's model is its checkpoint's; a Hugging Face model is opened and checked against
  // its config.json before anything else.
  void open_model_sources() {
    if (plan_.resume) {
      const auto text = plan_.resume->ckpt.file("config.json");
      MT_CHECK(text.has_value(), "--resume '{}': the checkpoint has no config.json", plan_.resume->ckpt.dir().string());
      cfg_ = ModelConfig::from_json(json::parse(*text), "the checkpoint's config.json");
      plan_.config_text = *text;
      for (const auto& name : plan_.resume->side_files) {
        const auto f = plan_.resume->ckpt.file(name);
        MT_CHECK(f.has_value(), "--resume '{}': the checkpoint lists {} but lacks it", plan_.resume->ckpt.dir().string(), name);
        plan_.side_files[name] = *f;
      }
    }
    if (plan_.resume && plan_.resume->state.user.contains("carried"))
      plan_.carried = io::CarriedTensors::from_json(plan_.resume->state.user.at("carried"),
                                                    fmt::format("--resume '{}'", plan_.resume->ckpt.dir().string()));
    if (s.model_dir.empty()) return;
    io::HfOpenOptions open_options;
    open_options.allow_dtype_mismatch = s.allow_dtype_mismatch;
    plan_.hf = io::HfCheckpoint::open(s.model_dir, open_options);
    StopSignals::check("while opening the model");
    // The tensors an export of the whole model carries: --model's; resumed, the checkpoint's record,
    // read from --model where that folder holds the same ones (it may have moved).
    auto carried = plan_.hf->carried();
    if (carried && plan_.resume && !plan_.carried)
      plan_.notes.push_back(fmt::format("note: --resume '{}' records none of the tensors beside the language model of "
                                        "--model '{}' (a checkpoint written before exports carried them): an export "
                                        "is its language model alone", plan_.resume->ckpt.dir().string(), s.model_dir));
    else if (!plan_.resume || (carried && plan_.carried && carried->digest == plan_.carried->digest))
      plan_.carried = std::move(carried);
    if (!plan_.resume) {
      plan_.config_text = plan_.hf->config_text();
      plan_.side_files = io::hf_side_files(s.model_dir);
    }
  }

  // The run folder, claimed by the first rank before anything is written in it (io/run_folder.hpp):
  // locked for the run's life; with --overwrite, the previous run moved aside.
  void claim_run_folder() {
    if (!ranks_.lead()) {  // (the first rank's folder is the run's: the others learn it later)
      plan_.out = s.out.empty() ? fs::path(default_out_dir()) : fs::path(s.out);
      return;
    }
    io::RunClaimOptions o;
    o.resume = plan_.resume.has_value() && !plan_.branch;  // (a branch starts a run folder of its own)
    o.overwrite = s.overwrite;
    for (const std::string* in : {&s.data, &s.val_data, &s.model_dir, &s.model_config, &s.tokenizer})
      if (!in->empty()) o.inputs.emplace_back(*in);
    if (plan_.resume) o.inputs.push_back(plan_.resume->ckpt.dir());
    plan_.folder =
        std::make_shared<io::RunFolder>(s.out.empty() ? io::RunFolder::claim_new("runs", o) : io::RunFolder::claim(s.out, o));
    plan_.out = plan_.folder->path();
    if (!plan_.folder->taken_over_from().empty())
      plan_.notes.push_back(fmt::format("note: took over the run folder's lock from {}, which is no longer running",
                                        plan_.folder->taken_over_from()));
    if (const auto& r = plan_.folder->replaced())
      plan_.notes.push_back(fmt::format("--overwrite: the previous run in '{}' was moved to '{}'; it is removed once this "
                                        "run has saved a checkpoint or finished, and put back if this run stops before its "
                                        "first step", plan_.out.string(), r->string()));
  }

  // JSON data, and text with a tokenizer, are tokenised first (megatrain-tokenize's work) into
  // token files in the run folder (a temporary folder when only evaluating), then memory-mapped.
  void prepare_data() {
    const std::string ext = fs::path(data_file_).extension().string();
    const bool json_data = ext == ".jsonl" || ext == ".json";
    const std::string tokenizer = !s.tokenizer.empty() ? s.tokenizer : plan_.hf ? s.model_dir : std::string();
    MT_CHECK(!json_data || !tokenizer.empty(),
             "--data '{}' is JSON records, tokenised with the model's own tokenizer: give --model DIR (a Hugging Face folder "
             "with tokenizer.json) or --tokenizer", data_file_);
    for (const char* f : {"--chat-format", "--skip-bad-lines"})
      MT_CHECK(json_data || !s.origins.conflicts(f, "--data"), "{} applies to JSON data; --data '{}' is not", f, data_file_);
    MT_CHECK(!s.origins.given("--tokenizer") || ext != ".bin", "--tokenizer applies to text and JSON data; --data '{}' holds "
             "token ids already", data_file_);
    if (ext == ".bin" || tokenizer.empty()) return;
    MT_CHECK(!s.origins.conflicts("--data-format", "--data"),
             "--data-format applies to .bin token files; --data '{}' is tokenised with the model's tokenizer", data_file_);
    std::error_code ec;
    const fs::path tp(tokenizer);
    const auto tok = fs::is_directory(tp, ec) ? text::Tokenizer::from_folder(tp) : text::Tokenizer::from_file(tp);
    StopSignals::check("while loading the tokenizer");
    keep_tokenizer_files(tokenizer, tok);
    const fs::path dir = data_folder();
    prepared_ = prepare(tok, dir, data_file_, "train.bin", "--data");
    data_file_ = (dir / "train.bin").string();
    if (val_file_.empty()) return;
    MT_CHECK(fs::path(val_file_).extension() != ".bin",
             "--val-data '{}' holds token ids but --data '{}' is tokenised here: give both as token files, or both as JSON or "
             "text", val_file_, s.data);
    const auto v = prepare(tok, dir, val_file_, "val.bin", "--val-data");
    MT_CHECK(v.examples == prepared_->examples, "--val-data '{}' holds {} but --data '{}' holds {}: give both alike", val_file_,
             v.examples ? "examples" : "documents", s.data, prepared_->examples ? "examples" : "documents");
    val_file_ = (dir / "val.bin").string();
  }
  // The tokenizer's end ids (for the config.json of a model given on the command line); and a run on
  // a tokenizer of its own (not --model's, not a checkpoint's): its files go with the checkpoints and
  // exports, as a model folder's would.
  void keep_tokenizer_files(const std::string& tokenizer, const text::Tokenizer& tok) {
    tokenizer_bos_ = tok.bos_id();
    tokenizer_eos_ = tok.eos_id();
    if (plan_.hf || plan_.resume) return;
    std::error_code ec;
    const fs::path tp(tokenizer);
    plan_.side_files = io::hf_side_files(fs::is_directory(tp, ec) ? tp : tp.parent_path());
    if (!fs::is_directory(tp, ec)) plan_.side_files["tokenizer.json"] = io::read_side_file(tp);
  }

  // Where the data is prepared: the run folder's data/; evaluating only, a temporary folder;
  // resuming, RUN/data/incoming, moved over RUN/data's files once the resume is accepted (so a
  // refused resume leaves the run's data as it was); a process of several other than the first, a
  // folder of its own (the first writes the run folder's).
  fs::path data_folder() {
    const bool temp = eval_only_ || !ranks_.lead();
    const fs::path dir = temp           ? fs::temp_directory_path() / fmt::format("megatrain-data-{}-{}", getpid(), ranks_.rank())
                         : plan_.resume ? plan_.out / "data" / "incoming"
                                        : plan_.out / "data";
    if (temp || plan_.resume) {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
      plan_.temp_data = std::shared_ptr<const fs::path>(new fs::path(dir), [](const fs::path* p) {
        std::error_code ignored_too;
        fs::remove_all(*p, ignored_too);
        delete p;
      });
    }
    fs::create_directories(dir);
    return dir;
  }
  text::PrepareResult prepare(const text::Tokenizer& tok, const fs::path& dir, const std::string& in, const char* name,
                              const char* option) {
    text::PrepareOptions po;
    po.input = in;
    po.output = dir / name;
    po.chat_format = s.chat_format;
    po.skip_bad_lines = s.skip_bad_lines;
    po.overwrite = true;  // (the run folder's own copy)
    po.input_option = option;
    po.skip_option = "--skip-bad-lines true";
    // (one bar, the first rank's; a stop signal ends the preparation, leaving nothing behind)
    po.progress = [bar = ranks_.lead() ? text::terminal_progress(in) : nullptr](std::uintmax_t done, std::uintmax_t total) {
      StopSignals::check("while preparing the data");
      if (bar) bar(done, total);
    };
    auto r = text::prepare_token_files(tok, po);
    std::fprintf(eval_only_ ? stderr : ranks_.out(), "%s\n", r.summary.c_str());
    return r;
  }

  // Token files need the vocabulary; their width is the prepared one's, or --data-format, or (auto)
  // uint32 where the vocabulary does not fit 16 bits (the reader refuses a file whose contents say
  // otherwise).
  void open_token_sources() {
    const bool bin_data = need_data_ && fs::path(data_file_).extension() == ".bin";
    MT_CHECK(!bin_data || s.vocab > 0 || plan_.hf || plan_.resume || !s.model_config.empty() || !s.preset.empty(),
             "--data '{}' holds token ids{}: give the vocabulary (--vocab, --model, --model-config or --preset)",
             s.data.empty() ? data_file_ : s.data, prepared_ ? " once tokenised" : "");
    MT_CHECK(!need_data_ || bin_data || !s.origins.conflicts("--data-format", "--data"),
             "--data-format applies to .bin token files, but the data is text ({}), tokenised by bytes",
             data_file_.empty() ? "the built-in text" : data_file_);
    fmt_bin_ = s.data_format == "u32" ? TokenFormat::u32 : TokenFormat::u16;
    if (prepared_) {
      fmt_bin_ = prepared_->wide ? TokenFormat::u32 : TokenFormat::u16;
    } else if (s.data_format == "auto" && bin_data) {
      const std::int64_t vocab = cfg_ ? cfg_->vocab_size : model_config(s, app_, 0, plan_.hf ? &*plan_.hf : nullptr).vocab_size;
      fmt_bin_ = vocab > 65536 ? TokenFormat::u32 : TokenFormat::u16;
    }
    if (need_data_)
      train_src_ = !data_file_.empty() ? TokenSource::open(data_file_, fmt_bin_)
                                       : TokenSource::from_text(builtin_text(1 << 20, 1), "built-in text");
    text_data_ = train_src_ && train_src_->format() == TokenFormat::text;
  }

  // The model: a resumed run's (model options given again must describe it), or the options'.
  void resolve_model() {
    // (a GRPO run's prompts: its tokenizer's vocabulary)
    const std::int64_t data_vocab = text_data_ ? 256 : plan_.grpo ? plan_.grpo->tokenizer->vocab_size() : 0;
    if (plan_.resume) {
      std::vector<std::string> opts = model_source_options();
      opts.insert(opts.end(), model_shape_options().begin(), model_shape_options().end());
      if (std::any_of(opts.begin(), opts.end(), [&](const std::string& o) { return s.origins.given_now(o); })) {
        const ModelConfig given = model_config(s, app_, data_vocab, plan_.hf ? &*plan_.hf : nullptr);
        const auto diff = model_differences(cfg_->to_json(), given.to_json());
        MT_CHECK(diff.empty(), "--resume: the model options given describe another model than the checkpoint's "
                 "(checkpoint vs given: {}); drop them (the checkpoint holds the model)", fmt::join(diff, "; "));
      }
    } else {
      cfg_ = model_config(s, app_, data_vocab, plan_.hf ? &*plan_.hf : nullptr);
      if (plan_.config_text.empty()) plan_.config_text = config_text_of(*cfg_, s.model_config, tokenizer_bos_, tokenizer_eos_);
    }
    if (plan_.export_options) {
      plan_.export_options->config_json = plan_.config_text;
      plan_.export_options->extra_files = plan_.side_files;
      // The whole model where the folder has more than its language model: its tensors checked now,
      // not after hours of training.
      if (plan_.carried && !s.export_language_model) {
        (void)io::open_carried(*plan_.carried);
        plan_.export_options->carry = plan_.carried;
      }
    }
    MT_CHECK(!text_data_ || cfg_->vocab_size >= 256,
             "text data is tokenised by bytes (vocabulary 256) but the model's vocab_size is {}", cfg_->vocab_size);
    // A pretrained model reads its own tokenizer's ids: byte ids would train it on nonsense (unless
    // its vocabulary is the 256 bytes, as a model megatrain-train trained on text is).
    MT_CHECK(!text_data_ || !plan_.hf || cfg_->vocab_size == 256,
             "{} is text, which megatrain-train tokenises by bytes (ids 0-255), not with the tokenizer of --model '{}' "
             "(vocabulary {}): tokenise it with the model's tokenizer first (megatrain-tokenize --tokenizer '{}' --input "
             "FILE --output train.bin) and pass the token file as --data",
             data_file_.empty() ? std::string("the built-in text") : "--data '" + data_file_ + "'", s.model_dir,
             cfg_->vocab_size, s.model_dir);
  }

  // The dataset over the training and validation tokens, and its identity (kept in checkpoints).
  void build_dataset() {
    if (plan_.grpo) {
      for (const PromptSet* set : {&plan_.grpo->train, &plan_.grpo->val})
        for (std::size_t i = 0; i < set->ids.size(); ++i)
          for (const std::int32_t id : set->ids[i])
            MT_CHECK(id >= 0 && id < cfg_->vocab_size, "{} prompt {} holds token id {}, outside the model's vocabulary of {}: "
                     "the tokenizer is not the model's", set == &plan_.grpo->train ? "--data" : "validation", i + 1, id,
                     cfg_->vocab_size);
      plan_.data_identity = plan_.grpo->identity;
      return;
    }
    std::optional<TokenSource> val_src;
    if (need_data_ && !val_file_.empty()) {
      val_src = TokenSource::open(val_file_, fmt_bin_);
      MT_CHECK((val_src->format() == TokenFormat::text) == text_data_,
               "--val-data '{}' is {} but --data '{}' is {}: both must be token files, or both text", s.val_data,
               val_src->format() == TokenFormat::text ? "text" : "a token file", s.data, text_data_ ? "text" : "a token file");
    }
    if (!need_data_) return;
    DatasetOptions dopt;
    dopt.vocab_size = cfg_->vocab_size;
    dopt.seq_len = s.seq;
    dopt.val_fraction = s.val_fraction;
    dopt.seed = s.seed;
    dopt.train_on_prompt = s.train_on == "prompt+completion";
    dopt.pack = s.pack;
    MT_CHECK(train_src_->has_examples() || !s.origins.conflicts("--train-on", "--data"),
             "--train-on applies to fine-tuning examples (prompt/completion, alpaca, conversations); --data '{}' is documents, "
             "every token of which is trained on", s.data.empty() ? "built-in text" : s.data);
    MT_CHECK(train_src_->has_examples() || !s.pack,
             "--pack applies to fine-tuning examples (prompt/completion, alpaca, conversations); --data '{}' is documents, "
             "which fill every sequence already", s.data.empty() ? "built-in text" : s.data);
    MT_CHECK(!train_src_->has_pairs() || s.objective == "dpo" || eval_only_,
             "--data '{}' holds preference pairs (a chosen and a rejected answer to each prompt): train them with "
             "--objective dpo", s.data);
    MT_CHECK(s.objective != "dpo" || eval_only_ || train_src_->has_pairs(),
             "--objective dpo trains on preference pairs, and --data '{}' is not: give JSONL records of prompt, chosen and "
             "rejected (or a token file megatrain-tokenize made of them)", s.data.empty() ? "built-in text" : s.data);
    data_.emplace(std::move(*train_src_), dopt, std::move(val_src));
    plan_.data_identity = {{"train_digest", data_->train_source().digest()},
                           {"train_tokens", data_->train_source().size()},
                           {"label", data_->train_source().label()}};
    if (data_->examples()) describe_examples();
  }
  void describe_examples() {
    const ExampleStats &t = data_->train_examples(), &v = data_->val_examples();
    plan_.data_identity["examples"] = data_->train_source().examples();
    plan_.data_identity["train_on"] = s.train_on;
    plan_.data_identity["pack"] = s.pack;
    const auto cut = [&](const ExampleStats& x) {
      std::string w;
      if (x.truncated) w += fmt::format(", {} cut at --seq {}", x.truncated, s.seq);
      if (x.dropped) w += fmt::format(", {} left out: no trained token within --seq", x.dropped);
      return w;
    };
    const std::string packing =
        s.pack ? fmt::format("packed into {} sequences of --seq {} ({:.1f}% of their tokens are examples'; --pack)", t.rows, s.seq,
                             100.0 * static_cast<double>(t.tokens - (t.examples - t.dropped)) / static_cast<double>(t.rows * s.seq))
               : fmt::format("one example per sequence, padded to --seq {}", s.seq);
    std::fprintf(eval_only_ ? stderr : ranks_.out(),
                 "examples: %lld for training%s; %lld for validation%s; %lld trained tokens of %lld (--train-on %s), %s\n",
                 static_cast<long long>(t.examples - t.dropped), cut(t).c_str(), static_cast<long long>(v.examples - v.dropped),
                 cut(v).c_str(), static_cast<long long>(t.labels), static_cast<long long>(t.tokens), s.train_on.c_str(),
                 packing.c_str());
    if (data_->pairs())
      std::fprintf(eval_only_ ? stderr : ranks_.out(), "preference pairs: %lld for training (%lld left out whole%s), %lld for "
                   "validation; %s\n", static_cast<long long>((t.examples - t.dropped) / 2),
                   static_cast<long long>(t.dropped / 2),
                   s.pack ? fmt::format(", {} of them too long for one row together", t.split).c_str() : "",
                   static_cast<long long>((v.examples - v.dropped) / 2),
                   s.pack ? "whole pairs packed in each row" : "a chosen and a rejected row each");
  }

  // ---- the trainer's options -------------------------------------------------------------------------
  void build_trainer_options() {
    topt_ = step_layout(s, cfg_->num_hidden_layers);
    if (ranks_.several()) {  // (this process's share of the global batch)
      topt_.batch_rows = s.batch / ranks_.world();
      topt_.micro_batches = std::max<std::int64_t>(1, s.micro_batches / ranks_.world());
      topt_.comm = ranks_.comm();
      topt_.shard_optimizer = s.shard_optimizer;  // (ZeRO-1: each process keeps and steps 1/N of AdamW's state)
      // (one bf16 copy for the host's processes: where each runs here, as the launcher says, unless
      // told; the store checks that they do)
      topt_.share_host_weights = share_weights(s, ranks_.info().local_world == ranks_.world());
      // (the ranks on this host share its CPU: the plan divides its AdamW rate among them; a
      // launcher that does not say how many run here: every rank, as on one host)
      topt_.host_processes = ranks_.info().local_world > 0 ? std::min(ranks_.info().local_world, ranks_.world()) : 0;
      topt_.gather_weights_on_device = s.gather_weights == "gpus";
      check_bf16_copy_option(s, topt_.sharded(), ranks_.world());
    }
    topt_.packed = data_ && data_->packed();
    // (a preference loss weighs each token, from its log-probabilities)
    topt_.token_weights = topt_.log_prob_objective = s.objective != "sft" && !eval_only_;
    topt_.adamw = {s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
    if (eval_only_) {
      // Every validation window once (at most --eval-batches x --batch when --eval-batches is given),
      // in batches of at most --batch sequences; no optimizer state is needed.
      plan_.eval_rows = data_ ? data_->val_windows() : 0;
      if (app_.get_option("--eval-batches")->count() > 0) plan_.eval_rows = std::min(plan_.eval_rows, s.eval_batches * s.batch);
      topt_.batch_rows = std::max<std::int64_t>(1, std::min(s.batch, plan_.eval_rows));
      topt_.micro_batches = 1;  // (--max-micro-batch still splits each evaluation batch)
      topt_.device_units = 0;   // (no optimizer state is needed)
      topt_.kept_blocks = 0;    // (no backward)
      topt_.spilled_blocks = 0;
      topt_.schedule = {LrSchedule::Kind::constant, s.lr, 0, 0, 0.0};
    } else {
      training_options();
    }
    topt_.validate();
    if (s.objective == "dpo" && !eval_only_ && !s.pack) check_pairs_micro_batches(topt_, s.batch);
    MT_CHECK(!s.origins.conflicts("--micro-batches", "--max-micro-batch") || topt_.resolved().micro_batches == topt_.micro_batches,
             "--micro-batches {} contradicts --max-micro-batch {}: parts of {} sequences are more than {}; pass one of them",
             s.micro_batches, s.max_micro_batch, s.batch / std::max<std::int64_t>(s.micro_batches, 1), s.max_micro_batch);
  }
  // The schedule (a resumed run keeps its length, set by its first run's --steps: --steps then only
  // says where this run stops), clipping and the non-finite policy.
  void training_options() {
    const TrainerOptions* before = plan_.resume ? &plan_.resume->state.options : nullptr;
    const std::int64_t length = before && before->schedule.decays() ? before->schedule.total_steps : s.steps;
    const bool decays = s.schedule != "constant";
    const std::int64_t warmup = decides(s, "--warmup-ratio", "--warmup")
                                    ? static_cast<std::int64_t>(std::ceil(s.warmup_ratio * static_cast<double>(length)))
                                : s.origins.given("--warmup") ? s.warmup
                                : decays                      ? std::min<std::int64_t>(10, length / 5)
                                                              : 0;
    const auto kind = s.schedule == "cosine"   ? LrSchedule::Kind::warmup_cosine
                      : s.schedule == "linear" ? LrSchedule::Kind::warmup_linear
                                               : LrSchedule::Kind::constant;
    topt_.schedule = {kind, s.lr, warmup, decays ? length : 0, decays ? min_lr_of(s) : 0.0};
    if (decays && length <= warmup)
      MT_FAIL("--warmup {} leaves no steps for the {} decay of --steps {}{}", warmup, s.schedule, length,
              before ? " (the first run's: the schedule's length)" : "");
    topt_.clip_norm = s.clip;
    topt_.clip_mode = s.clip_mode == "stale" ? ClipMode::stale : ClipMode::exact;
    topt_.on_nonfinite = s.on_nonfinite == "skip" ? NonFinite::skip : NonFinite::stop;
    topt_.max_nonfinite_skips = s.max_nonfinite_skips;
    MT_CHECK(topt_.on_nonfinite == NonFinite::stop || topt_.resolved().resident_gradients(),
             "--on-nonfinite skip needs the whole gradient before any update, which exact clipping gives (--clip > 0 with "
             "--clip-mode exact, the default); with {} each unit is updated during the backward",
             s.clip == 0 ? "--clip 0" : "--clip-mode stale");
    MT_CHECK(!ranks_.several() || topt_.resolved().resident_gradients(),
             "{} processes sum the whole gradient of each step before the update, which needs it held for the step: exact "
             "clipping (--clip > 0 with --clip-mode exact, the default) or more than one pass a process (--micro-batches {} "
             "or more); {} updates each unit during the backward", ranks_.world(), 2 * ranks_.world(),
             s.clip == 0 ? "--clip 0" : "--clip-mode stale");
  }

  // ---- a resume, an export ---------------------------------------------------------------------------
  // A resumed run must train exactly as the run it continues.
  void check_resume_continues() {
    const Resume& r = *plan_.resume;
    const fs::path dir = r.ckpt.dir();
    std::vector<std::string> diff;
    for (const auto& d : update_differences(r.state.options, topt_)) {
      std::string line = fmt::format("{} (checkpoint: {}, now: {})", option_of(d.field), d.before, d.after);
      if (std::find(diff.begin(), diff.end(), line) == diff.end()) diff.push_back(std::move(line));
    }
    if (plan_.grpo) grpo_differences(diff);
    else data_differences(diff);
    if (r.state.data && r.state.data->seed != s.seed)
      diff.push_back(fmt::format("--seed (checkpoint: {}, now: {})", r.state.data->seed, s.seed));
    MT_CHECK(diff.empty(), "--resume '{}': this run would not continue the checkpoint's run exactly: {}. Drop these options (a "
             "resumed run takes the checkpoint's), or start a new run", dir.string(), fmt::join(diff, "; "));
    MT_CHECK(s.steps > r.state.step, "--steps {}: the checkpoint '{}' is at step {} already; give --steps > {} to train "
             "further, or --steps 0 to evaluate or export it", s.steps, dir.string(), r.state.step, r.state.step);
    // The data prepared again is the run's: it replaces the run folder's copy (the same files).
    if (plan_.temp_data && plan_.temp_data->filename() == "incoming") {
      for (const auto& e : fs::directory_iterator(*plan_.temp_data))
        fs::rename(e.path(), plan_.temp_data->parent_path() / e.path().filename());
    }
  }
  // A GRPO run's prompts: the same records and ids, split alike.
  void grpo_differences(std::vector<std::string>& diff) const {
    const json& was = plan_.resume->state.user["data"];
    const json& now = plan_.data_identity;
    if (was.value("prompts_digest", "") != now["prompts_digest"].get<std::string>())
      diff.push_back(fmt::format("--data '{}' (its prompts, their split into training and validation prompts, or the "
                                 "tokenizer's ids differ from the run's: {} and {} prompts then, {} and {} now)", s.data,
                                 was.value("train_prompts", -1), was.value("val_prompts", -1),
                                 now["train_prompts"].get<std::int64_t>(), now["val_prompts"].get<std::int64_t>()));
    const json before = was.value("grpo", json::object());
    for (const auto& [option, value] : now["grpo"].items())
      if (before.value(option, json()) != value)
        diff.push_back(fmt::format("{} (checkpoint: {}, now: {})", option, before.value(option, json()).dump(), value.dump()));
  }
  // Token data: the same tokens (and loss masks), windows, --train-on and --pack.
  void data_differences(std::vector<std::string>& diff) const {
    const Resume& r = *plan_.resume;
    const json& was = r.state.user["data"];
    const std::string digest = plan_.data_identity["train_digest"].get<std::string>();
    if (was.value("train_digest", "") != digest)
      diff.push_back(fmt::format("--data '{}' (its tokens{} differ from the data the run was trained on: digest {} vs {})",
                                 s.data.empty() ? "built-in text" : s.data, data_->examples() ? " or loss masks" : "",
                                 was.value("train_digest", ""), digest));
    if (data_->examples() && was.value("train_on", "completion") != s.train_on)
      diff.push_back(fmt::format("--train-on (checkpoint: {}, now: {})", was.value("train_on", "completion"), s.train_on));
    if (data_->examples() && was.value("pack", false) != s.pack)
      diff.push_back(fmt::format("--pack (checkpoint: {}, now: {})", was.value("pack", false), s.pack));
    if (r.state.data && r.state.data->windows_per_epoch != data_->train_windows())
      diff.push_back(fmt::format("--val-fraction or --seq (the training windows per epoch, checkpoint: {}, now: {})",
                                 r.state.data->windows_per_epoch, data_->train_windows()));
  }

  // The export directory is replaced as a whole: it must not be, or hold, the run directory or the
  // checkpoint resumed from, nor lie inside a checkpoints folder.
  void check_export_paths() {
    const auto resolved = [](const fs::path& p) {
      fs::path r = fs::weakly_canonical(fs::absolute(p));
      return r.has_filename() ? r : r.parent_path();  // "dir/" -> "dir"
    };
    const auto within = [](const fs::path& a, const fs::path& b) {  // a is b or inside it
      return std::mismatch(b.begin(), b.end(), a.begin(), a.end()).first == b.end();
    };
    const fs::path e = resolved(s.export_dir);
    if (!plan_.out.empty()) {
      const fs::path o = resolved(plan_.out);
      MT_CHECK(!within(o, e), "--export '{}' would replace the run directory '{}' (it is, or holds, --out); export elsewhere",
               s.export_dir, plan_.out.string());
      MT_CHECK(!within(e, o / "checkpoints"), "--export '{}' lies in the run's checkpoints folder '{}'; export elsewhere",
               s.export_dir, (plan_.out / "checkpoints").string());
    }
    if (plan_.resume) {
      const fs::path c = resolved(plan_.resume->ckpt.dir());
      MT_CHECK(!within(c, e) && !within(e, c.parent_path()),
               "--export '{}' would replace or lie in the checkpoints of '{}'; export elsewhere", s.export_dir,
               c.parent_path().string());
    }
  }

  int train_on_backend() {
    if (use_cuda_) {
#if MEGATRAIN_HAS_CUDA
      CudaBackendOptions copt;
      if (!s.gpu_memory.empty()) copt.memory_limit = parse_byte_size(s.gpu_memory.c_str());
      copt.device = ranks_.info().local_rank;  // (one GPU a process: the launcher's local rank)
      // (a resumed run takes its checkpoint's choices, which end the tuning: see the resume)
      copt.gemm_tuning = s.gemm_tuning && !plan_.eval_only;
      CudaBackend be(copt);
      return run_training(be, "cuda", TrainInputs{s, app_, *cfg_, data_, topt_, plan_, ranks_});
#endif
    }
    CpuBackend<float> be;
    return run_training(be, "cpu", TrainInputs{s, app_, *cfg_, data_, topt_, plan_, ranks_});
  }

  const Settings& s;
  const CLI::App& app_;
  RunPlan& plan_;
  Ranks& ranks_;
  bool use_cuda_ = false, eval_only_ = false, need_data_ = false, text_data_ = false;
  std::string data_file_, val_file_;
  std::optional<text::PrepareResult> prepared_;
  std::optional<std::int32_t> tokenizer_bos_, tokenizer_eos_;  // (a --tokenizer's, for an export's config.json)
  TokenFormat fmt_bin_ = TokenFormat::u16;
  std::optional<TokenSource> train_src_;
  std::optional<ModelConfig> cfg_;
  std::optional<TokenDataset> data_;
  TrainerOptions topt_;
};

}  // namespace

int run_train(const Settings& s, const CLI::App& app, RunPlan plan, Ranks& ranks) {
  TrainSetup setup(s, app, plan, ranks);
  return setup.run();
}

}  // namespace megatrain::app
