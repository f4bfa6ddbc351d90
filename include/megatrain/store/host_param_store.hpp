// HostParamStore<T>: the model's home in host memory.
//
// For every unit (embedding, each decoder block, head) the store keeps one contiguous slab per
// kind of state: the master weights (T), AdamW's first and second moments m and v (T), and the
// bf16 compute copy that crosses PCIe to the GPU. Inside a unit every tensor sits at the same
// element offset in all four slabs, aligned to kAlign elements, so one offset addresses a
// parameter everywhere, and a unit's gradient (which has the same layout) can be applied to its
// slabs in one streaming pass. A ring of K gradient landing buffers receives gradients coming
// back from the GPU: each as long as the largest unit, or (GradSlotSize::largest_inner_unit) as
// the largest unit other than the first and the last, when the caller lands the embedding's and
// the head's gradients in pieces (the streaming trainer does).
//
// Memory: (3 sizeof(T) + 2) bytes per parameter plus the ring; the gaps between tensors are a
// few bytes each. A store sharded over N processes (StoreOptions::shard, ZeRO-1: each process
// steps its part of every unit) holds AdamW's m and v for its part only: (sizeof(T) (1 + 2 / N) + 2)
// bytes per parameter; with StoreShard::masters the master weights too (2 + 3 sizeof(T) / N, and
// the ranges kept whole). Only what the GPU's copy engines touch (the bf16 copy and the ring) is pinned;
// master, m and v are read only by the CPU optimizer and stay pageable (with huge pages).
// Without a bf16 copy (StoreOptions::bf16_copy false: 3 sizeof(T) bytes per parameter, 12 for
// fp32) the GPU reads the masters themselves and rounds them as they arrive: they are pinned then.
// The total is computed and checked against the host's available memory before anything is
// allocated: a store that cannot fit is refused with the numbers.
#pragma once

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <numbers>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/dist/comm.hpp"
#include "megatrain/model/param_spec.hpp"
#include "megatrain/model/unit_layout.hpp"

namespace megatrain {

/// How long one gradient landing slot is.
enum class GradSlotSize {
  largest_unit,        ///< any unit's whole gradient fits one slot
  largest_inner_unit,  ///< the largest unit other than the first and the last (the decoder blocks)
  /// This process's part (StoreOptions::shard) of the largest inner unit: what lands of a gradient
  /// summed over the processes where each steps its part (a trainer whose gradients wait on the GPU)
  largest_inner_part,
};

/// This process's part of the optimizer state of a run sharded over `count` processes (ZeRO-1;
/// docs/distributed.md): each unit's elements are cut into `count` consecutive parts
/// (HostParamStore::shard_bounds) and this process, `index`, keeps AdamW's m and v of its part
/// only and steps only those elements; the bf16 copy stays whole (every process streams every
/// unit) and is made whole again after each update (HostParamStore::gather_updated), unless it
/// is kept in parts (`weights_in_parts`: the GPUs gather it as they stream it).
struct StoreShard {
  int index = 0;
  int count = 1;
  /// The fp32 master weights sharded too (what a trainer whose weights are bf16 asks for): this
  /// process keeps the masters of its part, of the full-precision parameters (norm gains, which
  /// the ops read at master precision) and of `whole_master_units` (the embedding, whose lookup
  /// reads fp32 rows); the rest of the masters holds no memory. false: the masters stay whole.
  bool masters = false;
  std::vector<std::size_t> whole_master_units;
  /// With `masters`: the bf16 copy mapped by all `count` processes together (the processes of
  /// this communicator, which must all run on one host; the store checks it): the same pages for
  /// every process, each writing its part when it steps, so that the host holds one copy (2 bytes
  /// a parameter in all, not 2 a process) and gather_updated only waits for every part. Building
  /// the store is then collective (every process, at the same point), and so are loads into it
  /// (every process writes the same bytes, whole, as sync_compute does); a process's own writes to
  /// compute() must stay within its part. The masters of `whole_master_units` are mapped together
  /// the same way (one copy of the embedding's fp32 table for the host, each process stepping its
  /// part of it in place). Null: each process keeps its own copies, made whole again by gathering.
  dist::HostComm* shared_weights = nullptr;
  /// With `masters` and not shared: the bf16 copy held in this process's part of each unit only
  /// (a trainer that uploads each process's part and gathers the whole on the GPUs:
  /// TrainerOptions::gather_weights_on_device): 2 / count bytes a parameter instead of 2, the rest
  /// of the copy holding no memory (and pinned only where it is held); gather_updated leaves it,
  /// and HostParamStore::gather_weights brings it whole to one process for a reader (an export).
  bool weights_in_parts = false;
  /// Whether this process's bf16 copy is held in its part only (weights_in_parts, where it applies).
  bool keeps_weight_parts() const { return weights_in_parts && masters && count > 1 && !shares_weights(); }
  /// Whether the bf16 copy is shared (shared_weights, with sharded masters over several processes).
  bool shares_weights() const { return shared_weights != nullptr && masters && count > 1; }
  /// Whether unit k's masters are kept whole and mapped by the processes together.
  bool shares_masters_of(std::size_t k) const {
    return shares_weights() && std::find(whole_master_units.begin(), whole_master_units.end(), k) != whole_master_units.end();
  }
};

struct StoreOptions {
  std::uint64_t seed = 0;            ///< initialisation seed
  std::size_t grad_ring_slots = 2;   ///< K gradient landing buffers (>= 1 unless resident_gradients)
  GradSlotSize grad_slot_size = GradSlotSize::largest_unit;
  /// Also keep one gradient slab per unit (laid out like the masters, pinned): every unit's
  /// gradient can be resident at once, as exact global-norm clipping and gradient accumulation
  /// over micro-batches need. Costs sizeof(T) more bytes per parameter.
  bool resident_gradients = false;
  Pinning pinning = Pinning::automatic;
  /// Host memory the store may use; default: available_host_memory().
  std::optional<std::size_t> host_memory_budget;
  /// The optimizer state's part this store keeps (default: all of it).
  StoreShard shard;
  /// Keep the bf16 copy of the weights (2 bytes a parameter, written by each update): what a
  /// trainer whose weights are bf16 streams to the GPU. false: no copy (12 bytes a parameter of
  /// fp32 state instead of 14); the masters are pinned instead, a trainer streams them and the GPU
  /// rounds them to bf16 as they arrive (TrainerOptions::host_bf16_copy: the same bits, twice the
  /// PCIe bytes). Not with a store sharded over several processes, which exchange the copy.
  bool bf16_copy = true;
  /// Keep AdamW's moments m and v (8 bytes a parameter in fp32). false: a store that is read,
  /// never stepped (sampling, scoring: megatrain-generate): the masters and the bf16 copy only,
  /// 6 bytes a parameter. Its units' adam_m() and adam_v() are empty; a trainer's step and a
  /// checkpoint's save refuse it; a checkpoint's load reads its masters alone. Not sharded.
  bool optimizer_state = true;
};

/// Byte counts of a store, computed from the specs alone.
struct StoreFootprint {
  std::int64_t param_count = 0;    ///< sum of all tensors' elements
  std::int64_t slab_elements = 0;  ///< with alignment gaps
  std::int64_t largest_unit = 0;   ///< elements of the largest unit's slab
  std::int64_t grad_slot_numel = 0;  ///< elements of one gradient ring slot (see GradSlotSize)
  std::size_t master_bytes = 0, adam_bytes = 0, compute_bytes = 0, grad_ring_bytes = 0, resident_grad_bytes = 0;
  std::vector<std::size_t> unit_bytes;  ///< master + m + v + compute, per unit
  std::size_t total_bytes() const {
    return master_bytes + adam_bytes + compute_bytes + grad_ring_bytes + resident_grad_bytes;
  }
};

namespace detail {
/// Counter-based generator: value i of stream `key` is a pure function of (key, i), so
/// initialisation is deterministic however the work is split across threads.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
constexpr std::uint64_t hash_name(std::string_view s, std::uint64_t seed) {
  std::uint64_t h = 0xcbf29ce484222325ull ^ splitmix64(seed);
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return splitmix64(h);
}
/// Standard normal sample i of stream `key` (Box-Muller on two 32-bit uniforms).
inline double normal_sample(std::uint64_t key, std::uint64_t i) {
  const std::uint64_t r = splitmix64(key ^ splitmix64(i));
  const double u1 = (static_cast<double>(r >> 32) + 1.0) * 0x1p-32;  // (0, 1]
  const double u2 = static_cast<double>(r & 0xffffffffu) * 0x1p-32;  // [0, 1)
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}
/// Value i of a tensor initialised as `init` (stdev: the normal's) from stream `key`.
inline double initial_value(ParamInit init, double stdev, std::uint64_t key, std::uint64_t i) {
  switch (init) {
    case ParamInit::normal: return stdev * normal_sample(key, i);
    case ParamInit::ones: return 1.0;
    case ParamInit::zeros: return 0.0;
    case ParamInit::a_log: {
      const double u = static_cast<double>(splitmix64(key ^ splitmix64(i)) >> 11) * 0x1p-53;  // [0, 1)
      return std::log(0.01 + (16.0 - 0.01) * u);
    }
  }
  return 0.0;
}
}  // namespace detail

template <class T>
class HostParamStore {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "HostParamStore<T>: T is the master precision and must be float (training) or double (checks)");

