// The mixers' costs (plan/mixer_cost.hpp): one case per kind.
#include "megatrain/plan/mixer_cost.hpp"

namespace megatrain::plan {

double mixing_span(const ModelConfig& cfg, std::int64_t layer, double seq) {
  switch (cfg.layer_kind(layer).token_mixer) {
    case TokenMixerKind::full_attention:
    case TokenMixerKind::sliding_attention: {
      const double w = static_cast<double>(cfg.attention_window(layer));
      return w <= 0 || w >= seq ? seq : 2 * (w * (w + 1) / 2 + (seq - w) * w) / seq;
    }
  }
  return seq;
}

double token_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  switch (cfg.layer_kind(layer).token_mixer) {
    case TokenMixerKind::full_attention:
    case TokenMixerKind::sliding_attention:
      return 120.0 * static_cast<double>(cfg.hidden_size);  // (the norms, rotary, residual adds, conversions)
  }
  return 0;
}

double channel_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  switch (cfg.layer_kind(layer).channel_mixer) {
    case ChannelMixerKind::dense_mlp: return 18.0 * static_cast<double>(cfg.intermediate_size);
    case ChannelMixerKind::experts: {  // (each of a token's k experts, and the routing's rows)
      const double k = static_cast<double>(cfg.moe.experts_per_token);
      return k * (18.0 * static_cast<double>(cfg.moe.intermediate_size) + 18.0 * static_cast<double>(cfg.hidden_size));
    }
  }
  return 0;
}

}  // namespace megatrain::plan
