// main() of the GPU tests: exits with 77 (CTest's "skipped") where there is no usable GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "megatrain/core/host_memory.hpp"

int main(int argc, char** argv) {
  if (!megatrain::cuda_device_present()) {
    std::printf("no usable GPU: skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
