// HostParamStore: layout, alignment, byte counts, views by name, seeded initialisation, the
// gradient ring, refusal of stores that cannot fit, and stores without a bf16 copy or without the
// optimizer state.
#include <doctest/doctest.h>

#include <oneapi/tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "megatrain/optim/adamw.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;

namespace {
// A toy decoder with awkward sizes: hidden 72, intermediate 200, vocab 263, 2 blocks.
std::vector<UnitSpec> toy_units() {
  const std::int64_t h = 72, f = 200, vocab = 263;
  std::vector<UnitSpec> units;
  units.push_back({"embed", {ParamSpec::matrix("model.embed_tokens.weight", Shape{vocab, h}, 0.02f)}});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    units.push_back({"layers." + std::to_string(l),
                     {ParamSpec::norm(p + "input_layernorm.weight", h),
                      ParamSpec::matrix(p + "self_attn.q_proj.weight", Shape{h, h}),
                      ParamSpec::bias(p + "self_attn.q_proj.bias", h),
                      ParamSpec::matrix(p + "self_attn.k_proj.weight", Shape{24, h}),
                      ParamSpec::matrix(p + "mlp.gate_proj.weight", Shape{f, h}, 0.05f),
                      ParamSpec::matrix(p + "mlp.down_proj.weight", Shape{h, f}, 0.01f)}});
  }
  units.push_back({"head", {ParamSpec::norm("model.norm.weight", h), ParamSpec::matrix("lm_head.weight", Shape{vocab, h})}});
  return units;
}

StoreOptions small_opts(std::uint64_t seed = 7) {
  StoreOptions o;
  o.seed = seed;
  o.grad_ring_slots = 3;
  o.pinning = Pinning::never;
  return o;
}
}  // namespace

TEST_CASE("layout: aligned offsets, contiguous non-overlapping slabs, byte counts") {
  HostParamStore<float> s(toy_units(), small_opts());
  REQUIRE(s.num_units() == 4);
  std::int64_t params = 0, slab = 0, largest = 0;
  std::size_t unit_bytes = 0;
  const float* expect_next = s.unit(0).master().data();
  for (const auto& u : s.units()) {
    CHECK(u.master().data() == expect_next);  // units follow each other inside one allocation
    expect_next = u.master().data() + u.numel();
    CHECK(u.numel() % HostParamStore<float>::kAlign == 0);
    std::int64_t end = 0;
    for (const auto& p : u.params()) {
      CHECK(p.offset % HostParamStore<float>::kAlign == 0);
      CHECK(p.offset >= end);  // in order, no overlap
      end = p.offset + p.numel();
      CHECK(reinterpret_cast<std::uintptr_t>(u.master().data() + p.offset) % 256 == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(u.compute().data() + p.offset) % 128 == 0);
      params += p.numel();
    }
    CHECK(end <= u.numel());
    CHECK(u.numel() - end < HostParamStore<float>::kAlign);
    CHECK(u.bytes() == static_cast<std::size_t>(u.numel()) * 14);
    CHECK(u.master().size() == static_cast<std::size_t>(u.numel()));
    CHECK(u.adam_m().size() == u.master().size());
    CHECK(u.adam_v().size() == u.master().size());
    CHECK(u.compute().size() == u.master().size());
    slab += u.numel();
    largest = std::max(largest, u.numel());
    unit_bytes += u.bytes();
  }
  const auto& f = s.footprint();
  CHECK(s.param_count() == params);
  CHECK(f.slab_elements == slab);
  CHECK(f.largest_unit == largest);
  CHECK(s.grad_slot_numel() == largest);
  CHECK(f.grad_ring_bytes == 3 * static_cast<std::size_t>(largest) * 4);
  CHECK(s.bytes() == unit_bytes + f.grad_ring_bytes);
  CHECK(f.unit_bytes.size() == 4);
  CHECK(HostParamStore<float>::footprint(toy_units(), small_opts()).total_bytes() == s.bytes());
  // A double store takes 3*8+2 bytes per element.
  CHECK(HostParamStore<double>::footprint(toy_units(), small_opts()).unit_bytes[1] ==
        static_cast<std::size_t>(s.unit(1).numel()) * 26);
  // The exact count for the toy model.
  CHECK(params == 263 * 72 * 2 + 2 * (72 + 72 * 72 + 72 + 24 * 72 + 200 * 72 * 2) + 72);

  // Slots for the inner units only (the blocks), when the first and last units are larger.
  const std::vector<UnitSpec> big_ends = {{"embed", {ParamSpec::matrix("e", Shape{500, 16})}},
                                          {"mid.0", {ParamSpec::matrix("m0", Shape{20, 20})}},
                                          {"mid.1", {ParamSpec::matrix("m1", Shape{23, 19}), ParamSpec::norm("n1", 19)}},
                                          {"head", {ParamSpec::matrix("h", Shape{300, 16})}}};
  auto inner = small_opts();
  const auto fw = HostParamStore<float>::footprint(big_ends, inner);
  inner.grad_slot_size = GradSlotSize::largest_inner_unit;
  const auto fi = HostParamStore<float>::footprint(big_ends, inner);
  HostParamStore<float> si(big_ends, inner);
  const std::int64_t inner_largest = std::max(si.unit(1).numel(), si.unit(2).numel());
  CHECK(fw.grad_slot_numel == si.unit(0).numel());
  CHECK(fi.grad_slot_numel == inner_largest);
  CHECK(si.grad_slot_numel() == inner_largest);
  CHECK(si.grad_slot(2).size() == static_cast<std::size_t>(inner_largest));
  CHECK(fi.grad_ring_bytes == 3 * static_cast<std::size_t>(inner_largest) * 4);
  CHECK(fi.total_bytes() == fw.total_bytes() - 3 * static_cast<std::size_t>(si.unit(0).numel() - inner_largest) * 4);
}

