#include "megatrain/dist/local.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "megatrain/core/error.hpp"

namespace megatrain::dist {

LaunchInfo local_launch(int rank, int world, int port) {
  MT_CHECK(world >= 1 && rank >= 0 && rank < world, "rank {} of {} ranks", rank, world);
  LaunchInfo me;
  me.rank = me.local_rank = rank;
  me.world = me.local_world = world;
  me.master_addr = "127.0.0.1";
  me.master_port = port;
  me.launcher = "threads";
  return me;
}

int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  MT_CHECK(fd >= 0, "no socket for the ranks' meeting port on 127.0.0.1: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  MT_CHECK(ok, "could not find a free port on 127.0.0.1 for the ranks to meet on");
  return ntohs(a.sin_port);
}

// ---- LocalComm ------------------------------------------------------------------------------------

struct LocalComm::Group {
  int world = 1;
  std::chrono::milliseconds timeout{0};
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::uint64_t> passed;  // barriers each rank has reached
  std::vector<const void*> data;      // each rank's buffer in the collective under way
  std::vector<std::size_t> bytes;
  std::vector<const char*> what;
  int aborted_by = -1;  // the rank that failed (or timed out), else -1

  // Waits until every rank has reached this rank's barrier number `n` (every rank passes the same
  // barriers in the same order). Throws where the group is aborted, or past the timeout (then
  // aborting it, naming the ranks that never came).
  void barrier(int rank, std::unique_lock<std::mutex>& lock) {
    const std::uint64_t n = ++passed[static_cast<std::size_t>(rank)];
    const auto all_here = [&] {
      return std::all_of(passed.begin(), passed.end(), [&](std::uint64_t p) { return p >= n; });
    };
    cv.notify_all();
    const bool ok = cv.wait_for(lock, timeout, [&] { return aborted_by >= 0 || all_here(); });
    if (aborted_by >= 0 && aborted_by != rank)
      MT_FAIL("rank {} of {}: rank {} of {} failed (its own message says why): every rank of this process stops", rank,
              world, aborted_by, world);
    MT_CHECK(aborted_by < 0, "rank {} of {}: this rank's collectives stopped after it failed", rank, world);
    if (!ok) {
      std::vector<int> missing;
      for (int r = 0; r < world; ++r)
        if (passed[static_cast<std::size_t>(r)] < n) missing.push_back(r);
      aborted_by = rank;
      cv.notify_all();
      MT_FAIL("rank {} of {}: rank(s) {} did not reach the collective within {:g} s (stuck, or waiting elsewhere): every "
              "rank of this process stops (MEGATRAIN_COLLECTIVE_TIMEOUT sets the wait, in seconds)", rank, world,
              fmt::join(missing, ", "), static_cast<double>(timeout.count()) / 1000.0);
    }
  }
};

std::vector<std::unique_ptr<LocalComm>> LocalComm::group(int world, std::chrono::milliseconds timeout) {
  MT_CHECK(world >= 1, "a group of {} ranks", world);
  auto g = std::make_shared<Group>();
  g->world = world;
  g->timeout = timeout;
  g->passed.assign(static_cast<std::size_t>(world), 0);
  g->data.assign(static_cast<std::size_t>(world), nullptr);
  g->bytes.assign(static_cast<std::size_t>(world), 0);
  g->what.assign(static_cast<std::size_t>(world), "");
  std::vector<std::unique_ptr<LocalComm>> out;
  for (int r = 0; r < world; ++r) out.push_back(std::unique_ptr<LocalComm>(new LocalComm(g, r)));
  return out;
}

LocalComm::~LocalComm() = default;

int LocalComm::world() const { return g_->world; }

void LocalComm::abort(int /*status*/) noexcept {
  std::lock_guard lock(g_->m);
  if (g_->aborted_by < 0) g_->aborted_by = rank_;
  g_->cv.notify_all();
}

void LocalComm::collective(const void* data, std::size_t bytes, const char* what, const std::function<void()>& fn) {
  Group& g = *g_;
  const auto me = static_cast<std::size_t>(rank_);
  {
    std::unique_lock lock(g.m);
    g.data[me] = data;
    g.bytes[me] = bytes;
    g.what[me] = what;
    g.barrier(rank_, lock);
    for (int r = 0; r < g.world; ++r) {
      const auto k = static_cast<std::size_t>(r);
      MT_CHECK(g.bytes[k] == bytes && std::strcmp(g.what[k], what) == 0,
               "rank {} of {}: the ranks called different collectives at once (this rank {} of {} bytes, rank {} {} of {} "
               "bytes): every rank must call the same collectives in the same order", rank_, g.world, what, bytes, r,
               g.what[k], g.bytes[k]);
    }
  }
  // (every rank's buffer is published and stays unchanged until the second barrier)
  std::exception_ptr failed;
  try {
    fn();
  } catch (...) {
    failed = std::current_exception();
  }
  std::unique_lock lock(g.m);
  g.barrier(rank_, lock);
  if (failed) std::rethrow_exception(failed);
}

// In place: data[lo, lo + n) becomes the sum over the ranks of their buffers' [lo, lo + n), in
// rank order from rank 0's values (the same bits on every rank); the rest of data is left as it is.
template <class T>
void LocalComm::sum(std::span<T> data, std::size_t lo, std::size_t n, const char* what) {
  std::vector<T> total(n);
  collective(data.data(), data.size_bytes(), what, [&] {
    for (int r = 0; r < g_->world; ++r) {
      const T* p = static_cast<const T*>(g_->data[static_cast<std::size_t>(r)]) + lo;
      if (r == 0)
        std::copy(p, p + n, total.begin());
      else
        for (std::size_t i = 0; i < n; ++i) total[i] += p[i];
    }
  });
  std::copy(total.begin(), total.end(), data.begin() + static_cast<std::ptrdiff_t>(lo));
}

template <class T>
void LocalComm::sum(std::span<T> data) {
  sum(data, 0, data.size(), "a sum");
}

void LocalComm::all_reduce_sum(std::span<float> data) { sum(data); }
void LocalComm::all_reduce_sum(std::span<double> data) { sum(data); }
void LocalComm::all_reduce_sum(std::span<std::int64_t> data) { sum(data); }

void LocalComm::sum_backend_memory(float* data, std::size_t n, void* stream) {
  MT_CHECK(stream == nullptr, "LocalComm sums host memory (the CPU backend's), not a GPU's: the ranks of one process on "
           "GPUs sum over NCCL (dist::NcclHostComm)");
  sum(std::span<float>(data, n));
}

void LocalComm::reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) {
  const std::span<float> mine = shard_part(data, bounds, g_->world, rank_);
  sum(data, static_cast<std::size_t>(mine.data() - data.data()), mine.size(), "a reduce-scatter");
}

