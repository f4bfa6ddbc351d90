// What each kind of mixer costs a token, for the cost model (cost_model.hpp) and the probe: one
// entry per TokenMixerKind and ChannelMixerKind (model/layer_kind.hpp). A new kind of mixer adds
// its entry here; the compiler names every switch that lacks it.
//
// Matrix products are counted with the parameters that hold them (a token's products run 2 x its
// parameters FLOPs forward); what is here is the rest: the mixing of tokens beyond its
// projections, and the element-wise passes over HBM.
#pragma once

#include <cstdint>

#include "megatrain/model/config.hpp"

namespace megatrain::plan {

/// The keys a query of layer `layer` reads on average over a sequence of `seq` tokens (causal
/// attention: both products run over them, 2 x q_dim FLOPs a key forward, counting the masked
/// half as flash attention does: seq where it attends the whole sequence, less within a window).
double mixing_span(const ModelConfig& cfg, std::int64_t layer, double seq);

/// Bytes of HBM traffic a token's element-wise passes move in layer `layer` (the block's norms
/// and residual adds with its token mixer's, then its channel mixer's), forward and backward.
double token_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer);
double channel_mixer_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer);

}  // namespace megatrain::plan
