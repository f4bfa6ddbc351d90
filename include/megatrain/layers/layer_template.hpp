// LayerTemplate<Op>: a stateless op bound, at run time, to whatever buffer holds its weights.
//
// The template owns the op and the unit's layout (where each tensor sits in a slab; the same
// rule as HostParamStore and the device slots). Binding costs a few name lookups; it is done
// whenever the pipeline has streamed the unit's weights into a slot, and for the gradient
// buffer the unit accumulates into. Nothing assumes a fixed address.
#pragma once

#include <initializer_list>
#include <span>
#include <string>
#include <utility>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/unit_layout.hpp"

namespace megatrain {

template <class Op>
class LayerTemplate {
  static_assert(ParamOp<Op>,
                "LayerTemplate<Op>: Op does not satisfy megatrain::ParamOp: it needs params() returning "
                "std::vector<ParamSpec>, a member template Weights<E>, and bind(const ParamBinder<E>&) "
                "returning Weights<E> (see megatrain/layers/layer_op.hpp)");

 public:
  explicit LayerTemplate(Op op) : op_(std::move(op)), layout_(op_.params()), full_layout_(full_specs(layout_)) {}

  const Op& op() const { return op_; }
  const UnitLayout& layout() const { return layout_; }
  /// The unit's full-precision parameters alone (ParamSpec::full_precision), packed: how a
  /// buffer of their fp32 values is laid out beside bf16 weights.
  const UnitLayout& full_layout() const { return full_layout_; }

  /// The unit as HostParamStore wants it.
  UnitSpec unit_spec(std::string name) const {
    UnitSpec u{std::move(name), {}};
    for (const auto& e : layout_.entries()) u.params.push_back(e.spec);
    return u;
  }

  /// The op's weights inside `slab` (laid out per layout()); `others` are further units' slabs
  /// for tensors this op borrows (a tied LM head reads the embedding unit's table).
  template <class E>
  auto bind(std::span<E> slab, std::initializer_list<typename ParamBinder<E>::Slab> others = {}) const {
    std::vector<typename ParamBinder<E>::Slab> all{{&layout_, slab}};
    all.insert(all.end(), others.begin(), others.end());
    return op_.bind(ParamBinder<E>(std::move(all)));
  }
  /// The same, with the full-precision parameters (where E is bf16) in `full`.
  template <class E>
  auto bind(std::span<E> slab, typename ParamBinder<E>::FullSlab full,
            std::initializer_list<typename ParamBinder<E>::Slab> others = {}) const {
    std::vector<typename ParamBinder<E>::Slab> all{{&layout_, slab}};
    all.insert(all.end(), others.begin(), others.end());
    return op_.bind(ParamBinder<E>(std::move(all), {full}));
  }

 private:
  static UnitLayout full_specs(const UnitLayout& l) {
    std::vector<ParamSpec> specs;
    for (const auto& e : l.entries())
      if (e.spec.full_precision) specs.push_back(e.spec);
    return UnitLayout(std::move(specs));
  }

  Op op_;
  UnitLayout layout_;
  UnitLayout full_layout_;
};

}  // namespace megatrain