 public:
  using value_type = T;
  /// Every tensor starts at a multiple of kAlign elements (UnitLayout's rule).
  static constexpr std::int64_t kAlign = UnitLayout::kAlign;

  using Param = UnitLayout::Entry;  ///< spec and element offset inside the unit's slabs

  class Unit {
   public:
    const std::string& name() const { return name_; }
    std::size_t index() const { return index_; }
    std::span<const Param> params() const { return layout_.entries(); }
    const UnitLayout& layout() const { return layout_; }
    /// Slab length in elements (tensors plus alignment gaps): the length of its gradient.
    std::int64_t numel() const { return layout_.numel(); }
    /// Elements that belong to tensors.
    std::int64_t param_count() const {
      std::int64_t n = 0;
      for (const auto& p : params()) n += p.numel();
      return n;
    }
    /// Bytes of this unit's slabs (of m and v its part only; of the masters what is kept; of a
    /// bf16 copy shared by the processes of a host its share).
    std::size_t bytes() const {
      return static_cast<std::size_t>(master_kept_) * sizeof(T) + compute_held_ +
             (moments_ ? static_cast<std::size_t>(owned_end_ - owned_begin_) * 2 * sizeof(T) : 0);
    }
    /// Whether the store keeps this unit's AdamW moments (StoreOptions::optimizer_state).
    bool has_moments() const { return moments_; }
    /// The elements [first, second) whose AdamW state this store keeps and steps (all of them
    /// unless the store is sharded: StoreOptions::shard).
    std::pair<std::int64_t, std::int64_t> owned() const { return {owned_begin_, owned_end_}; }

    /// The master weights, as long as the unit; in a store whose masters are sharded
    /// (StoreShard::masters) only owned() and whole_masters() are this process's (the rest holds
    /// no memory and reads as zeros, or as what gather_state brought).
    std::span<T> master() const { return master_; }
    /// The ranges [first, second) of master() that a store with sharded masters keeps whole on
    /// every process (sorted; empty where the masters are not sharded).
    std::span<const std::pair<std::int64_t, std::int64_t>> whole_masters() const { return whole_masters_; }
    /// The ranges of master() this process holds (sorted, disjoint): all of it, or where the
    /// masters are sharded its part and the ranges kept whole.
    std::span<const std::pair<std::int64_t, std::int64_t>> held_masters() const { return held_masters_; }
    /// AdamW's moments, as long as the unit; in a sharded store only owned() is this process's
    /// (the rest holds no memory and reads as zeros, or as what gather_state brought).
    std::span<T> adam_m() const { return m_; }
    std::span<T> adam_v() const { return v_; }
    std::span<bf16> compute() const { return compute_; }
    /// The elements [first, second) of compute() this process holds and keeps current: its part
    /// where the copy is held in parts (StoreShard::weights_in_parts; the rest holds no memory and
    /// reads as zeros, or as what gather_weights brought), else all of it.
    std::pair<std::int64_t, std::int64_t> held_weights() const {
      return weight_parts_ ? owned() : std::pair<std::int64_t, std::int64_t>{0, numel()};
    }
    /// The unit's resident gradient slab (empty unless StoreOptions::resident_gradients).
    std::span<T> grad() const { return grad_; }

