// Where a process stands among the processes of a run, and how they find each other.
//
// Users launch one process per GPU the way they already do: torchrun (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Slurm's srun (SLURM_PROCID,
// SLURM_NTASKS, SLURM_LOCALID, ...) or Open MPI's mpirun (OMPI_COMM_WORLD_*). launch_from_env
// reads whichever is there; none: one process.
//
// The processes of a run meet once, at start, to exchange small blobs (an NCCL unique id, each
// rank's host name and GPU): tcp_all_gather, a rendezvous on MASTER_ADDR:MASTER_PORT where rank
// 0 listens and the others connect. It never hangs: a rank whose peers do not arrive within the
// rendezvous timeout (rendezvous_timeout: an option, else MEGATRAIN_RENDEZVOUS_TIMEOUT in seconds,
// else 300) gives up with a message naming the ranks that are missing and the address it waited
// on, and rank 0 tells the ranks that did arrive why it gave up, so they stop with the same words.
// (Issue 19; docs/distributed.md.)
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace megatrain::dist {

/// This process's place in the run.
struct LaunchInfo {
  int rank = 0;         ///< 0 .. world - 1
  int world = 1;        ///< processes in the run
  int local_rank = 0;   ///< this process's index on its host (its GPU, by default)
  int local_world = 1;  ///< processes on this host (0: unknown)
  std::string master_addr;  ///< where rank 0 listens for the rendezvous (a host name or an address)
  int master_port = 0;
  /// Where master_port came from, for messages: "MASTER_PORT", "MEGATRAIN_RENDEZVOUS_PORT", or
  /// "MASTER_PORT + 1" under torchrun, whose own store listens on MASTER_PORT.
  std::string port_source = "MASTER_PORT";
  /// Which launcher's environment this came from: "torchrun", "openmpi", "slurm", or "single".
  std::string launcher = "single";
};

/// Reads the launcher's environment: torchrun's RANK and WORLD_SIZE first (they are explicit),
/// then Open MPI's OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE, then Slurm's
/// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID. MASTER_ADDR and MASTER_PORT give the rendezvous
/// (Slurm: SLURM_LAUNCH_NODE_IPADDR where MASTER_ADDR is absent; 127.0.0.1 where every process is on
/// this host, as `mpirun -np N` starts them; else empty, which tcp_all_gather refuses, naming
/// MASTER_ADDR: a run over MPI alone needs none; the port defaults to 29500). Under torchrun
/// (TORCHELASTIC_USE_AGENT_STORE=True: the agent's own TCPStore already listens on MASTER_PORT)
/// the ranks meet on MASTER_PORT + 1; MEGATRAIN_RENDEZVOUS_PORT, where set, is the port for any
/// launcher. A
/// variable that is not a whole number, or a rank outside [0, world), is an error naming it.
/// `getenv` is std::getenv unless a test gives its own.
LaunchInfo launch_from_env(const std::function<const char*(const char*)>& getenv = {});

/// The rendezvous timeout: `option` where given (> 0), else MEGATRAIN_RENDEZVOUS_TIMEOUT (seconds,
/// a positive number; anything else is an error naming the variable), else 300 s.
std::chrono::milliseconds rendezvous_timeout(std::optional<double> option_seconds = {},
                                             const std::function<const char*(const char*)>& getenv = {});
/// How long a rank waits for one collective to complete before it concludes that a peer stopped
/// (killed, failed, stuck) and stops too: `option` where given (> 0), else
/// MEGATRAIN_COLLECTIVE_TIMEOUT (seconds), else 600 s.
std::chrono::milliseconds collective_timeout(std::optional<double> option_seconds = {},
                                             const std::function<const char*(const char*)>& getenv = {});

/// Every rank's blob, in rank order, on every rank: rank 0 listens on info.master_addr:master_port
/// and the others connect (retrying until rank 0 listens), send their rank, world size and blob,
/// and receive all of them. Throws megatrain::Error, never hangs: past `timeout` rank 0 names
/// the ranks that did not arrive and tells those that did; a rank that cannot reach rank 0, or
/// hears nothing back, names the address. A peer with another world size, a rank outside the
/// run or a rank that arrives twice is refused by name. A world of one returns {blob} at once.
/// Blobs up to 1 MiB.
std::vector<std::string> tcp_all_gather(const LaunchInfo& info, std::string_view blob, std::chrono::milliseconds timeout);

/// What tells the other ranks that this process still lives: a TCP socket listening on a port of
/// its own, which its kernel answers while the process lives and refuses once it has ended (killed
/// or failed); a thread of it accepts and closes each knock. Its address ("host:port": MASTER_ADDR
/// on rank 0, else the address this host reaches MASTER_ADDR from, or 127.0.0.1 for a run of one
/// process; empty, and not asked, for ranks on several hosts that met without MASTER_ADDR (over
/// MPI), whose own address is not known; it listens on every address) travels with the rendezvous, so that
/// a rank whose collective stalls can name the ranks that are gone (absent_ranks). Moves, no copies.
class Beacon {
 public:
  explicit Beacon(const LaunchInfo& info);
  Beacon(Beacon&& o) noexcept = default;
  Beacon& operator=(Beacon&&) = delete;
  Beacon(const Beacon&) = delete;
  ~Beacon();
  const std::string& address() const { return address_; }

 private:
  struct Listener;  // (the socket, and a thread that accepts and closes what knocks, so its queue never fills)
  std::unique_ptr<Listener> listener_;
  std::string address_;
};

/// The ranks of `beacons` (every rank's Beacon::address(), in rank order) other than `self` that
/// are not there, as words for an error message: those whose process has ended ("rank 1 of 2:
/// its process has ended (killed or failed)", its beacon refused) and those that do not answer
/// within `wait` (their host unreachable or down); empty where every other rank answers (alive:
/// then it is stuck or failed elsewhere). An empty or malformed address is skipped.
std::string absent_ranks(const std::vector<std::string>& beacons, int self,
                         std::chrono::milliseconds wait = std::chrono::milliseconds(1500));
/// Whether the process of a rank of `beacons` other than `self` has ended (its beacon refused):
/// what a rank waiting in a collective asks every few seconds, to stop at once rather than at the
/// collective timeout. A rank that does not answer within `wait` is not counted (it may be slow).
bool any_rank_ended(const std::vector<std::string>& beacons, int self,
                    std::chrono::milliseconds wait = std::chrono::milliseconds(500));

}  // namespace megatrain::dist
