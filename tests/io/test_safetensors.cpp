// Safetensors: round trips (F32, BF16, F16, F64; single file and sharded; metadata), the exact
// bytes of the layout, every malformed header and index the reader must refuse (each error
// naming the file and the tensor), read_into's checks, and that a failed write leaves an existing
// file or checkpoint directory untouched.
#include <doctest/doctest.h>

#include "io_test_util.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

#include <stdlib.h>  // mkdtemp
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/error.hpp"
#include "megatrain/io/safetensors.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;
using namespace megatrain::io;
namespace fs = std::filesystem;

namespace {

using megatrain::test::rng;

/// Random floats over several orders of magnitude, both signs, never all zero; within f16 range.
std::vector<float> random_floats(std::size_t n) {
  std::uniform_real_distribution<float> mant(0.5f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 12);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> v(n);
  for (auto& x : v) x = (neg(rng()) ? -1.0f : 1.0f) * std::ldexp(mant(rng()), expo(rng()));
  return v;
}

std::vector<double> random_doubles(std::size_t n) {
  std::normal_distribution<double> d(0.0, 3.0);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng());
  return v;
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

struct TempDir : megatrain::test::TempDir {
  TempDir() : megatrain::test::TempDir("megatrain-st") {}
};

using megatrain::test::read_file;

void write_text(const fs::path& p, std::string_view s) { megatrain::test::write_file(p, s); }

/// name -> contents of every file in `dir`, plus the names of every entry beside it.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s[e.path().filename().string()] = read_file(e.path());
  return s;
}
std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

/// A safetensors file's bytes: length field (of the header, or `length_field` if given), header,
/// then `data_bytes` random bytes.
std::vector<std::byte> make_bytes(std::string_view header, std::size_t data_bytes,
                                  std::optional<std::uint64_t> length_field = std::nullopt) {
  const std::uint64_t n = length_field.value_or(header.size());
  std::vector<std::byte> b(8 + header.size() + data_bytes);
  for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(b.data() + 8, header.data(), header.size());
  for (std::size_t i = 0; i < data_bytes; ++i) b[8 + header.size() + i] = static_cast<std::byte>(rng()() & 0xff);
  return b;
}

SafetensorsHeader parse(const std::vector<std::byte>& b) {
  return parse_safetensors_header(b, b.size(), "bad.safetensors");
}

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

/// What a float becomes when stored as `dtype` and read back as float.
float stored(float x, SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::bf16: return bf16_bits_to_float(float_to_bf16_bits(x));
    case SafetensorsDType::f16: return f16_bits_to_float(float_to_f16_bits(x));
    default: return x;
  }
}

/// A tensor to write together with its fp32 source.
struct Source {
  std::string name;
  std::vector<std::int64_t> shape;
  SafetensorsDType dtype;
  std::vector<float> values;
  TensorToWrite to_write() const {
    const Shape s{std::span<const std::int64_t>(shape)};
    return TensorToWrite(name, View<const float>(std::span<const float>(values), s), dtype);
  }
};

std::vector<Source> random_sources() {
  // Sizes at the edges of the 4096-element conversion chunk, odd sizes that misalign what
  // follows, a scalar, an empty tensor.
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> shapes = {
      {"model.embed_tokens.weight", {37, 113}}, {"model.layers.0.input_layernorm.weight", {7}},
      {"model.layers.0.mlp.up_proj.weight", {4096}}, {"model.layers.0.mlp.down_proj.weight", {3, 4097}},
      {"model.layers.0.self_attn.q_proj.bias", {4095}}, {"scalar", {}}, {"empty", {0, 5}},
      {"model.norm.weight", {2, 3, 5, 7}}};
  const SafetensorsDType dtypes[] = {SafetensorsDType::bf16, SafetensorsDType::f32, SafetensorsDType::f16};
  std::vector<Source> out;
  std::size_t k = 0;
  for (const auto& [name, shape] : shapes) {
    out.push_back({name, shape, dtypes[k++ % 3], random_floats(static_cast<std::size_t>(numel_of(shape)))});
  }
  return out;
}

std::vector<TensorToWrite> to_write(const std::vector<Source>& sources) {
  std::vector<TensorToWrite> t;
  for (const auto& s : sources) t.push_back(s.to_write());
  return t;
}

/// Reads every source back from `ckpt` (float and double) and compares with RNE rounding.
void check_contents(const SafetensorsCheckpoint& ckpt, const std::vector<Source>& sources) {
  REQUIRE(ckpt.size() == sources.size());
  for (const auto& s : sources) {
    INFO("tensor " << s.name);
    const auto ref = ckpt.tensor(s.name);
    CHECK(ref.info->dtype == s.dtype);
    CHECK(ref.info->shape == s.shape);
    const Shape shape{std::span<const std::int64_t>(s.shape)};
    std::vector<float> back(s.values.size(), -1.0f);
    read_into(ref, View<float>(std::span<float>(back), shape));
    std::vector<double> back64(s.values.size(), -1.0);
    read_into(ref, View<double>(std::span<double>(back64), shape));
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < back.size(); ++i) {
      const float want = stored(s.values[i], s.dtype);
      mismatches += !same_bits(back[i], want) || back64[i] != static_cast<double>(want);
    }
    CHECK(mismatches == 0);
  }
}

}  // namespace

// ---- element types ------------------------------------------------------------------------------

TEST_CASE("safetensors dtypes: spellings, sizes, megatrain equivalents") {
  for (const auto t : {SafetensorsDType::boolean, SafetensorsDType::u8, SafetensorsDType::f8_e4m3,
                       SafetensorsDType::bf16, SafetensorsDType::f32, SafetensorsDType::f64, SafetensorsDType::c64}) {
    CHECK(parse_safetensors_dtype(safetensors_dtype_name(t)) == t);
  }
  CHECK(safetensors_dtype_size(SafetensorsDType::bf16) == 2);
  CHECK(safetensors_dtype_size(SafetensorsDType::u64) == 8);
  CHECK(safetensors_dtype_size(SafetensorsDType::f8_e5m2) == 1);
  CHECK_FALSE(parse_safetensors_dtype("f32").has_value());  // case matters
  CHECK_FALSE(parse_safetensors_dtype("F4").has_value());
  for (const auto d : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u16, DType::u32}) {
    CHECK(to_dtype(to_safetensors_dtype(d)) == d);
    CHECK(safetensors_dtype_name(to_safetensors_dtype(d)) == dtype_name(d));
  }
  CHECK_FALSE(to_dtype(SafetensorsDType::u8).has_value());
}

