// NCCL communicator (include/megatrain/dist/nccl.hpp).
#include "megatrain/dist/nccl.hpp"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <string>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nccl_check.hpp"

namespace megatrain::dist {

NcclComm::NcclComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout)
    : rank_(info.rank), world_(info.world) {
  MT_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id{};
  std::string mine;
  if (info.rank == 0) {
    MT_CUDA_CHECK(ncclGetUniqueId(&id));
    mine.assign(reinterpret_cast<const char*>(&id), sizeof id);
  }
  // (rank 0's blob is the id; the others send nothing of use)
  const auto all = tcp_all_gather(info, mine, timeout);
  MT_CHECK(all.at(0).size() == sizeof id, "NCCL rendezvous on {}:{}: rank 0 sent {} bytes, not an NCCL unique id of {}",
           info.master_addr, info.master_port, all.at(0).size(), sizeof id);
  std::memcpy(&id, all[0].data(), sizeof id);
  ncclComm_t c = nullptr;
  MT_CUDA_CHECK(ncclCommInitRank(&c, info.world, id, info.rank));
  comm_ = c;
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
}

void NcclComm::all_reduce_sum(float* data, std::size_t n, cudaStream_t stream) {
  MT_CUDA_CHECK(ncclAllReduce(data, data, n, ncclFloat32, ncclSum, static_cast<ncclComm_t>(comm_), stream));
}

void NcclComm::reduce_scatter_sum(const float* in, float* out, std::size_t n, cudaStream_t stream) {
  MT_CUDA_CHECK(ncclReduceScatter(in, out, n, ncclFloat32, ncclSum, static_cast<ncclComm_t>(comm_), stream));
}

void NcclComm::all_gather(const float* in, float* out, std::size_t n, cudaStream_t stream) {
  MT_CUDA_CHECK(ncclAllGather(in, out, n, ncclFloat32, static_cast<ncclComm_t>(comm_), stream));
}

void NcclComm::all_gather(const bf16* in, bf16* out, std::size_t n, cudaStream_t stream) {
  MT_CUDA_CHECK(ncclAllGather(in, out, n, ncclBfloat16, static_cast<ncclComm_t>(comm_), stream));
}

namespace {
constexpr std::size_t kStagingBytes = std::size_t{64} << 20;
}  // namespace

NcclHostComm::NcclHostComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout,
                           std::chrono::milliseconds collective_timeout)
    : comm_(info, device, timeout), device_(device), collective_timeout_(collective_timeout) {
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MT_CUDA_CHECK(cudaMalloc(&staging_, kStagingBytes));
  MT_CUDA_CHECK(cudaMallocHost(&pinned_, kStagingBytes));
}

NcclHostComm::~NcclHostComm() {
  if (staging_ != nullptr) cudaFree(staging_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void NcclHostComm::wait() {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) MT_CUDA_CHECK(q);
    ncclResult_t async = ncclSuccess;
    MT_CUDA_CHECK(ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_.comm_), &async));
    const bool late = std::chrono::steady_clock::now() - start > collective_timeout_;
    if ((async != ncclSuccess && async != ncclInProgress) || late) {
      // (abort: the collective's kernel ends, and the communicator may not be used again)
      ncclCommAbort(static_cast<ncclComm_t>(comm_.comm_));
      comm_.comm_ = nullptr;
      if (!late) MT_FAIL("rank {} of {}: a collective failed in NCCL ({}); this rank stops", rank(), world(),
                         ncclGetErrorString(async));
      MT_FAIL("rank {} of {}: a collective did not complete within {} s: another rank stopped (killed, failed) or is "
              "stuck; this rank stops too (the collective timeout: MEGATRAIN_COLLECTIVE_TIMEOUT, in seconds)", rank(),
              world(), std::chrono::duration<double>(collective_timeout_).count());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclHostComm::sum(void* data, std::size_t bytes, std::size_t elem, int type) {
  MT_CHECK(comm_.comm_ != nullptr, "rank {} of {}: an earlier collective failed; the communicator is gone", rank(), world());
  MT_CUDA_CHECK(cudaSetDevice(device_));
  // Through pinned memory both ways: a copy into pageable memory would block until the collective
  // ends, where wait() could not see a peer that never comes.
  auto* p = static_cast<char*>(data);
  for (std::size_t o = 0; o < bytes; o += kStagingBytes) {
    const std::size_t n = std::min(kStagingBytes, bytes - o);
    std::memcpy(pinned_, p + o, n);
    MT_CUDA_CHECK(cudaMemcpyAsync(staging_, pinned_, n, cudaMemcpyHostToDevice, stream_));
    MT_CUDA_CHECK(ncclAllReduce(staging_, staging_, n / elem, static_cast<ncclDataType_t>(type), ncclSum,
                                static_cast<ncclComm_t>(comm_.comm_), stream_));
    MT_CUDA_CHECK(cudaMemcpyAsync(pinned_, staging_, n, cudaMemcpyDeviceToHost, stream_));
    wait();
    std::memcpy(p + o, pinned_, n);
  }
}

void NcclHostComm::all_reduce_sum(std::span<float> data) { sum(data.data(), data.size_bytes(), sizeof(float), ncclFloat32); }
void NcclHostComm::all_reduce_sum(std::span<double> data) { sum(data.data(), data.size_bytes(), sizeof(double), ncclFloat64); }
void NcclHostComm::all_reduce_sum(std::span<std::int64_t> data) {
  sum(data.data(), data.size_bytes(), sizeof(std::int64_t), ncclInt64);
}

}  // namespace megatrain::dist
