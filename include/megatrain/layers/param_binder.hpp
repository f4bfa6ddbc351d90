// ParamBinder: hands an op views of its tensors, by Hugging Face name, inside whatever buffers
// hold them right now — a host slab, a device slot the pipeline streamed into, a gradient
// accumulator. It knows each buffer's UnitLayout, so a view always has the spec's shape and
// lies inside its buffer. Tied weights (an LM head that is the embedding table) are found in
// another unit's buffer by giving the binder both. Full-precision parameters (norm gains) are
// read from fp32 buffers where the weights are bf16 (full()).
#pragma once

#include <initializer_list>
#include <span>
#include <string_view>
#include <vector>

#include <type_traits>

#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/model/unit_layout.hpp"

namespace megatrain {

template <class E>
class ParamBinder {
 public:
  struct Slab {
    const UnitLayout* layout;
    std::span<E> data;  ///< at least layout->numel() elements
  };
  /// Where full-precision parameters are when E is bf16: a buffer of fp32, laid out by `layout`
  /// (the unit's full layout, or its whole layout when the fp32 masters themselves are bound).
  struct FullSlab {
    const UnitLayout* layout;
    std::span<full_t<E>> data;
  };

  ParamBinder(std::initializer_list<Slab> slabs) : ParamBinder(std::vector<Slab>(slabs)) {}
  explicit ParamBinder(std::vector<Slab> slabs, std::vector<FullSlab> full = {})
      : slabs_(std::move(slabs)), full_(std::move(full)) {
    for (const auto& s : slabs_)
      MT_CHECK(static_cast<std::int64_t>(s.data.size()) >= s.layout->numel(),
               "buffer of {} elements is shorter than its unit's layout ({} elements)", s.data.size(), s.layout->numel());
    for (const auto& s : full_)
      MT_CHECK(static_cast<std::int64_t>(s.data.size()) >= s.layout->numel(),
               "full-precision buffer of {} elements is shorter than its layout ({} elements)", s.data.size(),
               s.layout->numel());
  }

  /// A full-precision parameter (a norm gain): from the fp32 slabs where E is bf16, else the
  /// same as operator().
  View<full_t<E>> full(std::string_view name) const {
    if constexpr (std::is_same_v<full_t<E>, E>) {
      return (*this)(name);
    } else {
      for (const auto& s : full_)
        if (const auto* e = s.layout->find(name))
          return View<full_t<E>>(s.data.subspan(static_cast<std::size_t>(e->offset), static_cast<std::size_t>(e->numel())),
                                 e->spec.shape);
      MT_FAIL("no full-precision buffer holds the tensor '{}' (bf16 weights need one: LayerTemplate::bind with a "
              "full-precision slab)", name);
    }
  }

  /// The tensor called `name`; throws if no slab has it.
  View<E> operator()(std::string_view name) const {
    for (const auto& s : slabs_)
      if (const auto* e = s.layout->find(name))
        return View<E>(s.data.subspan(static_cast<std::size_t>(e->offset), static_cast<std::size_t>(e->numel())),
                       e->spec.shape);
    MT_FAIL("no bound buffer holds the tensor '{}'", name);
  }
  /// The tensor called `name`, or an empty view if no slab has it (optional biases).
  View<E> optional(std::string_view name) const {
    for (const auto& s : slabs_)
      if (s.layout->find(name) != nullptr) return (*this)(name);
    return {};
  }

 private:
  std::vector<Slab> slabs_;
  std::vector<FullSlab> full_;
};

}  // namespace megatrain
