// The launcher's environment and the TCP rendezvous (include/megatrain/dist/launch.hpp).
#include "megatrain/dist/launch.hpp"

#include <fmt/format.h>
#include <arpa/inet.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "megatrain/core/error.hpp"

namespace megatrain::dist {

namespace {

using GetEnv = std::function<const char*(const char*)>;
using Clock = std::chrono::steady_clock;

const char* env(const GetEnv& g, const char* name) {
  const char* v = g ? g(name) : std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

/// The whole number in environment variable `name`, if it is set.
std::optional<long long> whole(const GetEnv& g, const char* name) {
  const char* v = env(g, name);
  if (v == nullptr) return std::nullopt;
  long long x = 0;
  const char* end = v + std::strlen(v);
  const auto [p, ec] = std::from_chars(v, end, x);
  MT_CHECK(ec == std::errc() && p == end && x >= 0 && x <= (1 << 30),
           "environment variable {} is '{}': it must be a whole number (as the launcher sets it)", name, v);
  return x;
}

// ---- sockets ----------------------------------------------------------------------------------

constexpr std::uint32_t kMagic = 0x4D545256;  // "MTRV"
constexpr std::uint32_t kVersion = 1;
constexpr std::uint32_t kMaxBlob = 1u << 20;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Socket() { reset(); }
  int fd() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

/// Waits until `fd` is ready for `events` or the deadline passes (false).
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, remaining_ms(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

/// Sends all of `data` (false: the peer is gone or the deadline passed).
bool send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) return false;
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

enum class Got { all, closed, timeout };
Got recv_all(int fd, void* data, std::size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return Got::timeout;
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (k <= 0) return Got::closed;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return Got::all;
}

/// A message as [u32 length][bytes], and a u32 alone.
std::string frame(std::uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof v); }
std::string frame(std::string_view s) { return frame(static_cast<std::uint32_t>(s.size())) + std::string(s); }

struct Addresses {
  addrinfo* list = nullptr;
  ~Addresses() {
    if (list != nullptr) ::freeaddrinfo(list);
  }
};
void resolve(const LaunchInfo& info, bool passive, Addresses& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string port = std::to_string(info.master_port);
  const int rc = ::getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, &out.list);
  MT_CHECK(rc == 0 && out.list != nullptr, "rendezvous: cannot resolve MASTER_ADDR '{}': {}", info.master_addr,
           ::gai_strerror(rc));
}

std::string where(const LaunchInfo& info) { return fmt::format("{}:{}", info.master_addr, info.master_port); }
std::string seconds(std::chrono::milliseconds t) { return fmt::format("{:g} s", static_cast<double>(t.count()) / 1000.0); }
constexpr const char* kTimeoutHint = "(the rendezvous timeout: MEGATRAIN_RENDEZVOUS_TIMEOUT, in seconds)";

// ---- rank 0 -----------------------------------------------------------------------------------

std::vector<std::string> serve(const LaunchInfo& info, std::string_view blob, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Addresses addrs;
  resolve(info, true, addrs);
  Socket listener;
  std::string why;
  for (addrinfo* a = addrs.list; a != nullptr && !listener; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
    if (!s) continue;
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(s.fd(), 128) == 0) listener = std::move(s);
    else why = std::strerror(errno);
  }
  MT_CHECK(static_cast<bool>(listener), "rendezvous: rank 0 cannot listen on {} ({}): MASTER_ADDR must be this host's "
           "address and {} a free port{}", where(info), why, info.port_source,
           info.port_source == "MEGATRAIN_RENDEZVOUS_PORT" ? "" : " (or set MEGATRAIN_RENDEZVOUS_PORT to one)");

