// The LayerOp plumbing shared by ops whose scratch is a struct of views carved from a chunk's
// arena (SelfAttention, SwiGluMlp, DecoderBlock). The op (Derived) provides
//
//   Acts<B> carve<B>(Arena&, ChunkShape, bool with_backward)   its activations (and backward buffers)
//   run(be, c, w, x, acts, y)         forward: y = op(x), keeping acts
//   run_kept(be, c, w, x, acts)       forward as far as backprop() needs (acts only, no y)
//   backprop(be, c, w, x, acts, dy, dx, g)   dx written, weight gradients added to g
//
// and CarvedOp turns them into scratch_bytes(), forward() and backward() (which recomputes from
// x, then backpropagates): one carving serves both, so the scratch measured is the scratch used.
//
// An op whose carve also takes `Arena* kept` (carve<B>(Arena&, ChunkShape, bool, Arena* kept))
// can keep its activations from forward to backward instead of recomputing them (KeepingLayerOp,
// layer_op.hpp): it carves what backprop() reads of the forward from `kept` (the same views
// whether or not with_backward), and the rest from the scratch arena; its run() and backprop()
// must then produce the same bits as the recomputing pair.
#pragma once

#include <cstddef>
#include <type_traits>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/core/tensor.hpp"

namespace megatrain {

template <class Derived>
class CarvedOp {
  template <class B, class D>
  static constexpr bool Keeps = requires(const D& d, Arena& a, ChunkShape c) { d.template carve<B>(a, c, true, &a); };

 public:
  template <class B>
  std::size_t scratch_bytes(ChunkShape c) const {
    Arena measure;
    (void)self().template carve<B>(measure, c, true);
    return measure.peak();
  }

  // (D names Derived late: Derived is still incomplete when CarvedOp<Derived> is instantiated.)
  // Input and output are the residual stream (B::Res). An op whose run() and backprop() speak
  // activations (a block's part: attention, MLP) is a LayerOp of its own only on backends whose
  // residual stream is its activation type (the CPU backend); a bf16 backend runs it inside a
  // block, which converts.
  template <class B, class D = Derived>
  void forward(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
               View<const typename B::Res> x, View<typename B::Res> y, Arena& scratch) const {
    check_io<B, D>();
    ArenaScope scope(scratch);
    self().run(be, c, w, x, self().template carve<B>(scratch, c, false), y);
  }

  template <class B, class D = Derived>
  void backward(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
                View<const typename B::Res> x, View<const typename B::Res> dy, View<typename B::Res> dx,
                const typename D::template Weights<typename B::Acc>& g, Arena& scratch) const {
    check_io<B, D>();
    ArenaScope scope(scratch);
    const auto a = self().template carve<B>(scratch, c, true);
    self().run_kept(be, c, w, x, a);  // recompute from the input (the activation checkpoint)
    self().backprop(be, c, w, x, a, dy, dx, g);
  }

  // Keeping activations (KeepingLayerOp): forward_keep() leaves the chunk's activations carved
  // from `kept`; backward_kept() carves the same views from an arena over the same memory, in
  // the same order of chunks, and backpropagates without recomputing.
  template <class B, class D = Derived>
    requires Keeps<B, D>
  void reserve_kept(Arena& kept, ChunkShape c) const {
    Arena measure;
    (void)self().template carve<B>(measure, c, true, &kept);
  }
  template <class B, class D = Derived>
    requires Keeps<B, D>
  std::size_t kept_scratch_bytes(ChunkShape c) const {
    Arena measure, kept;
    (void)self().template carve<B>(measure, c, true, &kept);
    return measure.peak();
  }
  template <class B, class D = Derived>
    requires Keeps<B, D>
  void forward_keep(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
                    View<const typename B::Res> x, View<typename B::Res> y, Arena& kept, Arena& scratch) const {
    check_io<B, D>();
    ArenaScope scope(scratch);
    self().run(be, c, w, x, self().template carve<B>(scratch, c, false, &kept), y);
  }
  template <class B, class D = Derived>
    requires Keeps<B, D>
  void backward_kept(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
                     View<const typename B::Res> x, View<const typename B::Res> dy, View<typename B::Res> dx,
                     const typename D::template Weights<typename B::Acc>& g, Arena& kept, Arena& scratch) const {
    check_io<B, D>();
    ArenaScope scope(scratch);
    self().backprop(be, c, w, x, self().template carve<B>(scratch, c, true, &kept), dy, dx, g);
  }

 protected:
  template <class E>
  static View<const E> cview(View<E> v) {
    return v;
  }

 private:
  template <class B, class D>
  static constexpr void check_io() {
    static_assert(D::kResidualIO || std::is_same_v<typename B::Res, typename B::Act>,
                  "this op reads and writes activations (B::Act), not the residual stream (B::Res): on a backend "
                  "where they differ (bf16 activations, fp32 residual) run it inside a block such as DecoderBlock");
  }
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace megatrain
