// NCCL communicator (include/megatrain/dist/nccl.hpp).
#include "megatrain/dist/nccl.hpp"

#include <nccl.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <string>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/nccl_check.hpp"

namespace megatrain::dist {

NcclComm::NcclComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout, const Rendezvous& meet)
    : rank_(info.rank), world_(info.world), beacon_(info) {
  MT_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id{};
  // (every rank's blob: its beacon's address, a newline, and on rank 0 the NCCL unique id)
  std::string mine = beacon_.address() + '\n';
  if (info.rank == 0) {
    MT_CUDA_CHECK(ncclGetUniqueId(&id));
    mine.append(reinterpret_cast<const char*>(&id), sizeof id);
  }
  const auto all = meet ? meet(mine) : tcp_all_gather(info, mine, timeout);
  MT_CHECK(static_cast<int>(all.size()) == info.world, "NCCL rendezvous: {} blobs for a run of {} ranks", all.size(),
           info.world);
  for (const auto& b : all) beacons_.push_back(b.substr(0, b.find('\n')));
  const auto at = all.at(0).find('\n');
  MT_CHECK(at != std::string::npos && all[0].size() - at - 1 == sizeof id,
           "NCCL rendezvous{}: rank 0 sent {} bytes, not its address and an NCCL unique id of {}",
           meet ? std::string(" (over MPI)") : fmt::format(" on {}:{}", info.master_addr, info.master_port),
           all.at(0).size(), sizeof id);
  std::memcpy(&id, all[0].data() + at + 1, sizeof id);
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

// Host copies to and from the pinned staging, by all cores (one core's memcpy was most of a
// collective's time: 6 GB of a 1.5B model's gradients or masters a step).
void copy_bytes(void* dst, const void* src, std::size_t n) {
  constexpr std::size_t kPiece = std::size_t{4} << 20;
  tbb::parallel_for(std::size_t{0}, (n + kPiece - 1) / kPiece, [&](std::size_t i) {
    const std::size_t o = i * kPiece;
    std::memcpy(static_cast<char*>(dst) + o, static_cast<const char*>(src) + o, std::min(kPiece, n - o));
  });
}
// Bounds in elements of `elem` bytes, as bounds in bytes.
std::vector<std::int64_t> in_bytes(std::span<const std::int64_t> bounds, std::size_t elem) {
  std::vector<std::int64_t> b(bounds.begin(), bounds.end());
  for (auto& x : b) x *= static_cast<std::int64_t>(elem);
  return b;
}
}  // namespace

NcclHostComm::NcclHostComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout,
                           std::chrono::milliseconds collective_timeout, const Rendezvous& meet)
    : comm_(info, device, timeout, meet), device_(device), collective_timeout_(collective_timeout) {
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MT_CUDA_CHECK(cudaMalloc(&staging_, kStagingBytes));
  MT_CUDA_CHECK(cudaMallocHost(&pinned_, kStagingBytes));
}