// ---- round trips --------------------------------------------------------------------------------

TEST_CASE("round trip: F32, BF16 and F16 from fp32, with metadata, single file") {
  TempDir dir;
  const auto sources = random_sources();
  const auto tensors = to_write(sources);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode ✓"}, {"empty", ""}};
  write_safetensors(dir / "model.safetensors", tensors, meta);

  const auto file = SafetensorsFile::open(dir / "model.safetensors");
  CHECK(file.metadata() == meta);
  CHECK(file.header().data_start % 8 == 0);
  // Laid out by element size, largest first: every tensor is naturally aligned in the file.
  std::size_t prev_size = 8;
  for (const auto& t : file.tensors()) {
    const std::size_t es = safetensors_dtype_size(t.dtype);
    CHECK(es <= prev_size);
    prev_size = es;
    CHECK((file.header().data_start + t.data_begin) % es == 0);
  }
  // Raw bytes of a BF16 tensor are exactly megatrain's RNE bits.
  const Source& emb = sources[0];
  REQUIRE(emb.dtype == SafetensorsDType::bf16);
  const TensorBytes raw = file.view(file.tensor(emb.name));
  REQUIRE(raw.bytes.size() == emb.values.size() * 2);
  std::size_t bad_bits = 0;
  for (std::size_t i = 0; i < emb.values.size(); ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, raw.bytes.data() + 2 * i, 2);
    bad_bits += bits != float_to_bf16_bits(emb.values[i]);
  }
  CHECK(bad_bits == 0);

  check_contents(SafetensorsCheckpoint::open(dir / "model.safetensors"), sources);
  check_contents(SafetensorsCheckpoint::open(dir.path()), sources);  // a directory with model.safetensors
  CHECK_FALSE(SafetensorsCheckpoint::open(dir.path()).sharded());
}

TEST_CASE("round trip: sources of every float type, producers, F64") {
  TempDir dir;
  const auto f = random_floats(1000);
  std::vector<bf16> h(1000);
  std::vector<f16> g(1000);
  for (std::size_t i = 0; i < f.size(); ++i) {
    h[i] = bf16(f[i]);
    g[i] = f16(f[i]);
  }
  const auto d = random_doubles(999);
  const Shape s2{10, 100}, s1{999};
  const auto produced = random_floats(5000);
  std::vector<TensorToWrite> t;
  t.emplace_back("bf16_raw", View<const bf16>(std::span<const bf16>(h), s2));  // stored as it is
  t.emplace_back("bf16_to_f32", View<const bf16>(std::span<const bf16>(h), s2), SafetensorsDType::f32);
  t.emplace_back("bf16_to_f16", View<const bf16>(std::span<const bf16>(h), s2), SafetensorsDType::f16);
  t.emplace_back("f16_raw", View<const f16>(std::span<const f16>(g), s2));
  t.emplace_back("f16_to_f32", View<const f16>(std::span<const f16>(g), s2), SafetensorsDType::f32);
  t.emplace_back("f64_raw", View<const double>(std::span<const double>(d), s1));
  t.emplace_back("f64_to_f32", View<const double>(std::span<const double>(d), s1), SafetensorsDType::f32);
  t.emplace_back("f32_to_f64", View<const float>(std::span<const float>(f), s2), SafetensorsDType::f64);
  t.emplace_back("produced", std::vector<std::int64_t>{50, 100}, SafetensorsDType::bf16,
                 [&](std::int64_t first, std::span<float> out) {
                   std::copy_n(produced.begin() + first, out.size(), out.begin());
                 });
  write_safetensors(dir / "m.safetensors", t);
  const auto ckpt = SafetensorsCheckpoint::open(dir / "m.safetensors");
  std::vector<float> out(5000);
  std::vector<double> out64(1000);
  const auto read = [&](const std::string& name, Shape shape) {
    read_into(ckpt.tensor(name), View<float>(std::span<float>(out).first(static_cast<std::size_t>(shape.numel())), shape));
  };
  std::size_t bad = 0;
  read("bf16_raw", s2);
  for (std::size_t i = 0; i < 1000; ++i) bad += !same_bits(out[i], static_cast<float>(h[i]));
  read("bf16_to_f32", s2);
  for (std::size_t i = 0; i < 1000; ++i) bad += !same_bits(out[i], static_cast<float>(h[i]));
  read("bf16_to_f16", s2);
  for (std::size_t i = 0; i < 1000; ++i) bad += !same_bits(out[i], static_cast<float>(f16(static_cast<float>(h[i]))));
  read("f16_raw", s2);
  for (std::size_t i = 0; i < 1000; ++i) bad += !same_bits(out[i], static_cast<float>(g[i]));
  read("f16_to_f32", s2);
  for (std::size_t i = 0; i < 1000; ++i) bad += !same_bits(out[i], static_cast<float>(g[i]));
  read("f64_to_f32", s1);
  for (std::size_t i = 0; i < 999; ++i) bad += !same_bits(out[i], static_cast<float>(d[i]));
  read("f64_raw", s1);  // F64 -> float rounds once
  for (std::size_t i = 0; i < 999; ++i) bad += !same_bits(out[i], static_cast<float>(d[i]));
  read_into(ckpt.tensor("f64_raw"), View<double>(std::span<double>(out64).first(999), s1));
  for (std::size_t i = 0; i < 999; ++i) bad += out64[i] != d[i];
  read_into(ckpt.tensor("f32_to_f64"), View<double>(std::span<double>(out64), s2));
  for (std::size_t i = 0; i < 1000; ++i) bad += out64[i] != static_cast<double>(f[i]);
  read("produced", Shape{50, 100});
  for (std::size_t i = 0; i < 5000; ++i) bad += !same_bits(out[i], stored(produced[i], SafetensorsDType::bf16));
  CHECK(bad == 0);
  CHECK(ckpt.tensor("f64_raw").info->dtype == SafetensorsDType::f64);
  CHECK(ckpt.tensor("bf16_raw").info->dtype == SafetensorsDType::bf16);
  // Another file's tensors, byte for byte: any dtype and rank (a Conv3d weight is rank 5; U8 has no
  // megatrain dtype).
  std::vector<std::uint8_t> u8(2 * 3 * 2 * 2 * 5);
  for (std::size_t i = 0; i < u8.size(); ++i) u8[i] = static_cast<std::uint8_t>(rng()());
  const std::vector<std::int64_t> rank5{2, 3, 2, 2, 5};
  std::vector<TensorToWrite> copied;
  copied.emplace_back("u8_rank5", TensorBytes{std::as_bytes(std::span<const std::uint8_t>(u8)), SafetensorsDType::u8, rank5});
  copied.emplace_back("bf16_copied", ckpt.tensor("bf16_raw").bytes());
  copied.emplace_back("f64_copied", ckpt.tensor("f64_raw").bytes());
  write_safetensors(dir / "copied.safetensors", copied);
  const auto again = SafetensorsCheckpoint::open(dir / "copied.safetensors");
  const auto same = [](const TensorBytes& a, const TensorBytes& b) {
    return a.dtype == b.dtype && std::ranges::equal(a.shape, b.shape) && std::ranges::equal(a.bytes, b.bytes);
  };
  CHECK(same(again.tensor("bf16_copied").bytes(), ckpt.tensor("bf16_raw").bytes()));
  CHECK(same(again.tensor("f64_copied").bytes(), ckpt.tensor("f64_raw").bytes()));
  CHECK(same(again.tensor("u8_rank5").bytes(),
             TensorBytes{std::as_bytes(std::span<const std::uint8_t>(u8)), SafetensorsDType::u8, rank5}));
}

