// Status checks turn library failures into megatrain::Error with the call, the place and the
// library's own words. None of this needs a GPU: the status values are fed in directly.
#include <doctest/doctest.h>

#include <string>

#include "megatrain/core/cudnn_check.hpp"
#include "megatrain/core/nccl_check.hpp"

using megatrain::Error;

TEST_CASE("MT_CUDA_CHECK: CUDA runtime status") {
  CHECK_NOTHROW(MT_CUDA_CHECK(cudaSuccess));
  try {
    MT_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no exception");
  } catch (const Error& e) {
    const std::string w = e.what();
    CHECK(e.call() == "cudaErrorInvalidValue");
    CHECK(w.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(w.find("invalid argument") != std::string::npos);
    CHECK(w.find("test_cuda_check.cpp:") != std::string::npos);
  }
}

TEST_CASE("MT_CUDA_CHECK: cuBLAS, cuDNN and NCCL status") {
  CHECK_NOTHROW(MT_CUDA_CHECK(CUBLAS_STATUS_SUCCESS));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(CUBLAS_STATUS_INVALID_VALUE), doctest::Contains("CUBLAS_STATUS_INVALID_VALUE"), Error);
  CHECK_NOTHROW(MT_CUDA_CHECK(CUDNN_STATUS_SUCCESS));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(CUDNN_STATUS_BAD_PARAM), doctest::Contains("CUDNN_STATUS_BAD_PARAM"), Error);
  CHECK_NOTHROW(MT_CUDA_CHECK(ncclSuccess));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(ncclInvalidArgument), doctest::Contains("invalid argument"), Error);
}
