// StreamPipeline's ordering rules, checked on a log of when each stage started and finished
// each item while stages sleep for random times; plus error propagation.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "megatrain/pipeline/stream_pipeline.hpp"

using namespace megatrain;

namespace {

struct Item {
  std::size_t unit;
  int id;
  bool skip_middle = false;
  bool write_only = false;  // only the last stage (the unit writer) applies
};

struct Log {
  std::atomic<std::int64_t> clock{0};
  std::mutex m;
  std::map<std::pair<int, int>, std::pair<std::int64_t, std::int64_t>> span;  // (stage, id) -> (start, end)
  std::map<std::pair<int, int>, StageSlots> slots;
  std::vector<std::pair<int, int>> order;  // (stage, id) in start order per stage
};

struct TestStage {
  int index;
  Log* log;
  std::size_t ring;
  UnitAccess access;
  bool skips;  // does not apply to items with skip_middle
  int throw_at = -1;
  HostExecutor exec{};
  unsigned seed;
  int sleep_us = -1;  // >= 0: sleep exactly this long per item (else a random 0..1.5 ms)

  HostExecutor& executor() { return exec; }
  bool applies(const Item& it) const {
    if (it.write_only) return access == UnitAccess::writes;
    return !(skips && it.skip_middle);
  }
  std::size_t ring_slots() const { return ring; }
  UnitAccess unit_access() const { return access; }
  void run(const Item& it, const StageSlots& s) {
    const std::int64_t start = ++log->clock;
    std::mt19937 rng(seed + static_cast<unsigned>(it.id) * 31u);
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us >= 0 ? sleep_us : static_cast<int>(rng() % 1500)));
    if (it.id == throw_at) throw std::runtime_error("stage failed on purpose");
    const std::int64_t end = ++log->clock;
    std::lock_guard lock(log->m);
    log->span[{index, it.id}] = {start, end};
    log->slots[{index, it.id}] = s;
    log->order.emplace_back(index, it.id);
  }
};

}  // namespace

TEST_CASE("ordering rules hold whatever the timing") {
  for (unsigned trial = 0; trial < 4; ++trial) {
    Log log;
    // prefetch (ring 2) -> compute (ring 3) -> offload (ring 2; skips some items) -> optimizer (writes units)
    StreamPipeline<Item, TestStage, TestStage, TestStage, TestStage> p(
        TestStage{0, &log, 2, UnitAccess::reads, false, -1, {}, trial * 7 + 1},
        TestStage{1, &log, 3, UnitAccess::none, false, -1, {}, trial * 7 + 2},
        TestStage{2, &log, 2, UnitAccess::none, true, -1, {}, trial * 7 + 3},
        TestStage{3, &log, 0, UnitAccess::writes, true, -1, {}, trial * 7 + 4});
    std::vector<Item> items;
    int id = 0;
    for (int step = 0; step < 3; ++step) {
      for (std::size_t u = 0; u < 5; ++u) {
        items.push_back({u, id++, true});  // forward: no offload/optimizer
        if (u % 2 == 0) items.push_back({u, id++, false, true});  // writes unit u, with nothing upstream
      }
      for (std::size_t u = 5; u-- > 0;) items.push_back({u, id++, false});  // backward
    }
    p.submit(std::vector<Item>(items.begin(), items.begin() + 17));
    p.submit(std::vector<Item>(items.begin() + 17, items.end()));
    p.drain();

    auto ran = [&](int stage, int i) { return log.span.count({stage, i}) != 0; };
    std::vector<int> slot_users[3];
    for (const auto& it : items)
      for (int j = 0; j < 3; ++j)
        if (ran(j, it.id)) slot_users[j].push_back(it.id);
    for (const auto& it : items) {
      // Rule 1: data flow (a skipping stage forwards its upstream's completion).
      int prev = -1;
      for (int j = 0; j < 4; ++j) {
        if (!ran(j, it.id)) continue;
        if (prev >= 0) CHECK(log.span[{j, it.id}].first > log.span[{prev, it.id}].second);
        prev = j;
      }
      CHECK(ran(0, it.id) == !it.write_only);
      CHECK(ran(1, it.id) == !it.write_only);
      CHECK(ran(2, it.id) == (!it.skip_middle && !it.write_only));
      CHECK(ran(3, it.id) == (!it.skip_middle || it.write_only));
      // Rule 3: ring slots. Stage 0's ring (2 slots) is read by stage 1; stage 1's (3 slots) by
      // stage 2 (the last reader before the next writer); stage 2's (2 slots, handed only to the
      // items it applies to) by stage 3.
      const std::size_t K[3] = {2, 3, 2};
      for (int j = 0; j < 3; ++j) {
        if (!ran(j, it.id)) continue;
        const auto& users = slot_users[j];  // ids of the items stage j wrote, in order
        const auto n = static_cast<std::size_t>(std::find(users.begin(), users.end(), it.id) - users.begin());
        CHECK(log.slots[{j, it.id}].out == n % K[j]);
        if (j + 1 < 4 && ran(j + 1, it.id)) CHECK(log.slots[{j + 1, it.id}].in == n % K[j]);
        if (n < K[j]) continue;
        const int earlier = users[n - K[j]];  // held the same slot before
        // The reader of the earlier item, or (if it skipped) whatever it forwarded, ended first.
        for (int r = j + 1; r >= 0; --r)
          if (ran(r, earlier)) {
            CHECK(log.span[{j, it.id}].first > log.span[{r, earlier}].second);
            break;
          }
      }
      // Rule 4: a reader of a unit starts after the last earlier writer of that unit ended.
      if (ran(0, it.id))
        for (const auto& w : items)
          if (w.id < it.id && w.unit == it.unit && ran(3, w.id)) CHECK(log.span[{0, it.id}].first > log.span[{3, w.id}].second);
      // Rule 5: a writer of a unit starts after the last earlier reader of that unit ended.
      if (ran(3, it.id))
        for (const auto& r : items)
          if (r.id < it.id && r.unit == it.unit && ran(0, r.id)) CHECK(log.span[{3, it.id}].first > log.span[{0, r.id}].second);
    }
    // Rule 2: each stage in submission order.
    std::map<int, int> last;
    for (const auto& [stage, i] : log.order) {
      if (last.count(stage)) CHECK(i > last[stage]);
      last[stage] = i;
    }
  }
}

