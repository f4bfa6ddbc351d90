#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "megatrain/core/tensor.hpp"

using namespace megatrain;

TEST_CASE("Shape: rank, numel, validation") {
  Shape s{3, 5, 7};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 105);
  CHECK(s.str() == "[3, 5, 7]");
  CHECK(Shape{}.numel() == 1);
  CHECK(Shape{4, 0}.numel() == 0);
  CHECK_THROWS_AS((Shape{2, -1}), Error);
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5}), Error);
  CHECK(contiguous_strides(s) == Strides{35, 7, 1, 0});
}

TEST_CASE("View: contiguous, strided, bounds-checked construction") {
  std::vector<float> buf(60);
  std::iota(buf.begin(), buf.end(), 0.0f);
  View<float> v(std::span<float>(buf), Shape{3, 4, 5});
  CHECK(v.is_contiguous());
  CHECK(v(2, 3, 4) == 59.0f);
  CHECK(v(1, 0, 2) == 22.0f);
  CHECK(v.span().size() == 60);

  // A transposed 4x5 view over the second 20 elements.
  View<float> t(std::span<float>(buf), Shape{5, 4}, Strides{1, 5, 0, 0}, 20);
  CHECK(!t.is_contiguous());
  CHECK(t(0, 0) == 20.0f);
  CHECK(t(4, 3) == 39.0f);
  CHECK_THROWS_AS(t.span(), Error);

  // Negative stride (reversed rows) is fine when it stays inside.
  View<float> r(std::span<float>(buf), Shape{3, 2}, Strides{-2, 1, 0, 0}, 4);
  CHECK(r(0, 0) == 4.0f);
  CHECK(r(2, 1) == 1.0f);

  // Out of bounds at every edge is refused.
  CHECK_THROWS_WITH_AS(View<float>(std::span<float>(buf), Shape{61}), doctest::Contains("reaches elements 0..60"), Error);
  CHECK_THROWS_AS(View<float>(std::span<float>(buf), Shape{5, 4}, Strides{1, 5, 0, 0}, 41), Error);
  CHECK_THROWS_AS(View<float>(std::span<float>(buf), Shape{3, 2}, Strides{-2, 1, 0, 0}, 3), Error);
  CHECK_THROWS_AS(View<float>(std::span<float>(buf), Shape{2}, Strides{1, 0, 0, 0}, -1), Error);
  // An empty view reaches nothing, wherever it points.
  CHECK_NOTHROW(View<float>(std::span<float>(buf), Shape{0, 1000}));

  // const conversion
  View<const float> c = v;
  CHECK(c(2, 3, 4) == 59.0f);
#ifndef NDEBUG
  CHECK_THROWS_AS(v(3, 0, 0), Error);
#endif
}

TEST_CASE("AnyView: dtype checked, bounds checked in bytes") {
  std::vector<bf16> buf(12, bf16(1.5f));
  AnyView a(buf.data(), buf.size() * sizeof(bf16), DType::bf16, Shape{3, 4});
  CHECK(a.nbytes() == 24);
  CHECK(static_cast<float>(a.as<bf16>()(2, 3)) == 1.5f);
  CHECK_THROWS_WITH_AS(a.as<float>(), doctest::Contains("holds BF16 elements, not F32"), Error);
  CHECK_THROWS_AS(AnyView(buf.data(), 23, DType::bf16, Shape{3, 4}), Error);
  AnyView b(buf.data(), 24, DType::bf16, Shape{2, 2}, Strides{-2, 1, 0, 0}, 4);
  CHECK(b.as<bf16>()(1, 1).bits == buf[3].bits);
}
