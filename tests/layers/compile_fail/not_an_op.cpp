// Must NOT compile: LayerTemplate<Op> of a type that is not a ParamOp. The test
// layers_compile_fail_not_an_op (tests/layers/CMakeLists.txt) builds this file and passes only
// if the compiler stops with LayerTemplate's static_assert message, naming what is missing.
#include "megatrain/layers/layer_template.hpp"

namespace {

struct NotAnOp {  // has parameters in spirit, but none of params(), Weights<E> or bind()
  int hidden = 16;
};

}  // namespace

int main() {
  megatrain::LayerTemplate<NotAnOp> layer{NotAnOp{}};
  (void)layer;
  return 0;
}
