// The launcher's environment (torchrun, Open MPI, Slurm) and the TCP rendezvous: ranks as threads
// of this process on 127.0.0.1 (the protocol is the same between processes and hosts).
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/dist/launch.hpp"

using namespace megatrain;
using namespace megatrain::dist;
using namespace std::chrono_literals;

namespace {

/// A getenv over a fixed map.
std::function<const char*(const char*)> env_of(const std::map<std::string, std::string>& m) {
  return [m](const char* name) -> const char* {
    const auto it = m.find(name);
    return it == m.end() ? nullptr : it->second.c_str();
  };
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A socket listening on a free port of 127.0.0.1 with `backlog`; `a` gets its address.
int listening(int backlog, sockaddr_in& a) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  a = sockaddr_in{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, backlog) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  return fd;
}

/// A port nobody listens on now (the kernel's choice for port 0, released).
int free_port() {
  sockaddr_in a{};
  ::close(listening(1, a));
  return ntohs(a.sin_port);
}

LaunchInfo rank_of(int rank, int world, int port) {
  LaunchInfo li;
  li.rank = rank;
  li.world = world;
  li.master_addr = "127.0.0.1";
  li.master_port = port;
  li.launcher = "torchrun";
  return li;
}

/// Runs `ranks` of a world of `world` as threads; each returns its blobs or its error.
struct Outcome {
  std::vector<std::string> blobs;
  std::string error;
};
std::vector<Outcome> run_ranks(const std::vector<int>& ranks, int world, std::chrono::milliseconds timeout,
                               const std::function<LaunchInfo(int)>& info_of = {}) {
  const int port = free_port();
  std::vector<std::future<Outcome>> f;
  for (const int r : ranks)
    f.push_back(std::async(std::launch::async, [=] {
      Outcome o;
      try {
        const LaunchInfo li = info_of ? info_of(r) : rank_of(r, world, port);
        LaunchInfo with_port = li;
        with_port.master_port = port;
        o.blobs = tcp_all_gather(with_port, "blob of rank " + std::to_string(r) + std::string(static_cast<std::size_t>(r) * 1000, 'x'),
                                 timeout);
      } catch (const Error& e) {
        o.error = e.what();
      }
      return o;
    }));
  std::vector<Outcome> out;
  for (auto& x : f) out.push_back(x.get());
  return out;
}

}  // namespace

TEST_CASE("launch_from_env: torchrun, Open MPI, Slurm, and one process") {
  const auto t = launch_from_env(env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"}}));
  CHECK(t.launcher == "torchrun");
  CHECK(t.rank == 3);
  CHECK(t.world == 8);
  CHECK(t.local_rank == 1);
  CHECK(t.local_world == 2);
  CHECK(t.master_addr == "node0");
  CHECK(t.master_port == 29400);

  const auto m = launch_from_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"},
                                         {"MASTER_ADDR", "10.0.0.1"}}));
  CHECK(m.launcher == "openmpi");
  CHECK(m.rank == 1);
  CHECK(m.world == 3);
  CHECK(m.master_port == 29500);  // the default port

  const auto s = launch_from_env(env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                                         {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}}));
  CHECK(s.launcher == "slurm");
  CHECK(s.rank == 5);
  CHECK(s.world == 16);
  CHECK(s.local_rank == 1);
  CHECK(s.master_addr == "10.1.2.3");
  // (without SLURM_NTASKS_PER_NODE: the tasks spread over SLURM_NNODES hosts, where they divide)
  CHECK(launch_from_env(env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_NNODES", "4"}, {"MASTER_ADDR", "a"}}))
            .local_world == 4);
  CHECK(launch_from_env(env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "15"}, {"SLURM_NNODES", "4"}, {"MASTER_ADDR", "a"}}))
            .local_world == 0);

  // torchrun's explicit RANK wins over the others (srun or mpirun launching torchrun)
  const auto both = launch_from_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "7"},
                                            {"SLURM_NTASKS", "9"}, {"MASTER_ADDR", "a"}}));
  CHECK(both.launcher == "torchrun");
  CHECK(both.world == 2);

  const auto one = launch_from_env(env_of({}));
  CHECK(one.launcher == "single");
  CHECK(one.world == 1);
  CHECK(one.rank == 0);
}