TEST_CASE("round trip: a tensor large enough to be read in parallel") {
  TempDir dir;
  Source big{"big", {1031, 1117}, SafetensorsDType::bf16, random_floats(1031 * 1117)};
  Source big32{"big32", {1031, 1117}, SafetensorsDType::f32, random_floats(1031 * 1117)};
  const std::vector<TensorToWrite> t = {big.to_write(), big32.to_write()};
  write_safetensors(dir / "big.safetensors", t);
  check_contents(SafetensorsCheckpoint::open(dir / "big.safetensors"), {big, big32});
}

TEST_CASE("round trip: sharded and unsharded checkpoint directories") {
  TempDir dir;
  const auto sources = random_sources();
  const auto tensors = to_write(sources);
  std::uint64_t total = 0;
  for (const auto& s : sources) total += static_cast<std::uint64_t>(numel_of(s.shape)) * safetensors_dtype_size(s.dtype);

  SUBCASE("sharded") {
    ShardedWriteOptions opt;
    opt.max_shard_bytes = 20000;  // the embedding alone is 8362 bytes; several shards
    opt.metadata = {{"format", "pt"}};
    const auto plan = plan_safetensors_shards(tensors, opt.max_shard_bytes);
    REQUIRE(plan.size() >= 3);
    write_safetensors_sharded(dir / "ckpt", tensors, opt);

    const auto files = listing(dir / "ckpt");
    CHECK(files.size() == plan.size() + 1);
    CHECK(files.contains("model.safetensors.index.json"));
    CHECK(files.contains(fmt::format("model-00001-of-{:05d}.safetensors", plan.size())));
    CHECK(files.contains(fmt::format("model-{:05d}-of-{:05d}.safetensors", plan.size(), plan.size())));
    const auto index = nlohmann::json::parse(read_file(dir / "ckpt" / "model.safetensors.index.json"));
    CHECK(index["metadata"]["total_size"].get<std::uint64_t>() == total);
    CHECK(index["weight_map"].size() == sources.size());
    for (std::size_t s = 0; s < plan.size(); ++s)
      for (const std::size_t i : plan[s])
        CHECK(index["weight_map"][sources[i].name] ==
              fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, plan.size()));

    const auto ckpt = SafetensorsCheckpoint::open(dir / "ckpt");
    CHECK(ckpt.sharded());
    CHECK(ckpt.files().size() == plan.size());
    for (const auto& f : ckpt.files()) CHECK(f.metadata() == opt.metadata);
    std::vector<std::string> names;
    for (const auto& s : sources) names.push_back(s.name);
    std::sort(names.begin(), names.end());
    CHECK(ckpt.names() == names);
    check_contents(ckpt, sources);
    check_contents(SafetensorsCheckpoint::open(dir / "ckpt" / "model.safetensors.index.json"), sources);
    CHECK_FALSE(ckpt.find("nope").has_value());
    CHECK_ERROR_MENTIONS(ckpt.tensor("nope"), "'nope'", "model.safetensors.index.json");
  }
  SUBCASE("everything fits in one shard") {
    write_safetensors_sharded(dir / "ckpt", tensors);
    CHECK(listing(dir / "ckpt") == std::set<std::string>{"model.safetensors"});
    const auto ckpt = SafetensorsCheckpoint::open(dir / "ckpt");
    CHECK_FALSE(ckpt.sharded());
    check_contents(ckpt, sources);
  }
  // No staging or old directories are left beside the target.
  CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
}

TEST_CASE("one set written by several writers (ShardedWrite): each its own shards, the first stages and commits") {
  TempDir dir;
  const auto sources = random_sources();
  const auto tensors = to_write(sources);
  REQUIRE(tensors.size() >= 4);
  // The first third of the tensors written by writer 0, the rest by writer 1: two writers' plans alike.
  std::vector<int> writer_of(tensors.size(), 1);
  for (std::size_t i = 0; i < tensors.size() / 3; ++i) writer_of[i] = 0;
  ShardedWriteOptions opt;
  opt.max_shard_bytes = 20000;
  ShardedWrite first(dir / "ckpt", tensors, opt, writer_of);
  ShardedWrite second(dir / "ckpt", tensors, opt, writer_of);
  REQUIRE(first.num_shards() == second.num_shards());
  REQUIRE(first.num_shards() >= 2);
  for (std::size_t s = 0; s < first.num_shards(); ++s) {
    CHECK(first.shard_name(s) == second.shard_name(s));
    CHECK(first.shard_writer(s) == second.shard_writer(s));
    if (s > 0) CHECK(first.shard_writer(s) >= first.shard_writer(s - 1));
  }
  CHECK_ERROR_MENTIONS(second.write_shards(1), "not staged");
  first.stage();
  CHECK_ERROR_MENTIONS(second.attach(first.staging_key() ^ 1u), "does not see it");
  second.attach(first.staging_key());
  CHECK_FALSE(fs::exists(dir / "ckpt"));  // (nothing in place before the commit)
  std::vector<WrittenFile> files = first.write_shards(0);
  for (auto& f : second.write_shards(1)) files.push_back(std::move(f));
  CHECK_ERROR_MENTIONS(second.commit(files), "only the writer that staged");
  const auto all = first.commit(files);
  CHECK(all.size() == first.num_shards() + 1);  // (and the index)
  const auto ckpt = SafetensorsCheckpoint::open(dir / "ckpt");
  CHECK(ckpt.files().size() == first.num_shards());
  check_contents(ckpt, sources);
  CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
  // Writers out of order are refused before anything is written.
  std::vector<int> unordered(tensors.size(), 0);
  unordered.front() = 1;
  CHECK_ERROR_MENTIONS(ShardedWrite(dir / "other", tensors, opt, unordered), "non-decreasing");
}