NcclHostComm::~NcclHostComm() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  for (const auto& p : pending_) cudaEventDestroy(p.done);
  for (const auto e : free_events_) cudaEventDestroy(e);
  if (staging_ != nullptr) cudaFree(staging_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

// Under the lock: the watchdog (or another thread's abort) cannot abort the communicator while a
// call enqueues on it.
void NcclHostComm::with_comm(const std::function<void(void*)>& call) {
  {
    std::lock_guard lock(mutex_);
    if (comm_.comm_ != nullptr) {
      call(comm_.comm_);
      return;
    }
  }
  MT_FAIL("rank {} of {}: an earlier collective failed or did not complete ({}); the communicator is gone", rank(), world(),
          stopped());
}

std::string NcclHostComm::stopped() const {
  const std::string gone = comm_.absent();
  return gone.empty() ? std::string("another rank stopped or is stuck; every other rank's process still answers")
                      : "another rank stopped: " + gone;
}

void NcclHostComm::abort_comm() noexcept {
  std::lock_guard lock(mutex_);
  if (comm_.comm_ == nullptr) return;
  ncclCommAbort(static_cast<ncclComm_t>(comm_.comm_));  // (a collective's kernel ends; the comm is gone)
  comm_.comm_ = nullptr;
}

void NcclHostComm::sum_backend_memory(float* data, std::size_t n, void* stream) {
  MT_CHECK(stream != nullptr, "NcclHostComm::sum_backend_memory sums a GPU's memory (host memory: all_reduce_sum)");
  const auto s = static_cast<cudaStream_t>(stream);
  with_comm([&](void* c) {
    MT_CUDA_CHECK(ncclAllReduce(data, data, n, ncclFloat32, ncclSum, static_cast<ncclComm_t>(c), s));
  });
  watch_stream(s);
}

// One collective for each rank's part of the n elements of `elem` bytes at `data` (in a GPU's
// memory), in one group on `stream`, watched: op(part, count, rank, communicator, stream).
void NcclHostComm::each_part(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds, void* stream,
                             const char* what, const PartOp& op) {
  MT_CHECK(stream != nullptr, "NcclHostComm::{} works on a GPU's memory (host memory: the collectives of host memory)", what);
  const std::span<std::byte> all(static_cast<std::byte*>(data), n * elem);
  const std::vector<std::int64_t> b = in_bytes(bounds, elem);
  for (int r = 0; r < world(); ++r) (void)shard_part(all, b, world(), r);  // (checks the bounds)
  const auto s = static_cast<cudaStream_t>(stream);
  with_comm([&](void* c) {
    MT_CUDA_CHECK(ncclGroupStart());
    for (int r = 0; r < world(); ++r) {
      const auto part = shard_part(all, b, world(), r);
      if (!part.empty()) op(part.data(), part.size() / elem, r, c, s);
    }
    MT_CUDA_CHECK(ncclGroupEnd());
  });
  watch_stream(s);
}

// (NCCL's reduce-scatter and all-gather take equal parts, and the bounds need not be: one reduce
// to each part's owner, one broadcast from it)
void NcclHostComm::reduce_scatter_backend_memory(float* data, std::span<const std::int64_t> bounds, void* stream) {
  MT_CHECK(!bounds.empty(), "reduce_scatter_backend_memory: no bounds");
  each_part(data, sizeof(float), static_cast<std::size_t>(bounds.back()), bounds, stream, "reduce_scatter_backend_memory",
            [](std::byte* p, std::size_t count, int root, void* c, cudaStream_t st) {
              MT_CUDA_CHECK(ncclReduce(p, p, count, ncclFloat32, ncclSum, root, static_cast<ncclComm_t>(c), st));
            });
}

void NcclHostComm::gather_parts(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds,
                                void* stream) {
  each_part(data, elem, n, bounds, stream, "all_gather_backend_memory",
            [elem](std::byte* p, std::size_t count, int root, void* c, cudaStream_t st) {
              MT_CUDA_CHECK(ncclBroadcast(p, p, count * elem, ncclUint8, root, static_cast<ncclComm_t>(c), st));
            });
}

void NcclHostComm::all_gather_backend_memory(std::span<float> data, std::span<const std::int64_t> bounds, void* stream) {
  gather_parts(data.data(), sizeof(float), data.size(), bounds, stream);
}

void NcclHostComm::all_gather_backend_memory(std::span<bf16> data, std::span<const std::int64_t> bounds, void* stream) {
  gather_parts(data.data(), sizeof(bf16), data.size(), bounds, stream);
}

void NcclHostComm::watch_stream(cudaStream_t s) {
  cudaEvent_t done = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (!free_events_.empty()) {
      done = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (done == nullptr) MT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  if (const cudaError_t e = cudaEventRecord(done, s); e != cudaSuccess) {
    cudaEventDestroy(done);
    MT_CUDA_CHECK(e);
  }
  {
    std::lock_guard lock(mutex_);
    pending_.push_back({done, std::chrono::steady_clock::now()});
    if (!watchdog_.joinable()) watchdog_ = std::thread([this] { watch(); });
  }
  wake_.notify_all();
}

// Whether a collective waiting since `since` waits for a rank whose process has ended: asked once
// it has waited kAskAfter, then every kAskAfter (`knocked`: when last asked).
bool NcclHostComm::peer_gone(std::chrono::steady_clock::time_point since,
                             std::chrono::steady_clock::time_point& knocked) const {
  constexpr auto kAskAfter = std::chrono::seconds(2);
  const auto now = std::chrono::steady_clock::now();
  if (now - since < kAskAfter || now - knocked < kAskAfter) return false;
  knocked = now;
  return comm_.peer_ended();
}

void NcclHostComm::watch() {
  (void)cudaSetDevice(device_);
  std::chrono::steady_clock::time_point knocked{};
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (pending_.empty() || comm_.comm_ == nullptr) {
      wake_.wait(lock);
      continue;
    }
    const Pending p = pending_.front();
    ncclResult_t async = ncclSuccess;
    (void)ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_.comm_), &async);
    lock.unlock();
    const cudaError_t q = cudaEventQuery(p.done);
    const auto now = std::chrono::steady_clock::now();
    const bool late = now - p.since > collective_timeout_;
    if (q == cudaSuccess) {
      lock.lock();
      pending_.pop_front();
      free_events_.push_back(p.done);
      continue;
    }
    const bool gone = q == cudaErrorNotReady && peer_gone(p.since, knocked);
    if (q != cudaErrorNotReady || (async != ncclSuccess && async != ncclInProgress) || late || gone) {
      std::fprintf(stderr, "megatrain: rank %d of %d: a collective on the GPUs (a gradient's sum, or a unit's weights "
                   "gathered) %s; %s: this rank's communicator is aborted and its next collective fails (the collective "
                   "timeout: MEGATRAIN_COLLECTIVE_TIMEOUT, in seconds)\n", rank(), world(),
                   late   ? fmt::format("did not complete within {} s", std::chrono::duration<double>(collective_timeout_).count()).c_str()
                   : gone ? "waits for a rank that is gone"
                          : fmt::format("failed ({})", ncclGetErrorString(async)).c_str(),
                   stopped().c_str());
      abort_comm();
      lock.lock();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    lock.lock();
  }
}

