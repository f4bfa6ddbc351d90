// What sampling with the trainer (--objective grpo) adds to a run's backend memory beside the plan
// of its step: each block's decoding cache for every slot (train/decoding.hpp), made when the
// sampling starts and freed when it ends, and the head's logits of a micro-batch's rows. The plans
// leave it free (TrainerOptions::reserved_device_bytes).
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "megatrain/core/host_memory.hpp"  // format_bytes
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain::app {

/// The bytes on backend B of sampling `rows` slots of `capacity` tokens, `micro_rows` rows a pass:
/// the caches where every block decodes on B (else none: each prefix is recomputed), and the logits.
/// B may be a stand-in (plan::CudaTypes): then every block is counted as decoding, the larger figure.
template <class B>
std::size_t sampling_bytes(const DecoderModel<>& model, std::int64_t rows, std::int64_t capacity, std::int64_t micro_rows) {
  // (a stand-in for a backend this build lacks, plan::CudaTypes: every block counted as decoding)
  constexpr bool stand_in = !requires(B& b) { b.template alloc<std::byte>(std::size_t{1}); };
  std::size_t caches = 0;
  for (std::size_t i = 0; i < model.num_blocks(); ++i) {
    const auto& op = model.block(i).op();
    if (!stand_in && !op.template decodes<B>()) {
      caches = 0;
      break;
    }
    caches += op.template decode_cache_bytes<B>(rows, capacity);
  }
  return caches + static_cast<std::size_t>(micro_rows * model.config().vocab_size) * sizeof(typename B::Act);
}

/// What the plan of a GRPO run says of its sampling: the memory left free for it
/// (TrainerOptions::reserved_device_bytes).
inline std::string sampling_line(const TrainerOptions& topt) {
  return fmt::format("plan: {} of backend memory left free beside the step's for sampling {} slots of {} tokens (the "
                     "decoding caches and logits of --objective grpo)\n", format_bytes(topt.reserved_device_bytes),
                     topt.batch_rows, topt.seq_len);
}

}  // namespace megatrain::app