TEST_CASE("shard planning: in order, a tensor larger than the limit gets its own shard") {
  std::vector<float> v(100);
  const auto view = [&](std::int64_t n) { return View<const float>(std::span<const float>(v).first(static_cast<std::size_t>(n)), Shape{n}); };
  const std::vector<TensorToWrite> t = {{"a", view(10)}, {"b", view(10)}, {"c", view(100)}, {"d", view(5)}, {"e", view(15)}};
  using Plan = std::vector<std::vector<std::size_t>>;
  CHECK(plan_safetensors_shards(t, 80) == Plan{{0, 1}, {2}, {3, 4}});
  CHECK(plan_safetensors_shards(t, 1000) == Plan{{0, 1, 2, 3, 4}});
  CHECK(plan_safetensors_shards(t, 1) == Plan{{0}, {1}, {2}, {3}, {4}});
  CHECK(plan_safetensors_shards({}, 1) == Plan{{}});
  CHECK_THROWS_AS(plan_safetensors_shards(t, 0), Error);
}

TEST_CASE("an empty checkpoint round-trips") {
  TempDir dir;
  write_safetensors(dir / "e.safetensors", {});
  const auto f = SafetensorsFile::open(dir / "e.safetensors");
  CHECK(f.tensors().empty());
  CHECK(f.file_size() == 16);  // 8 + "{}" padded to 8
}

TEST_CASE("export and import of a HostParamStore by names (the docs' example)") {
  TempDir dir;
  std::vector<UnitSpec> units;
  units.push_back({"embed", {ParamSpec::matrix("model.embed_tokens.weight", Shape{97, 24})}});
  units.push_back({"layers.0",
                   {ParamSpec::norm("model.layers.0.input_layernorm.weight", 24),
                    ParamSpec::matrix("model.layers.0.mlp.up_proj.weight", Shape{40, 24})}});
  StoreOptions opt;
  opt.pinning = Pinning::never;
  opt.seed = rng()();
  HostParamStore<float> a(units, opt);

  // Export: one entry per parameter, converted to bf16 while writing.
  std::vector<io::TensorToWrite> out;
  for (const auto& unit : a.units())
    for (const auto& p : unit.params())
      out.emplace_back(p.spec.name, a.master(p.spec.name), io::SafetensorsDType::bf16);
  io::ShardedWriteOptions wopt;
  wopt.max_shard_bytes = 4096;
  wopt.metadata = {{"format", "pt"}};
  wopt.extra_files = {{"config.json", R"({"model_type": "toy"})"}};
  io::write_safetensors_sharded(dir / "export", out, wopt);

  // Import into a store initialised differently.
  opt.seed += 1;
  HostParamStore<float> b(units, opt);
  const auto ckpt = io::SafetensorsCheckpoint::open(dir / "export");
  for (const auto& unit : b.units()) {
    for (const auto& p : unit.params()) io::read_into(ckpt.tensor(p.spec.name), b.master(p.spec.name));
    b.sync_compute(unit);
  }
  std::size_t bad = 0;
  for (const auto& unit : a.units())
    for (const auto& p : unit.params()) {
      const auto x = a.master(p.spec.name).span(), y = b.master(p.spec.name).span();
      for (std::size_t i = 0; i < x.size(); ++i) bad += !same_bits(y[i], stored(x[i], SafetensorsDType::bf16));
    }
  CHECK(bad == 0);
  CHECK(read_file(dir / "export" / "config.json") == R"({"model_type": "toy"})");
}

// ---- malformed headers --------------------------------------------------------------------------

TEST_CASE("header: length field and framing") {
  CHECK_ERROR_MENTIONS(parse(std::vector<std::byte>(5)), "bad.safetensors", "too short");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4, 1000)),
                       "bad.safetensors", "past the end of the file");
  CHECK_ERROR_MENTIONS(parse(make_bytes("{}", 0, 0xffffffffffffffffull)), "bad.safetensors", "past the end");
  {
    // A length over the 100 MB limit is refused without touching (or needing) the bytes.
    const auto b = make_bytes("{}", 0, 150'000'000);
    CHECK_ERROR_MENTIONS(parse_safetensors_header(b, 200'000'000, "huge.safetensors"), "huge.safetensors",
                         "more than the");
  }
  CHECK_ERROR_MENTIONS(parse(make_bytes("{}", 0, 1)), "bad.safetensors", "too short for a JSON object");
  CHECK_ERROR_MENTIONS(parse(make_bytes("[1]", 0)), "bad.safetensors", "does not start with '{'");
  CHECK_ERROR_MENTIONS(parse(make_bytes(" {}", 0)), "bad.safetensors", "does not start with '{'");
  // Only a prefix given: fine if it holds the header, an error if not.
  {
    const auto b = make_bytes(R"({"w":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", 3);
    CHECK(parse_safetensors_header(std::span(b).first(b.size() - 3), b.size(), "x").tensors.size() == 1);
    CHECK_ERROR_MENTIONS(parse_safetensors_header(std::span(b).first(20), b.size(), "x.safetensors"),
                         "x.safetensors", "only 20 bytes");
  }
}