    /// The parameter called `name` in this unit; throws if there is none.
    const Param& param(std::string_view name) const {
      const Param* p = layout_.find(name);
      MT_CHECK(p != nullptr, "unit '{}' has no parameter '{}'", name_, name);
      return *p;
    }
    /// Typed view of one tensor inside any slab of this unit (or a gradient laid out like it).
    template <class E>
    View<E> tensor(std::span<E> slab, const Param& p) const {
      MT_CHECK(static_cast<std::int64_t>(slab.size()) >= numel(), "slab of {} elements is shorter than unit '{}' ({})",
               slab.size(), name_, numel());
      return View<E>(slab.subspan(static_cast<std::size_t>(p.offset), static_cast<std::size_t>(p.numel())), p.spec.shape);
    }

   private:
    friend class HostParamStore;
    std::string name_;
    std::size_t index_ = 0;
    UnitLayout layout_;
    std::span<T> master_, m_, v_;
    std::span<bf16> compute_;
    std::span<T> grad_;
    std::int64_t owned_begin_ = 0, owned_end_ = 0;
    std::vector<std::pair<std::int64_t, std::int64_t>> whole_masters_, held_masters_;
    std::int64_t master_kept_ = 0;  // elements of master() this process keeps
    int sharers_ = 1;               // processes mapping the bf16 copy together
    std::size_t compute_held_ = 0;  // bytes of the bf16 copy this process holds (its share, or its part)
    bool weight_parts_ = false;     // the bf16 copy held in this process's part only
    bool moments_ = true;           // AdamW's m and v kept (StoreOptions::optimizer_state)
  };

  /// A process's bytes of a bf16 copy of `numel` elements mapped by `sharers` processes together.
  static std::size_t compute_bytes(std::int64_t numel, int sharers) {
    const auto b = static_cast<std::size_t>(numel) * sizeof(bf16), n = static_cast<std::size_t>(sharers);
    return (b + n - 1) / n;
  }

  /// The ranges of unit `k`'s masters (laid out as `layout`) that every process keeps whole under
  /// `s` (see StoreShard::masters).
  static std::vector<std::pair<std::int64_t, std::int64_t>> whole_master_ranges(const UnitLayout& layout, std::size_t k,
                                                                               const StoreShard& s) {
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    if (!s.masters || s.count <= 1) return out;
    if (std::find(s.whole_master_units.begin(), s.whole_master_units.end(), k) != s.whole_master_units.end())
      return {{0, layout.numel()}};
    for (const auto& e : layout.entries())
      if (e.spec.full_precision) out.emplace_back(e.offset, e.offset + e.numel());
    std::sort(out.begin(), out.end());
    return out;
  }
  /// Elements of a unit's masters kept by the process owning [lo, hi) of it (all but the rest of
  /// the unit where the masters are sharded; `whole`: whole_master_ranges).
  static std::int64_t kept_master_elements(std::int64_t numel, std::int64_t lo, std::int64_t hi, const StoreShard& s,
                                           std::span<const std::pair<std::int64_t, std::int64_t>> whole,
                                           bool shared = false) {
    if (!s.masters || s.count <= 1) return numel;
    if (shared) return (numel + s.count - 1) / s.count;  // (this process's share of the pages mapped together)
    std::int64_t n = hi - lo;
    for (const auto& [a, b] : whole) n += (b - a) - std::max<std::int64_t>(0, std::min(b, hi) - std::max(a, lo));
    return n;
  }

  /// Where `count` processes cut a unit of `numel` elements: count + 1 offsets, from 0 to numel,
  /// part r = [bounds[r], bounds[r + 1]); parts of equal length (a multiple of 16 elements, the
  /// last shorter), so that each process steps about 1/count of every unit.
  static std::vector<std::int64_t> shard_bounds(std::int64_t numel, int count) {
    MT_CHECK(count >= 1 && numel >= 0, "shard_bounds: {} elements over {} parts", numel, count);
    const std::int64_t part = (numel + count - 1) / count;
    const std::int64_t step = (part + 15) / 16 * 16;
    std::vector<std::int64_t> b(static_cast<std::size_t>(count) + 1);
    for (int r = 0; r <= count; ++r) b[static_cast<std::size_t>(r)] = std::min(numel, step * r);
    return b;
  }
  /// The cut of `u` over this store's processes (shard_bounds of its length).
  std::vector<std::int64_t> shard_bounds(const Unit& u) const { return shard_bounds(u.numel(), options_.shard.count); }
  const StoreShard& shard() const { return options_.shard; }
  bool sharded() const { return options_.shard.count > 1; }
  /// Whether this process keeps only its part of the master weights (StoreShard::masters).
  bool masters_sharded() const { return sharded() && options_.shard.masters; }
  /// Whether the processes map one bf16 copy together (StoreShard::shared_weights).
  bool weights_shared() const { return options_.shard.shares_weights(); }
  /// Whether this process's bf16 copy is kept current in its part only (StoreShard::weights_in_parts).
  bool weights_in_parts() const { return options_.shard.keeps_weight_parts(); }
  /// Whether the store keeps a bf16 copy of the weights (StoreOptions::bf16_copy); without one,
  /// every Unit::compute() is empty.
  bool has_bf16_copy() const { return options_.bf16_copy; }
  /// Whether the store keeps AdamW's moments and so can be stepped (StoreOptions::optimizer_state).
  bool has_optimizer_state() const { return options_.optimizer_state; }
  /// Whether the bf16 copy is whole and current on this process: not kept in parts, or the root of
  /// a gather_weights with no update since.
  bool weights_whole() const { return !weights_in_parts() || weights_whole_; }