// Each rank's part of `data` copied from that rank's buffer: to every rank (root < 0) or to root.
template <class E>
void LocalComm::parts(std::span<E> data, std::span<const std::int64_t> bounds, int root) {
  (void)shard_part(data, bounds, g_->world, rank_);  // (the bounds checked)
  MT_CHECK(root < g_->world, "a gather to rank {} of {}", root, g_->world);
  collective(data.data(), data.size_bytes(), root < 0 ? "an all-gather" : "a gather", [&] {
    if (root >= 0 && root != rank_) return;
    for (int r = 0; r < g_->world; ++r) {
      if (r == rank_) continue;
      const auto lo = static_cast<std::size_t>(bounds[static_cast<std::size_t>(r)]),
                 hi = static_cast<std::size_t>(bounds[static_cast<std::size_t>(r) + 1]);
      const E* p = static_cast<const E*>(g_->data[static_cast<std::size_t>(r)]);
      std::copy(p + lo, p + hi, data.begin() + static_cast<std::ptrdiff_t>(lo));
    }
  });
}

void LocalComm::all_gather(std::span<float> data, std::span<const std::int64_t> bounds) { parts(data, bounds, -1); }
void LocalComm::all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) { parts(data, bounds, -1); }
void LocalComm::gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) {
  MT_CHECK(root >= 0, "a gather to rank {}", root);
  parts(data, bounds, root);
}
void LocalComm::gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) {
  MT_CHECK(root >= 0, "a gather to rank {}", root);
  parts(data, bounds, root);
}

// ---- run_local_ranks ------------------------------------------------------------------------------

std::vector<int> run_local_ranks(int world, const std::function<int(int rank)>& rank_main,
                                 const std::function<void(int failed_rank)>& on_failure, int thrown_status) {
  MT_CHECK(world >= 1, "{} ranks", world);
  std::vector<int> status(static_cast<std::size_t>(world), 0);
  std::mutex m;
  std::condition_variable cv;
  std::vector<int> finished;  // ranks in the order they ended
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      int st = 0;
      try {
        st = rank_main(r);
      } catch (const Error& e) {
        std::fprintf(stderr, "rank %d of %d: error: %s\n", r, world, e.reason().c_str());
        st = thrown_status;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d of %d: error: %s\n", r, world, e.what());
        st = thrown_status;
      }
      std::lock_guard lock(m);
      status[static_cast<std::size_t>(r)] = st;
      finished.push_back(r);
      cv.notify_all();
    });
  {
    std::unique_lock lock(m);
    for (std::size_t seen = 0; seen < static_cast<std::size_t>(world);) {
      cv.wait(lock, [&] { return finished.size() > seen; });
      for (; seen < finished.size(); ++seen) {
        const int r = finished[seen];
        if (status[static_cast<std::size_t>(r)] != 0 && on_failure) {
          lock.unlock();
          on_failure(r);
          lock.lock();
        }
      }
    }
  }
  for (auto& t : threads) t.join();
  return status;
}

}  // namespace megatrain::dist