TEST_CASE("header: malformed JSON, duplicates, nesting, UTF-8") {
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w": {"dtype": "F32", )", 0)), "bad.safetensors", "not valid JSON");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w": 1} x)", 0)), "bad.safetensors", "not valid JSON");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w": 1, /* comment */ })", 0)), "bad.safetensors", "not valid JSON");
  CHECK_ERROR_MENTIONS(parse(make_bytes("{\"w\xff\": 1}", 0)), "bad.safetensors", "not valid JSON");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                        R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                        8)),
                       "bad.safetensors", "tensor 'w' appears twice");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"w":{"dtype":"F32","dtype":"BF16","shape":[1],"data_offsets":[0,4]}})", 4)),
                       "bad.safetensors", "'w'", "'dtype' twice");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"__metadata__":{"a":"1","a":"2"}})", 0)), "bad.safetensors",
                       "'__metadata__'", "'a' twice");
  std::string deep = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":)" + std::string(200, '[') +
                     std::string(200, ']') + "}}";
  CHECK_ERROR_MENTIONS(parse(make_bytes(deep, 4)), "bad.safetensors", "'w'", "deeper than");
}

TEST_CASE("header: entries with missing fields, wrong types, unknown dtypes, bad dims") {
  const auto entry = [](std::string body, std::size_t data = 4) {
    return parse(make_bytes("{\"model.w\":" + body + "}", data));
  };
  CHECK_ERROR_MENTIONS(entry("[1, 2]"), "bad.safetensors", "'model.w'", "not an object");
  CHECK_ERROR_MENTIONS(entry(R"({"shape":[1],"data_offsets":[0,4]})"), "bad.safetensors", "'model.w'", "no \"dtype\"");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","data_offsets":[0,4]})"), "bad.safetensors", "'model.w'", "no \"shape\"");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1]})"), "bad.safetensors", "'model.w'", "no \"data_offsets\"");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":32,"shape":[1],"data_offsets":[0,4]})"), "bad.safetensors", "'model.w'",
                       "not a string");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})"), "bad.safetensors", "'model.w'",
                       "unknown dtype \"F33\"");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})"), "'model.w'", "unknown dtype");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})"), "bad.safetensors", "'model.w'",
                       "not an array");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})"), "bad.safetensors", "'model.w'",
                       "dimension 0 = -1");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[2, 0.5],"data_offsets":[0,4]})"), "'model.w'",
                       "dimension 1 = 0.5");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1.0],"data_offsets":[0,4]})"), "'model.w'", "dimension 0");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[null],"data_offsets":[0,4]})"), "'model.w'", "dimension 0");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]})"), "'model.w'",
                       "dimension 0");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})"),
                       "bad.safetensors", "'model.w'", "overflows");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})"), "bad.safetensors", "'model.w'",
                       "not an array of two integers");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1],"data_offsets":{"0":4}})"), "'model.w'",
                       "not an array of two integers");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,"4"]})"), "bad.safetensors", "'model.w'",
                       "not non-negative integers");
  CHECK_ERROR_MENTIONS(entry(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})"), "'model.w'",
                       "not non-negative integers");
}

TEST_CASE("header: sizes and offsets") {
  const auto one = [](std::string_view offsets, std::string_view shape, std::size_t data) {
    return parse(make_bytes(fmt::format(R"({{"w":{{"dtype":"BF16","shape":{},"data_offsets":{}}}}})", shape, offsets),
                            data));
  };
  CHECK_ERROR_MENTIONS(one("[0,6]", "[2,2]", 6), "bad.safetensors", "'w'", "(8 bytes) but data_offsets [0, 6] span 6");
  CHECK_ERROR_MENTIONS(one("[8,0]", "[2,2]", 8), "bad.safetensors", "'w'", "reversed");
  CHECK_ERROR_MENTIONS(one("[0,8]", "[2,2]", 6), "bad.safetensors", "'w'", "past the end of the data section");
  CHECK_ERROR_MENTIONS(one("[2,10]", "[2,2]", 10), "bad.safetensors", "'w'", "hole");
  CHECK_ERROR_MENTIONS(one("[0,8]", "[2,2]", 11), "bad.safetensors", "'w'", "3 bytes of data follow");
  CHECK_ERROR_MENTIONS(parse(make_bytes("{}", 5)), "bad.safetensors", "declares no tensors");
  const auto two = [](std::string_view a, std::string_view b, std::size_t data) {
    return parse(make_bytes(fmt::format(R"({{"a":{{"dtype":"F32","shape":[2],"data_offsets":{}}},)"
                                        R"("b":{{"dtype":"F32","shape":[2],"data_offsets":{}}}}})",
                                        a, b),
                            data));
  };
  CHECK_ERROR_MENTIONS(two("[0,8]", "[4,12]", 12), "bad.safetensors", "'b'", "overlaps tensor 'a'");
  CHECK_ERROR_MENTIONS(two("[0,8]", "[0,8]", 8), "bad.safetensors", "overlaps", "'a'", "'b'");
  CHECK_ERROR_MENTIONS(two("[0,8]", "[12,20]", 20), "bad.safetensors", "'b'", "hole");
  // A zero-size tensor inside another one's bytes overlaps it too.
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                        R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                                        8)),
                       "'z'", "overlaps tensor 'a'");
  CHECK(two("[8,16]", "[0,8]", 16).tensors.front().name == "b");  // sorted by offset
}

TEST_CASE("header: metadata") {
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"__metadata__":{"format":"pt","step":3}})", 0)), "bad.safetensors",
                       "metadata key 'step'", "not a string");
  CHECK_ERROR_MENTIONS(parse(make_bytes(R"({"__metadata__":["pt"]})", 0)), "bad.safetensors", "__metadata__",
                       "not an object");
  CHECK(parse(make_bytes(R"({"__metadata__":null})", 0)).metadata.empty());
  const auto h = parse(make_bytes(R"({"__metadata__":{"format":"pt","x":""}})", 0));
  CHECK(h.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"x", ""}});
}

