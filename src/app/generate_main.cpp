// megatrain-generate (programs.hpp): completions of prompts by a model from a Hugging Face folder
// or a run's checkpoint, JSONL in and JSONL out (docs/generation.md).
//
//   megatrain-generate --model models/qwen2.5-0.5b --prompts prompts.jsonl --output completions.jsonl
//
// Every input is read and checked (the model, the tokenizer, every prompt, the output's place)
// before the weights load; the output is written once, whole, when the last completion is made.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "generate_run.hpp"
#include "prompts.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/text/chat.hpp"
#include "programs.hpp"
#include "resume.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#endif

namespace megatrain::app {

namespace fs = std::filesystem;
using json = nlohmann::json;

template <class B>
std::vector<generate::Completion> run_generation(B& be, const char* backend_name, const GenerateInputs& in);
extern template std::vector<generate::Completion> run_generation<CpuBackend<float>>(CpuBackend<float>&, const char*,
                                                                                    const GenerateInputs&);
#if MEGATRAIN_HAS_CUDA
extern template std::vector<generate::Completion> run_generation<CudaBackend>(CudaBackend&, const char*, const GenerateInputs&);
#endif

namespace {

struct Options {
  std::string model, checkpoint, prompts, output, backend = "auto", chat_format = "auto";
  std::int64_t max_new_tokens = 256, batch = 8, seq = 0;
  double temperature = 1.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;
  std::vector<std::string> stops;
  bool logprobs = false, overwrite = false, no_progress = false, no_kv_cache = false;
};

/// The folder the model is read from: --model's, or the checkpoint's (--checkpoint: a checkpoint
/// folder, or a run folder: its newest intact checkpoint), which keeps config.json and the side files.
struct Source {
  fs::path dir;
  ModelConfig cfg;
  std::function<void(HostParamStore<float>&)> load;
};

Source open_source(const Options& o) {
  MT_CHECK(o.model.empty() != o.checkpoint.empty(), "give the model as --model DIR (a Hugging Face folder) or "
           "--checkpoint DIR (a run folder or one of its checkpoints), one of them");
  if (!o.model.empty()) {
    auto hf = std::make_shared<io::HfCheckpoint>(io::HfCheckpoint::open(o.model));
    return {o.model, hf->config(), [hf](HostParamStore<float>& s) { hf->load_into(s); }};
  }
  fs::path dir = o.checkpoint;
  std::error_code ec;
  if (fs::is_directory(dir / "checkpoints", ec)) {
    const auto all = checkpoints_newest_first(dir / "checkpoints");
    MT_CHECK(!all.empty(), "--checkpoint '{}': the run folder holds no checkpoint yet", o.checkpoint);
    dir = all.front();
  }
  auto r = std::make_shared<Resume>(open_checkpoint(dir));
  const auto text = r->ckpt.file("config.json");
  MT_CHECK(text.has_value(), "--checkpoint '{}': the checkpoint has no config.json", dir.string());
  return {dir, ModelConfig::from_json(json::parse(*text), "the checkpoint's config.json"),
          [r](HostParamStore<float>& s) { r->ckpt.load_into(s); }};
}

/// Sampling as transformers' generate() reads the folder's generation_config.json (greedy unless
/// do_sample; top_k 50 when sampling, its default), each option given on the command line over it.
generate::SamplingOptions sampling(const Options& o, const CLI::App& app, const fs::path& dir) {
  generate::SamplingOptions s;
  const json g = read_generation_config(dir);
  const std::string file = (dir / "generation_config.json").string();
  const auto number = [&](const char* key, double fallback) {  // (absent or null: the fallback)
    if (!g.contains(key) || g[key].is_null()) return fallback;
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    MT_CHECK(g[key].is_number(), "'{}': {} is {}, not a number: fix the file, or give --{}", file, key, g[key].dump(), flag);
    return g[key].get<double>();
  };
  MT_CHECK(!g.contains("do_sample") || g["do_sample"].is_boolean() || g["do_sample"].is_null(),
           "'{}': do_sample is {}, not true or false: fix the file", file, g["do_sample"].dump());
  const bool sample = g.contains("do_sample") && g["do_sample"].is_boolean() && g["do_sample"].get<bool>();
  const double temperature = number("temperature", 1.0), top_k = number("top_k", 50), top_p = number("top_p", 1.0),
               min_p = number("min_p", 0.0);
  s.temperature = sample ? temperature : 0.0;
  s.top_k = sample ? static_cast<std::int64_t>(top_k) : 0;
  s.top_p = sample ? top_p : 1.0;
  s.min_p = sample ? min_p : 0.0;
  s.repetition_penalty = number("repetition_penalty", 1.0);
  if (app.count("--temperature")) s.temperature = o.temperature;
  if (app.count("--top-k")) s.top_k = o.top_k;
  if (app.count("--top-p")) s.top_p = o.top_p;
  if (app.count("--min-p")) s.min_p = o.min_p;
  if (app.count("--repetition-penalty")) s.repetition_penalty = o.repetition_penalty;
  s.seed = o.seed;
  return s;
}

/// Each record with its completion: the text (completion_text), the prompt's and the completion's
/// token counts, why it ended, and (--logprobs) its ids and their log-probabilities.
std::string output_lines(const Options& o, const text::Tokenizer& tok, Prompts& prompts,
                         const std::vector<generate::Completion>& done) {
  std::string out;
  for (std::size_t i = 0; i < prompts.records.size(); ++i) {
    const generate::Completion& c = done[i];
    auto& r = prompts.records[i];
    r["completion"] = completion_text(c, tok, o.stops);
    r["prompt_tokens"] = prompts.ids[i].size();
    r["completion_tokens"] = c.tokens.size();
    r["finish_reason"] = generate::finish_name(c.finish);
    if (o.logprobs) {
      r["token_ids"] = c.tokens;
      r["logprobs"] = c.log_probs;
    }
    out += r.dump() + "\n";
  }
  return out;
}

void add_options(CLI::App& app, Options& o) {
  app.add_option("--model", o.model, "A Hugging Face model folder (config.json, safetensors, tokenizer.json)");
  app.add_option("--checkpoint", o.checkpoint, "A megatrain-train run folder (its newest checkpoint) or a checkpoint folder");
  app.add_option("--prompts", o.prompts, "JSONL: {\"prompt\": text} or {\"messages\": [...]} a line")->required();
  app.add_option("--output", o.output, "The JSONL to write (each record with its completion); default: standard output");
  app.add_flag("--overwrite", o.overwrite, "Replace --output if it exists");
  app.add_option("--max-new-tokens", o.max_new_tokens, "Tokens a completion may have at most")->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--temperature", o.temperature, "0: greedy (default: the folder's generation_config.json, else greedy)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--top-k", o.top_k, "Keep the k most likely tokens (0: all)")->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 31));
  app.add_option("--top-p", o.top_p, "Keep the most likely tokens up to this probability (1: all)")->check(CLI::Range(0.0, 1.0));
  app.add_option("--min-p", o.min_p, "Keep tokens at least this fraction as likely as the most likely (0: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--repetition-penalty", o.repetition_penalty, "Penalise tokens already in the sequence (1: none)")
      ->check(CLI::Range(1e-6, 1e6));
  app.add_option("--seed", o.seed, "The seed of the draws: the same seed, prompts and options give the same completions")
      ->capture_default_str();
  app.add_option("--stop", o.stops, "End a completion where its text holds this string (repeatable; the text stops before it)");
  app.add_flag("--logprobs", o.logprobs, "Write each completion's token ids and their log-probabilities");
  app.add_option("--batch", o.batch, "Prompts sampled together (slots)")->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--seq", o.seq, "Tokens a slot holds, prompt and completion (default: the longest prompt + --max-new-tokens)")
      ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 30));
  app.add_option("--backend", o.backend, "auto (cuda where a GPU is present), cpu or cuda")->capture_default_str()
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--chat-format", o.chat_format,
                 fmt::format("Conversations' format: auto (the tokenizer's chat template) or one of: {}", text::chat_format_names()))
      ->capture_default_str();
  app.add_flag("--no-progress", o.no_progress, "No progress line on standard error");
  app.add_flag("--no-kv-cache", o.no_kv_cache,
               "Recompute every prefix at each step instead of decoding a token at a time (slower; the same completions "
               "to rounding)");
}

