// What each decoder layer is made of: its token mixer (how a token reads the others: attention
// over the whole sequence, or within a sliding window, or linear attention: Gated DeltaNet) and
// its channel mixer (how a token's
// features are transformed: a dense gated MLP, or a mixture of experts). ModelConfig::layer_kind
// says it per layer, from the config's data (config.json's layer_types, the experts' layers); a
// block (ComposedBlock) builds each layer's mixers from it. docs/layers.md#mixers.
#pragma once

#include <optional>
#include <string_view>

namespace megatrain {

/// A layer's token mixer, named as config.json's layer_types names it.
enum class TokenMixerKind { full_attention, sliding_attention, linear_attention };
/// A layer's channel mixer.
enum class ChannelMixerKind { dense_mlp, experts };

struct LayerKind {
  TokenMixerKind token_mixer = TokenMixerKind::full_attention;
  ChannelMixerKind channel_mixer = ChannelMixerKind::dense_mlp;
  bool operator==(const LayerKind&) const = default;
};

/// "full_attention", "sliding_attention", "linear_attention": the layer_types entry of a token mixer.
std::string_view layer_type_name(TokenMixerKind kind);
/// The token mixer a layer_types entry names; none for a name megatrain does not build.
std::optional<TokenMixerKind> token_mixer_named(std::string_view name);
/// "dense_mlp", "experts".
std::string_view channel_mixer_name(ChannelMixerKind kind);

}  // namespace megatrain
