// Status checks turn library failures into megatrain::Error with the call, the place and the
// library's own words. None of this needs a GPU: the status values are fed in directly.
#include <doctest/doctest.h>

#include <string>

#include "megatrain/core/cuda_check.hpp"
#if MEGATRAIN_HAS_CUDNN
#include "megatrain/core/cudnn_check.hpp"
#endif
#if MEGATRAIN_TEST_HAS_NCCL
#include "megatrain/core/nccl_check.hpp"
#endif

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

TEST_CASE("MT_CUDA_CHECK: cuBLAS status") {
  CHECK_NOTHROW(MT_CUDA_CHECK(CUBLAS_STATUS_SUCCESS));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(CUBLAS_STATUS_INVALID_VALUE), doctest::Contains("CUBLAS_STATUS_INVALID_VALUE"), Error);
}

TEST_CASE("MT_CUDA_CHECK: cuDNN status") {
#if MEGATRAIN_HAS_CUDNN
  CHECK_NOTHROW(MT_CUDA_CHECK(CUDNN_STATUS_SUCCESS));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(CUDNN_STATUS_BAD_PARAM), doctest::Contains("CUDNN_STATUS_BAD_PARAM"), Error);
#else
  MESSAGE("built without cuDNN (not found at configure time): cuDNN status checks not tested");
#endif
}

TEST_CASE("MT_CUDA_CHECK: NCCL status") {
#if MEGATRAIN_TEST_HAS_NCCL
  CHECK_NOTHROW(MT_CUDA_CHECK(ncclSuccess));
  CHECK_THROWS_WITH_AS(MT_CUDA_CHECK(ncclInvalidArgument), doctest::Contains("invalid argument"), Error);
#else
  MESSAGE("built without NCCL (not found at configure time): NCCL status checks not tested");
#endif
}