TEST_CASE("views by name address the slabs; the gradient ring has distinct slots") {
  HostParamStore<float> s(toy_units(), small_opts());
  auto q = s.master("model.layers.1.self_attn.q_proj.weight");
  CHECK(q.shape() == Shape{72, 72});
  const auto [u, p] = s.find("model.layers.1.self_attn.q_proj.weight");
  CHECK(u->name() == "layers.1");
  q(3, 5) = 42.5f;
  CHECK(u->master()[static_cast<std::size_t>(p->offset + 3 * 72 + 5)] == 42.5f);
  s.adam_m("lm_head.weight")(262, 71) = 1.0f;
  CHECK(s.unit(3).adam_m()[static_cast<std::size_t>(s.unit(3).param("lm_head.weight").offset + 262 * 72 + 71)] == 1.0f);
  CHECK(s.compute("model.norm.weight").shape() == Shape{72});
  CHECK(s.adam_v("model.embed_tokens.weight").numel() == 263 * 72);
  CHECK_THROWS_WITH_AS(s.master("model.layers.7.mlp.up_proj.weight"), doctest::Contains("no parameter named"), Error);
  CHECK_THROWS_AS(s.unit(4), Error);
  CHECK_THROWS_AS(s.unit(0).param("lm_head.weight"), Error);
  CHECK(s.contains("lm_head.weight"));
  CHECK(!s.contains("lm_head.bias"));

  std::set<const float*> starts;
  for (std::size_t k = 0; k < s.grad_ring_slots(); ++k) {
    auto g = s.grad_slot(k);
    CHECK(static_cast<std::int64_t>(g.size()) == s.grad_slot_numel());
    starts.insert(g.data());
    if (k > 0) CHECK(g.data() == s.grad_slot(k - 1).data() + g.size());
  }
  CHECK(starts.size() == 3);
  CHECK_THROWS_AS(s.grad_slot(3), Error);
}

