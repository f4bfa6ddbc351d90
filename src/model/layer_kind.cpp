// The names of the layers' mixers (model/layer_kind.hpp).
#include "megatrain/model/layer_kind.hpp"

namespace megatrain {

std::string_view layer_type_name(TokenMixerKind kind) {
  switch (kind) {
    case TokenMixerKind::full_attention: return "full_attention";
    case TokenMixerKind::sliding_attention: return "sliding_attention";
    case TokenMixerKind::linear_attention: return "linear_attention";
  }
  return "?";
}

std::optional<TokenMixerKind> token_mixer_named(std::string_view name) {
  for (const TokenMixerKind k :
       {TokenMixerKind::full_attention, TokenMixerKind::sliding_attention, TokenMixerKind::linear_attention})
    if (layer_type_name(k) == name) return k;
  return std::nullopt;
}

std::string_view channel_mixer_name(ChannelMixerKind kind) {
  return kind == ChannelMixerKind::experts ? "experts" : "dense_mlp";
}

}  // namespace megatrain