void NcclHostComm::wait() {
  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point knocked{};
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) MT_CUDA_CHECK(q);
    ncclResult_t async = ncclSuccess;
    with_comm([&](void* c) { MT_CUDA_CHECK(ncclCommGetAsyncError(static_cast<ncclComm_t>(c), &async)); });
    const bool late = std::chrono::steady_clock::now() - start > collective_timeout_;
    const bool gone = !late && peer_gone(start, knocked);
    if ((async != ncclSuccess && async != ncclInProgress) || late || gone) {
      abort_comm();  // (the collective's kernel ends, and the communicator may not be used again)
      if (gone) MT_FAIL("rank {} of {}: a collective waits for a rank that is gone ({}); this rank stops too", rank(),
                        world(), stopped());
      if (!late) MT_FAIL("rank {} of {}: a collective failed in NCCL ({}; {}); this rank stops", rank(), world(),
                         ncclGetErrorString(async), stopped());
      MT_FAIL("rank {} of {}: a collective did not complete within {} s ({}); this rank stops too (the collective "
              "timeout: MEGATRAIN_COLLECTIVE_TIMEOUT, in seconds)", rank(), world(),
              std::chrono::duration<double>(collective_timeout_).count(), stopped());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclHostComm::sum(void* data, std::size_t bytes, std::size_t elem, int type) {
  MT_CUDA_CHECK(cudaSetDevice(device_));
  // Through pinned memory both ways: a copy into pageable memory would block until the collective
  // ends, where wait() could not see a peer that never comes.
  auto* p = static_cast<char*>(data);
  for (std::size_t o = 0; o < bytes; o += kStagingBytes) {
    const std::size_t n = std::min(kStagingBytes, bytes - o);
    copy_bytes(pinned_, p + o, n);
    MT_CUDA_CHECK(cudaMemcpyAsync(staging_, pinned_, n, cudaMemcpyHostToDevice, stream_));
    with_comm([&](void* c) {
      MT_CUDA_CHECK(ncclAllReduce(staging_, staging_, n / elem, static_cast<ncclDataType_t>(type), ncclSum,
                                  static_cast<ncclComm_t>(c), stream_));
    });
    MT_CUDA_CHECK(cudaMemcpyAsync(pinned_, staging_, n, cudaMemcpyDeviceToHost, stream_));
    wait();
    copy_bytes(p + o, pinned_, n);
  }
}

void NcclHostComm::broadcast(void* data, std::size_t bytes, int root, bool keep) {
  MT_CUDA_CHECK(cudaSetDevice(device_));
  auto* p = static_cast<char*>(data);
  if (host_pages_locked(data, bytes)) {
    // Memory a HostBuffer page-locked (a store's bf16 weights, or this process's part of them):
    // copied by DMA straight to and from the GPU, the pieces one after another on the stream with
    // no host copy and no wait between them (a 14B model's weights, gathered after each update,
    // took 2 s a step through the staging).
    for (std::size_t o = 0; o < bytes; o += kStagingBytes) {
      const std::size_t n = std::min(kStagingBytes, bytes - o);
      if (rank() == root) MT_CUDA_CHECK(cudaMemcpyAsync(staging_, p + o, n, cudaMemcpyHostToDevice, stream_));
      with_comm([&](void* c) {
        MT_CUDA_CHECK(ncclBroadcast(staging_, staging_, n, ncclUint8, root, static_cast<ncclComm_t>(c), stream_));
      });
      if (keep && rank() != root) MT_CUDA_CHECK(cudaMemcpyAsync(p + o, staging_, n, cudaMemcpyDeviceToHost, stream_));
    }
    wait();
    return;
  }
  for (std::size_t o = 0; o < bytes; o += kStagingBytes) {
    const std::size_t n = std::min(kStagingBytes, bytes - o);
    if (rank() == root) {
      copy_bytes(pinned_, p + o, n);
      MT_CUDA_CHECK(cudaMemcpyAsync(staging_, pinned_, n, cudaMemcpyHostToDevice, stream_));
    }
    with_comm([&](void* c) {
      MT_CUDA_CHECK(ncclBroadcast(staging_, staging_, n, ncclUint8, root, static_cast<ncclComm_t>(c), stream_));
    });
    if (keep && rank() != root) MT_CUDA_CHECK(cudaMemcpyAsync(pinned_, staging_, n, cudaMemcpyDeviceToHost, stream_));
    wait();
    if (keep && rank() != root) copy_bytes(p + o, pinned_, n);
  }
}

// (NCCL's reduce-scatter takes equal parts: the whole is summed instead, which gives every rank its part)
void NcclHostComm::reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) {
  (void)shard_part(data, bounds, world(), rank());  // (checks the bounds)
  all_reduce_sum(data);
}