TEST_CASE("launch_from_env refuses what a launcher would not set, by name") {
  CHECK(contains(error_of([] { (void)launch_from_env(env_of({{"RANK", "x1"}, {"WORLD_SIZE", "2"}})); }), "RANK"));
  CHECK(contains(error_of([] { (void)launch_from_env(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}})); }),
                 "[0, 2)"));
  CHECK(contains(error_of([] { (void)launch_from_env(env_of({{"RANK", "1"}})); }), "WORLD_SIZE"));
  // (no MASTER_ADDR: refused where the ranks must meet, unless every process is on this host)
  const auto no_addr = launch_from_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}}));
  CHECK(no_addr.master_addr.empty());
  CHECK(contains(error_of([&] { (void)tcp_all_gather(no_addr, "x", std::chrono::milliseconds(100)); }), "MASTER_ADDR"));
  CHECK(launch_from_env(env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}))
            .master_addr == "127.0.0.1");
  CHECK(contains(error_of([] {
          (void)launch_from_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}));
        }),
        "MASTER_PORT"));
}

TEST_CASE("launch_from_env: torchrun's own store holds MASTER_PORT, so its ranks meet on the next port") {
  const std::map<std::string, std::string> torchrun{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"},
                                                    {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  const auto t = launch_from_env(env_of(torchrun));
  CHECK(t.master_port == 29401);
  CHECK(t.port_source == "MASTER_PORT + 1");
  auto no_store = torchrun;
  no_store["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // (the workers would make the store: the port is free)
  CHECK(launch_from_env(env_of(no_store)).master_port == 29400);
  // (another launcher's variables keep MASTER_PORT: only torchrun's agent holds it)
  CHECK(launch_from_env(env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_PORT", "29400"},
                                {"TORCHELASTIC_USE_AGENT_STORE", "True"}}))
            .master_port == 29400);
  // MEGATRAIN_RENDEZVOUS_PORT wins for any launcher, and is checked
  auto chosen = torchrun;
  chosen["MEGATRAIN_RENDEZVOUS_PORT"] = "31000";
  const auto c = launch_from_env(env_of(chosen));
  CHECK(c.master_port == 31000);
  CHECK(c.port_source == "MEGATRAIN_RENDEZVOUS_PORT");
  chosen["MEGATRAIN_RENDEZVOUS_PORT"] = "0";
  CHECK(contains(error_of([&] { (void)launch_from_env(env_of(chosen)); }), "MEGATRAIN_RENDEZVOUS_PORT"));
  auto last = torchrun;
  last["MASTER_PORT"] = "65535";
  CHECK(contains(error_of([&] { (void)launch_from_env(env_of(last)); }), "MEGATRAIN_RENDEZVOUS_PORT"));
  last["MEGATRAIN_RENDEZVOUS_PORT"] = "31000";  // (which is what the message says to do)
  CHECK(launch_from_env(env_of(last)).master_port == 31000);
}

TEST_CASE("tcp_all_gather under torchrun: the ranks meet beside the agent's store listening on MASTER_PORT") {
  // What torchrun does: its agent listens on MASTER_PORT before it starts the workers.
  sockaddr_in a{};
  const int store = listening(16, a);
  const std::string port = std::to_string(ntohs(a.sin_port));
  const auto gather = [&](int rank, bool agent_store) {
    std::map<std::string, std::string> e{{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"},
                                         {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
    if (agent_store) e["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    return std::async(std::launch::async, [=] {
      Outcome o;
      try {
        o.blobs = tcp_all_gather(launch_from_env(env_of(e)), "rank " + std::to_string(rank), 5s);
      } catch (const Error& err) {
        o.error = err.what();
      }
      return o;
    });
  };
  auto r1 = gather(1, true), r0 = gather(0, true);
  const Outcome o0 = r0.get(), o1 = r1.get();
  CHECK(o0.error.empty());
  CHECK(o1.error.empty());
  CHECK(o0.blobs == std::vector<std::string>{"rank 0", "rank 1"});
  CHECK(o1.blobs == o0.blobs);
  // Without torchrun's word, rank 0 cannot listen on the taken port, and says what to set.
  const Outcome taken = gather(0, false).get();
  CHECK(contains(taken.error, "cannot listen on 127.0.0.1:" + port));
  CHECK(contains(taken.error, "MEGATRAIN_RENDEZVOUS_PORT"));
  ::close(store);
}

// Run by tests/dist/torchrun_launch.sh under torchrun itself (MEGATRAIN_TEST_LAUNCHED=1), one
// process a rank: each reads its launcher's environment and meets the others. Elsewhere it does
// nothing.
TEST_CASE("the launcher's own environment: every process meets every other") {
  if (std::getenv("MEGATRAIN_TEST_LAUNCHED") == nullptr) return;
  const LaunchInfo me = launch_from_env();
  REQUIRE(me.world >= 2);
  const auto all = tcp_all_gather(me, "rank " + std::to_string(me.rank), 60s);
  REQUIRE(static_cast<int>(all.size()) == me.world);
  for (int r = 0; r < me.world; ++r) CHECK(all[static_cast<std::size_t>(r)] == "rank " + std::to_string(r));
  MESSAGE("rank " << me.rank << " of " << me.world << " (" << me.launcher << ") met the others on " << me.master_addr
                  << ":" << me.master_port << " (" << me.port_source << ")");
}

TEST_CASE("rendezvous_timeout: the option, else MEGATRAIN_RENDEZVOUS_TIMEOUT, else 300 s") {
  CHECK(rendezvous_timeout(2.5, env_of({{"MEGATRAIN_RENDEZVOUS_TIMEOUT", "9"}})) == 2500ms);
  CHECK(rendezvous_timeout({}, env_of({{"MEGATRAIN_RENDEZVOUS_TIMEOUT", "9"}})) == 9000ms);
  CHECK(rendezvous_timeout({}, env_of({})) == 300000ms);
  CHECK(contains(error_of([] { (void)rendezvous_timeout({}, env_of({{"MEGATRAIN_RENDEZVOUS_TIMEOUT", "soon"}})); }),
                 "MEGATRAIN_RENDEZVOUS_TIMEOUT"));
  CHECK(contains(error_of([] { (void)rendezvous_timeout(-1.0, env_of({})); }), "positive"));
}

TEST_CASE("collective_timeout: the option, else MEGATRAIN_COLLECTIVE_TIMEOUT, else 600 s") {
  CHECK(collective_timeout(1.5, env_of({{"MEGATRAIN_COLLECTIVE_TIMEOUT", "9"}})) == 1500ms);
  CHECK(collective_timeout({}, env_of({{"MEGATRAIN_COLLECTIVE_TIMEOUT", "30"}})) == 30000ms);
  CHECK(collective_timeout({}, env_of({{"MEGATRAIN_RENDEZVOUS_TIMEOUT", "30"}})) == 600000ms);
  CHECK(contains(error_of([] { (void)collective_timeout({}, env_of({{"MEGATRAIN_COLLECTIVE_TIMEOUT", "0"}})); }),
                 "MEGATRAIN_COLLECTIVE_TIMEOUT"));
  CHECK(contains(error_of([] { (void)collective_timeout(0.0, env_of({})); }), "collective timeout"));
}

TEST_CASE("tcp_all_gather: every rank gets every rank's blob, in rank order") {
  for (const int world : {1, 2, 5}) {
    CAPTURE(world);
    std::vector<int> ranks;
    for (int r = world - 1; r >= 0; --r) ranks.push_back(r);  // (rank 0 last: the others wait for it to listen)
    const auto out = run_ranks(ranks, world, 20s);
    for (const auto& o : out) {
      CHECK(o.error.empty());
      REQUIRE(static_cast<int>(o.blobs.size()) == world);
      for (int r = 0; r < world; ++r)
        CHECK(o.blobs[static_cast<std::size_t>(r)] ==
              "blob of rank " + std::to_string(r) + std::string(static_cast<std::size_t>(r) * 1000, 'x'));
    }
  }
}

TEST_CASE("tcp_all_gather never hangs: missing ranks are named, and the ranks that came hear why") {
  // ranks 0 and 1 of 4: rank 0 gives up naming 2 and 3 and the address; rank 1 gets its words
  const auto start = std::chrono::steady_clock::now();
  const auto out = run_ranks({0, 1}, 4, 1500ms);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(contains(out[0].error, "ranks 2, 3 of the 4 did not arrive"));
  CHECK(contains(out[0].error, "127.0.0.1:"));
  CHECK(contains(out[0].error, "MEGATRAIN_RENDEZVOUS_TIMEOUT"));
  CHECK(contains(out[1].error, "rank 0 gave up"));
  CHECK(contains(out[1].error, "ranks 2, 3"));

  // no rank 0: rank 2 cannot reach it, and says where it looked
  const auto alone = run_ranks({2}, 3, 1000ms);
  CHECK(contains(alone[0].error, "rank 2 of 3 could not reach rank 0 at 127.0.0.1:"));
}

TEST_CASE("tcp_all_gather refuses ranks launched inconsistently") {
  // rank 1 thinks the world has 3 processes, rank 0 has 2
  const auto out = run_ranks({0, 1}, 2, 5000ms, [](int r) { return rank_of(r, r == 1 ? 3 : 2, 0); });
  CHECK(contains(out[0].error, "WORLD_SIZE"));
  CHECK(contains(out[1].error, "WORLD_SIZE"));
  // two processes say they are rank 1
  const auto dup = run_ranks({0, 1, 1}, 3, 5000ms);
  CHECK(contains(dup[0].error, "rank 1 arrived twice"));
}

TEST_CASE("Beacon and absent_ranks: a live process answers, one that ended is named, an unreachable one too") {
  LaunchInfo info;  // (no MASTER_ADDR: the beacon gives 127.0.0.1)
  Beacon self(info), alive(info);
  CHECK(alive.address().rfind("127.0.0.1:", 0) == 0);
  info.master_addr = "127.0.0.1";
  info.master_port = 29500;
  const Beacon reached(info);  // (the address this host reaches MASTER_ADDR from)
  CHECK(reached.address().rfind("127.0.0.1:", 0) == 0);
  CHECK(reached.address() != alive.address());
  const auto ended = [&] {  // (a beacon that was there and is gone: its port refuses now)
    const Beacon b(info);
    return b.address();
  };
  const std::string gone1 = ended(), gone2 = ended();
  CHECK(absent_ranks({self.address(), alive.address(), reached.address()}, 0).empty());
  CHECK_FALSE(any_rank_ended({self.address(), alive.address(), reached.address()}, 0));
  CHECK(any_rank_ended({self.address(), alive.address(), gone1}, 0));
  CHECK_FALSE(any_rank_ended({gone1, self.address()}, 0));  // (this rank's own is not asked)
  // (each knock is accepted and closed: a hundred knocks, more than the queue holds, all answered)
  for (int i = 0; i < 100; ++i) REQUIRE_FALSE(any_rank_ended({self.address(), alive.address()}, 0));
  CHECK(absent_ranks({self.address(), alive.address()}, 0).empty());
  // (ranks on several hosts that met over MPI without MASTER_ADDR: this host's address for the
  // others is not known, so the beacon gives none, and nobody knocks on it)
  LaunchInfo hosts;
  hosts.world = 4;
  hosts.local_world = 2;
  CHECK(Beacon(hosts).address().empty());
  CHECK(absent_ranks({self.address(), alive.address(), gone1}, 0) == "rank 2 of 3: its process has ended (killed or failed)");
  CHECK(absent_ranks({gone1, self.address(), gone2}, 1) == "ranks 0, 2 of 3: their processes have ended (killed or failed)");
  // (this rank's own beacon is not asked; an empty address is skipped)
  CHECK(absent_ranks({gone1, ""}, 0).empty());
  // A peer that does not answer, beside one that ended: a port whose queue of connections is full
  // (never accepted), where the kernel drops the next ones as an unreachable host does.
  sockaddr_in a{};
  const int full = listening(0, a);
  std::vector<int> queued;
  for (int i = 0; i < 4; ++i) {  // (filling its queue)
    queued.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    (void)::connect(queued.back(), reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  std::this_thread::sleep_for(100ms);
  const std::string silent = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  CHECK_FALSE(any_rank_ended({self.address(), silent}, 0, std::chrono::milliseconds(300)));  // (slow is not gone)
  CHECK(absent_ranks({self.address(), silent, gone1}, 0, std::chrono::milliseconds(300)) ==
        "rank 2 of 3: its process has ended (killed or failed); rank 1 of 3: no answer within 0.3 s (the host down or "
        "unreachable)");
  for (const int fd : queued) ::close(fd);
  ::close(full);
}