TEST_CASE("header: valid edge cases") {
  // Scalars, empty tensors, unknown fields (ignored, as the reference implementation does),
  // space padding, dtypes megatrain does not compute with.
  const auto h = parse(make_bytes(R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                                  R"("e":{"dtype":"F32","shape":[3,0],"data_offsets":[8,8]},)"
                                  R"("q":{"dtype":"F8_E4M3","shape":[3],"data_offsets":[8,11],"extra":{"k":[1]}},)"
                                  R"("m":{"dtype":"BOOL","shape":[1],"data_offsets":[11,12]}}      )",
                                  12));
  REQUIRE(h.tensors.size() == 4);
  CHECK(h.tensors[0].name == "s");
  CHECK(h.tensors[0].numel() == 1);
  CHECK(h.tensors[1].name == "e");
  CHECK(h.tensors[1].numel() == 0);
  CHECK(h.tensors[2].dtype == SafetensorsDType::f8_e4m3);
  CHECK(h.tensors[3].shape_str() == "[1]");
  CHECK(parse(make_bytes("{}", 0)).tensors.empty());
}

TEST_CASE("SafetensorsFile::open: errors name the file; moves keep views valid") {
  TempDir dir;
  const auto short_file = dir / "short.safetensors";
  write_text(short_file, "abc");
  CHECK_ERROR_MENTIONS(SafetensorsFile::open(short_file), short_file.string().c_str(), "too short");
  const auto empty_file = dir / "empty.safetensors";
  write_text(empty_file, "");
  CHECK_ERROR_MENTIONS(SafetensorsFile::open(empty_file), empty_file.string().c_str(), "0 bytes long");
  const auto bad = dir / "bad.safetensors";
  const auto bytes = make_bytes(R"({"layer.w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 4);
  write_text(bad, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  CHECK_ERROR_MENTIONS(SafetensorsFile::open(bad), bad.string().c_str(), "'layer.w'", "span 4 bytes");
  CHECK_ERROR_MENTIONS(SafetensorsFile::open(dir / "missing.safetensors"), "missing.safetensors", "cannot open");
  CHECK_ERROR_MENTIONS(SafetensorsFile::open(dir.path()), dir.path().string().c_str(), "not a regular file");

  Source s{"w", {3, 5}, SafetensorsDType::f32, random_floats(15)};
  const std::vector<TensorToWrite> t = {s.to_write()};
  write_safetensors(dir / "ok.safetensors", t);
  auto a = SafetensorsFile::open(dir / "ok.safetensors");
  const TensorInfo* info = a.find("w");
  REQUIRE(info != nullptr);
  CHECK(a.find("v") == nullptr);
  CHECK_ERROR_MENTIONS(a.tensor("v"), "ok.safetensors", "'v'");
  SafetensorsFile b = std::move(a);
  CHECK(b.find("w") == info);  // the same TensorInfo: references survive moves
  std::vector<float> out(15);
  read_into(TensorRef(b, *info), View<float>(std::span<float>(out), Shape{3, 5}));
  CHECK(std::equal(out.begin(), out.end(), s.values.begin(), same_bits));
  auto c = SafetensorsFile::open(dir / "ok.safetensors");
  CHECK_ERROR_MENTIONS(c.view(*info), "'w'", "does not belong");
  c = std::move(b);
  CHECK(c.view(*info).bytes.size() == 60);
}

// ---- read_into ----------------------------------------------------------------------------------

TEST_CASE("read_into: shape, contiguity and dtype are checked before anything is written") {
  TempDir dir;
  const auto f = random_floats(12);
  const std::vector<std::int32_t> ints = {1, 2, 3, 4};
  std::vector<TensorToWrite> t;
  t.emplace_back("model.w", View<const float>(std::span<const float>(f), Shape{3, 4}), SafetensorsDType::bf16);
  t.emplace_back("ids", View<const std::int32_t>(std::span<const std::int32_t>(ints), Shape{4}));
  const auto path = dir / "r.safetensors";
  write_safetensors(path, t);
  const auto ckpt = SafetensorsCheckpoint::open(path);

  std::vector<float> dst(12, 42.0f);
  CHECK_ERROR_MENTIONS(read_into(ckpt.tensor("model.w"), View<float>(std::span<float>(dst), Shape{4, 3})),
                       "'model.w'", path.string().c_str(), "has shape [3, 4] but the destination has shape [4, 3]");
  CHECK_ERROR_MENTIONS(read_into(ckpt.tensor("model.w"), View<float>(std::span<float>(dst), Shape{12})), "'model.w'",
                       "[12]");
  CHECK_ERROR_MENTIONS(read_into(ckpt.tensor("model.w"), View<float>(std::span<float>(dst), Shape{1, 3, 4})),
                       "'model.w'", "[1, 3, 4]");
  const View<float> transposed(std::span<float>(dst), Shape{3, 4}, Strides{1, 3, 0, 0}, 0);
  CHECK_ERROR_MENTIONS(read_into(ckpt.tensor("model.w"), transposed), "'model.w'", "not contiguous");
  std::vector<float> four(4, 42.0f);
  CHECK_ERROR_MENTIONS(read_into(ckpt.tensor("ids"), View<float>(std::span<float>(four), Shape{4})), "'ids'",
                       path.string().c_str(), "I32");
  CHECK(std::all_of(dst.begin(), dst.end(), [](float x) { return x == 42.0f; }));
  CHECK(std::all_of(four.begin(), four.end(), [](float x) { return x == 42.0f; }));
  // Raw access still works for dtypes read_into does not convert.
  const auto raw = ckpt.tensor("ids").bytes();
  CHECK(raw.dtype == SafetensorsDType::i32);
  REQUIRE(raw.bytes.size() == 16);
  CHECK(std::memcmp(raw.bytes.data(), ints.data(), 16) == 0);
  CHECK_ERROR_MENTIONS(read_into(TensorRef{}, View<float>(std::span<float>(four), Shape{4})), "empty TensorRef");
}

// ---- sharded checkpoints: index errors ----------------------------------------------------------

TEST_CASE("sharded checkpoints: every inconsistency between index and shards is refused") {
  TempDir dir;
  const auto a = random_floats(6), b = random_floats(4), c = random_floats(5);
  const auto tensor = [](const char* name, const std::vector<float>& v) {
    return TensorToWrite(name, View<const float>(std::span<const float>(v), Shape{static_cast<std::int64_t>(v.size())}));
  };
  const std::vector<TensorToWrite> shard1 = {tensor("layers.0.w", a), tensor("layers.0.b", b)};
  const std::vector<TensorToWrite> shard2 = {tensor("layers.1.w", c)};
  write_safetensors(dir / "s1.safetensors", shard1);
  write_safetensors(dir / "s2.safetensors", shard2);
  const auto index = dir / "model.safetensors.index.json";
  const std::string idx = index.string();
  const auto write_index = [&](std::string_view weight_map) {
    write_text(index, fmt::format(R"({{"metadata": {{"total_size": 60}}, "weight_map": {}}})", weight_map));
  };

  write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.b": "s1.safetensors", "layers.1.w": "s2.safetensors"})");
  {
    const auto ckpt = SafetensorsCheckpoint::open(dir.path());
    CHECK(ckpt.sharded());
    CHECK(ckpt.size() == 3);
    CHECK(ckpt.tensor("layers.1.w").file->path() == dir / "s2.safetensors");
    std::vector<float> out(5);
    read_into(ckpt.tensor("layers.1.w"), View<float>(std::span<float>(out), Shape{5}));
    CHECK(std::equal(out.begin(), out.end(), c.begin(), same_bits));
  }
  SUBCASE("an entry whose shard lacks the tensor") {
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.b": "s1.safetensors", "layers.1.w": "s2.safetensors",
                    "layers.9.w": "s2.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "'layers.9.w'", "s2.safetensors",
                         "has no such tensor");
  }
  SUBCASE("a tensor of a shard absent from the index") {
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.1.w": "s2.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), "s1.safetensors", "'layers.0.b'", idx.c_str(),
                         "does not list");
  }
  SUBCASE("a tensor mapped to another shard") {
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.b": "s2.safetensors", "layers.1.w": "s2.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), "s1.safetensors", "'layers.0.b'",
                         "maps it to 's2.safetensors'");
  }
  SUBCASE("the same tensor in two shards") {
    const std::vector<TensorToWrite> dup = {tensor("layers.1.w", c), tensor("layers.0.b", b)};
    write_safetensors(dir / "s2.safetensors", dup);
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.b": "s1.safetensors", "layers.1.w": "s2.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), "'layers.0.b'", "two shards", "s1.safetensors",
                         "s2.safetensors");
  }
  SUBCASE("a missing shard") {
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.b": "s1.safetensors", "layers.1.w": "s3.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "'s3.safetensors'", "'layers.1.w'",
                         "does not exist");
  }
  SUBCASE("a corrupt shard") {
    write_text(dir / "s2.safetensors", "garbage!garbage!");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), "s2.safetensors", "past the end of the file");
  }
  SUBCASE("malformed index JSON") {
    write_text(index, R"({"weight_map": {"layers.0.w": "s1.safetensors",)");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "not valid JSON");
    write_text(index, R"([1, 2])");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "not an object");
    write_text(index, R"({"metadata": {}})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "no \"weight_map\"");
    write_text(index, R"({"weight_map": ["s1.safetensors"]})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "\"weight_map\" is a JSON array");
    write_text(index, R"({"metadata": 5, "weight_map": {}})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "\"metadata\"");
    write_index(R"({"layers.0.w": 1})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "'layers.0.w'", "not to a file name");
    write_index(R"({"layers.0.w": "../s1.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "'layers.0.w'", "not a plain file name");
    write_index(R"({"layers.0.w": "s1.safetensors", "layers.0.w": "s2.safetensors"})");
    CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), idx.c_str(), "'layers.0.w' twice");
  }
}

