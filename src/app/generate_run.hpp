// megatrain-generate's sampling on a backend (generate_main.cpp prepares its inputs): the model
// and its weights in a store, a trainer over them whose next_logits() is the source of the
// completions (generate/generator.hpp), the stop strings, and the progress on stderr. Compiled
// once a backend, in generate_cpu.cpp and generate_cuda.cpp.
#pragma once

#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/generate/generator.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/text/tokenizer.hpp"
#include "megatrain/train/trainer.hpp"
#include "prompts.hpp"

namespace megatrain::app {

struct GenerateInputs {
  ModelConfig cfg;
  std::string label;                                     // what the messages call the model
  std::function<void(HostParamStore<float>&)> load;      // its weights into a store
  std::vector<std::vector<std::int32_t>> prompts;
  generate::GenerationOptions options;
  std::int64_t batch = 1, seq = 0;                       // slots, and the tokens a slot holds
  std::vector<std::string> stops;                        // stop strings
  const text::Tokenizer* tokenizer = nullptr;            // for the stop strings (and nothing else here)
  bool progress = true;
};

/// The completions of in.prompts on backend `be`.
template <class B>
std::vector<generate::Completion> run_generation(B& be, const char* backend_name, const GenerateInputs& in);

/// The progress line on stderr: redrawn on a terminal, else a line every 30 seconds.
class GenerateProgress {
 public:
  explicit GenerateProgress(std::size_t prompts, bool on) : prompts_(prompts), on_(on), tty_(isatty(STDERR_FILENO) != 0) {}
  void operator()(std::int64_t tokens, std::int64_t ended) {
    if (!on_) return;
    const double t = seconds();
    const bool last = ended == static_cast<std::int64_t>(prompts_);
    if (!tty_ && !last && t - printed_ < 30) return;
    printed_ = t;
    std::fprintf(stderr, "%s%lld/%zu completions, %lld tokens, %.1f tokens/s%s", tty_ ? "\r\033[K" : "",
                 static_cast<long long>(ended), prompts_, static_cast<long long>(tokens),
                 t > 0 ? static_cast<double>(tokens) / t : 0.0, tty_ && !last ? "" : "\n");
    std::fflush(stderr);
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::size_t prompts_;
  bool on_, tty_;
  double printed_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};


template <class B>
std::vector<generate::Completion> run_generation(B& be, const char* backend_name, const GenerateInputs& in) {
  TrainerOptions topt;
  topt.batch_rows = in.batch;
  topt.seq_len = in.seq;
  DecoderModel<> model(in.cfg);
  StoreOptions so;
  so.optimizer_state = false;  // (read, never stepped: 6 bytes a parameter, not 14)
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(topt, so));
  in.load(store);
  Trainer<B> trainer(model, store, be, topt);
  const char* decoding = !in.options.cache     ? "each prefix recomputed (--no-kv-cache)"
                         : trainer.decodes() ? "a KV cache"
                                             : "each prefix recomputed (no KV cache on this backend yet)";
  std::fprintf(stderr, "megatrain-generate: %s (%s, %lld parameters), backend %s: %zu prompts, %lld slots of %lld tokens, %s\n",
               in.label.c_str(), std::string(in.cfg.architecture_name()).c_str(),
               static_cast<long long>(in.cfg.param_count()), backend_name, in.prompts.size(), static_cast<long long>(in.batch),
               static_cast<long long>(in.seq), decoding);
  GenerateProgress progress(in.prompts.size(), in.progress);
  generate::StopCheck stop;
  if (!in.stops.empty())
    stop = [&](std::size_t, std::vector<std::int32_t>& tokens) {
      return first_stop(decode_known(*in.tokenizer, tokens), in.stops).has_value();
    };
  const generate::SlotShape shape{in.batch, in.seq, in.cfg.vocab_size,
                                  static_cast<std::int32_t>(in.cfg.pad_token_id.value_or(0))};
  return generate::generate(trainer, shape, in.prompts, in.options, stop, std::ref(progress));
}

}  // namespace megatrain::app
