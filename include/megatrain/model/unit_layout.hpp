// Where each tensor of a unit sits inside the unit's slabs. One rule, used by HostParamStore
// (host slabs), by LayerTemplate (binding an op to whatever buffer holds its weights) and by
// the pipeline (device slots): every tensor starts at a multiple of kAlign elements, in spec
// order, and the slab length is rounded up to kAlign too.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/model/param_spec.hpp"

namespace megatrain {

class UnitLayout {
 public:
  /// Every tensor starts at a multiple of kAlign elements (256 B of fp32, 128 B of bf16).
  static constexpr std::int64_t kAlign = 64;
  static constexpr std::int64_t align(std::int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  struct Entry {
    ParamSpec spec;
    std::int64_t offset;  ///< element offset inside the slab
    std::int64_t numel() const { return spec.numel(); }
  };

  UnitLayout() = default;
  explicit UnitLayout(std::vector<ParamSpec> specs) {
    std::int64_t n = 0;
    entries_.reserve(specs.size());
    for (auto& s : specs) {
      n = align(n);
      entries_.push_back(Entry{std::move(s), n});
      n += entries_.back().numel();
    }
    numel_ = align(n);
    for (std::size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].spec.name, i);  // (the first of a name)
  }

  std::span<const Entry> entries() const { return entries_; }
  /// Slab length in elements, alignment gaps included.
  std::int64_t numel() const { return numel_; }
  /// The entry called `name`, or nullptr.
  const Entry* find(std::string_view name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &entries_[it->second];
  }

 private:
  std::vector<Entry> entries_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> entry (a 128-expert layer has 385 tensors)
  std::int64_t numel_ = 0;
};

}  // namespace megatrain