TEST_CASE("SafetensorsCheckpoint::open: what a path may be") {
  TempDir dir;
  CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir / "nothing"), "nothing", "does not exist");
  CHECK_ERROR_MENTIONS(SafetensorsCheckpoint::open(dir.path()), dir.path().string().c_str(),
                       "neither model.safetensors.index.json nor model.safetensors");
}

// ---- writing: validation and atomicity ----------------------------------------------------------

TEST_CASE("write_safetensors: invalid input is refused before any file is touched") {
  TempDir dir;
  const auto target = dir / "model.safetensors";
  Source good{"w", {4, 4}, SafetensorsDType::bf16, random_floats(16)};
  const std::vector<TensorToWrite> ok = {good.to_write()};
  write_safetensors(target, ok);
  const std::string before = read_file(target);
  const std::string tgt = target.string();

  const auto f = random_floats(8);
  const View<const float> v8(std::span<const float>(f), Shape{8});
  std::vector<TensorToWrite> t;
  SUBCASE("empty name") { t = {good.to_write(), TensorToWrite("", v8)}; }
  SUBCASE("reserved name") { t = {TensorToWrite("__metadata__", v8)}; }
  SUBCASE("duplicate name") { t = {good.to_write(), TensorToWrite("w", v8)}; }
  SUBCASE("name not UTF-8") { t = {TensorToWrite("bad\xff", v8)}; }
  SUBCASE("shape inconsistent with the source") {
    t = {good.to_write(), TensorToWrite("x", v8)};
    t.back().shape = {3, 3};
  }
  SUBCASE("negative dimension") {
    t = {TensorToWrite("x", std::vector<std::int64_t>{-1, 2}, SafetensorsDType::f32, [](std::int64_t, std::span<float>) {})};
  }
  SUBCASE("unsupported conversion") {
    const std::vector<std::int32_t> ints(8, 1);
    t = {TensorToWrite("x", View<const std::int32_t>(std::span<const std::int32_t>(ints), Shape{8}), SafetensorsDType::f32)};
  }
  SUBCASE("double rounding") {
    const std::vector<double> d(8, 0.1);
    t = {TensorToWrite("x", View<const double>(std::span<const double>(d), Shape{8}), SafetensorsDType::bf16)};
  }
  SUBCASE("non-contiguous source") {
    t = {TensorToWrite("x", View<const float>(std::span<const float>(f), Shape{2, 4}, Strides{1, 2, 0, 0}, 0))};
  }
  SUBCASE("producer for an integer dtype") {
    t = {TensorToWrite("x", std::vector<std::int64_t>{2}, SafetensorsDType::i32, [](std::int64_t, std::span<float>) {})};
  }
  SUBCASE("empty producer") { t = {TensorToWrite("x", std::vector<std::int64_t>{2}, SafetensorsDType::f32, {})}; }
  SUBCASE("stored bytes of another size than the shape's") {
    const std::vector<std::int64_t> dims{3, 3};
    t = {TensorToWrite("x", TensorBytes{std::as_bytes(std::span<const float>(f)), SafetensorsDType::f32, dims})};
  }
  CHECK_ERROR_MENTIONS(write_safetensors(target, t), tgt.c_str(), "cannot write");
  CHECK(read_file(target) == before);
  CHECK(listing(dir.path()) == std::set<std::string>{"model.safetensors"});
  CHECK_ERROR_MENTIONS(write_safetensors(target, ok, {{"k", "bad\xfe"}}), tgt.c_str(), "metadata key 'k'");
  CHECK_ERROR_MENTIONS(write_safetensors(dir / "no" / "such.safetensors", ok), "does not exist");
  CHECK_ERROR_MENTIONS(write_safetensors(dir.path(), ok), "is a directory");
  CHECK(read_file(target) == before);
}

