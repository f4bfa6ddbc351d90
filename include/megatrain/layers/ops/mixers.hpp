// The two parts a decoder block is made of, as ComposedBlock drives them (composed_block.hpp):
//
//   token mixer    how a token reads the others (SelfAttention: full or sliding-window attention)
//   channel mixer  how a token's features are transformed (SwiGluMlp, MoeMlp)
//
// Each is an op (ParamOp: params(), Weights<E>, bind()) with the phases below, and says which
// layers it builds (`static bool builds(const ModelConfig&, std::int64_t layer)`, from
// ModelConfig::layer_kind). The block normalises each part's input, runs it, and adds its output
// to the residual stream. A new kind of mixer is one op with these phases (its backend primitives
// on both backends, its entry in plan/mixer_cost.hpp), listed in a block's variant of mixers.
// docs/layers.md#mixers walks through one.
#pragma once

#include <concepts>
#include <cstdint>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

// clang-format off
/// A token mixer: its input projections run a token block at a time (project), the mixing over
/// the whole chunk (mix: tokens read each other within a sequence), its output projection a
/// token block at a time again (out_add into the residual stream, or out alone for a block that
/// normalises it); the backward mirrors them.
template <class Op, class B>
concept TokenMixerOp = ParamOp<Op> && Backend<B> &&
  requires(const Op& op, B& be, ChunkShape c, Arena& ar, const ModelConfig& cfg, std::int64_t first,
           const typename Op::template Acts<B>& a, const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& g, View<const typename B::Act> x,
           View<typename B::Act> y, View<const typename B::Res> r, View<typename B::Res> ry) {
  { Op::builds(cfg, first) } -> std::convertible_to<bool>;
  // The chunk's activations; where `kept` is given, what the backward reads is carved from it.
  { op.template carve<B>(ar, c, true, &ar) } -> std::same_as<typename Op::template Acts<B>>;
  op.project(be, w, x, a, first);            // input projections of tokens [first, first + x rows)
  op.mix(be, c, a, w);                       // the whole chunk's mixing
  op.out_add(be, w, a, first, r, ry);        // ry = r + output projection, those tokens
  op.out(be, w, a, first, y);                // y = output projection, those tokens
  op.out_backward(be, w, a, first, x, g);    // from the output's gradient x, those tokens
  op.mix_backward(be, c, a, w, g);           // the mixing's backward, the whole chunk
  op.project_backward(be, w, x, a, first, y, g);  // y = the input's gradient, those tokens
};

/// A channel mixer: token-wise, run a token block at a time. mix_add writes y = h + mixer(x);
/// mix_out the output alone (kHasOutput: for a block that normalises it); mix_backward takes the
/// gradient of the output and recomputes what was neither kept nor made by mix_out.
template <class Op, class B>
concept ChannelMixerOp = ParamOp<Op> && Backend<B> &&
  requires(const Op& op, B& be, ChunkShape c, Arena& ar, const ModelConfig& cfg, std::int64_t first,
           const typename Op::template Acts<B>& a, const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& g, View<const typename B::Act> x,
           View<typename B::Act> y, View<const typename B::Res> r, View<typename B::Res> ry, const RouterStats& stats) {
  { Op::builds(cfg, first) } -> std::convertible_to<bool>;
  { Op::kHasOutput } -> std::convertible_to<bool>;
  // A token block's activations (c.block_tokens() tokens); `kept` where they are kept for the chunk.
  { op.template carve_block<B>(ar, c, true, &ar) } -> std::same_as<typename Op::template Acts<B>>;
  { op.block_rows(a, first, first) } -> std::same_as<typename Op::template Acts<B>>;
  op.mix_add(be, w, x, a, r, ry, stats);
  op.mix_out(be, w, x, a, y);
  op.mix_backward(be, w, x, a, x, y, g, stats, true);
};
// clang-format on

}  // namespace megatrain
