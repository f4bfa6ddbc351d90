// NCCL across processes, as a run's ranks meet: each process is a rank (torchrun's variables, set
// by run_ranks.sh), the NCCL unique id travels through dist::tcp_all_gather, and the collectives a
// data-parallel trainer needs are checked exactly (sums of small whole numbers are exact in fp32)
// at an awkward size. Exit 77 (skipped) where this host has fewer GPUs than ranks.
#include <cuda_runtime.h>

#include <cstdio>
#include <exception>
#include <string_view>
#include <vector>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/dist/nccl.hpp"
#include "../dist/rank_checks.hpp"
#include "gpu_per_rank.hpp"

using namespace megatrain;

namespace {
template <class T>
struct Device {
  T* p = nullptr;
  explicit Device(std::size_t n) { MT_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T))); }
  ~Device() { cudaFree(p); }
  void put(const std::vector<T>& h) { MT_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> get(std::size_t n) const {
    std::vector<T> h(n);
    MT_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};
}  // namespace

int main() {
  try {
    const dist::LaunchInfo me = dist::launch_from_env();
    if (!test::gpu_per_rank(me)) return test::kSkipped;
    // (the rendezvous given, as megatrain-train gives MPI's where mpirun launched it: here the
    // TCP one wrapped, to check that the communicator meets through what it is given)
    int met = 0;
    const dist::Rendezvous meet = [&](std::string_view blob) {
      ++met;
      return dist::tcp_all_gather(me, blob, dist::rendezvous_timeout(60.0));
    };
    dist::NcclComm comm(me, me.local_rank, dist::rendezvous_timeout(60.0), meet);
    test::rank_check(met == 1, "the communicator met the others through the rendezvous it was given", me.rank);
    const int W = comm.world(), r = comm.rank();
    cudaStream_t stream = nullptr;
    MT_CUDA_CHECK(cudaStreamCreate(&stream));
    const std::size_t n = 1000003;  // (odd: no collective's chunking divides it)
    const float tri = static_cast<float>(W * (W + 1) / 2);

    std::vector<float> a(n);
    for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<float>((r + 1) * static_cast<int>(i % 97));
    Device<float> da(n);
    da.put(a);
    comm.all_reduce_sum(da.p, n, stream);
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto got = da.get(n);
    bool ok = true;
    for (std::size_t i = 0; i < n; ++i) ok = ok && got[i] == tri * static_cast<float>(i % 97);
    test::rank_check(ok, "all_reduce_sum", r);

    std::vector<float> s(n * static_cast<std::size_t>(W));
    for (std::size_t j = 0; j < s.size(); ++j) s[j] = static_cast<float>((r + 1) * static_cast<int>(j % 89));
    Device<float> ds(s.size()), dshare(n);
    ds.put(s);
    comm.reduce_scatter_sum(ds.p, dshare.p, n, stream);
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    got = dshare.get(n);
    ok = true;
    for (std::size_t i = 0; i < n; ++i) ok = ok && got[i] == tri * static_cast<float>((static_cast<std::size_t>(r) * n + i) % 89);
    test::rank_check(ok, "reduce_scatter_sum: this rank's share", r);

    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>(r * 1000 + static_cast<int>(i % 13));
    Device<float> dg(n), dall(n * static_cast<std::size_t>(W));
    dg.put(g);
    comm.all_gather(dg.p, dall.p, n, stream);
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    got = dall.get(n * static_cast<std::size_t>(W));
    ok = true;
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < n; ++i)
        ok = ok && got[static_cast<std::size_t>(q) * n + i] == static_cast<float>(q * 1000 + static_cast<int>(i % 13));
    test::rank_check(ok, "all_gather (fp32), in rank order", r);

    std::vector<bf16> wb(n);
    for (std::size_t i = 0; i < n; ++i) wb[i] = bf16(static_cast<float>(r * 16 + static_cast<int>(i % 7)));
    Device<bf16> dwb(n), dwall(n * static_cast<std::size_t>(W));
    dwb.put(wb);
    comm.all_gather(dwb.p, dwall.p, n, stream);
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto wall = dwall.get(n * static_cast<std::size_t>(W));
    ok = true;
    for (int q = 0; q < W; ++q)
      for (std::size_t i = 0; i < n; ++i)
        ok = ok && static_cast<float>(wall[static_cast<std::size_t>(q) * n + i]) == static_cast<float>(q * 16 + static_cast<int>(i % 7));
    test::rank_check(ok, "all_gather (bf16), in rank order", r);
    MT_CUDA_CHECK(cudaStreamDestroy(stream));
    std::printf("rank %d of %d (%s, GPU %d): all_reduce, reduce_scatter, all_gather of %zu elements: %s\n", r, W,
                me.launcher.c_str(), me.local_rank, n, test::rank_failures() == 0 ? "exact" : "FAILED");
    return test::rank_failures() == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_dist_nccl: %s\n", e.what());
    return 1;
  }
}