/// Everything checked, then the weights loaded and the completions made.
int run(const Options& o, const CLI::App& app) {
  std::error_code ec;
  MT_CHECK(o.output.empty() || o.overwrite || !fs::exists(o.output, ec),
           "--output '{}' exists: pass --overwrite to replace it, or name another file", o.output);
  const Source src = open_source(o);
  MT_CHECK(fs::exists(src.dir / "tokenizer.json", ec), "'{}' has no tokenizer.json: megatrain-generate encodes the prompts "
           "with the model's tokenizer (a run trained on token files or the built-in text keeps none: copy the "
           "tokenizer's files into the folder)", src.dir.string());
  const text::Tokenizer tok = text::Tokenizer::from_folder(src.dir);
  MT_CHECK(tok.vocab_size() <= src.cfg.vocab_size, "the tokenizer of '{}' has {} ids, more than the model's vocab_size {}",
           src.dir.string(), tok.vocab_size(), src.cfg.vocab_size);
  GenerateInputs in{src.cfg, src.dir.string(), src.load, {}, {}, 0, 0, o.stops, &tok, !o.no_progress};
  Prompts prompts = read_prompts(o.prompts, "--prompts", tok, o.chat_format);
  in.prompts = prompts.ids;
  in.options.max_new_tokens = o.max_new_tokens;
  in.options.cache = !o.no_kv_cache;
  in.options.sampling = sampling(o, app, src.dir);
  in.options.eos = eos_ids(src.dir, tok);
  std::size_t longest = 0;
  for (const auto& p : in.prompts) longest = std::max(longest, p.size());
  in.seq = o.seq > 0 ? o.seq : static_cast<std::int64_t>(longest) + o.max_new_tokens;
  in.batch = std::min<std::int64_t>(o.batch, static_cast<std::int64_t>(in.prompts.size()));
  src.cfg.check_sequence_length(in.seq);
  for (std::size_t i = 0; i < in.prompts.size(); ++i)
    MT_CHECK(static_cast<std::int64_t>(in.prompts[i].size()) < in.seq, "--prompts '{}': prompt {} has {} tokens, and a slot "
             "holds {} (--seq): raise --seq or shorten the prompt", o.prompts, i + 1, in.prompts[i].size(), in.seq);
  in.options.check(src.cfg.vocab_size);
  MT_CHECK(!(o.backend == "cuda" && !MEGATRAIN_HAS_CUDA), "--backend cuda: megatrain was built without CUDA");
  MT_CHECK(!(o.backend == "cuda" && !cuda_device_present()), "--backend cuda: no usable GPU was found");
  std::vector<generate::Completion> done;
  const bool cuda = o.backend == "cuda" || (o.backend == "auto" && cuda_device_present());
#if MEGATRAIN_HAS_CUDA
  if (cuda) {
    CudaBackend be;
    done = run_generation(be, "cuda", in);
  }
#endif
  if (!cuda) {
    CpuBackend<float> be;
    done = run_generation(be, "cpu", in);
  }
  const std::string lines = output_lines(o, tok, prompts, done);
  if (o.output.empty()) {
    std::fwrite(lines.data(), 1, lines.size(), stdout);
    std::fflush(stdout);
  } else {
    io::detail::write_file_atomically(o.output, lines);
  }
  return 0;
}

}  // namespace

int generate_main(int argc, char** argv) {
  Options o;
  CLI::App app{"megatrain-generate: completions of prompts by a model (a Hugging Face folder or a run's checkpoint), "
               "JSONL in and out", "megatrain-generate"};
  app.set_version_flag("--version", "megatrain-generate " + std::string(megatrain::version()), "Print the version and exit");
  add_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(o, app);
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-generate: error: %s\n", e.reason().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatrain-generate: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace megatrain::app