  std::vector<std::string> blobs(static_cast<std::size_t>(info.world));
  std::vector<Socket> peers(static_cast<std::size_t>(info.world));
  blobs[0] = std::string(blob);
  int arrived = 1;
  // Every rank that arrived hears why rank 0 gives up, then rank 0 throws the same words.
  const auto give_up = [&](const std::string& reason) {
    const std::string msg = frame(std::uint32_t{1}) + frame(reason);
    for (auto& p : peers)
      if (p) send_all(p.fd(), msg.data(), msg.size(), Clock::now() + std::chrono::seconds(2));
    MT_FAIL("{}", reason);
  };
  while (arrived < info.world) {
    if (!wait_fd(listener.fd(), POLLIN, deadline)) {
      std::vector<int> missing;
      for (int r = 1; r < info.world; ++r)
        if (!peers[static_cast<std::size_t>(r)]) missing.push_back(r);
      give_up(fmt::format("rendezvous on {}: rank{} {} of the {} did not arrive within {} {}; each rank must be launched "
                          "with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE",
                          where(info), missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), info.world,
                          seconds(timeout), kTimeoutHint));
    }
    Socket c(::accept(listener.fd(), nullptr, nullptr));
    if (!c) continue;
    std::array<std::uint32_t, 5> hello{};  // magic, version, world, rank, blob length
    if (recv_all(c.fd(), hello.data(), sizeof hello, deadline) != Got::all || hello[0] != kMagic || hello[1] != kVersion)
      continue;  // (not a megatrain rank, or one that went away: ignored)
    const auto world = static_cast<int>(hello[2]), rank = static_cast<int>(hello[3]);
    std::string theirs(std::min(hello[4], kMaxBlob), '\0');
    if (hello[4] > kMaxBlob || recv_all(c.fd(), theirs.data(), theirs.size(), deadline) != Got::all) continue;
    if (world != info.world || rank < 1 || rank >= info.world || peers[static_cast<std::size_t>(rank)]) {
      const std::string reason =
          world != info.world
              ? fmt::format("rendezvous on {}: rank {} was launched with a world of {} processes, rank 0 with {}: "
                            "every rank must be given the same WORLD_SIZE", where(info), rank, world, info.world)
          : rank < 1 || rank >= info.world
              ? fmt::format("rendezvous on {}: a process says it is rank {}, outside the run's ranks 0 .. {}",
                            where(info), rank, info.world - 1)
              : fmt::format("rendezvous on {}: rank {} arrived twice: two processes were launched with the same RANK",
                            where(info), rank);
      const std::string msg = frame(std::uint32_t{1}) + frame(reason);
      send_all(c.fd(), msg.data(), msg.size(), Clock::now() + std::chrono::seconds(2));
      give_up(reason);
    }
    blobs[static_cast<std::size_t>(rank)] = std::move(theirs);
    peers[static_cast<std::size_t>(rank)] = std::move(c);
    ++arrived;
  }
  std::string all = frame(std::uint32_t{0}) + frame(static_cast<std::uint32_t>(info.world));
  for (const auto& b : blobs) all += frame(b);
  for (int r = 1; r < info.world; ++r) {
    auto& p = peers[static_cast<std::size_t>(r)];
    MT_CHECK(send_all(p.fd(), all.data(), all.size(), deadline + std::chrono::seconds(5)),
             "rendezvous on {}: rank {} went away before it got the others' answers", where(info), r);
  }
  return blobs;
}

// ---- the other ranks --------------------------------------------------------------------------

