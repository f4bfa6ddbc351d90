#include <doctest/doctest.h>

#include <string>

#include "megatrain/core/error.hpp"

namespace {
void refuse_negative(int x) { MT_CHECK(x >= 0, "x must be >= 0 (got {})", x); }
}  // namespace

TEST_CASE("MT_CHECK throws megatrain::Error naming the function, the place and the reason") {
  CHECK_NOTHROW(refuse_negative(1));
  try {
    refuse_negative(-3);
    FAIL("no exception");
  } catch (const megatrain::Error& e) {
    CHECK(e.call().find("refuse_negative") != std::string::npos);
    CHECK(e.reason() == "x must be >= 0 (got -3)");
    CHECK(e.file().find("test_error.cpp") != std::string::npos);
    CHECK(e.line() > 0);
    const std::string what = e.what();
    CHECK(what.find("refuse_negative") != std::string::npos);
    CHECK(what.find("x must be >= 0 (got -3)") != std::string::npos);
    CHECK(what.find("test_error.cpp:") != std::string::npos);
  }
}

TEST_CASE("short_function_name strips return types, arguments and keeps templates") {
  using megatrain::detail::short_function_name;
  CHECK(short_function_name("void ns::f(int)") == "ns::f");
  CHECK(short_function_name("ns::A<float, int>::A(std::vector<int>)") == "ns::A<float, int>::A");
  CHECK(short_function_name("static std::pair<int, int> ns::B<T>::g() [with T = float]") == "ns::B<T>::g");
}
