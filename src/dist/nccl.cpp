// NCCL communicator (include/megatrain/dist/nccl.hpp).
#include "megatrain/dist/nccl.hpp"

#include <nccl.h>

#include <algorithm>
#include <cstring>
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

NcclHostComm::NcclHostComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout)
    : comm_(info, device, timeout), device_(device) {
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MT_CUDA_CHECK(cudaMalloc(&staging_, kStagingBytes));
}

NcclHostComm::~NcclHostComm() {
  if (staging_ != nullptr) cudaFree(staging_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void NcclHostComm::sum(void* data, std::size_t bytes, std::size_t elem, int type) {
  MT_CUDA_CHECK(cudaSetDevice(device_));
  auto* p = static_cast<char*>(data);
  for (std::size_t o = 0; o < bytes; o += kStagingBytes) {
    const std::size_t n = std::min(kStagingBytes, bytes - o);
    MT_CUDA_CHECK(cudaMemcpyAsync(staging_, p + o, n, cudaMemcpyHostToDevice, stream_));
    MT_CUDA_CHECK(ncclAllReduce(staging_, staging_, n / elem, static_cast<ncclDataType_t>(type), ncclSum,
                                static_cast<ncclComm_t>(comm_.comm_), stream_));
    MT_CUDA_CHECK(cudaMemcpyAsync(p + o, staging_, n, cudaMemcpyDeviceToHost, stream_));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

void NcclHostComm::all_reduce_sum(std::span<float> data) { sum(data.data(), data.size_bytes(), sizeof(float), ncclFloat32); }
void NcclHostComm::all_reduce_sum(std::span<double> data) { sum(data.data(), data.size_bytes(), sizeof(double), ncclFloat64); }
void NcclHostComm::all_reduce_sum(std::span<std::int64_t> data) {
  sum(data.data(), data.size_bytes(), sizeof(std::int64_t), ncclInt64);
}

}  // namespace megatrain::dist