TEST_CASE("initialisation: seeded, statistics per kind, gaps zero, bf16 copy in sync") {
  HostParamStore<float> a(toy_units(), small_opts(11));
  HostParamStore<float> b(toy_units(), small_opts(11));
  HostParamStore<float> c(toy_units(), small_opts(12));
  bool differs = false;
  for (std::size_t ui = 0; ui < a.num_units(); ++ui) {
    const auto& ua = a.unit(ui);
    CHECK(std::equal(ua.master().begin(), ua.master().end(), b.unit(ui).master().begin()));
    differs |= !std::equal(ua.master().begin(), ua.master().end(), c.unit(ui).master().begin());
    for (std::size_t i = 0; i < ua.master().size(); ++i) {
      REQUIRE(ua.compute()[i] == bf16(ua.master()[i]));
      REQUIRE(ua.adam_m()[i] == 0.0f);
      REQUIRE(ua.adam_v()[i] == 0.0f);
    }
    std::int64_t end = 0;
    for (const auto& p : ua.params()) {
      for (std::int64_t i = end; i < p.offset; ++i) REQUIRE(ua.master()[static_cast<std::size_t>(i)] == 0.0f);
      end = p.offset + p.numel();
      const auto v = ua.tensor(ua.master(), p).span();
      if (p.spec.init == ParamInit::ones) {
        for (float x : v) REQUIRE(x == 1.0f);
      } else if (p.spec.init == ParamInit::zeros) {
        for (float x : v) REQUIRE(x == 0.0f);
      } else {
        double s1 = 0, s2 = 0;
        for (float x : v) {
          s1 += x;
          s2 += static_cast<double>(x) * x;
        }
        const double n = static_cast<double>(v.size());
        const double mean = s1 / n, sd = std::sqrt(s2 / n - mean * mean);
        CAPTURE(p.spec.name);
        CHECK(std::fabs(mean) < 4 * p.spec.init_std / std::sqrt(n));  // 4 sigma
        CHECK(sd == doctest::Approx(p.spec.init_std).epsilon(0.05));
      }
    }
  }
  CHECK(differs);
  // Two tensors of the same shape get different values (streams keyed by name).
  auto k0 = a.master("model.layers.0.self_attn.k_proj.weight"), k1 = a.master("model.layers.1.self_attn.k_proj.weight");
  CHECK(k0(0, 0) != k1(0, 0));
}

TEST_CASE("initialisation does not depend on the number of threads") {
  std::vector<float> one_thread;
  {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
    HostParamStore<float> s(toy_units(), small_opts(5));
    auto m = s.unit(1).master();
    one_thread.assign(m.begin(), m.end());
  }
  HostParamStore<float> s(toy_units(), small_opts(5));
  CHECK(std::equal(one_thread.begin(), one_thread.end(), s.unit(1).master().begin()));
}

TEST_CASE("a store that cannot fit is refused before anything is allocated, with the numbers") {
  auto opts = small_opts();
  const auto need = HostParamStore<float>::footprint(toy_units(), opts).total_bytes();
  opts.host_memory_budget = need - 1;
  CHECK_THROWS_WITH_AS(HostParamStore<float>(toy_units(), opts), doctest::Contains("of host memory is available"), Error);
  opts.host_memory_budget = need;
  CHECK_NOTHROW(HostParamStore<float>(toy_units(), opts));

  // 2 x 10^12 parameters against this machine's real free memory (52 TB needed).
  std::vector<UnitSpec> huge{{"embed", {ParamSpec::matrix("w", Shape{1000000, 2000000})}}};
  try {
    HostParamStore<float> s(huge, small_opts());
    FAIL("a 52 TB store was accepted");
  } catch (const Error& e) {
    const std::string what = e.what();
    const auto need_huge = HostParamStore<float>::footprint(huge, small_opts()).total_bytes();
    CHECK(need_huge == 2000000000000ull * 14 + 3 * 2000000000000ull * 4);
    CHECK(what.find("needs " + format_bytes(need_huge)) != std::string::npos);
    CHECK(what.find("2000000000000 parameters") != std::string::npos);
  }
}

TEST_CASE("bad specs are refused with a message") {
  auto dup = toy_units();
  dup[2].params.push_back(ParamSpec::norm("model.layers.0.input_layernorm.weight", 72));
  CHECK_THROWS_WITH_AS(HostParamStore<float>(dup, small_opts()), doctest::Contains("appears twice"), Error);
  CHECK_THROWS_AS(HostParamStore<float>(std::vector<UnitSpec>{}, small_opts()), Error);
  CHECK_THROWS_AS(HostParamStore<float>(std::vector<UnitSpec>{{"empty", {}}}, small_opts()), Error);
  CHECK_THROWS_AS(HostParamStore<float>(std::vector<UnitSpec>{{"u", {ParamSpec::matrix("w", Shape{0, 4})}}}, small_opts()),
                  Error);
  auto opts = small_opts();
  opts.grad_ring_slots = 0;
  CHECK_THROWS_AS(HostParamStore<float>(toy_units(), opts), Error);
}

