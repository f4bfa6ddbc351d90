// StreamPipeline<Item, Stages...>: a compile-time list of stages that every item flows through,
// in order, each stage on its own executor, joined by ring slots and completions.
//
// The pipeline owns the ordering rules, so code that uses it never waits by hand:
//   1. data: stage j of an item starts after stage j-1 of the same item;
//   2. order: each stage handles items in submission order (one thread per stage);
//   3. rings: a stage with ring_slots() = K >= 2 (0: none) hands the slots of a ring to the items it
//      applies to, in turn (the n-th such item writes slot n % K); the stages after it up to
//      the next ring writer read that slot (or, for an item the writer skipped, the slot of the
//      writer's latest item). A slot is reused only after the ring's last reader is done with
//      the item that held it before (double buffering with K = 2). Items a writer skips take
//      no slot, so they never make it wait; nor do items it applies to but writes no slot for,
//      when it says so with an optional takes_slot(item) (e.g. a compute stage whose forward
//      items need no gradient buffer: they must not wait for a slow reader of that ring);
//   4. units: a stage whose unit_access() is `reads` starts an item it applies to only after the
//      last earlier item of the same unit has passed every stage whose unit_access() is `writes`
//      (e.g. a prefetch of a unit's weights waits for that unit's last optimizer step);
//   5. and the other way round: a stage whose unit_access() is `writes` starts an item it
//      applies to only after the last earlier item of the same unit has passed every `reads`
//      stage (an optimizer step submitted after a prefetch of the same unit waits until that
//      copy is done). An item a stage passes through waits for neither: it would hold up every
//      later item of the stage (a prefetch stage, passing an optimizer's item of unit u, would
//      otherwise wait for u's previous optimizer item, and the next prefetch with it).
// Dependencies only point to earlier items or earlier stages, so the graph cannot deadlock.
// Work that needs everything before it finished (exact gradient clipping needs every unit's
// gradient) is a new pass submitted after drain().
//
// Each stage S provides (see the Stage concept): executor() — a HostExecutor, or a CUDA stream
// executor; applies(item) — whether it has work for the item (a stage with none forwards the
// completion it depended on); run(item, slots) — does or enqueues the work; ring_slots() and
// unit_access(). Stages are plain objects: a user adds one by putting it in the list. Timing
// never changes what is computed, only when.
//
// NVTX: submit() and drain() open a range each, and the worker opens "pipeline:stage J" around
// every run(item, slots) of stage J (0-based), so a user-defined stage shows on a timeline too.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/pipeline/executor.hpp"