void NcclHostComm::host_parts(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds, int root) {
  const std::span<std::byte> all(static_cast<std::byte*>(data), n * elem);
  const std::vector<std::int64_t> b = in_bytes(bounds, elem);
  MT_CHECK(root < world(), "gather to rank {} of {}", root, world());
  for (int r = 0; r < world(); ++r) {
    const auto p = shard_part(all, b, world(), r);
    if (r != root) broadcast(p.data(), p.size_bytes(), r, root < 0 || rank() == root);
  }
}

void NcclHostComm::all_gather(std::span<float> data, std::span<const std::int64_t> bounds) {
  host_parts(data.data(), sizeof(float), data.size(), bounds, -1);
}

void NcclHostComm::all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) {
  host_parts(data.data(), sizeof(bf16), data.size(), bounds, -1);
}

void NcclHostComm::gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) {
  host_parts(data.data(), sizeof(float), data.size(), bounds, root);
}

void NcclHostComm::gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) {
  host_parts(data.data(), sizeof(bf16), data.size(), bounds, root);
}

void NcclHostComm::all_reduce_sum(std::span<float> data) { sum(data.data(), data.size_bytes(), sizeof(float), ncclFloat32); }
void NcclHostComm::all_reduce_sum(std::span<double> data) { sum(data.data(), data.size_bytes(), sizeof(double), ncclFloat64); }
void NcclHostComm::abort(int /*status*/) noexcept {
  abort_comm();
}

void NcclHostComm::all_reduce_sum(std::span<std::int64_t> data) {
  sum(data.data(), data.size_bytes(), sizeof(std::int64_t), ncclInt64);
}

}  // namespace megatrain::dist