TEST_CASE("rule 5: a writer waits for an earlier item's reader, even one downstream of it") {
  // Stage 1 writes units, stage 2 (after it) reads them. Odd items only read, even items only
  // write: without rule 5, stage 1 would write item 2k's unit while stage 2 still reads it for
  // item 2k-1.
  for (unsigned trial = 0; trial < 3; ++trial) {
    Log log;
    StreamPipeline<Item, TestStage, TestStage, TestStage> p(TestStage{0, &log, 0, UnitAccess::none, false, -1, {}, trial + 1},
                                                          TestStage{1, &log, 0, UnitAccess::writes, true, -1, {}, trial + 2},
                                                          TestStage{2, &log, 0, UnitAccess::reads, false, -1, {}, trial + 3});
    std::vector<Item> items;
    for (int i = 0; i < 24; ++i) {
      const bool reader = i % 2 == 1;
      items.push_back({static_cast<std::size_t>((i + 1) / 2 % 3), i, reader});  // items 2k-1, 2k: one unit
    }
    p.submit(items);
    p.drain();
    for (const auto& w : items) {
      if (w.skip_middle) continue;  // readers only: stage 1 skipped them
      for (const auto& r : items)
        if (r.id < w.id && r.unit == w.unit && r.skip_middle)
          CHECK(log.span[{1, w.id}].first > log.span[{2, r.id}].second);
    }
  }
}

namespace {
// A ring writer that writes a slot only for even items (takes_slot): the odd ones it applies to
// need none, like a compute stage's forward items.
struct EvenSlotStage : TestStage {
  bool takes_slot(const Item& it) const { return it.id % 2 == 0; }
};
}  // namespace

TEST_CASE("rules 4 and 5: an item a stage passes through waits for no unit's writer or reader") {
  // A slow writer steps unit 0 in three pieces; the reading stage (a prefetch) passes those
  // through and must reach the next item of another unit at once, not in step with the writer.
  Log log;
  StreamPipeline<Item, TestStage, TestStage> p(TestStage{0, &log, 0, UnitAccess::reads, false, -1, {}, 1, 0},
                                               TestStage{1, &log, 0, UnitAccess::writes, true, -1, {}, 2, 30000});
  p.submit({{0, 0, false, true}, {0, 1, false, true}, {0, 2, false, true}, {1, 3, true, false}});
  p.drain();
  REQUIRE(log.span.count({0, 3}) == 1);
  REQUIRE(log.span.count({1, 1}) == 1);
  CHECK(log.span[{0, 3}].first < log.span[{1, 1}].first);  // read before the writer's second piece began
  CHECK(log.span.count({1, 3}) == 0);                          // (the writer skips it)
}

