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

// `fn(pointer, count)` over `p` in pieces whose counts fit an int.
template <class E, class Fn>
void in_chunks(std::span<E> p, Fn&& fn) {
  constexpr std::size_t kChunk = std::size_t{1} << 26;
  for (std::size_t o = 0; o < p.size(); o += kChunk) fn(p.data() + o, static_cast<int>(std::min(kChunk, p.size() - o)));
}

}  // namespace

MpiComm::MpiComm() {
  int initialised = 0;
  check(MPI_Initialized(&initialised), "MPI_Initialized");
  if (!initialised) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    std::atexit(finalise_at_exit);  // (after every MpiComm: MPI cannot be initialised twice)
  }
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &world_), "MPI_Comm_size");
  int level = MPI_THREAD_SINGLE;
  check(MPI_Query_thread(&level), "MPI_Query_thread");
  serialized_ = level >= MPI_THREAD_SERIALIZED;
}

MpiComm::~MpiComm() = default;

void MpiComm::all_reduce_sum(std::span<float> data) { sum_everywhere(data, MPI_FLOAT); }
void MpiComm::all_reduce_sum(std::span<double> data) { sum_everywhere(data, MPI_DOUBLE); }
void MpiComm::all_reduce_sum(std::span<std::int64_t> data) { sum_everywhere(data, MPI_INT64_T); }
void MpiComm::abort(int status) noexcept { MPI_Abort(MPI_COMM_WORLD, status); }

void MpiComm::sum_backend_memory(float* data, std::size_t n, void* stream) {
  MT_CHECK(stream == nullptr && serialized_, "MpiComm sums host memory only, with MPI initialised for threads "
           "(MPI_THREAD_SERIALIZED)");
  all_reduce_sum(std::span<float>(data, n));
}

void MpiComm::reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) {
  for (int r = 0; r < world_; ++r)  // (each part reduced to its owner)
    in_chunks(shard_part(data, bounds, world_, r), [&](float* p, int n) {
      check(MPI_Reduce(rank_ == r ? MPI_IN_PLACE : p, rank_ == r ? p : nullptr, n, MPI_FLOAT, MPI_SUM, r, MPI_COMM_WORLD),
            "MPI_Reduce");
    });
}

void MpiComm::all_gather(std::span<float> data, std::span<const std::int64_t> bounds) {
  for (int r = 0; r < world_; ++r)
    in_chunks(shard_part(data, bounds, world_, r),
              [&](float* p, int n) { check(MPI_Bcast(p, n, MPI_FLOAT, r, MPI_COMM_WORLD), "MPI_Bcast"); });
}

void MpiComm::all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) {
  for (int r = 0; r < world_; ++r)
    in_chunks(shard_part(data, bounds, world_, r),
              [&](bf16* p, int n) { check(MPI_Bcast(p, n, MPI_UINT16_T, r, MPI_COMM_WORLD), "MPI_Bcast"); });
}

namespace {
template <class E>
void gather_to(std::span<E> data, std::span<const std::int64_t> bounds, int root, int rank, int world, MPI_Datatype type) {
  MT_CHECK(root >= 0 && root < world, "gather to rank {} of {}", root, world);
  for (int r = 0; r < world; ++r) {
    if (r == root) continue;
    in_chunks(shard_part(data, bounds, world, r), [&](E* p, int n) {
      if (rank == r) check(MPI_Send(p, n, type, root, 0, MPI_COMM_WORLD), "MPI_Send");
      else if (rank == root) check(MPI_Recv(p, n, type, r, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
    });
  }
}
}  // namespace

void MpiComm::gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) {
  gather_to(data, bounds, root, rank_, world_, MPI_FLOAT);
}

void MpiComm::gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) {
  gather_to(data, bounds, root, rank_, world_, MPI_UINT16_T);
}

std::vector<std::string> MpiComm::all_gather_blobs(std::string_view blob) {
  // (every rank learns every size first, so that a blob too large fails every rank alike)
  constexpr int kMax = 1 << 20;
  std::vector<int> sizes(static_cast<std::size_t>(world_)), offsets(static_cast<std::size_t>(world_));
  const int mine = static_cast<int>(std::min<std::size_t>(blob.size(), std::size_t{kMax} + 1));
  check(MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
  long long total = 0;
  for (std::size_t r = 0; r < sizes.size(); ++r) {
    MT_CHECK(sizes[r] <= kMax, "MPI rendezvous: rank {}'s blob is over 1 MiB", r);
    offsets[r] = static_cast<int>(total);
    total += sizes[r];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  check(MPI_Allgatherv(blob.data(), mine, MPI_CHAR, all.data(), sizes.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD),
        "MPI_Allgatherv");
  std::vector<std::string> out;
  for (std::size_t r = 0; r < sizes.size(); ++r) out.push_back(all.substr(static_cast<std::size_t>(offsets[r]),
                                                                         static_cast<std::size_t>(sizes[r])));
  return out;
}

}  // namespace megatrain::dist
