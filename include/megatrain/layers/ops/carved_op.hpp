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
#pragma once

#include <cstddef>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/core/tensor.hpp"

namespace megatrain {

template <class Derived>
class CarvedOp {
 public:
  template <class B>
  std::size_t scratch_bytes(ChunkShape c) const {
    Arena measure;
    (void)self().template carve<B>(measure, c, true);
    return measure.peak();
  }

  // (D names Derived late: Derived is still incomplete when CarvedOp<Derived> is instantiated.)
  template <class B, class D = Derived>
  void forward(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
               View<const typename B::Act> x, View<typename B::Act> y, Arena& scratch) const {
    ArenaScope scope(scratch);
    self().run(be, c, w, x, self().template carve<B>(scratch, c, false), y);
  }

  template <class B, class D = Derived>
  void backward(B& be, ChunkShape c, const typename D::template Weights<const typename B::Weight>& w,
                View<const typename B::Act> x, View<const typename B::Act> dy, View<typename B::Act> dx,
                const typename D::template Weights<typename B::Acc>& g, Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = self().template carve<B>(scratch, c, true);
    self().run_kept(be, c, w, x, a);  // recompute from the input (the activation checkpoint)
    self().backprop(be, c, w, x, a, dy, dx, g);
  }

 protected:
  template <class E>
  static View<const E> cview(View<E> v) {
    return v;
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace megatrain
