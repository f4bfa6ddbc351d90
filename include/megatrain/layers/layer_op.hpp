// The contract of a layer op, and of the two ops at the ends of a model.
//
// An op is a stateless value: built from a model config (and, for a block, its layer index),
// it says which parameters it has and computes forward and backward over views. It keeps no
// state between calls: its only input to backward is what the caller passes explicitly (the
// unit's input, the activation checkpoint, from which backward recomputes the forward).
// All member functions are const. Weights are never owned: `bind` turns a ParamBinder (views of
// whatever buffers hold the unit's tensors right now) into the op's Weights struct, so the same
// op runs on a host slab, a device slot the pipeline streamed into, or a gradient buffer.
//
// Between units (and along the residual path inside a block) activations are of the backend's
// residual type B::Res, which is fp32 where the other activations are bf16, as PyTorch's
// autocast keeps the residual stream: every block adds into it without rounding it to bf16.
//
// Ops run one chunk at a time (a few whole sequences; see ChunkShape): forward writes the
// chunk's output; backward writes the chunk's input gradient and *accumulates* weight
// gradients, so a unit run over a batch chunk by chunk sums its gradients over the batch.
// Scratch memory comes from an Arena; `scratch_bytes` says how much one chunk needs.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/layers/param_binder.hpp"
#include "megatrain/model/param_spec.hpp"

namespace megatrain {

template <class T>
inline constexpr bool dependent_false = false;

// clang-format off
/// What every op with parameters provides.
template <class Op>
concept ParamOp = requires(const Op& op, const ParamBinder<float>& binder) {
  // Its parameters: Hugging Face names and shapes, in slab order.
  { op.params() } -> std::same_as<std::vector<ParamSpec>>;
  // Weights<E>: a struct of View<E>, one per tensor it reads; bind() fills it from a binder.
  typename Op::template Weights<float>;
  { op.bind(binder) } -> std::same_as<typename Op::template Weights<float>>;
};

/// A layer that maps [tokens, hidden] to [tokens, hidden]: a decoder block, or a user's own.
template <class Op, class B>
concept LayerOp = ParamOp<Op> && Backend<B> &&
  requires(const Op& op, B& be, ChunkShape chunk, Arena& scratch,
           const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& grads,
           View<const typename B::Res> in, View<typename B::Res> out) {
  // Width of its input and output rows.
  { op.hidden_size() } -> std::convertible_to<std::int64_t>;
  // Scratch one chunk needs (forward or backward, whichever is more).
  { op.template scratch_bytes<B>(chunk) } -> std::convertible_to<std::size_t>;
  // out = layer(in) for one chunk.
  op.forward(be, chunk, w, in, out, scratch);
  // Given the chunk's input x and the gradient dy of its output: recompute, write dx, add to grads.
  op.backward(be, chunk, w, in /* x */, in /* dy */, out /* dx */, grads, scratch);
};

/// A layer that can also keep its activations from forward to backward (in memory the caller
/// provides) instead of recomputing them from the input: the trainer uses it where the plan
/// has room (TrainerOptions::kept_blocks). The results are the same bits as forward() then
/// backward(). The kept arena is carved chunk after chunk in the same order by forward_keep()
/// and backward_kept(); reserve_kept() carves a chunk's share of a measuring (or real) arena.
template <class Op, class B>
concept KeepingLayerOp = LayerOp<Op, B> &&
  requires(const Op& op, B& be, ChunkShape chunk, Arena& kept, Arena& scratch,
           const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& grads,
           View<const typename B::Res> in, View<typename B::Res> out) {
  op.template reserve_kept<B>(kept, chunk);
  { op.template kept_scratch_bytes<B>(chunk) } -> std::convertible_to<std::size_t>;
  op.forward_keep(be, chunk, w, in, out, kept, scratch);
  op.backward_kept(be, chunk, w, in /* x */, in /* dy */, out /* dx */, grads, kept, scratch);
};

/// Token ids to [tokens, hidden].
template <class Op, class B>
concept EmbeddingOp = ParamOp<Op> && Backend<B> &&
  requires(const Op& op, B& be, ChunkShape chunk, Arena& scratch,
           const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& grads,
           View<const std::int32_t> ids, View<const typename B::Res> dy, View<typename B::Res> out) {
  { op.hidden_size() } -> std::convertible_to<std::int64_t>;
  op.forward(be, chunk, w, ids, out, scratch);
  op.backward(be, chunk, ids, dy, grads, scratch);
};

/// [tokens, hidden] and labels to per-token losses (and, fused, the backward).
template <class Op, class B>
concept HeadOp = ParamOp<Op> && Backend<B> &&
  requires(const Op& op, B& be, ChunkShape chunk, Arena& scratch,
           const typename Op::template Weights<const typename B::Weight>& w,
           const typename Op::template Weights<typename B::Acc>& grads,
           View<const std::int32_t> labels, View<const typename B::Res> x, View<typename B::Res> dx,
           View<typename B::Acc> loss, double loss_scale) {
  { op.hidden_size() } -> std::convertible_to<std::int64_t>;
  { op.template scratch_bytes<B>(chunk) } -> std::convertible_to<std::size_t>;
  // Evaluation: per-token losses (0 where the label is ignored).
  op.forward(be, chunk, w, x, labels, loss, scratch);
  // Training: losses, dx of sum(loss_scale * loss), and weight gradients accumulated.
  op.forward_backward(be, chunk, w, x, labels, loss_scale, loss, dx, grads, scratch);
};
// clang-format on

}  // namespace megatrain
