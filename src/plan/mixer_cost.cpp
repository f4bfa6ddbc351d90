// The mixers' costs (plan/mixer_cost.hpp): one case per kind.
#include "megatrain/plan/mixer_cost.hpp"

#include <algorithm>

namespace megatrain::plan {

double mixing_span(const ModelConfig& cfg, std::int64_t layer, double seq) {
  switch (cfg.layer_kind(layer).token_mixer) {
    case TokenMixerKind::full_attention:
    case TokenMixerKind::sliding_attention: {
      const double w = static_cast<double>(cfg.attention_window(layer));
      return w <= 0 || w >= seq ? seq : 2 * (w * (w + 1) / 2 + (seq - w) * w) / seq;
    }
    case TokenMixerKind::linear_attention: {
      // The chunked delta rule's forward FLOPs a token, as keys of attention's 2 x q_dim FLOPs:
      // each value head's products within a chunk of C (K K^T, Q K^T, the triangular system and
      // its two right-hand sides, the intra-chunk outputs) and with the state (read twice,
      // written once). Linear in the sequence: no term grows with seq.
      const auto& la = cfg.linear_attention;
      const double C = std::min(64.0, seq), dk = static_cast<double>(la.key_head_dim), dv = static_cast<double>(la.value_head_dim);
      const double per_head = 2 * C * (3 * dk + 2 * dv) + 2 * C * C / 3 + 6 * dk * dv;
      return static_cast<double>(la.value_heads) * per_head / (2 * static_cast<double>(cfg.q_dim()));
    }
  }
  return seq;
}

double token_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  switch (cfg.layer_kind(layer).token_mixer) {
    case TokenMixerKind::full_attention:
    case TokenMixerKind::sliding_attention:
      return 120.0 * static_cast<double>(cfg.hidden_size);  // (the norms, rotary, residual adds, conversions)
    case TokenMixerKind::linear_attention: {  // (the block's norms and residual adds; the convolution, the q/k
      const auto& la = cfg.linear_attention;   // norms, the gates and the gated norm, forward and backward)
      return 120.0 * static_cast<double>(cfg.hidden_size) + 24.0 * static_cast<double>(la.conv_dim() + 3 * la.value_dim());
    }
  }
  return 0;
}

double channel_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  switch (cfg.layer_kind(layer).channel_mixer) {
    case ChannelMixerKind::dense_mlp: return 18.0 * static_cast<double>(cfg.intermediate_size);
    case ChannelMixerKind::experts: {  // (each of a token's k experts, and the routing's rows)
      const double k = static_cast<double>(cfg.moe.experts_per_token);
      const double shared = cfg.moe.shared_expert_size > 0  // (its SwiGLU, its gate and the gated sum)
                                ? 18.0 * static_cast<double>(cfg.moe.shared_expert_size) + 24.0 * static_cast<double>(cfg.hidden_size)
                                : 0.0;
      return k * (18.0 * static_cast<double>(cfg.moe.intermediate_size) + 18.0 * static_cast<double>(cfg.hidden_size)) + shared;
    }
  }
  return 0;
}

}  // namespace megatrain::plan
