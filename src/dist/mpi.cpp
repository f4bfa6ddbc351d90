#include "megatrain/dist/mpi.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "megatrain/core/error.hpp"

namespace megatrain::dist {

namespace {

void finalise_at_exit() {
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (!finalised) MPI_Finalize();
}

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  MT_FAIL("MPI: {} failed: {}", what, std::string(text, static_cast<std::size_t>(len)));
}

// Sum to rank 0, then broadcast its bits: the same result on every rank (MPI_Allreduce need not
// give every rank the same rounding). In chunks: MPI counts are ints.
template <class T>
void sum_everywhere(std::span<T> data, MPI_Datatype type) {
  constexpr std::size_t kChunk = std::size_t{1} << 26;
  int rank = 0;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  for (std::size_t o = 0; o < data.size(); o += kChunk) {
    const int n = static_cast<int>(std::min(kChunk, data.size() - o));
    T* p = data.data() + o;
    check(MPI_Reduce(rank == 0 ? MPI_IN_PLACE : p, rank == 0 ? p : nullptr, n, type, MPI_SUM, 0, MPI_COMM_WORLD),
          "MPI_Reduce");
    check(MPI_Bcast(p, n, type, 0, MPI_COMM_WORLD), "MPI_Bcast");
  }
}

}  // namespace

MpiComm::MpiComm() {
  int initialised = 0;
  check(MPI_Initialized(&initialised), "MPI_Initialized");
  if (!initialised) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    std::atexit(finalise_at_exit);  // (after every MpiComm: MPI cannot be initialised twice)
  }
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &world_), "MPI_Comm_size");
}

MpiComm::~MpiComm() = default;

void MpiComm::all_reduce_sum(std::span<float> data) { sum_everywhere(data, MPI_FLOAT); }
void MpiComm::all_reduce_sum(std::span<double> data) { sum_everywhere(data, MPI_DOUBLE); }
void MpiComm::all_reduce_sum(std::span<std::int64_t> data) { sum_everywhere(data, MPI_INT64_T); }

}  // namespace megatrain::dist
