// Non-owning tensor views: a pointer, a shape and strides (in elements), over memory that
// something else owns (a HostParamStore slab, a device slot, a memory-mapped file).
//
// Construction is bounds-checked against the extent of the underlying buffer: a view whose
// reachable elements would leave the buffer cannot be made. Element access checks indices
// only in debug builds. A view's pointer may be device memory; then only its metadata is
// used on the host.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include <fmt/format.h>

#include "megatrain/core/checked.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain {

inline constexpr int kMaxRank = 4;

/// Up to four dimensions, each >= 0.
class Shape {
 public:
  constexpr Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) : Shape(std::span<const std::int64_t>(dims.begin(), dims.size())) {}
  explicit Shape(std::span<const std::int64_t> dims) {
    MT_CHECK(dims.size() <= static_cast<std::size_t>(kMaxRank), "rank {} exceeds the maximum {}", dims.size(), kMaxRank);
    rank_ = static_cast<int>(dims.size());
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) {
      MT_CHECK(dims[i] >= 0, "dimension {} is negative ({})", i, dims[i]);
      dims_[i] = dims[i];
      n = checked_mul(n, dims[i], "shape size");  // (so that numel() never overflows)
    }
  }

  constexpr int rank() const { return rank_; }
  constexpr std::int64_t operator[](int i) const { return dims_[static_cast<std::size_t>(i)]; }
  constexpr std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  std::span<const std::int64_t> dims() const { return {dims_.data(), static_cast<std::size_t>(rank_)}; }
  friend bool operator==(const Shape& a, const Shape& b) {
    return a.rank_ == b.rank_ && std::equal(a.dims_.begin(), a.dims_.begin() + a.rank_, b.dims_.begin());
  }
  /// "[4096, 11008]"
  std::string str() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

 private:
  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

using Strides = std::array<std::int64_t, kMaxRank>;

/// Row-major strides of `shape`.
inline Strides contiguous_strides(const Shape& shape) {
  Strides s{};
  std::int64_t acc = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    s[static_cast<std::size_t>(i)] = acc;
    acc *= shape[i];
  }
  return s;
}

namespace detail {
/// Smallest and largest element offset a view can reach (an empty view reaches nothing).
inline std::pair<std::int64_t, std::int64_t> reach(const Shape& shape, const Strides& strides, std::int64_t offset) {
  std::int64_t lo = offset, hi = offset;
  for (int i = 0; i < shape.rank(); ++i) {
    const std::int64_t span = (shape[i] - 1) * strides[static_cast<std::size_t>(i)];
    (span < 0 ? lo : hi) += span;
  }
  return {lo, hi};
}
inline void check_reach(const Shape& shape, const Strides& strides, std::int64_t offset, std::int64_t extent) {
  if (shape.numel() == 0) return;
  const auto [lo, hi] = reach(shape, strides, offset);
  MT_CHECK(lo >= 0 && hi < extent,
           "view of shape {} (offset {}, strides [{}]) reaches elements {}..{} of a buffer of {} elements",
           shape.str(), offset, fmt::join(std::span(strides.data(), static_cast<std::size_t>(shape.rank())), ", "),
           lo, hi, extent);
}
}  // namespace detail

/// A typed view. `T` may be const.
template <class T>
class View {
 public:
  using element_type = T;

  View() = default;
  /// Contiguous view of the first shape.numel() elements of `buffer`.
  View(std::span<T> buffer, Shape shape) : View(buffer, shape, contiguous_strides(shape), 0) {}
  /// General view: element (i0, i1, ...) is buffer[offset + sum(ik * strides[k])].
  View(std::span<T> buffer, Shape shape, Strides strides, std::int64_t offset)
      : shape_(shape), strides_(strides) {
    detail::check_reach(shape, strides, offset, static_cast<std::int64_t>(buffer.size()));
    data_ = buffer.data() + offset;
  }
  /// A mutable view converts to a const one.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  View(const View<U>& other) : data_(other.data()), shape_(other.shape()), strides_(other.strides()) {}

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  /// A default-constructed view stands for "no tensor" (an absent bias, a gradient not wanted).
  bool is_null() const { return data_ == nullptr && shape_.rank() == 0; }
  int rank() const { return shape_.rank(); }
  std::int64_t size(int dim) const { return shape_[dim]; }
  std::int64_t numel() const { return shape_.numel(); }
  static constexpr DType dtype() { return dtype_of<T>; }
  bool is_contiguous() const { return strides_ == contiguous_strides(shape_); }

  /// The elements of a contiguous view as a span.
  std::span<T> span() const {
    MT_CHECK(is_contiguous(), "view of shape {} is not contiguous", shape_.str());
    return {data_, static_cast<std::size_t>(numel())};
  }

  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) <= kMaxRank);
    const std::int64_t ids[] = {static_cast<std::int64_t>(idx)...};
#ifndef NDEBUG
    MT_CHECK(static_cast<int>(sizeof...(I)) == rank(), "{} indices for a rank-{} view", sizeof...(I), rank());
    for (std::size_t k = 0; k < sizeof...(I); ++k)
      MT_CHECK(ids[k] >= 0 && ids[k] < shape_[static_cast<int>(k)], "index {} out of range [0, {}) in dimension {}",
               ids[k], shape_[static_cast<int>(k)], k);
#endif
    std::int64_t off = 0;
    for (std::size_t k = 0; k < sizeof...(I); ++k) off += ids[k] * strides_[k];
    return data_[off];
  }

 private:
  T* data_ = nullptr;
  Shape shape_;
  Strides strides_{};
};

/// A view whose element type is known only at run time (a safetensors tensor, a device buffer).
class AnyView {
 public:
  AnyView() = default;
  /// `extent_bytes` is the size of the buffer that starts at `data`; the view must stay inside it.
  AnyView(void* data, std::size_t extent_bytes, DType dtype, Shape shape)
      : AnyView(data, extent_bytes, dtype, shape, contiguous_strides(shape), 0) {}
  AnyView(void* data, std::size_t extent_bytes, DType dtype, Shape shape, Strides strides, std::int64_t offset)
      : dtype_(dtype), shape_(shape), strides_(strides) {
    detail::check_reach(shape, strides, offset, static_cast<std::int64_t>(extent_bytes / dtype_size(dtype)));
    data_ = static_cast<std::byte*>(data) + offset * static_cast<std::int64_t>(dtype_size(dtype));
  }
  template <class T>
  AnyView(View<T> v)  // NOLINT: implicit on purpose, like span
      : data_(const_cast<std::remove_const_t<T>*>(v.data())), dtype_(dtype_of<T>), shape_(v.shape()), strides_(v.strides()) {}

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Strides& strides() const { return strides_; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  /// The typed view; throws if T is not this view's dtype.
  template <class T>
  View<T> as() const {
    MT_CHECK(dtype_of<T> == dtype_, "view holds {} elements, not {}", dtype_name(dtype_), dtype_name(dtype_of<T>));
    View<T> v;
    v = make_typed<T>();
    return v;
  }

 private:
  template <class T>
  View<T> make_typed() const {
    // Bounds were checked at construction: rebuild over exactly the reachable range.
    if (numel() == 0) return View<T>(std::span<T>(static_cast<T*>(data_), 0), shape_);
    const auto [lo, hi] = detail::reach(shape_, strides_, 0);
    T* base = static_cast<T*>(data_) + lo;
    return View<T>(std::span<T>(base, static_cast<std::size_t>(hi - lo + 1)), shape_, strides_, -lo);
  }

  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  Strides strides_{};
};

}  // namespace megatrain