namespace megatrain {

enum class UnitAccess { none, reads, writes };

namespace detail {
/// "pipeline:stage J", NUL-terminated, built at compile time: the worker's NVTX range name.
template <std::size_t J>
inline constexpr auto pipeline_stage_range_name = [] {
  constexpr char prefix[] = "pipeline:stage ";
  std::array<char, sizeof(prefix) + 20> name{};  // room for any std::size_t and the NUL
  std::size_t n = 0;
  for (std::size_t i = 0; i + 1 < sizeof(prefix); ++i) name[n++] = prefix[i];
  char digits[20]{};
  std::size_t d = 0;
  std::size_t v = J;
  do {
    digits[d++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  while (d > 0) name[n++] = digits[--d];
  return name;
}();
static_assert(std::string_view(pipeline_stage_range_name<0>.data()) == "pipeline:stage 0");
static_assert(std::string_view(pipeline_stage_range_name<12>.data()) == "pipeline:stage 12");
}  // namespace detail

/// Ring slot indices of one item at one stage.
struct StageSlots {
  std::size_t in = 0;   ///< slot of the ring this stage reads (written by the nearest earlier writer)
  std::size_t out = 0;  ///< slot of the ring this stage writes (if ring_slots() > 0)
};

// clang-format off
/// An item: anything with a `unit` (which unit's state it touches; used for rule 4).
template <class I>
concept PipelineItem = std::copyable<I> && requires(const I& i) {
  { i.unit } -> std::convertible_to<std::size_t>;
};

template <class S, class Item>
concept Stage = PipelineItem<Item> && requires(S& s, const S& cs, const Item& item, const StageSlots& slots) {
  { s.executor() } -> Executor;                            // where its work runs
  { cs.applies(item) } -> std::convertible_to<bool>;      // has work for this item (pure)
  s.run(item, slots);                                      // does or enqueues the work
  { cs.ring_slots() } -> std::convertible_to<std::size_t>; // K >= 2: writes a ring of K slots; 0: writes none
  { cs.unit_access() } -> std::convertible_to<UnitAccess>;
};
// clang-format on

/// Whether stage `s` writes a slot of its ring for `item` (rule 3): takes_slot(item) where the
/// stage defines it, else every item it applies to.
template <class S, class Item>
bool stage_takes_slot(const S& s, const Item& item) {
  if (!s.applies(item)) return false;
  if constexpr (requires { { s.takes_slot(item) } -> std::convertible_to<bool>; }) return s.takes_slot(item);
  return true;
}

template <class Item, class... Stages>
class StreamPipeline {
  static_assert(sizeof...(Stages) >= 1, "StreamPipeline needs at least one stage");
  static_assert((Stage<Stages, Item> && ...),
                "StreamPipeline<Item, Stages...>: every stage must satisfy megatrain::Stage<S, Item> (executor(), "
                "applies(item), run(item, slots), ring_slots(), unit_access()) and Item must have a "
                "`unit` member (see megatrain/pipeline/stream_pipeline.hpp)");
  static constexpr std::size_t kStages = sizeof...(Stages);

 public:
  explicit StreamPipeline(Stages... stages) : stages_(std::move(stages)...) {
    configure(std::index_sequence_for<Stages...>{});
    start(std::index_sequence_for<Stages...>{});
  }
  StreamPipeline(const StreamPipeline&) = delete;
  StreamPipeline& operator=(const StreamPipeline&) = delete;

  ~StreamPipeline() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  template <std::size_t J>
  auto& stage() {
    return std::get<J>(stages_);
  }

  /// Queues items: they flow through the stages in this order. Does not block.
  void submit(const std::vector<Item>& items) {
    MT_NVTX_RANGE("StreamPipeline::submit");
    const auto& pass = items;
    if (pass.empty()) return;
    {
      std::lock_guard lock(mutex_);
      throw_if_failed();
      const std::uint64_t first = base_ + entries_.size();
      for (std::size_t k = 0; k < pass.size(); ++k) {
        Entry e;
        e.item = pass[k];
        // Rule 4: for each reading stage, the latest earlier item of the same unit a writer touches.
        const auto u = static_cast<std::size_t>(pass[k].unit);
        if (auto it = last_write_.find(u); it != last_write_.end()) e.unit_writes = it->second;
        std::vector<std::pair<std::size_t, std::uint64_t>> writes;
        for_each_stage([&](std::size_t j, const auto& s) {
          if (access_[j] == UnitAccess::writes && s.applies(pass[k])) writes.emplace_back(j, first + k);
        });
        if (!writes.empty()) last_write_[u] = std::move(writes);
        // Rule 5: for each writing stage, the latest earlier item of the same unit a reader touches.
        if (auto it = last_read_.find(u); it != last_read_.end()) e.unit_reads = it->second;
        std::vector<std::pair<std::size_t, std::uint64_t>> reads;
        for_each_stage([&](std::size_t j, const auto& s) {
          if (access_[j] == UnitAccess::reads && s.applies(pass[k])) reads.emplace_back(j, first + k);
        });
        if (!reads.empty()) last_read_[u] = std::move(reads);
        // Rule 3: each ring writer's next slot goes to this item if the writer applies to it.
        for_each_stage([&](std::size_t j, const auto& s) {
          if (ring_size_[j] == 0) return;
          e.slot_prev[j] = kNone;
          if (stage_takes_slot(s, pass[k])) {
            const std::uint64_t n = ring_uses_[j]++;
            e.slot[j] = static_cast<std::size_t>(n % ring_size_[j]);
            e.slot_prev[j] = ring_holder_[j][e.slot[j]];
            ring_holder_[j][e.slot[j]] = first + k;
            ring_latest_[j] = e.slot[j];
          } else {
            e.slot[j] = ring_latest_[j];
          }
        });
        entries_.push_back(std::move(e));
      }
    }
    cv_.notify_all();
  }

  /// Blocks until every submitted item has passed every stage (its device work included), then
  /// rethrows the first error a stage raised, if any.
  void drain() {
    MT_NVTX_RANGE("StreamPipeline::drain");
    std::vector<Completion> device_tails;
    {
      std::unique_lock lock(mutex_);
      const std::uint64_t end = base_ + entries_.size();
      cv_.wait(lock, [&] { return failed_ || done_[kStages - 1] >= end; });
      throw_if_failed();
      // Every stage has posted every item; device work may still be in flight. A stream runs
      // its work in order, so each stage's last device completion covers all of its earlier ones.
      for (std::size_t j = 0; j < kStages; ++j)
        for (std::uint64_t seq = end; seq-- > base_;)
          if (const Completion& c = entries_[seq - base_].done[j]; c.is_device()) {
            device_tails.push_back(c);
            break;
          }
    }
    for (const auto& c : device_tails) c.host_sync(c.device_event);
    std::lock_guard lock(mutex_);
    trim();
  }

 private:
  static constexpr std::size_t kNoRing = static_cast<std::size_t>(-1);

  static constexpr std::uint64_t kNone = static_cast<std::uint64_t>(-1);

  struct Entry {
    Item item;
    std::vector<std::pair<std::size_t, std::uint64_t>> unit_writes;  // (writer stage, seq) to wait for
    std::vector<std::pair<std::size_t, std::uint64_t>> unit_reads;   // (reader stage, seq) to wait for
    std::array<Completion, kStages> done{};
    std::array<std::size_t, kStages> slot{};                         // rule 3: the writer's slot (ring stages)
    std::array<std::uint64_t, kStages> slot_prev{};                  // the item that held that slot before, or kNone
  };

  struct Aborted {};

  template <class F>
  void for_each_stage(F&& f) const {
    [&]<std::size_t... J>(std::index_sequence<J...>) { (f(J, std::get<J>(stages_)), ...); }(std::index_sequence_for<Stages...>{});
  }

  template <std::size_t... J>
  void configure(std::index_sequence<J...>) {
    ((ring_size_[J] = std::get<J>(stages_).ring_slots(), access_[J] = std::get<J>(stages_).unit_access()), ...);
    for (std::size_t j = 0; j < kStages; ++j)
      MT_CHECK(ring_size_[j] != 1,
               "stage {} of the pipeline asks for a ring of 1 slot: a ring needs at least 2 (a stage writes one "
               "slot while the next reads the other); 0 means the stage writes none",
               j);
    for (std::size_t j = 0; j < kStages; ++j) ring_holder_[j].assign(ring_size_[j], kNone);
    // Which ring each stage reads, and which stage is the last reader of each ring.
    std::size_t current = kNoRing;
    for (std::size_t j = 0; j < kStages; ++j) {
      reads_ring_[j] = current;
      if (current != kNoRing) last_reader_[current] = j;
      if (ring_size_[j] > 0) {
        current = j;
        last_reader_[j] = kNoRing;
      }
    }
  }

  template <std::size_t... J>
  void start(std::index_sequence<J...>) {
    (threads_.emplace_back([this] { worker<J>(); }), ...);
  }

  void throw_if_failed() {
    if (failed_) {
      if (error_) std::rethrow_exception(error_);
      MT_FAIL("the pipeline stopped after an earlier error");
    }
  }

  // Waits (under the lock) until stage j has posted item `seq`, and returns its completion.
  // Items before base_ were drained: all their work, device work included, has finished.
  Completion await_posted(std::unique_lock<std::mutex>& lock, std::size_t j, std::uint64_t seq) {
    cv_.wait(lock, [&] { return failed_ || stopping_ || done_[j] > seq; });
    if (failed_ || stopping_) throw Aborted{};
    if (seq < base_) return {};
    return entries_[seq - base_].done[j];
  }

  template <std::size_t J>
  void worker() {
    auto& stage = std::get<J>(stages_);
    auto& exec = stage.executor();
    try {
      // (an executor whose work belongs to one GPU makes it current on this thread first)
      if constexpr (requires { exec.bind_thread(); }) exec.bind_thread();
      for (std::uint64_t seq = 0;; ++seq) {
        std::vector<Completion> deps;
        Item item;
        StageSlots slots;
        bool applies = false;
        {
          std::unique_lock lock(mutex_);
          cv_.wait(lock, [&] { return failed_ || stopping_ || seq < base_ + entries_.size(); });
          if (failed_ || stopping_) return;
          const Entry& e = entries_[seq - base_];
          item = e.item;
          applies = stage.applies(item);
          if (J > 0) deps.push_back(await_posted(lock, J - 1, seq));                       // rule 1
          if (ring_size_[J] > 0 && last_reader_[J] != kNoRing && e.slot_prev[J] != kNone)  // rule 3
            deps.push_back(await_posted(lock, last_reader_[J], e.slot_prev[J]));
          // Rules 4 and 5 order the stage's own work on a unit: an item it passes through waits
          // for nothing more (else it would hold up every later item of this stage).
          if (applies && access_[J] == UnitAccess::reads) {                                // rule 4
            const auto writes = entries_[seq - base_].unit_writes;
            for (const auto& [wj, wseq] : writes) deps.push_back(await_posted(lock, wj, wseq));
          }
          if (applies && access_[J] == UnitAccess::writes) {                               // rule 5
            const auto reads = entries_[seq - base_].unit_reads;
            for (const auto& [rj, rseq] : reads) deps.push_back(await_posted(lock, rj, rseq));
          }
          if (reads_ring_[J] != kNoRing) slots.in = e.slot[reads_ring_[J]];
          if (ring_size_[J] > 0) slots.out = e.slot[J];
        }
        Completion posted;
        if (applies) {
          for (const auto& d : deps) exec.wait(d);
          {
            MT_NVTX_RANGE(detail::pipeline_stage_range_name<J>.data());
            stage.run(item, slots);
          }
          posted = exec.complete();
        } else if (J > 0) {
          posted = deps.front();  // nothing done here: downstream orders after the upstream work
        }
        {
          std::lock_guard lock(mutex_);
          entries_[seq - base_].done[J] = posted;
          done_[J] = seq + 1;
        }
        cv_.notify_all();
      }
    } catch (const Aborted&) {
      return;
    } catch (...) {
      {
        std::lock_guard lock(mutex_);
        if (!failed_) error_ = std::current_exception();
        failed_ = true;
      }
      cv_.notify_all();
    }
  }

  // After a drain every item has finished everywhere: drop them all (waits on earlier items
  // then see finished work; see await_posted).
  void trim() {
    base_ += entries_.size();
    entries_.clear();
  }

  std::tuple<Stages...> stages_;
  std::array<std::size_t, kStages> ring_size_{};
  std::array<UnitAccess, kStages> access_{};
  std::array<std::size_t, kStages> reads_ring_{};
  std::array<std::size_t, kStages> last_reader_{};
  std::array<std::uint64_t, kStages> ring_uses_{};            // rule 3: slots handed out per ring
  std::array<std::vector<std::uint64_t>, kStages> ring_holder_;  // the item holding each slot
  std::array<std::size_t, kStages> ring_latest_{};             // the slot handed out last

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Entry> entries_;
  std::uint64_t base_ = 0;                     // seq of entries_.front()
  std::array<std::uint64_t, kStages> done_{};  // items posted per stage
  std::unordered_map<std::size_t, std::vector<std::pair<std::size_t, std::uint64_t>>> last_write_, last_read_;
  bool stopping_ = false;
  bool failed_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace megatrain