TEST_CASE("a store without a bf16 copy: 12 bytes a parameter, the same masters, no copy to read") {
  auto with = small_opts(), without = small_opts();
  without.bf16_copy = false;
  const auto fa = HostParamStore<float>::footprint(toy_units(), with);
  const auto fb = HostParamStore<float>::footprint(toy_units(), without);
  CHECK(fa.compute_bytes == static_cast<std::size_t>(fa.slab_elements) * 2);
  CHECK(fb.compute_bytes == 0);
  CHECK(fb.total_bytes() == fa.total_bytes() - fa.compute_bytes);
  CHECK(fb.master_bytes + fb.adam_bytes == static_cast<std::size_t>(fb.slab_elements) * 12);
  HostParamStore<float> a(toy_units(), with), b(toy_units(), without);
  CHECK(a.has_bf16_copy());
  CHECK_FALSE(b.has_bf16_copy());
  CHECK(b.bytes() == fb.total_bytes());
  for (std::size_t u = 0; u < a.num_units(); ++u) {
    CHECK(b.unit(u).compute().empty());
    CHECK(b.unit(u).bytes() == static_cast<std::size_t>(b.unit(u).numel()) * 12);
    CHECK(std::equal(a.unit(u).master().begin(), a.unit(u).master().end(), b.unit(u).master().begin()));
  }
  b.sync_compute(b.unit(1));  // (nothing to rewrite)
  CHECK_THROWS_WITH_AS((void)b.compute("model.norm.weight"), doctest::Contains("keeps no bf16 copy"), Error);
  // a store sharded over processes exchanges the copy: refused without one
  without.shard = {0, 2, true, {0}, nullptr};
  CHECK_THROWS_WITH_AS(HostParamStore<float>::footprint(toy_units(), without), doctest::Contains("sharded over 2 processes"),
                       Error);
}

TEST_CASE("a store without the optimizer state: 6 bytes a parameter, the same masters, never stepped") {
  auto with = small_opts(), without = small_opts();
  without.optimizer_state = false;
  const auto fa = HostParamStore<float>::footprint(toy_units(), with);
  const auto fb = HostParamStore<float>::footprint(toy_units(), without);
  CHECK(fb.adam_bytes == 0);
  CHECK(fb.total_bytes() == fa.total_bytes() - fa.adam_bytes);
  CHECK(fb.master_bytes + fb.compute_bytes == static_cast<std::size_t>(fb.slab_elements) * 6);
  HostParamStore<float> a(toy_units(), with), b(toy_units(), without);
  CHECK(a.has_optimizer_state());
  CHECK_FALSE(b.has_optimizer_state());
  CHECK(b.bytes() == fb.total_bytes());
  for (std::size_t u = 0; u < a.num_units(); ++u) {
    CAPTURE(u);
    const auto& bu = b.unit(u);
    CHECK_FALSE(bu.has_moments());
    CHECK(bu.adam_m().empty());
    CHECK(bu.adam_v().empty());
    CHECK(bu.bytes() == static_cast<std::size_t>(bu.numel()) * 6);
    CHECK(std::equal(a.unit(u).master().begin(), a.unit(u).master().end(), bu.master().begin()));
    CHECK(std::equal(a.unit(u).compute().begin(), a.unit(u).compute().end(), bu.compute().begin(),
                     [](bf16 x, bf16 y) { return static_cast<float>(x) == static_cast<float>(y); }));
  }
  b.initialize(5);  // (re-initialised: the masters only)
  // AdamW refuses it before anything changes
  const auto& u1 = b.unit(1);
  const std::vector<float> before(u1.master().begin(), u1.master().end());
  const std::vector<float> grad(static_cast<std::size_t>(u1.numel()), 0.25f);
  CHECK_THROWS_WITH_AS(adamw_step<float>(u1, grad, AdamWConfig{}, 1, 1e-3, 1.0), doctest::Contains("keeps no optimizer state"),
                       Error);
  CHECK(std::equal(before.begin(), before.end(), u1.master().begin()));
  // a store sharded over processes steps its part: refused without the state
  without.shard = {0, 2, false, {}, nullptr};
  CHECK_THROWS_WITH_AS(HostParamStore<float>::footprint(toy_units(), without), doctest::Contains("not sharded over 2"),
                       Error);
}
