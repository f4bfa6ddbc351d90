// Must NOT compile: a Trainer over a block type that is a ParamOp (params(), Weights<E>, bind())
// and has hidden_size(), scratch_bytes<B>() and forward(), but no backward(). The test
// layers_compile_fail_block_without_backward (tests/layers/CMakeLists.txt) builds this file and
// passes only if the compiler stops with the Trainer's static_assert message naming LayerOp.
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/cpu_trainer.hpp"

namespace {

struct BadBlock {  // a forward-only block: the trainer cannot train it
  template <class E>
  struct Weights {
    megatrain::View<E> w;
  };
  std::vector<megatrain::ParamSpec> params() const;
  template <class E>
  Weights<E> bind(const megatrain::ParamBinder<E>&) const;
  std::int64_t hidden_size() const;
  template <class B>
  std::size_t scratch_bytes(megatrain::ChunkShape) const;
  template <class B>
  void forward(B&, megatrain::ChunkShape, const Weights<const typename B::Weight>&,
               megatrain::View<const typename B::Act>, megatrain::View<typename B::Act>, megatrain::Arena&) const;
};
static_assert(megatrain::ParamOp<BadBlock>);  // only the LayerOp part is missing

}  // namespace

int main() {
  // Instantiating the class (here through a static member) runs its static_asserts.
  (void)megatrain::Trainer<megatrain::CpuBackend<float>, BadBlock>::store_options({});
  return 0;
}