Socket connect_to(const LaunchInfo& info, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  std::string last = "no answer";
  while (true) {
    Addresses addrs;
    resolve(info, false, addrs);
    for (addrinfo* a = addrs.list; a != nullptr; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol));
      if (!s) continue;
      if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) return s;
      if (errno != EINPROGRESS) {
        last = std::strerror(errno);
        continue;
      }
      if (!wait_fd(s.fd(), POLLOUT, std::min(deadline, Clock::now() + std::chrono::seconds(2)))) continue;
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) return s;
      last = std::strerror(err);
    }
    MT_CHECK(Clock::now() < deadline, "rendezvous: rank {} of {} could not reach rank 0 at {} within {} ({}) {}; is rank 0 "
             "running, and are MASTER_ADDR and MASTER_PORT the same for every rank?", info.rank, info.world, where(info),
             seconds(timeout), last, kTimeoutHint);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::vector<std::string> join(const LaunchInfo& info, std::string_view blob, std::chrono::milliseconds timeout) {
  MT_CHECK(blob.size() <= kMaxBlob, "rendezvous: a blob of {} bytes (at most {})", blob.size(), kMaxBlob);
  const auto deadline = Clock::now() + timeout;
  Socket s = connect_to(info, deadline, timeout);
  const std::array<std::uint32_t, 5> hello{kMagic, kVersion, static_cast<std::uint32_t>(info.world),
                                           static_cast<std::uint32_t>(info.rank), static_cast<std::uint32_t>(blob.size())};
  const std::string msg = std::string(reinterpret_cast<const char*>(hello.data()), sizeof hello) + std::string(blob);
  MT_CHECK(send_all(s.fd(), msg.data(), msg.size(), deadline), "rendezvous: rank {} of {} reached rank 0 at {} but could "
           "not send it its part", info.rank, info.world, where(info));
  // (a little past the deadline: rank 0, which started later, explains a timeout of its own)
  const auto answer_by = deadline + std::chrono::seconds(5);
  const auto fail = [&](Got g) {
    MT_FAIL("rendezvous: rank {} of {} reached rank 0 at {} but {}", info.rank, info.world, where(info),
            g == Got::closed ? std::string("rank 0 closed the connection without an answer (it stopped)")
                             : fmt::format("heard nothing back within {} {}", seconds(timeout), kTimeoutHint));
  };
  std::uint32_t status = 0, n = 0;
  for (auto* v : {&status, &n})
    if (const Got g = recv_all(s.fd(), v, sizeof *v, answer_by); g != Got::all) fail(g);
  if (status != 0) {  // rank 0 gave up, and says why
    std::string reason(std::min(n, kMaxBlob), '\0');
    recv_all(s.fd(), reason.data(), reason.size(), answer_by);
    MT_FAIL("rendezvous: rank 0 gave up: {}", reason);
  }
  MT_CHECK(static_cast<int>(n) == info.world, "rendezvous on {}: rank 0 answered for {} ranks, this run has {}",
           where(info), n, info.world);
  std::vector<std::string> blobs(n);
  for (auto& b : blobs) {
    std::uint32_t len = 0;
    if (const Got g = recv_all(s.fd(), &len, sizeof len, answer_by); g != Got::all) fail(g);
    MT_CHECK(len <= kMaxBlob, "rendezvous on {}: a malformed answer from rank 0", where(info));
    b.resize(len);
    if (const Got g = recv_all(s.fd(), b.data(), len, answer_by); g != Got::all) fail(g);
  }
  return blobs;
}

}  // namespace