TEST_CASE("write_safetensors: a failure midway leaves the existing file untouched") {
  TempDir dir;
  const auto target = dir / "model.safetensors";
  Source good{"w", {4, 4}, SafetensorsDType::bf16, random_floats(16)};
  const std::vector<TensorToWrite> ok = {good.to_write()};
  write_safetensors(target, ok);
  const std::string before = read_file(target);

  // A producer that fails after some chunks have been written to the temporary file.
  std::int64_t calls = 0;
  const auto failing = [&](std::int64_t first, std::span<float> out) {
    if (++calls == 3) throw std::runtime_error("source went away");
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(first) + static_cast<float>(i);
  };
  const std::vector<TensorToWrite> t = {good.to_write(),
                                        TensorToWrite("big", std::vector<std::int64_t>{100000}, SafetensorsDType::f32, failing)};
  CHECK_THROWS_WITH_AS(write_safetensors(target, t), "source went away", std::runtime_error);
  CHECK(calls == 3);
  CHECK(read_file(target) == before);
  CHECK(listing(dir.path()) == std::set<std::string>{"model.safetensors"});  // no temporary left
  check_contents(SafetensorsCheckpoint::open(target), {good});
}

TEST_CASE("write_safetensors_sharded: replacing an existing checkpoint directory") {
  TempDir dir;
  const auto target = dir / "ckpt";
  const auto sources = random_sources();
  const auto tensors = to_write(sources);
  ShardedWriteOptions three;
  three.max_shard_bytes = 20000;
  write_safetensors_sharded(target, tensors, three);
  write_text(target / "config.json", R"({"hidden_size": 72})");
  write_text(target / "tokenizer.json", "{}");
  fs::create_symlink("config.json", target / "alias.json");
  const auto before = snapshot(target);
  REQUIRE(before.size() >= 6);

  SUBCASE("a producer that throws in the last shard leaves the directory untouched") {
    auto t = tensors;
    t.back() = TensorToWrite(t.back().name, t.back().shape, SafetensorsDType::f32,
                             [](std::int64_t, std::span<float>) { throw std::runtime_error("export interrupted"); });
    CHECK_THROWS_WITH_AS(write_safetensors_sharded(target, t, three), "export interrupted", std::runtime_error);
    CHECK(snapshot(target) == before);
    CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
  }
  SUBCASE("invalid input leaves the directory untouched") {
    auto t = tensors;
    t[1].name = t[0].name;
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(target, t, three), target.string().c_str(), "given twice");
    ShardedWriteOptions bad = three;
    bad.extra_files = {{"../escape.json", "{}"}};
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(target, tensors, bad), "'../escape.json'", "plain file name");
    bad.extra_files = {{"model.safetensors.index.json", "{}"}};
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(target, tensors, bad), "clash");
    bad = three;
    bad.max_shard_bytes = 0;
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(target, tensors, bad), "positive");
    CHECK(snapshot(target) == before);
    CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
  }
  SUBCASE("a directory holding a subdirectory is refused, untouched") {
    fs::create_directory(target / "subdir");
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(target, tensors, three), target.string().c_str(), "'subdir'");
    CHECK(fs::is_directory(target / "subdir"));
    CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
  }
  SUBCASE("a file in the way is refused") {
    write_text(dir / "file", "x");
    CHECK_ERROR_MENTIONS(write_safetensors_sharded(dir / "file", tensors, three), "not a directory");
    CHECK(read_file(dir / "file") == "x");
  }
  SUBCASE("a successful re-export replaces the weights and keeps the other files") {
    auto changed = sources;
    for (auto& s : changed) s.values = random_floats(s.values.size());
    ShardedWriteOptions one;
    one.extra_files = {{"tokenizer.json", R"({"new": true})"}};
    write_safetensors_sharded(target, to_write(changed), one);
    CHECK(listing(target) ==
          std::set<std::string>{"model.safetensors", "config.json", "tokenizer.json", "alias.json"});
    CHECK(read_file(target / "config.json") == R"({"hidden_size": 72})");
    CHECK(read_file(target / "tokenizer.json") == R"({"new": true})");
    CHECK(fs::is_symlink(target / "alias.json"));
    CHECK(fs::read_symlink(target / "alias.json") == "config.json");
    check_contents(SafetensorsCheckpoint::open(target), changed);
    CHECK(listing(dir.path()) == std::set<std::string>{"ckpt"});
  }
}

TEST_CASE("replace_directory: the atomic exchange and the two-rename fallback") {
  TempDir dir;
  for (const bool exchange : {true, false}) {
    INFO("exchange " << exchange);
    const auto target = dir / "model", staged = dir / "model.partial-test";
    fs::create_directory(target);
    write_text(target / "a", "old");
    fs::create_directory(staged);
    write_text(staged / "a", "new");
    const fs::path old = io::detail::replace_directory(staged, target, exchange);
    CHECK(read_file(target / "a") == "new");
    REQUIRE_FALSE(old.empty());
    CHECK(read_file(old / "a") == "old");
    if (exchange) CHECK((old == staged || old.filename().string().starts_with("model.old-")));  // no RENAME_EXCHANGE
    else CHECK(old.filename().string().starts_with("model.old-"));
    fs::remove_all(old);
    fs::remove_all(target);
    // Without an existing target, a plain rename.
    fs::create_directory(staged);
    CHECK(io::detail::replace_directory(staged, target, exchange).empty());
    CHECK(fs::is_directory(target));
    CHECK_FALSE(fs::exists(staged));
    fs::remove_all(target);
  }
}