TEST_CASE("rule 3: items a ring writer takes no slot for do not wait for the ring's readers") {
  Log log;
  EvenSlotStage writer{TestStage{0, &log, 2, UnitAccess::none, false, -1, {}, 1, 0}};
  TestStage reader{1, &log, 0, UnitAccess::none, false, -1, {}, 2, 20000};  // a slow reader: 20 ms per item
  StreamPipeline<Item, EvenSlotStage, TestStage> p(writer, reader);
  std::vector<Item> items;
  for (int i = 0; i < 8; ++i) items.push_back({static_cast<std::size_t>(i), i});
  p.submit(items);
  p.drain();
  // Slots go to the even items only, in turn; an odd item sees the latest even item's slot.
  for (int i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK(log.slots[{0, i}].out == static_cast<std::size_t>((i / 2) % 2));
    CHECK(log.slots[{1, i}].in == static_cast<std::size_t>((i / 2) % 2));
  }
  // Items 0..3 take two slots between them: none waits for the reader. Item 4 reuses item 0's
  // slot, so it waits until the reader is done with item 0.
  CHECK(log.span[{0, 3}].first < log.span[{1, 0}].second);
  CHECK(log.span[{0, 4}].first > log.span[{1, 0}].second);
  CHECK(log.span[{0, 6}].first > log.span[{1, 2}].second);
}

TEST_CASE("a stage's error stops the pipeline and reaches drain()") {
  Log log;
  StreamPipeline<Item, TestStage, TestStage> p(TestStage{0, &log, 2, UnitAccess::none, false, -1, {}, 1},
                                               TestStage{1, &log, 0, UnitAccess::none, false, 5, {}, 2});
  std::vector<Item> items;
  for (int i = 0; i < 20; ++i) items.push_back({0, i});
  p.submit(items);
  CHECK_THROWS_WITH(p.drain(), "stage failed on purpose");
  CHECK_THROWS(p.submit(items));
  CHECK(log.span.count({1, 6}) == 0);
}

TEST_CASE("drain can be called repeatedly; later items see earlier writers as finished") {
  Log log;
  StreamPipeline<Item, TestStage, TestStage> p(TestStage{0, &log, 2, UnitAccess::reads, false, -1, {}, 3},
                                               TestStage{1, &log, 0, UnitAccess::writes, false, -1, {}, 4});
  for (int round = 0; round < 5; ++round) {
    p.submit({{0, 2 * round}, {1, 2 * round + 1}});
    p.drain();
  }
  CHECK(log.order.size() == 20);
  CHECK(log.span[{0, 2}].first > log.span[{1, 0}].second);
}

TEST_CASE("prefetch, offload and the optimizer overlap the compute") {
  // The trainer's shape: prefetch (ring 2, reads units) -> compute (ring 2) -> offload (ring 2,
  // backward items only) -> optimizer (writes units, backward items only); a forward pass over
  // units 0..4, then a backward pass 4..0. Every stage takes 30 ms per item, so what overlaps is
  // decided by the ordering rules, not by luck.
  Log log;
  constexpr int kSleep = 30000;
  StreamPipeline<Item, TestStage, TestStage, TestStage, TestStage> p(
      TestStage{0, &log, 2, UnitAccess::reads, false, -1, {}, 1, kSleep},
      TestStage{1, &log, 2, UnitAccess::none, false, -1, {}, 2, kSleep},
      TestStage{2, &log, 2, UnitAccess::none, true, -1, {}, 3, kSleep},
      TestStage{3, &log, 0, UnitAccess::writes, true, -1, {}, 4, kSleep});
  std::vector<Item> items;
  for (std::size_t u = 0; u < 5; ++u) items.push_back({u, static_cast<int>(u), true});  // forward: ids 0..4
  for (std::size_t u = 5; u-- > 0;) items.push_back({u, static_cast<int>(9 - u), false});  // backward: ids 5..9
  p.submit(items);
  p.drain();
  auto overlap = [&](int sa, int a, int sb, int b) {
    const auto x = log.span.at({sa, a}), y = log.span.at({sb, b});
    return x.first < y.second && y.first < x.second;
  };
  for (int k = 0; k + 1 < 10; ++k) {
    CAPTURE(k);
    CHECK(overlap(0, k + 1, 1, k));  // prefetching the next unit while the current one computes
  }
  for (int k = 5; k + 1 < 10; ++k) {
    CAPTURE(k);
    CHECK(overlap(2, k, 1, k + 1));  // offloading unit u's gradient while unit u-1 computes
  }
  // The optimizer steps the first unit whose gradient landed before the backward has finished.
  CHECK(log.span.at({3, 5}).second < log.span.at({1, 9}).second);
  CHECK(overlap(3, 5, 1, 7));
}

TEST_CASE("a ring of one slot is refused: double buffering needs two") {
  Log log;
  using P = StreamPipeline<Item, TestStage, TestStage>;
  CHECK_THROWS_WITH_AS(P(TestStage{0, &log, 1, UnitAccess::none, false, -1, {}, 1}, TestStage{1, &log, 0, UnitAccess::none, false, -1, {}, 2}),
                       doctest::Contains("ring of 1 slot"), Error);
  P ok(TestStage{0, &log, 2, UnitAccess::none, false, -1, {}, 1}, TestStage{1, &log, 0, UnitAccess::none, false, -1, {}, 2});
  ok.submit({{0, 0}, {0, 1}, {0, 2}});
  ok.drain();
  CHECK(log.order.size() == 6);
}