  /// Computes the store's layout and byte counts without allocating; validates the specs.
  static StoreFootprint footprint(const std::vector<UnitSpec>& units, const StoreOptions& opt = {}) {
    MT_CHECK(!units.empty(), "a store needs at least one unit");
    MT_CHECK(opt.grad_ring_slots >= 1 || opt.resident_gradients,
             "the gradient ring needs at least one slot (got {}) unless gradients are resident", opt.grad_ring_slots);
    MT_CHECK(opt.shard.count >= 1 && opt.shard.index >= 0 && opt.shard.index < opt.shard.count,
             "store shard {} of {}: want 0 <= index < count", opt.shard.index, opt.shard.count);
    MT_CHECK(opt.optimizer_state || opt.shard.count <= 1,
             "a store without the optimizer state (StoreOptions::optimizer_state false) is read, never stepped: it is not "
             "sharded over {} processes", opt.shard.count);
    MT_CHECK(opt.bf16_copy || (opt.shard.count <= 1 && std::is_same_v<T, float>),
             "a store without a bf16 copy (StoreOptions::bf16_copy false) {}: keep the copy",
             opt.shard.count > 1 ? fmt::format("cannot be sharded over {} processes, which exchange the copy", opt.shard.count)
                                 : std::string("needs fp32 masters, which the GPU rounds to bf16"));
    StoreFootprint f;
    std::int64_t owned = 0, masters = 0;
    std::unordered_map<std::string_view, std::string_view> seen;  // parameter -> unit
    std::int64_t largest_inner = 0, largest_inner_part = 0;
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto& u = units[k];
      MT_CHECK(!u.params.empty(), "unit '{}' has no parameters", u.name);
      for (const auto& p : u.params) {
        MT_CHECK(!p.name.empty(), "unit '{}' has a parameter without a name", u.name);
        MT_CHECK(p.shape.rank() >= 1 && p.numel() > 0, "parameter '{}' has an empty shape {}", p.name, p.shape.str());
        MT_CHECK(p.init != ParamInit::normal || (std::isfinite(p.init_std) && p.init_std >= 0),
                 "parameter '{}' has an invalid init_std {}", p.name, p.init_std);
        auto [it, fresh] = seen.emplace(p.name, u.name);
        MT_CHECK(fresh, "parameter '{}' appears twice (units '{}' and '{}')", p.name, it->second, u.name);
        f.param_count += p.numel();
      }
      const UnitLayout layout(u.params);
      const std::int64_t n = layout.numel();
      const auto b = shard_bounds(n, opt.shard.count);
      const auto lo = b[static_cast<std::size_t>(opt.shard.index)], hi = b[static_cast<std::size_t>(opt.shard.index) + 1];
      const std::int64_t mine = hi - lo;
      const std::int64_t kept = kept_master_elements(n, lo, hi, opt.shard, whole_master_ranges(layout, k, opt.shard),
                                                     opt.shard.shares_masters_of(k));
      owned += mine;
      masters += kept;
      f.slab_elements += n;
      f.largest_unit = std::max(f.largest_unit, n);
      if (k > 0 && k + 1 < units.size()) {
        largest_inner = std::max(largest_inner, n);
        largest_inner_part = std::max(largest_inner_part, mine);
      }
      const std::size_t copy = opt.bf16_copy ? compute_held(n, lo, hi, opt.shard) : 0;
      f.compute_bytes += copy;
      const std::size_t moments = opt.optimizer_state ? static_cast<std::size_t>(mine) * 2 * sizeof(T) : 0;
      f.unit_bytes.push_back(static_cast<std::size_t>(kept) * sizeof(T) + copy + moments);
    }
    const auto elems = static_cast<std::size_t>(f.slab_elements);
    f.master_bytes = static_cast<std::size_t>(masters) * sizeof(T);  // (sharded masters: what is kept)
    f.adam_bytes = opt.optimizer_state ? 2 * static_cast<std::size_t>(owned) * sizeof(T) : 0;  // (a sharded store: its part)
    // (shared by the processes of a host: this process's share of the pages they map; in parts: its parts)
    if (opt.bf16_copy && !opt.shard.keeps_weight_parts()) f.compute_bytes = compute_bytes(f.slab_elements, sharers(opt.shard));
    // With fewer than three units there is no inner unit: the slot then holds the largest one.
    f.grad_slot_numel = units.size() <= 2                                     ? f.largest_unit
                        : opt.grad_slot_size == GradSlotSize::largest_inner_unit ? largest_inner
                        : opt.grad_slot_size == GradSlotSize::largest_inner_part ? std::max<std::int64_t>(largest_inner_part, 1)
                                                                                 : f.largest_unit;
    f.grad_ring_bytes = opt.grad_ring_slots * static_cast<std::size_t>(f.grad_slot_numel) * sizeof(T);
    f.resident_grad_bytes = opt.resident_gradients ? elems * sizeof(T) : 0;
    return f;
  }

  /// Lays out, checks the memory budget, allocates and initialises (seeded) the store.
  explicit HostParamStore(std::vector<UnitSpec> units, StoreOptions opt = {}) : options_(opt) {
    MT_NVTX_RANGE("HostParamStore::HostParamStore");
    footprint_ = footprint(units, opt);
    const std::size_t budget = opt.host_memory_budget ? *opt.host_memory_budget : available_host_memory();
    host_budget_ = budget;
    MT_CHECK(footprint_.total_bytes() <= budget,
             "the parameter store needs {} ({} parameters: master {}, AdamW m and v {}, bf16 copy {}, gradient "
             "ring {}, resident gradients {}) but only {} of host memory is available{}",
             format_bytes(footprint_.total_bytes()), footprint_.param_count, format_bytes(footprint_.master_bytes),
             format_bytes(footprint_.adam_bytes), format_bytes(footprint_.compute_bytes),
             format_bytes(footprint_.grad_ring_bytes), format_bytes(footprint_.resident_grad_bytes), format_bytes(budget),
             opt.host_memory_budget ? " (the budget given in StoreOptions)"
                                    : " (set MEGATRAIN_HOST_MEMORY if this machine's memory grows on demand)");

    const auto elems = static_cast<std::size_t>(footprint_.slab_elements);
    // (whole, as addresses: a sharded store touches its parts only, and the rest takes no memory)
    // (no bf16 copy: the GPU's copy engines read the masters)
    master_buf_ = HostBuffer::allocate(elems * sizeof(T), opt.bf16_copy ? Pinning::never : opt.pinning);
    const std::size_t moment_bytes = opt.optimizer_state ? elems * sizeof(T) : 0;
    m_buf_ = HostBuffer::allocate(moment_bytes, Pinning::never);
    v_buf_ = HostBuffer::allocate(moment_bytes, Pinning::never);
    // (held in parts: pinned where held, below, so that the rest can be given back)
    if (opt.bf16_copy)
      compute_buf_ = opt.shard.shares_weights() ? allocate_shared_host(elems * sizeof(bf16), "bf16 weights", opt.pinning)
                                              : HostBuffer::allocate(elems * sizeof(bf16), opt.shard.keeps_weight_parts()
                                                                                               ? Pinning::never
                                                                                               : opt.pinning);
    // (the masters kept whole, mapped together: the units' slabs one after another)
    std::size_t shared_masters = 0;
    for (std::size_t ui = 0; ui < units.size(); ++ui)
      if (opt.shard.shares_masters_of(ui)) shared_masters += static_cast<std::size_t>(UnitLayout(units[ui].params).numel());
    if (shared_masters > 0)
      shared_master_buf_ = allocate_shared_host(shared_masters * sizeof(T), "fp32 embedding masters", Pinning::never);
    std::size_t shared_at = 0;
    grad_buf_ = HostBuffer::allocate(footprint_.resident_grad_bytes, opt.pinning);

    std::int64_t base = 0;
    units_.reserve(units.size());
    for (std::size_t ui = 0; ui < units.size(); ++ui) {
      Unit u;
      u.name_ = std::move(units[ui].name);
      u.index_ = ui;
      u.layout_ = UnitLayout(std::move(units[ui].params));
      const auto b = static_cast<std::size_t>(base), len = static_cast<std::size_t>(u.numel());
      if (opt.shard.shares_masters_of(ui)) {
        u.master_ = shared_master_buf_.template as<T>(shared_at, len);
        shared_at += len;
      } else {
        u.master_ = master_buf_.template as<T>(b, len);
      }
      if (opt.optimizer_state) {
        u.m_ = m_buf_.template as<T>(b, len);
        u.v_ = v_buf_.template as<T>(b, len);
      }
      u.moments_ = opt.optimizer_state;
      if (opt.bf16_copy) u.compute_ = compute_buf_.template as<bf16>(b, len);
      if (opt.resident_gradients) u.grad_ = grad_buf_.template as<T>(b, len);
      const auto cut = shard_bounds(u.numel(), opt.shard.count);
      u.owned_begin_ = cut[static_cast<std::size_t>(opt.shard.index)];
      u.owned_end_ = cut[static_cast<std::size_t>(opt.shard.index) + 1];
      u.whole_masters_ = whole_master_ranges(u.layout_, ui, opt.shard);
      u.master_kept_ = kept_master_elements(u.numel(), u.owned_begin_, u.owned_end_, opt.shard, u.whole_masters_,
                                            opt.shard.shares_masters_of(ui));
      u.sharers_ = sharers(opt.shard);
      u.compute_held_ = opt.bf16_copy ? compute_held(u.numel(), u.owned_begin_, u.owned_end_, opt.shard) : 0;
      u.weight_parts_ = opt.shard.keeps_weight_parts();
      u.held_masters_ = {{0, u.numel()}};
      if (opt.shard.masters && opt.shard.count > 1) {  // (its part and the ranges kept whole, merged)
        auto r = u.whole_masters_;
        r.push_back(u.owned());
        std::sort(r.begin(), r.end());
        u.held_masters_.clear();
        for (const auto& [from, to] : r) {
          if (!u.held_masters_.empty() && from <= u.held_masters_.back().second)
            u.held_masters_.back().second = std::max(u.held_masters_.back().second, to);
          else if (to > from)
            u.held_masters_.emplace_back(from, to);
        }
      }
      base += u.numel();
      units_.push_back(std::move(u));
    }
    for (std::size_t ui = 0; ui < units_.size(); ++ui)
      for (std::size_t pi = 0; pi < units_[ui].params().size(); ++pi)
        index_.emplace(units_[ui].params()[pi].spec.name, std::pair{ui, pi});
    if (weights_in_parts() && opt.pinning == Pinning::automatic) {  // (the parts this process holds: DMA reads them)
      std::vector<std::pair<std::size_t, std::size_t>> held;
      for (const auto& u : units_)
        held.emplace_back(static_cast<std::size_t>(reinterpret_cast<const std::byte*>(u.compute_.data() + u.owned_begin_) -
                                                   static_cast<const std::byte*>(compute_buf_.data())),
                          static_cast<std::size_t>(u.owned_end_ - u.owned_begin_) * sizeof(bf16));
      (void)compute_buf_.pin_ranges(std::move(held));
    }
    initialize(opt.seed);
    // (a shared bf16 copy: no process goes on, to load into it or read it, while another still
    // writes its initial values; loads then write the same bytes in every process)
    if (weights_shared()) barrier(*opt.shard.shared_weights);
  }

  HostParamStore(const HostParamStore&) = delete;
  HostParamStore& operator=(const HostParamStore&) = delete;
  HostParamStore(HostParamStore&&) noexcept = default;  // slabs do not move: their views stay valid
  HostParamStore& operator=(HostParamStore&&) noexcept = default;

  /// Re-initialises every master tensor from `seed` (normal(0, init_std) for matrices, ones for
  /// norm weights, zeros for biases, ParamInit's others as it says), zeroes m and v, and refreshes the bf16 copy. Value i of a
  /// tensor depends only on (seed, tensor name, i): the result does not depend on thread count.
  void initialize(std::uint64_t seed) {
    MT_NVTX_RANGE("HostParamStore::initialize");
    for (auto& u : units_) {
      for (const auto& p : u.params()) {
        const std::uint64_t key = detail::hash_name(p.spec.name, seed);
        const auto out = u.master_.subspan(static_cast<std::size_t>(p.offset), static_cast<std::size_t>(p.numel()));
        const ParamInit init = p.spec.init;
        const double stdev = p.spec.init_std;
        tbb::parallel_for(tbb::blocked_range<std::size_t>(0, out.size(), 1 << 16), [&](const auto& r) {
          for (std::size_t i = r.begin(); i != r.end(); ++i)
            out[i] = static_cast<T>(detail::initial_value(init, stdev, key, i));
        });
      }
      if (u.moments_) {
        const auto [lo, hi] = u.owned();
        std::fill(u.m_.begin() + lo, u.m_.begin() + hi, T(0));
        std::fill(u.v_.begin() + lo, u.v_.begin() + hi, T(0));
      }
      sync_compute(u);
    }
  }

  /// A sharded store: every process's part of AdamW's moments, and of the masters where they are
  /// sharded, brought to process `root` (every process calls it, at the same point, with the store
  /// settled), whose store then holds the whole train state until the next update (state_whole()):
  /// what a checkpoint or an export written there needs. That costs the root the memory of the
  /// whole state until release_unowned_state(). A store that is not sharded holds it whole already.
  void gather_state(dist::HostComm& comm, int root) {
    if (!sharded()) return;
    check_comm(comm, "gather_state");
    check_settled("gather_state");
    for (auto& u : units_) {
      const auto b = shard_bounds(u);
      comm.gather(u.m_, b, root);
      comm.gather(u.v_, b, root);
      // (masters the processes map together are whole everywhere already)
      if (masters_sharded() && !options_.shard.shares_masters_of(u.index_)) comm.gather(u.master_, b, root);
    }
    whole_state_ = comm.rank() == root;
  }
  /// Whether this store holds the whole train state (masters, AdamW's moments) as of its last
  /// update: not sharded, or the root of a gather_state since.
  bool state_whole() const { return !sharded() || whole_state_; }
  /// The trainer's update made the gathered state stale (a sharded store).
  void state_updated() {
    whole_state_ = false;
    weights_whole_ = false;
  }

  /// A sharded store: gives back the memory of the state outside this process's parts (what
  /// gather_state brought in), which then reads as zeros again.
  void release_unowned_state() {
    if (!sharded()) return;
    whole_state_ = false;
    weights_whole_ = false;
    for (auto& u : units_) {
      release_outside(u.m_, {u.owned()});
      release_outside(u.v_, {u.owned()});
      release_unowned_masters(u);
      release_unowned_weights(u);
    }
  }

  /// After every process stepped its part of every unit (a sharded store; every process calls it
  /// at the same point): each process's updated part sent to every process, so that each holds
  /// the same whole weights it streams. Masters sharded: the bf16 copy, and the masters of the
  /// ranges kept whole; else the masters, and the bf16 copy from them. The same bits everywhere.
  /// Units before `first` are left alone (a trainer's device units, gathered on the GPUs).
  void gather_updated(dist::HostComm& comm, std::size_t first = 0) {
    if (!sharded()) return;
    check_comm(comm, "gather_updated");
    if (!masters_sharded()) {
      for (std::size_t k = first; k < units_.size(); ++k) {
        comm.all_gather(units_[k].master_, shard_bounds(units_[k]));
        sync_compute(units_[k]);
      }
      return;
    }
    // The masters kept whole: a unit kept whole, in place; the full-precision ranges of the others
    // (a few small tensors a unit) packed into one buffer, rank by rank, and gathered at once.
    struct Piece {
      T* at;
      std::size_t n;
      int rank;
    };
    std::vector<Piece> pieces;
    std::vector<std::int64_t> bounds{0};
    for (int r = 0; r < options_.shard.count; ++r) {
      for (std::size_t k = first; k < units_.size(); ++k) {
        auto& u = units_[k];
        if (whole_master_unit(u)) continue;
        const auto b = shard_bounds(u);
        for (const auto& [a, e] : u.whole_masters_) {
          const auto lo = std::max(a, b[static_cast<std::size_t>(r)]), hi = std::min(e, b[static_cast<std::size_t>(r) + 1]);
          if (hi > lo) pieces.push_back({u.master_.data() + lo, static_cast<std::size_t>(hi - lo), r});
        }
      }
      std::int64_t total = bounds.back();
      for (const Piece& p : pieces) total += p.rank == r ? static_cast<std::int64_t>(p.n) : 0;
      bounds.push_back(total);
    }
    std::vector<T> packed(static_cast<std::size_t>(bounds.back()));
    const auto each_piece = [&](auto&& fn) {  // fn(piece, its place in `packed`)
      auto at = packed.begin();
      for (const Piece& p : pieces) {
        fn(p, at);
        at += static_cast<std::ptrdiff_t>(p.n);
      }
    };
    each_piece([&](const Piece& p, auto at) {
      if (p.rank == options_.shard.index) std::copy_n(p.at, p.n, at);
    });
    comm.all_gather(std::span<T>(packed), bounds);
    each_piece([](const Piece& p, auto at) { std::copy_n(at, p.n, p.at); });
    for (std::size_t k = first; k < units_.size(); ++k) {
      // (masters mapped together: every process stepped its part in the same pages)
      if (whole_master_unit(units_[k]) && !options_.shard.shares_masters_of(k))
        comm.all_gather(units_[k].master_, shard_bounds(units_[k]));
      if (!weights_shared() && !weights_in_parts()) comm.all_gather(units_[k].compute_, shard_bounds(units_[k]));
    }
    // A shared bf16 copy (and masters): every process wrote its parts into the same pages as it
    // stepped; once each has come this far (after its update), they are whole for all of them.
    if (weights_shared()) barrier(comm);
  }

  /// A bf16 copy held in parts (weights_in_parts()) brought whole to process `root`, for a reader
  /// of the whole copy (a bf16 export); every process calls it at the same point, with no update
  /// in flight. That costs the root the memory of the whole copy until release_unowned_state()
  /// (or the next update). Else nothing to do.
  void gather_weights(dist::HostComm& comm, int root) {
    if (!weights_in_parts()) return;
    check_comm(comm, "gather_weights");
    check_settled("gather_weights");
    for (auto& u : units_) comm.gather(u.compute_, shard_bounds(u), root);
    weights_whole_ = comm.rank() == root;
  }

  /// Rewrites a unit's bf16 copy from its master weights (after loading or editing masters). A
  /// store whose masters are sharded takes them as just written whole (a load), and gives back the
  /// memory of those outside this process's parts afterwards. Nothing to do without a copy.
  void sync_compute(const Unit& u) {
    MT_NVTX_RANGE("HostParamStore::sync_compute");
    if (!has_bf16_copy()) return;
    if constexpr (std::is_same_v<T, float>) {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, u.master_.size(), 1 << 16), [&](const auto& r) {
        convert(std::span<const float>(u.master_.subspan(r.begin(), r.size())), u.compute_.subspan(r.begin(), r.size()));
      });
    } else {
      for (std::size_t i = 0; i < u.master_.size(); ++i) u.compute_[i] = bf16(static_cast<float>(u.master_[i]));
    }
    if (masters_sharded() && !whole_state_) release_unowned_masters(u);
    release_unowned_weights(u);
    weights_whole_ = false;
  }

  std::size_t num_units() const { return units_.size(); }
  std::span<Unit> units() { return units_; }
  std::span<const Unit> units() const { return units_; }
  Unit& unit(std::size_t i) {
    MT_CHECK(i < units_.size(), "unit {} out of range (the store has {})", i, units_.size());
    return units_[i];
  }
  const Unit& unit(std::size_t i) const { return const_cast<HostParamStore*>(this)->unit(i); }

  /// Where the parameter `name` lives: (unit, parameter). Throws if unknown.
  std::pair<const Unit*, const Param*> find(std::string_view name) const {
    auto it = index_.find(std::string(name));
    MT_CHECK(it != index_.end(), "no parameter named '{}' in the store", name);
    const Unit& u = units_[it->second.first];
    return {&u, &u.params()[it->second.second]};
  }
  bool contains(std::string_view name) const { return index_.count(std::string(name)) != 0; }

  View<T> master(std::string_view name) const { auto [u, p] = find(name); return u->tensor(u->master_, *p); }
  View<T> adam_m(std::string_view name) const { auto [u, p] = find(name); return u->tensor(u->m_, *p); }
  View<T> adam_v(std::string_view name) const { auto [u, p] = find(name); return u->tensor(u->v_, *p); }
  View<bf16> compute(std::string_view name) const {
    MT_CHECK(has_bf16_copy(), "'{}': this store keeps no bf16 copy (StoreOptions::bf16_copy false); read master()", name);
    auto [u, p] = find(name);
    return u->tensor(u->compute_, *p);
  }

  /// Gradient landing buffer k of the ring, grad_slot_numel() elements (zeroed at start). The
  /// ring is allocated at the first call (a trainer whose units all step on the device never
  /// lands a gradient: its ring would be host memory held for nothing), from any thread; the
  /// store's memory budget counted it from the start.
  std::span<T> grad_slot(std::size_t k) const {
    MT_CHECK(k < options_.grad_ring_slots, "gradient slot {} out of range (the ring has {})", k, options_.grad_ring_slots);
    std::call_once(*ring_once_, [this] { ring_buf_ = HostBuffer::allocate(footprint_.grad_ring_bytes, options_.pinning); });
    const auto len = static_cast<std::size_t>(footprint_.grad_slot_numel);
    return ring_buf_.template as<T>(k * len, len);
  }
  std::size_t grad_ring_slots() const { return options_.grad_ring_slots; }
  std::int64_t grad_slot_numel() const { return footprint_.grad_slot_numel; }

  const StoreFootprint& footprint() const { return footprint_; }
  std::size_t bytes() const { return footprint_.total_bytes(); }
  /// The host memory this store was checked against when it was built (StoreOptions::host_memory_budget,
  /// or what was available then): the budget of the store and of what a trainer adds beside it.
  std::size_t host_budget() const { return host_budget_; }
  std::int64_t param_count() const { return footprint_.param_count; }
  /// Whether the buffers the GPU copies from and into are page-locked (the gradient ring once
  /// it is allocated).
  bool pinned() const {
    return (has_bf16_copy() ? compute_buf_.pinned() || compute_buf_.pinned_in_ranges() : master_buf_.pinned()) && (!ring_buf_ || ring_buf_.pinned()) && (!grad_buf_ || grad_buf_.pinned());
  }
  bool resident_gradients() const { return options_.resident_gradients; }

  /// Whether a trainer holds state newer than (or owned apart from) this store: its last step's
  /// update still being applied in the background, or units whose AdamW state it keeps on the
  /// GPU (Trainer::finish_update() settles both). Set and cleared by the trainer.
  bool update_in_flight() const { return in_flight_->load(std::memory_order_acquire); }
  void set_update_in_flight(bool on) const { in_flight_->store(on, std::memory_order_release); }
  /// Throws, naming `what`, while that is so: the store then holds some units before and some
  /// after the update, or stale copies of the GPU's units, and whatever reads (or loads into) it
  /// whole must wait.
  void check_settled(std::string_view what) const {
    MT_CHECK(!update_in_flight(), "{}: the trainer holds newer state than this store (the last step's update "
             "running in the background, or units kept on the GPU); call trainer.finish_update() first", what);
  }

 private:
  void check_comm(const dist::HostComm& comm, std::string_view what) const {
    MT_CHECK(comm.world() == options_.shard.count && comm.rank() == options_.shard.index,
             "{}: the store keeps part {} of {}, but this is process {} of {}", what, options_.shard.index,
             options_.shard.count, comm.rank(), comm.world());
  }
  static int sharers(const StoreShard& s) { return s.shares_weights() ? s.count : 1; }
  static void barrier(dist::HostComm& comm) {
    std::int64_t one = 1;
    comm.all_reduce_sum(std::span<std::int64_t>(&one, 1));
  }
  // Memory that the processes map together (StoreShard::shared_weights: the bf16 copy, the masters
  // kept whole): process 0 creates it and hands it to the others, once every process has shown
  // that it runs on the same host.
  HostBuffer allocate_shared_host(std::size_t bytes, std::string_view what, Pinning pinning) {
    dist::HostComm& comm = *options_.shard.shared_weights;
    check_comm(comm, "StoreShard::shared_weights");
    const auto n = static_cast<std::size_t>(comm.world());
    // Every process's value (one a slot, summed: every process gets them all), and the ranks
    // whose value is not the first's.
    const auto differing = [&](std::int64_t mine) {
      std::vector<std::int64_t> all(n, 0);
      all[static_cast<std::size_t>(comm.rank())] = mine;
      comm.all_reduce_sum(all);
      std::vector<int> out;
      for (std::size_t r = 0; r < n; ++r)
        if (all[r] != all[0]) out.push_back(static_cast<int>(r));
      return out;
    };
    const std::vector<int> elsewhere = differing(static_cast<std::int64_t>(host_identity()));
    MT_CHECK(elsewhere.empty(), "the {} can be shared only by processes on one host (StoreShard::shared_weights"
             ", --share-weights), but process(es) {} of {} run on another host than process 0; share them only where "
             "every process runs on one host", what, fmt::join(elsewhere, ", "), n);
    // (every process learns of a failure anywhere and throws, instead of waiting for the others)
    HostBuffer b;
    std::vector<std::int64_t> handle(5, 0);  // pid, fd, dev, ino, failed
    std::string why;
    if (comm.rank() == 0) {
      try {
        b = HostBuffer::allocate_shared(bytes, comm.world(), nullptr, pinning);
        const SharedHostHandle h = b.shared_handle();
        handle = {h.pid, h.fd, h.dev, h.ino, 0};
      } catch (const Error& e) {
        why = e.reason();
        handle[4] = 1;
      }
    }
    comm.all_reduce_sum(handle);
    MT_CHECK(handle[4] == 0, "{}", comm.rank() == 0 ? why : fmt::format("process 0 could not create the {} that the "
             "processes of this host share (its message says why)", what));
    std::int64_t failed = 0;
    if (comm.rank() != 0) {
      try {
        const SharedHostHandle h{handle[0], handle[1], handle[2], handle[3]};
        b = HostBuffer::allocate_shared(bytes, comm.world(), &h, pinning);
      } catch (const Error& e) {
        why = e.reason();
        failed = 1;
      }
    }
    // (and every process has mapped it: process 0's descriptor may close from now on)
    const std::vector<int> which = differing(failed);  // (process 0 did not fail: those that did)
    MT_CHECK(which.empty(), "{}", !why.empty() ? why : fmt::format("process(es) {} of {} could not map the {} that the "
             "processes of this host share (their messages say why)", fmt::join(which, ", "), n, what));
    return b;
  }
  static bool whole_master_unit(const Unit& u) {
    return u.whole_masters_.size() == 1 && u.whole_masters_[0] == std::pair<std::int64_t, std::int64_t>{0, u.numel()};
  }
  // The pages of `slab` outside the ranges `keep` given back.
  template <class E>
  static void release_outside(std::span<E> slab, std::vector<std::pair<std::int64_t, std::int64_t>> keep) {
    std::sort(keep.begin(), keep.end());
    std::int64_t at = 0;
    const auto release = [&](std::int64_t a, std::int64_t b) {
      if (b > a) release_host_pages(slab.data() + a, static_cast<std::size_t>(b - a) * sizeof(E));
    };
    for (const auto& [a, b] : keep) {
      release(at, a);
      at = std::max(at, b);
    }
    release(at, static_cast<std::int64_t>(slab.size()));
  }
  // The pages of u's masters outside its part and its ranges kept whole, given back.
  void release_unowned_masters(const Unit& u) {
    if (masters_sharded()) release_outside(u.master_, u.held_masters_);
  }
  // The pages of u's bf16 copy outside its part given back, where the copy is held in parts.
  void release_unowned_weights(const Unit& u) {
    if (weights_in_parts()) release_outside(u.compute_, {u.owned()});
  }
  // Bytes of a unit's bf16 copy (n elements, this process's part [lo, hi)) that a process holds.
  static std::size_t compute_held(std::int64_t n, std::int64_t lo, std::int64_t hi, const StoreShard& s) {
    return s.keeps_weight_parts() ? static_cast<std::size_t>(hi - lo) * sizeof(bf16) : compute_bytes(n, sharers(s));
  }

  std::unique_ptr<std::atomic<bool>> in_flight_ = std::make_unique<std::atomic<bool>>(false);
  bool whole_state_ = false;  // (sharded: gather_state made this the root, no update since)
  bool weights_whole_ = false;  // (weights_in_parts: the root of a gather_weights, no update since)
  StoreOptions options_;
  StoreFootprint footprint_;
  std::size_t host_budget_ = 0;
  HostBuffer master_buf_, m_buf_, v_buf_, compute_buf_, grad_buf_, shared_master_buf_;
  mutable HostBuffer ring_buf_;  // allocated by the first grad_slot()
  std::unique_ptr<std::once_flag> ring_once_ = std::make_unique<std::once_flag>();
  std::vector<Unit> units_;
  std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> index_;
};

}  // namespace megatrain