LaunchInfo launch_from_env(const GetEnv& getenv) {
  LaunchInfo li;
  const auto set = [&](const char* launcher, const char* rank, const char* world, const char* local_rank,
                       const char* local_world) {
    li.launcher = launcher;
    li.rank = static_cast<int>(*whole(getenv, rank));
    li.world = static_cast<int>(*whole(getenv, world));
    li.local_rank = static_cast<int>(whole(getenv, local_rank).value_or(0));
    li.local_world = static_cast<int>(whole(getenv, local_world).value_or(0));
    MT_CHECK(li.world >= 1 && li.rank < li.world, "{} says rank {} of {} processes ({} and {}): a rank must be in [0, {})",
             launcher, li.rank, li.world, rank, world, li.world);
    MT_CHECK(li.local_world == 0 || li.local_rank < li.local_world, "{} says local rank {} of {} on this host ({} and {})",
             launcher, li.local_rank, li.local_world, local_rank, local_world);
  };
  const auto both = [&](const char* a, const char* b) {
    const bool x = whole(getenv, a).has_value(), y = whole(getenv, b).has_value();
    MT_CHECK(x == y, "{} is set but {} is not: a launcher sets both", x ? a : b, x ? b : a);
    return x;
  };
  if (both("RANK", "WORLD_SIZE")) set("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  else if (both("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    set("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  else if (both("SLURM_PROCID", "SLURM_NTASKS"))
    set("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
  if (li.launcher == "single") return li;
  // (Slurm sets SLURM_NTASKS_PER_NODE only where it was asked for: else the tasks spread evenly
  // over SLURM_NNODES hosts, where they divide)
  if (li.launcher == "slurm" && li.local_world == 0)
    if (const auto nodes = whole(getenv, "SLURM_NNODES"); nodes && *nodes > 0 && li.world % *nodes == 0)
      li.local_world = static_cast<int>(li.world / *nodes);
  const char* addr = env(getenv, "MASTER_ADDR");
  if (addr == nullptr && li.launcher == "slurm") addr = env(getenv, "SLURM_LAUNCH_NODE_IPADDR");
  li.master_addr = addr != nullptr ? addr : "";
  li.master_port = static_cast<int>(whole(getenv, "MASTER_PORT").value_or(29500));
  MT_CHECK(li.master_port > 0 && li.master_port < 65536, "environment variable MASTER_PORT is {}: a TCP port is 1 .. 65535",
           li.master_port);
  // torchrun's agent keeps a TCPStore of its own listening on MASTER_PORT for the workers' process
  // groups (it says so with TORCHELASTIC_USE_AGENT_STORE=True): rank 0 cannot listen there, so the
  // ranks meet on the next port. MEGATRAIN_RENDEZVOUS_PORT chooses the port for any launcher.
  const char* agent_store = env(getenv, "TORCHELASTIC_USE_AGENT_STORE");
  if (const auto port = whole(getenv, "MEGATRAIN_RENDEZVOUS_PORT")) {
    MT_CHECK(*port > 0 && *port < 65536, "environment variable MEGATRAIN_RENDEZVOUS_PORT is {}: a TCP port is 1 .. 65535",
             *port);
    li.master_port = static_cast<int>(*port);
    li.port_source = "MEGATRAIN_RENDEZVOUS_PORT";
  } else if (li.launcher == "torchrun" && agent_store != nullptr &&
             (std::string_view(agent_store) == "True" || std::string_view(agent_store) == "true" ||
              std::string_view(agent_store) == "1")) {
    MT_CHECK(li.master_port < 65535, "MASTER_PORT is 65535: under torchrun the ranks meet on MASTER_PORT + 1 (torchrun's "
             "own store listens on MASTER_PORT); give torchrun another --master-port, or set MEGATRAIN_RENDEZVOUS_PORT");
    li.master_port += 1;
    li.port_source = "MASTER_PORT + 1";
  }
  // (All processes on this host, as mpirun -np N or srun on one node starts them: rank 0 is here.)
  if (li.master_addr.empty() && li.local_world == li.world) li.master_addr = "127.0.0.1";
  return li;
}

namespace {
// A timeout in seconds: the option where given, else the environment variable, else `fallback`.
std::chrono::milliseconds timeout_seconds(std::optional<double> option_seconds, const GetEnv& getenv, const char* variable,
                                          const char* what, double fallback) {
  double s = fallback;
  if (option_seconds) {
    MT_CHECK(std::isfinite(*option_seconds) && *option_seconds > 0, "the {} timeout must be a positive number of "
             "seconds (got {})", what, *option_seconds);
    s = *option_seconds;
  } else if (const char* v = env(getenv, variable)) {
    char* end = nullptr;
    s = std::strtod(v, &end);
    MT_CHECK(end != v && *end == '\0' && std::isfinite(s) && s > 0 && s < 1e7,
             "environment variable {} is '{}': it must be a positive number of seconds", variable, v);
  }
  return std::chrono::milliseconds(static_cast<long long>(std::ceil(s * 1000)));
}
}  // namespace

std::chrono::milliseconds rendezvous_timeout(std::optional<double> option_seconds, const GetEnv& getenv) {
  return timeout_seconds(option_seconds, getenv, "MEGATRAIN_RENDEZVOUS_TIMEOUT", "rendezvous", 300);
}

std::chrono::milliseconds collective_timeout(std::optional<double> option_seconds, const GetEnv& getenv) {
  return timeout_seconds(option_seconds, getenv, "MEGATRAIN_COLLECTIVE_TIMEOUT", "collective", 600);
}

namespace {
// The address of this host that a connection to MASTER_ADDR leaves from (a UDP socket's connect
// sends nothing), where the others can reach it; 127.0.0.1 where there is no MASTER_ADDR.
std::string own_address(const LaunchInfo& info) {
  if (info.master_addr.empty() || info.master_port <= 0) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* list = nullptr;
  const std::string port = std::to_string(info.master_port);
  if (::getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, &list) != 0 || list == nullptr) return "127.0.0.1";
  std::string out = "127.0.0.1";
  Socket s(::socket(AF_INET, SOCK_DGRAM, 0));
  sockaddr_in local{};
  socklen_t len = sizeof local;
  char text[INET_ADDRSTRLEN] = {};
  if (s && ::connect(s.fd(), list->ai_addr, list->ai_addrlen) == 0 &&
      ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
      ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text) != nullptr)
    out = text;
  ::freeaddrinfo(list);
  return out;
}


// Knocks on every other rank's beacon at once: the ranks whose process has ended (refused), and
// those that do not answer by `wait` (their host down or unreachable, or their queue full). An
// empty or unresolvable address is not asked.
void knock_all(const std::vector<std::string>& beacons, int self, std::chrono::milliseconds wait,
               std::vector<std::string>& ended, std::vector<std::string>& silent) {
  const auto deadline = Clock::now() + wait;
  std::vector<int> gone, quiet;
  std::vector<std::pair<int, Socket>> pending;  // (rank, a connection under way)
  for (int r = 0; r < static_cast<int>(beacons.size()); ++r) {
    const std::string& address = beacons[static_cast<std::size_t>(r)];
    const auto colon = address.rfind(':');
    if (r == self || address.empty() || colon == std::string::npos) continue;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    if (::getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints, &list) != 0 ||
        list == nullptr)
      continue;
    Socket s(::socket(list->ai_family, list->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, list->ai_protocol));
    const int rc = s ? ::connect(s.fd(), list->ai_addr, list->ai_addrlen) : -1;
    const int err = rc == 0 ? 0 : errno;
    ::freeaddrinfo(list);
    if (!s || rc == 0) continue;  // (answered: alive; or nothing to ask with)
    if (err == ECONNREFUSED) gone.push_back(r);
    else if (err == EINPROGRESS) pending.emplace_back(r, std::move(s));
    else quiet.push_back(r);
  }
  while (!pending.empty()) {
    std::vector<pollfd> fds;
    for (const auto& [r, s] : pending) fds.push_back({s.fd(), POLLOUT, 0});
    const int n = ::poll(fds.data(), fds.size(), remaining_ms(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    std::vector<std::pair<int, Socket>> still;
    for (std::size_t k = 0; k < pending.size(); ++k) {
      if (fds[k].revents == 0) {
        still.push_back(std::move(pending[k]));
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(pending[k].second.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == ECONNREFUSED) gone.push_back(pending[k].first);
      else if (err != 0) quiet.push_back(pending[k].first);
    }
    pending = std::move(still);
  }
  for (const auto& p : pending) quiet.push_back(p.first);
  std::sort(gone.begin(), gone.end());
  std::sort(quiet.begin(), quiet.end());
  for (const int r : gone) ended.push_back(std::to_string(r));
  for (const int r : quiet) silent.push_back(std::to_string(r));
}
}  // namespace

struct Beacon::Listener {
  Socket socket;
  std::atomic<bool> stop{false};
  std::thread thread;
  ~Listener() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
};

Beacon::Beacon(const LaunchInfo& info) : listener_(std::make_unique<Listener>()) {
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  MT_CHECK(static_cast<bool>(s), "cannot open a socket to tell the other ranks this process lives: {}", std::strerror(errno));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = 0;  // (a free port)
  socklen_t len = sizeof any;
  MT_CHECK(::bind(s.fd(), reinterpret_cast<sockaddr*>(&any), sizeof any) == 0 && ::listen(s.fd(), 64) == 0 &&
               ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&any), &len) == 0,
           "cannot listen on a port to tell the other ranks this process lives: {}", std::strerror(errno));
  // (rank 0 is where the others reached it, MASTER_ADDR; the others where they reach it from; ranks
  // that met over MPI on several hosts without MASTER_ADDR: not known, so not asked)
  const bool master = info.rank == 0 && !info.master_addr.empty() && info.master_addr.find(':') == std::string::npos;
  if (info.world <= 1 || !info.master_addr.empty())
    address_ = fmt::format("{}:{}", master ? info.master_addr : own_address(info), ntohs(any.sin_port));
  listener_->socket = std::move(s);
  // (each knock accepted and closed at once, so that the queue of connections never fills: a full
  // queue would leave the next knocks unanswered, as if the host were down)
  listener_->thread = std::thread([l = listener_.get()] {
    while (!l->stop) {
      pollfd p{l->socket.fd(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      for (int c; (c = ::accept4(l->socket.fd(), nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) ::close(c);
    }
  });
}

Beacon::~Beacon() = default;

bool any_rank_ended(const std::vector<std::string>& beacons, int self, std::chrono::milliseconds wait) {
  std::vector<std::string> ended, silent;
  knock_all(beacons, self, wait, ended, silent);
  return !ended.empty();
}

std::string absent_ranks(const std::vector<std::string>& beacons, int self, std::chrono::milliseconds wait) {
  std::vector<std::string> ended, silent;
  const int world = static_cast<int>(beacons.size());
  knock_all(beacons, self, wait, ended, silent);
  std::vector<std::string> parts;
  if (!ended.empty())
    parts.push_back(fmt::format("rank{} {} of {}: {} process{} ended (killed or failed)", ended.size() > 1 ? "s" : "",
                                fmt::join(ended, ", "), world, ended.size() > 1 ? "their" : "its",
                                ended.size() > 1 ? "es have" : " has"));
  if (!silent.empty())
    parts.push_back(fmt::format("rank{} {} of {}: no answer within {:g} s (the host down or unreachable)",
                                silent.size() > 1 ? "s" : "", fmt::join(silent, ", "), world,
                                static_cast<double>(wait.count()) / 1000.0));
  return fmt::format("{}", fmt::join(parts, "; "));
}

std::vector<std::string> tcp_all_gather(const LaunchInfo& info, std::string_view blob, std::chrono::milliseconds timeout) {
  MT_CHECK(info.world >= 1 && info.rank >= 0 && info.rank < info.world, "rendezvous: rank {} of {} processes", info.rank,
           info.world);
  MT_CHECK(blob.size() <= kMaxBlob, "rendezvous: a blob of {} bytes (at most {})", blob.size(), kMaxBlob);
  if (info.world == 1) return {std::string(blob)};
  MT_CHECK(!info.master_addr.empty() && info.master_port > 0,
           "{} launched {} processes on several hosts but MASTER_ADDR is not set: the ranks meet at "
           "MASTER_ADDR:MASTER_PORT (rank 0's host and a free port; torchrun sets them, with Slurm or mpirun export them, "
           "e.g. MASTER_ADDR=$(hostname) on the first host)", info.launcher, info.world);
  return info.rank == 0 ? serve(info, blob, timeout) : join(info, blob, timeout);
}

}  // namespace megatrain::dist
