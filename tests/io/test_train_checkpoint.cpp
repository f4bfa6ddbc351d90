// Train-state checkpoints: a sharded round trip (masters, both Adam moments and the bf16 copy,
// tensors readable by their names, the caller's unit order, unit_done, state and extra files,
// xxhsum's check of the checksums); damage refused at open (truncated or flipped shard, altered
// train_state.json, missing checksums or listed file) and a store of another model refused before
// anything is loaded; a full disk (RLIMIT_FSIZE) leaving the previous checkpoint and the store
// as they were; debris of dead writers removed and a live writer's left alone; CheckpointFolder's
// rotation and `latest` pointer; and a SIGKILL at every crash point of a save + commit, after
// which the latest checkpoint still verifies and loads and the next save succeeds.
#include <doctest/doctest.h>

#include "io_test_util.hpp"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>  // setenv
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/io/safetensors.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/store/host_param_store.hpp"

using namespace megatrain;
using namespace megatrain::io;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using megatrain::test::rng;
using megatrain::test::TempDir;

// ---- stores ---------------------------------------------------------------------------------------

/// A toy decoder: an embedding, two blocks, a head; awkward sizes so that tensors leave gaps.
/// `variant` changes the model: 1 transposes one matrix, 2 renames one tensor, 3 drops the head,
/// 4 adds a tensor.
std::vector<UnitSpec> toy_units(int variant = 0) {
  const std::int64_t h = 24, f = 40, vocab = 37;
  std::vector<UnitSpec> units;
  units.push_back({"embed", {ParamSpec::matrix("model.embed_tokens.weight", Shape{vocab, h})}});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    units.push_back({"layers." + std::to_string(l),
                     {ParamSpec::norm(p + "input_layernorm.weight", h),
                      ParamSpec::matrix(p + "self_attn.q_proj.weight", Shape{h, h}),
                      ParamSpec::bias(p + (variant == 2 && l == 1 ? "self_attn.q_proj.bias2" : "self_attn.q_proj.bias"), h),
                      ParamSpec::matrix(p + "mlp.gate_proj.weight", variant == 1 && l == 1 ? Shape{h, f} : Shape{f, h})}});
  }
  if (variant == 4) units.back().params.push_back(ParamSpec::norm("model.layers.1.post_attention_layernorm.weight", h));
  if (variant != 3)
    units.push_back({"head", {ParamSpec::norm("model.norm.weight", h), ParamSpec::matrix("lm_head.weight", Shape{vocab, h})}});
  return units;
}

HostParamStore<float> make_store(std::uint64_t seed, int variant = 0, bool optimizer_state = true) {
  StoreOptions o;
  o.seed = seed;
  o.optimizer_state = optimizer_state;
  o.grad_ring_slots = 1;
  o.pinning = Pinning::never;
  return HostParamStore<float>(toy_units(variant), o);
}

/// A random finite float (any exponent, subnormals included, both signs).
float random_float() {
  std::uint32_t bits = static_cast<std::uint32_t>(rng()());
  if ((bits & 0x7f800000u) == 0x7f800000u) bits &= ~0x40000000u;  // no inf/NaN
  return std::bit_cast<float>(bits);
}

/// Fills every slab of `store` (gaps included) with random values; the bf16 copy with random
/// bits too, so that only a refresh can make it match the masters.
void randomize(HostParamStore<float>& store) {
  for (auto& u : store.units()) {
    for (float& x : u.master()) x = random_float();
    for (float& x : u.adam_m()) x = random_float();
    for (float& x : u.adam_v()) x = random_float();
    for (bf16& x : u.compute()) x = bf16::from_bits(static_cast<std::uint16_t>(rng()()));
  }
}

/// A bitwise copy of every slab of a store.
struct Snapshot {
  std::vector<std::vector<std::uint32_t>> master, m, v;
  std::vector<std::vector<std::uint16_t>> compute;
  bool operator==(const Snapshot&) const = default;
};

std::vector<std::uint32_t> bits_of(std::span<const float> s) {
  std::vector<std::uint32_t> out(s.size());
  std::memcpy(out.data(), s.data(), s.size_bytes());
  return out;
}

Snapshot snapshot(const HostParamStore<float>& store) {
  Snapshot s;
  for (const auto& u : store.units()) {
    s.master.push_back(bits_of(u.master()));
    s.m.push_back(bits_of(u.adam_m()));
    s.v.push_back(bits_of(u.adam_v()));
    std::vector<std::uint16_t> c(u.compute().size());
    std::memcpy(c.data(), u.compute().data(), u.compute().size_bytes());
    s.compute.push_back(std::move(c));
  }
  return s;
}

/// Elements of the parameters of `store` (same layout as `want`'s store) whose master, m or v
/// differ bitwise from `want`, plus those whose bf16 copy is not bf16(master).
std::size_t param_mismatches(const HostParamStore<float>& store, const Snapshot& want) {
  std::size_t bad = 0;
  for (std::size_t ui = 0; ui < store.num_units(); ++ui) {
    const auto& u = store.unit(ui);
    const auto master = bits_of(u.master()), m = bits_of(u.adam_m()), v = bits_of(u.adam_v());
    for (const auto& p : u.params())
      for (auto i = static_cast<std::size_t>(p.offset); i < static_cast<std::size_t>(p.offset + p.numel()); ++i) {
        bad += master[i] != want.master[ui][i];
        bad += m[i] != want.m[ui][i];
        bad += v[i] != want.v[ui][i];
        bad += u.compute()[i].bits != bf16(u.master()[i]).bits;
      }
  }
  return bad;
}

/// Every tensor name in the order write_train_checkpoint writes them for `order`.
std::vector<std::string> tensor_names(const HostParamStore<float>& store, const std::vector<std::size_t>& order) {
  std::vector<std::string> out;
  for (const std::size_t u : order)
    for (const auto& p : store.unit(u).params()) {
      out.push_back(p.spec.name);
      out.push_back(p.spec.name + ".exp_avg");
      out.push_back(p.spec.name + ".exp_avg_sq");
    }
  return out;
}

// ---- files ------------------------------------------------------------------------------------

using megatrain::test::read_file;

void write_text(const fs::path& p, std::string_view s) { megatrain::test::write_file(p, s); }

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

/// Names in `dir` of a writer's temporary entries (`.partial-`, `.old-`, `.trash-`).
std::vector<std::string> debris_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& name : listing(dir))
    if (name.find(".partial-") != std::string::npos || name.find(".old-") != std::string::npos ||
        name.find(".trash-") != std::string::npos)
      out.push_back(name);
  return out;
}

void flip_bit(const fs::path& p, std::size_t byte, int bit) {
  std::string s = read_file(p);
  REQUIRE(byte < s.size());
  s[byte] = static_cast<char>(s[byte] ^ (1 << bit));
  write_text(p, s);
}

void copy_folder(const fs::path& from, const fs::path& to) { fs::copy(from, to, fs::copy_options::recursive); }

/// The shard files of a checkpoint folder, in order.
std::vector<fs::path> shards_of(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& name : listing(dir))
    if (name.ends_with(".safetensors")) out.push_back(dir / name);
  return out;
}

/// Saves `store` as the checkpoint of `step` in `folder`; state {"step": step, "tag": tag}. Uses
/// no doctest macro (it runs in forked children too).
void save(const CheckpointFolder& folder, std::int64_t step, const HostParamStore<float>& store,
          const std::string& tag = "") {
  TrainCheckpointWriteOptions o;
  o.state = {{"step", step}, {"tag", tag}};
  o.extra_files = {{"config.json", "{\"model_type\": \"toy\"}\n"}};
  o.max_shard_bytes = 8192;
  write_train_checkpoint(folder.path_for(step), store, o);
}

/// Opens and verifies the checkpoint at `dir`, checks its step, loads it into a fresh store and
/// checks the values against `want`.
void check_loads(const fs::path& dir, std::int64_t step, const Snapshot& want) {
  const TrainCheckpoint ck = TrainCheckpoint::open(dir);
  CHECK(ck.state().at("step") == step);
  auto other = make_store(99);
  randomize(other);
  ck.load_into(other);
  CHECK(param_mismatches(other, want) == 0);
}

/// Sets RLIMIT_FSIZE (and ignores SIGXFSZ, so that a write past it fails with EFBIG instead of
/// killing the process) for its lifetime.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_) == 0);
    rlimit l = old_;
    l.rlim_cur = bytes;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &l) == 0);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = SIG_DFL;
};

bool have_xxhsum() { return std::system("command -v xxhsum >/dev/null 2>&1") == 0; }

std::string quoted(const fs::path& p) {
  std::string out = "'";
  for (const char c : p.string()) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

// ---- round trip -----------------------------------------------------------------------------------

TEST_CASE("train checkpoint round trip: sharded, in the caller's unit order, bitwise") {
  TempDir tmp;
  auto store = make_store(1);
  randomize(store);
  for (auto& u : store.units()) store.sync_compute(u);
  const Snapshot want = snapshot(store);

  std::vector<std::size_t> order(store.num_units());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng());
  CAPTURE(fmt::format("{}", fmt::join(order, ",")));

  const json state = {{"step", 1234}, {"lr", 3e-4}, {"data", {{"epoch", 2}, {"offset", 987654321}}}};
  const std::string config = "{\"model_type\": \"toy\", \"hidden_size\": 24}\n";
  std::vector<std::size_t> announced;
  TrainCheckpointWriteOptions o;
  o.state = state;
  o.extra_files = {{"config.json", config}, {"notes.txt", "hello\n"}};
  o.unit_order = order;
  o.unit_done = [&](std::size_t u) { announced.push_back(u); };
  o.max_shard_bytes = 8192;
  const fs::path dir = tmp / "ck";
  const auto written = write_train_checkpoint(dir, store, o);

  CHECK(announced == order);
  CHECK(snapshot(store) == want);  // writing does not touch the store
  CHECK(debris_in(tmp.path()).empty());

  // The files: shards, the index, the state, the extras, the checksums, nothing else; the
  // checksums list every other one with the digest the writer returned.
  const auto shards = shards_of(dir);
  REQUIRE(shards.size() > 2);
  std::set<std::string> expect_files = {"train-state.safetensors.index.json", "train_state.json", "config.json",
                                        "notes.txt", "checksums.xxh128"};
  for (const auto& s : shards) expect_files.insert(s.filename().string());
  CHECK(listing(dir) == expect_files);
  std::string expect_sums;
  for (const auto& f : written) {
    CHECK(f.bytes == fs::file_size(dir / f.name));
    CHECK(f.digest == digest_file(dir / f.name));
    if (f.name != "checksums.xxh128") expect_sums += f.digest.hex() + "  " + f.name + "\n";
  }
  CHECK(written.size() == expect_files.size());
  CHECK(read_file(dir / "checksums.xxh128") == expect_sums);

  const TrainCheckpoint ck = TrainCheckpoint::open(dir);
  CHECK(ck.dir() == dir);
  CHECK(ck.state() == state);
  CHECK(ck.file("config.json") == config);
  CHECK(ck.file("notes.txt") == "hello\n");
  CHECK(ck.file("train_state.json").has_value());
  CHECK_FALSE(ck.file("tokenizer.json").has_value());
  std::uint64_t shard_bytes = 0;
  for (const auto& s : shards) shard_bytes += fs::file_size(s);
  CHECK(ck.tensor_bytes() == shard_bytes);

  // Loaded into a store of the same model holding other values: bitwise equal, bf16 refreshed.
  auto other = make_store(2);
  randomize(other);
  REQUIRE(param_mismatches(other, want) > 0);
  ck.load_into(other);
  CHECK(param_mismatches(other, want) == 0);

  // The tensors under their names, in the order given, shard after shard.
  const auto sc = SafetensorsCheckpoint::open(dir / "train-state.safetensors.index.json");
  CHECK(sc.sharded());
  const auto names = tensor_names(store, order);
  CHECK(sc.size() == names.size());
  std::vector<std::string> in_file_order;
  for (const auto& f : sc.files()) {
    CHECK(f.metadata().at("format") == "megatrain-train-state");
    for (const auto& t : f.tensors()) in_file_order.push_back(t.name);
  }
  CHECK(in_file_order == names);
  for (const auto& u : store.units())
    for (const auto& p : u.params()) {
      const std::pair<std::string, std::span<float>> kinds[] = {
          {p.spec.name, u.master()}, {p.spec.name + ".exp_avg", u.adam_m()}, {p.spec.name + ".exp_avg_sq", u.adam_v()}};
      for (const auto& [name, slab] : kinds) {
        CAPTURE(name);
        const auto ref = sc.find(name);
        REQUIRE(ref.has_value());
        CHECK(ref->info->dtype == SafetensorsDType::f32);
        CHECK(std::equal(ref->info->shape.begin(), ref->info->shape.end(), p.spec.shape.dims().begin(),
                         p.spec.shape.dims().end()));
        const auto bytes = ref->bytes().bytes;
        REQUIRE(bytes.size() == static_cast<std::size_t>(p.numel()) * 4);
        CHECK(std::memcmp(bytes.data(), slab.data() + p.offset, bytes.size()) == 0);
      }
    }

  if (have_xxhsum()) {
    const std::string cmd = "cd " + quoted(dir) + " && xxhsum -H2 -c checksums.xxh128 >/dev/null 2>&1";
    CHECK(std::system(cmd.c_str()) == 0);
    flip_bit(dir / "config.json", 3, 1);  // and it does notice a change
    CHECK(std::system(cmd.c_str()) != 0);
  } else {
    MESSAGE("xxhsum is not on PATH: the check of checksums.xxh128 with xxhsum -H2 -c is skipped");
  }
}

TEST_CASE("train checkpoint: a small one is one safetensors file; default order is the store's") {
  TempDir tmp;
  auto store = make_store(3);
  randomize(store);
  const Snapshot want = snapshot(store);
  std::vector<std::size_t> announced;
  TrainCheckpointWriteOptions o;
  o.unit_done = [&](std::size_t u) { announced.push_back(u); };
  write_train_checkpoint(tmp / "ck", store, o);
  CHECK(announced == std::vector<std::size_t>{0, 1, 2, 3});
  CHECK(listing(tmp / "ck") == std::set<std::string>{"train-state.safetensors", "train_state.json", "checksums.xxh128"});
  const auto ck = TrainCheckpoint::open(tmp / "ck");
  CHECK(ck.state() == json::object());
  auto other = make_store(4);
  randomize(other);
  ck.load_into(other);
  CHECK(param_mismatches(other, want) == 0);
  const auto sc = SafetensorsCheckpoint::open(tmp / "ck" / "train-state.safetensors");
  std::vector<std::string> in_order;
  for (const auto& t : sc.files()[0].tensors()) in_order.push_back(t.name);
  CHECK(in_order == tensor_names(store, {0, 1, 2, 3}));
}

TEST_CASE("train checkpoint: a store without the optimizer state loads the masters alone, and writes none") {
  TempDir tmp;
  auto store = make_store(3);
  randomize(store);
  write_train_checkpoint(tmp / "ck", store, {});
  auto bare = make_store(4, 0, false);
  REQUIRE_FALSE(bare.has_optimizer_state());
  TrainCheckpoint::open(tmp / "ck").load_into(bare);
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    CAPTURE(u);
    for (const auto& p : store.unit(u).params()) {  // (each parameter's elements; the gaps between are not saved)
      const auto a = store.unit(u).master().subspan(static_cast<std::size_t>(p.offset), static_cast<std::size_t>(p.numel()));
      const auto b = bare.unit(u).master().subspan(static_cast<std::size_t>(p.offset), static_cast<std::size_t>(p.numel()));
      CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end(), [](float x, float y) {
        return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
      }));
      for (std::size_t i = 0; i < b.size(); ++i)  // (the bf16 copy refreshed from them)
        CHECK(static_cast<float>(bare.unit(u).compute()[static_cast<std::size_t>(p.offset) + i]) == static_cast<float>(bf16(b[i])));
    }
    CHECK(bare.unit(u).adam_m().empty());
  }
  CHECK_ERROR_MENTIONS(write_train_checkpoint(tmp / "ck2", bare, {}), "StoreOptions::optimizer_state false");
  CHECK_FALSE(fs::exists(tmp / "ck2"));
}

TEST_CASE("train checkpoint: bad requests are refused before anything is written") {
  TempDir tmp;
  auto store = make_store(5);
  const fs::path dir = tmp / "ck";
  TrainCheckpointWriteOptions o;
  o.unit_order = {0, 1, 1, 3};
  CHECK_ERROR_MENTIONS(write_train_checkpoint(dir, store, o), dir.string(), "unit order");
  o.unit_order = {0, 1, 2};
  CHECK_ERROR_MENTIONS(write_train_checkpoint(dir, store, o), "unit order");
  o.unit_order = {};
  o.extra_files = {{"train_state.json", "{}"}};
  CHECK_ERROR_MENTIONS(write_train_checkpoint(dir, store, o), "train_state.json");
  o.extra_files = {{"checksums.xxh128", ""}};
  CHECK_ERROR_MENTIONS(write_train_checkpoint(dir, store, o), "checksums.xxh128");
  o.extra_files = {};
  o.state = json::array({1, 2});
  CHECK_ERROR_MENTIONS(write_train_checkpoint(dir, store, o), "JSON object");
  CHECK(listing(tmp.path()).empty());
}

// ---- damage -----------------------------------------------------------------------------------

TEST_CASE("train checkpoint: damage is refused at open, naming the file") {
  TempDir tmp;
  auto store = make_store(6);
  randomize(store);
  TrainCheckpointWriteOptions o;
  o.state = {{"step", 7}};
  o.extra_files = {{"config.json", "{}\n"}};
  o.max_shard_bytes = 8192;
  const fs::path good = tmp / "good";
  write_train_checkpoint(good, store, o);
  REQUIRE_NOTHROW(TrainCheckpoint::open(good));
  const auto shards = shards_of(good);
  REQUIRE(shards.size() > 2);
  std::uniform_int_distribution<std::size_t> pick(0, shards.size() - 1);
  const std::string shard = shards[pick(rng())].filename().string();
  CAPTURE(shard);
  int n = 0;
  const auto fresh = [&] {
    const fs::path d = tmp / ("bad" + std::to_string(n++));
    copy_folder(good, d);
    REQUIRE_NOTHROW(TrainCheckpoint::open(d));
    return d;
  };

  SUBCASE("a shard one byte short") {
    const fs::path d = fresh();
    fs::resize_file(d / shard, fs::file_size(d / shard) - 1);
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), (d / shard).string(), "checksum", "damaged");
    CHECK_NOTHROW(TrainCheckpoint::open(d, /*verify=*/false));
  }
  SUBCASE("one bit flipped in the middle of a shard") {
    const fs::path d = fresh();
    std::uniform_int_distribution<int> bit(0, 7);
    flip_bit(d / shard, fs::file_size(d / shard) / 2, bit(rng()));
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), (d / shard).string(), "checksum");
  }
  SUBCASE("one bit flipped in train_state.json") {
    const fs::path d = fresh();
    const std::string text = read_file(d / "train_state.json");
    const auto seven = text.find('7');
    REQUIRE(seven != std::string::npos);
    flip_bit(d / "train_state.json", seven, 0);  // "step": 7 -> 6: still valid JSON, only the digest tells
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), (d / "train_state.json").string(), "checksum");
  }
  SUBCASE("no checksums.xxh128") {
    const fs::path d = fresh();
    fs::remove(d / "checksums.xxh128");
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), d.string(), "checksums.xxh128", "incomplete",
                         "not a megatrain train-state checkpoint");
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d, false), "checksums.xxh128", "incomplete");
  }
  SUBCASE("checksums.xxh128 lists a file that is not there") {
    const fs::path d = fresh();
    fs::remove(d / "config.json");
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), d.string(), "'config.json'", "checksums.xxh128");
    const fs::path e = fresh();
    std::string sums = read_file(e / "checksums.xxh128");
    sums += std::string(32, 'a') + "  optimizer-extra.bin\n";
    write_text(e / "checksums.xxh128", sums);
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(e), "'optimizer-extra.bin'", "checksums.xxh128");
  }
  SUBCASE("checksums.xxh128 leaves a shard out") {
    const fs::path d = fresh();
    std::string sums = read_file(d / "checksums.xxh128"), kept;
    for (std::size_t pos = 0; pos < sums.size();) {
      const auto nl = sums.find('\n', pos);
      const std::string line = sums.substr(pos, nl + 1 - pos);
      if (line.find(shard) == std::string::npos) kept += line;
      pos = nl + 1;
    }
    REQUIRE(kept.size() < sums.size());
    write_text(d / "checksums.xxh128", kept);
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), shard, "not listed");
  }
  SUBCASE("checksums.xxh128 itself truncated or garbled") {
    const fs::path d = fresh();
    std::string sums = read_file(d / "checksums.xxh128");
    write_text(d / "checksums.xxh128", sums.substr(0, sums.size() - 1));
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), "checksums.xxh128", "truncated");
    write_text(d / "checksums.xxh128", "zz" + sums.substr(2));
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d), "checksums.xxh128", "line 1");
  }
  SUBCASE("train_state.json holding a number beyond a double's range (found by fuzzing)") {
    // (nlohmann reports it as out_of_range, not as a parse error: it once escaped as that)
    const fs::path d = fresh();
    std::string text = read_file(d / "train_state.json");
    text.replace(text.find('7'), 1, "1e400");
    write_text(d / "train_state.json", text);
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(d, /*verify=*/false), "train_state.json", "malformed JSON", "1e400");
  }
}

TEST_CASE("train checkpoint: a store of another model is refused before anything changes") {
  TempDir tmp;
  auto store = make_store(7);
  randomize(store);
  write_train_checkpoint(tmp / "ck", store, {});
  const auto ck = TrainCheckpoint::open(tmp / "ck");
  const std::pair<int, std::string> variants[] = {{1, "model.layers.1.mlp.gate_proj.weight"},
                                                  {2, "model.layers.1.self_attn.q_proj.bias2"},
                                                  {3, "holds 33 tensors, the model needs 27"},
                                                  {4, "model.layers.1.post_attention_layernorm.weight"}};
  for (const auto& [variant, mention] : variants) {
    CAPTURE(variant);
    auto other = make_store(8, variant);
    randomize(other);
    const Snapshot before = snapshot(other);
    CHECK_ERROR_MENTIONS(ck.load_into(other), mention, (tmp / "ck").string());
    CHECK(snapshot(other) == before);
  }
}

TEST_CASE("train checkpoint: a NaN or an infinity in a weight or a moment is refused before anything changes, naming it") {
  TempDir tmp;
  struct Plant {
    const char* tensor;  // where the value goes (a master, or a moment)
    float value;
    std::string mention;
  };
  const Plant plants[] = {
      {"model.layers.1.mlp.gate_proj.weight", std::numeric_limits<float>::quiet_NaN(), "model.layers.1.mlp.gate_proj.weight'"},
      {"model.embed_tokens.weight.exp_avg", std::numeric_limits<float>::infinity(), "model.embed_tokens.weight.exp_avg'"},
      {"model.norm.weight.exp_avg_sq", -std::numeric_limits<float>::infinity(), "model.norm.weight.exp_avg_sq'"}};
  int k = 0;
  for (const Plant& p : plants) {
    CAPTURE(p.tensor);
    auto store = make_store(7);
    randomize(store);
    const std::string name(p.tensor);
    const auto strip = [&](std::string_view suffix) { return name.substr(0, name.size() - suffix.size()); };
    auto view = name.ends_with(".exp_avg_sq") ? store.adam_v(strip(".exp_avg_sq"))
                : name.ends_with(".exp_avg")  ? store.adam_m(strip(".exp_avg"))
                                              : store.master(name);
    view.data()[view.numel() - 1] = p.value;
    // (a diverged run's state: written with valid checksums)
    const auto dir = tmp / fmt::format("ck{}", k++);
    write_train_checkpoint(dir, store, {});
    auto other = make_store(8);
    randomize(other);
    const Snapshot before = snapshot(other);
    CHECK_ERROR_MENTIONS(TrainCheckpoint::open(dir).load_into(other), p.mention, "non-finite", dir.string());
    CHECK(snapshot(other) == before);
  }
}

// ---- a full disk ----------------------------------------------------------------------------------

TEST_CASE("train checkpoint: a full disk fails naming the file and leaves the previous checkpoint") {
  TempDir tmp;
  auto store = make_store(9);
  randomize(store);
  const Snapshot first = snapshot(store);
  TrainCheckpointWriteOptions o;
  o.state = {{"step", 1}};
  o.max_shard_bytes = 8192;
  const fs::path dir = tmp / "ck";
  write_train_checkpoint(dir, store, o);
  const auto before_files = listing(dir);
  const std::string before_sums = read_file(dir / "checksums.xxh128");

  randomize(store);
  const Snapshot second = snapshot(store);
  REQUIRE_FALSE(second == first);
  std::vector<std::size_t> announced;
  o.state = {{"step", 2}};
  o.unit_done = [&](std::size_t u) { announced.push_back(u); };
  std::string message;
  bool threw_other = false;
  {
    const FileSizeLimit limit(4096);  // below one shard (8 KB of data)
    try {
      write_train_checkpoint(dir, store, o);
    } catch (const Error& e) {
      message = e.what();
    } catch (...) {
      threw_other = true;
    }
  }
  CHECK_FALSE(threw_other);
  CAPTURE(message);
  CHECK(message.find("File too large") != std::string::npos);
  CHECK(message.find("train-state-00001-of-") != std::string::npos);
  CHECK(message.find(".partial-") != std::string::npos);  // the file, where it was being written
  // unit_done hears of every unit, once, even though the write failed.
  std::sort(announced.begin(), announced.end());
  CHECK(announced == std::vector<std::size_t>{0, 1, 2, 3});

  CHECK(snapshot(store) == second);
  CHECK(debris_in(tmp.path()).empty());
  CHECK(listing(tmp.path()) == std::set<std::string>{"ck"});
  CHECK(listing(dir) == before_files);
  CHECK(read_file(dir / "checksums.xxh128") == before_sums);
  check_loads(dir, 1, first);

  // And with room again, the same write succeeds.
  write_train_checkpoint(dir, store, o);
  check_loads(dir, 2, second);
}

// ---- debris -----------------------------------------------------------------------------------

TEST_CASE("debris of dead writers is removed; a live writer's is left alone") {
  TempDir tmp;
  const fs::path root = tmp.path();
  const auto make_dead_dir = [](const fs::path& p) {
    fs::create_directory(p);
    write_text(p / "half-written.safetensors", "junk");
  };
  auto store = make_store(10);
  randomize(store);

  SUBCASE("write_train_checkpoint, write_safetensors_sharded and write_safetensors clean up first") {
    const fs::path ck = root / "ck";
    make_dead_dir(root / "ck.partial-0123abcd");
    make_dead_dir(root / "ck.trash-89abcdef");
    write_train_checkpoint(ck, store, {});
    CHECK(listing(root) == std::set<std::string>{"ck"});
    CHECK_NOTHROW(TrainCheckpoint::open(ck));

    std::vector<float> values(100);
    for (auto& x : values) x = random_float();
    const std::vector<TensorToWrite> tensors = {
        TensorToWrite("w", View<const float>(std::span<const float>(values), Shape{10, 10}))};
    const fs::path model = root / "model";
    write_safetensors_sharded(model, tensors);
    make_dead_dir(root / "model.partial-0123abcd");
    make_dead_dir(root / "model.trash-89abcdef");
    make_dead_dir(root / "model.old-00000001");  // the target exists: removed
    write_safetensors_sharded(model, tensors);
    CHECK(listing(root) == std::set<std::string>{"ck", "model"});
    CHECK(SafetensorsCheckpoint::open(model).contains("w"));

    write_text(root / "x.safetensors.partial-deadbeef", "junk");
    write_safetensors(root / "x.safetensors", tensors);
    CHECK(listing(root) == std::set<std::string>{"ck", "model", "x.safetensors"});
    CHECK(SafetensorsFile::open(root / "x.safetensors").find("w") != nullptr);
  }

  SUBCASE("a folder left as .old- by a crash between two renames is restored, its other files carried") {
    // An export killed after moving the previous folder aside and before moving the new one in
    // leaves no target and `model.old-*` (with the user's tokenizer files). The next export to
    // the same target puts the old folder back first, so the tokenizer is carried, not lost.
    std::vector<float> values(60);
    for (auto& x : values) x = random_float();
    const std::vector<TensorToWrite> tensors = {
        TensorToWrite("w", View<const float>(std::span<const float>(values), Shape{6, 10}))};
    const fs::path model = root / "model", old = root / "model.old-0badcafe";
    write_safetensors_sharded(old, tensors);
    write_text(old / "tokenizer.json", "{\"model\": {}}");
    REQUIRE_FALSE(fs::exists(model));
    write_safetensors_sharded(model, tensors);
    CHECK(listing(root) == std::set<std::string>{"model"});
    CHECK(read_file(model / "tokenizer.json") == "{\"model\": {}}");
    CHECK(SafetensorsCheckpoint::open(model).contains("w"));
  }

  SUBCASE("a live writer's partial stays until its lock is gone") {
    const fs::path ck = root / "ck";
    const fs::path live = root / "ck.partial-feedface";
    make_dead_dir(live);
    const int fd = ::open(live.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX) == 0);
    CHECK(io::detail::remove_debris(ck).empty());
    CHECK(fs::exists(live / "half-written.safetensors"));
    write_train_checkpoint(ck, store, {});  // another writer of the same target leaves it too
    CHECK(fs::exists(live / "half-written.safetensors"));
    CHECK(io::detail::remove_debris_in(root).empty());
    CHECK(fs::exists(live));
    ::close(fd);
    CHECK(io::detail::remove_debris(ck) == std::vector<std::string>{"ck.partial-feedface"});
    CHECK_FALSE(fs::exists(live));
    CHECK(listing(root) == std::set<std::string>{"ck"});
  }

  SUBCASE("an .old- folder is put back when its target is missing, removed otherwise") {
    const fs::path ck = root / "ck";
    fs::create_directory(root / "ck.old-00000001");
    write_text(root / "ck.old-00000001" / "marker", "previous");
    CHECK(io::detail::remove_debris(ck) == std::vector<std::string>{"ck.old-00000001"});
    CHECK(listing(root) == std::set<std::string>{"ck"});
    CHECK(read_file(ck / "marker") == "previous");

    fs::create_directory(root / "ck.old-00000002");
    write_text(root / "ck.old-00000002" / "marker", "older");
    CHECK(io::detail::remove_debris(ck) == std::vector<std::string>{"ck.old-00000002"});
    CHECK(listing(root) == std::set<std::string>{"ck"});
    CHECK(read_file(ck / "marker") == "previous");

    // With a dead writer's partial and an .old- both there (a crash in the two-rename fallback):
    // the partial goes, the old comes back.
    fs::rename(ck, root / "ck.old-0000000a");
    make_dead_dir(root / "ck.partial-0000000b");
    CHECK(io::detail::remove_debris(ck).size() == 2);
    CHECK(listing(root) == std::set<std::string>{"ck"});
    CHECK(read_file(ck / "marker") == "previous");
  }

  SUBCASE("names that only look like debris are not touched") {
    const fs::path ck = root / "ck";
    const std::vector<std::string> others = {"ck.partial-xyz",       "ck.partial-0123ABCD",  "ck.partial-0123abc",
                                             "ck.partial-0123abcde", "ck.partial-0123abcg",  "xck.partial-0123abcd",
                                             "other.partial-0123abcd", "ck.x.partial-0123abcd", "ck.part-0123abcd",
                                             "ck.partial0123abcd",   "ck.old-0123abc",       "ck.trash-"};
    for (const auto& name : others) make_dead_dir(root / name);
    write_text(root / "ck.partial-00000000", "a dead writer's file");  // this one matches
    std::set<std::string> expect(others.begin(), others.end());
    CHECK(io::detail::remove_debris(ck) == std::vector<std::string>{"ck.partial-00000000"});
    CHECK(listing(root) == expect);
    write_train_checkpoint(ck, store, {});
    expect.insert("ck");
    CHECK(listing(root) == expect);
    // remove_debris_in cleans every target's: only other.partial-0123abcd, xck.partial-0123abcd and
    // ck.x.partial-0123abcd are debris there.
    const auto removed = io::detail::remove_debris_in(root);
    CHECK(std::set<std::string>(removed.begin(), removed.end()) ==
          std::set<std::string>{"other.partial-0123abcd", "xck.partial-0123abcd", "ck.x.partial-0123abcd"});
  }
}

TEST_CASE("replace_directory: exchange, and the two-rename fallback") {
  TempDir tmp;
  const fs::path root = tmp.path(), target = root / "t";
  const auto make = [](const fs::path& p, std::string_view marker) {
    fs::create_directory(p);
    write_text(p / "marker", marker);
  };
  for (const bool exchange : {true, false}) {
    CAPTURE(exchange);
    fs::remove_all(target);
    make(target, "old");
    make(root / "t.partial-11111111", "new");
    const fs::path old = io::detail::replace_directory(root / "t.partial-11111111", target, exchange);
    CHECK(read_file(target / "marker") == "new");
    REQUIRE_FALSE(old.empty());
    CHECK(read_file(old / "marker") == "old");
    if (!exchange) CHECK(old.filename().string().starts_with("t.old-"));
    io::detail::remove_flat_directory(old);
    CHECK(listing(root) == std::set<std::string>{"t"});
  }
  // Nothing at the target: a plain rename.
  fs::remove_all(target);
  make(root / "t.partial-22222222", "first");
  CHECK(io::detail::replace_directory(root / "t.partial-22222222", target, true).empty());
  CHECK(read_file(target / "marker") == "first");
  CHECK(listing(root) == std::set<std::string>{"t"});
}

// ---- a run's folder -----------------------------------------------------------------------------

TEST_CASE("CheckpointFolder: latest pointer, rotation, higher steps left alone") {
  TempDir tmp;
  auto store = make_store(11);
  randomize(store);
  CHECK(CheckpointFolder::name_for(120) == "step-00000120");
  CHECK_THROWS_AS(CheckpointFolder::name_for(-1), Error);

  SUBCASE("keep 2") {
    const CheckpointFolder f(tmp / "run");
    CHECK_FALSE(f.latest().has_value());
    f.prepare();
    CHECK(fs::is_directory(tmp / "run"));
    CHECK_FALSE(f.latest().has_value());
    CHECK_ERROR_MENTIONS(f.commit(1, 2), "step-00000001");
    for (std::int64_t s = 1; s <= 5; ++s) {
      save(f, s, store);
      f.commit(s, 2);
      CHECK(read_file(f.root() / "latest") == CheckpointFolder::name_for(s) + "\n");
    }
    CHECK(listing(f.root()) == std::set<std::string>{"latest", "step-00000004", "step-00000005"});
    const auto l = f.list();
    REQUIRE(l.size() == 2);
    CHECK(l[0] == std::pair<std::int64_t, fs::path>{4, f.path_for(4)});
    CHECK(l[1] == std::pair<std::int64_t, fs::path>{5, f.path_for(5)});
    CHECK(f.latest() == f.path_for(5));
    CHECK(TrainCheckpoint::open(*f.latest()).state().at("step") == 5);
  }
  SUBCASE("keep 0 keeps all") {
    const CheckpointFolder f(tmp / "run");
    f.prepare();
    for (std::int64_t s = 1; s <= 4; ++s) {
      save(f, s, store);
      f.commit(s, 0);
    }
    CHECK(f.list().size() == 4);
    CHECK(f.latest() == f.path_for(4));
  }
  SUBCASE("a higher step is left alone; the pointer wins; without it the highest step") {
    const CheckpointFolder f(tmp / "run");
    f.prepare();
    save(f, 1, store);
    f.commit(1, 1);
    save(f, 2, store);
    f.commit(2, 1);
    save(f, 9, store);
    save(f, 3, store);
    f.commit(3, 1);
    CHECK(listing(f.root()) == std::set<std::string>{"latest", "step-00000003", "step-00000009"});
    CHECK(f.latest() == f.path_for(3));
    fs::remove(f.root() / "latest");
    CHECK(f.latest() == f.path_for(9));
    // A pointer to a folder that is not there is an error naming it.
    write_text(f.root() / "latest", "step-00000007\n");
    CHECK_ERROR_MENTIONS(f.latest(), "step-00000007", (f.root() / "latest").string());
    write_text(f.root() / "latest", "../elsewhere\n");
    CHECK_ERROR_MENTIONS(f.latest(), "../elsewhere");
  }
  SUBCASE("list() ignores what is not a step folder") {
    const CheckpointFolder f(tmp / "run");
    f.prepare();
    save(f, 2, store);
    fs::create_directory(f.root() / "step-xyz");
    fs::create_directory(f.root() / "step-1");
    fs::create_directory(f.root() / "step-00000003x");
    fs::create_directory(f.root() / "step--0000003");
    fs::create_directory(f.root() / "logs");
    write_text(f.root() / "step-00000004", "a file");
    write_text(f.root() / "notes.txt", "hi");
    const auto l = f.list();
    REQUIRE(l.size() == 1);
    CHECK(l[0].first == 2);
    CHECK(f.latest() == f.path_for(2));
  }
}

// ---- crashes --------------------------------------------------------------------------------------

TEST_CASE("a SIGKILL at any moment of save + commit leaves a loadable latest checkpoint") {
  struct Case {
    const char* point;
    std::int64_t latest_step;   // what latest() names after the crash
    bool leaves_debris;         // a crash there must leave a .partial-/.trash- entry
    bool step2_there_first;     // a step-2 folder exists before the child writes it
    bool may_not_be_reached;    // the child may finish normally
  };
  const Case cases[] = {
      {"crash@write:tensor#1", 1, true, false, false},       {"crash@write:tensor#7", 1, true, false, false},
      {"crash@write:files", 1, true, false, false},          {"crash@checkpoint:checksums", 1, true, false, false},
      {"crash@write:before-rename", 1, true, false, false},  {"crash@write:after-rename", 1, false, false, false},
      {"crash@checkpoint:latest", 2, false, false, false},   {"crash@retire", 2, true, false, false},
      {"crash@replace:halfway", 1, true, true, true},
  };
  for (const Case& c : cases) {
    const std::string point = c.point;
    CAPTURE(point);
    TempDir tmp;
    const CheckpointFolder f(tmp / "run");
    f.prepare();
    auto store = make_store(12);
    randomize(store);
    const Snapshot one = snapshot(store);
    save(f, 1, store, "one");
    f.commit(1, 1);
    randomize(store);
    const Snapshot two = snapshot(store);
    if (c.step2_there_first) save(f, 2, store, "two, first");

    std::fflush(nullptr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child: no doctest here
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, 2);
      ::setenv("MEGATRAIN_FAULTS", c.point, 1);
      try {
        save(f, 2, store, "two");
        f.commit(2, 1);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    std::int64_t expect = c.latest_step;
    if (!killed) {
      CHECK(c.may_not_be_reached);
      REQUIRE(WIFEXITED(status));
      REQUIRE(WEXITSTATUS(status) == 0);
      MESSAGE(point << " was not reached (this file system exchanges directories atomically)");
      expect = 2;
    }

    // latest() names a complete checkpoint that verifies and loads.
    const auto latest = f.latest();
    REQUIRE(latest.has_value());
    CHECK(*latest == f.path_for(expect));
    check_loads(*latest, expect, expect == 1 ? one : two);
    if (killed && std::string_view(c.point) == "crash@write:after-rename") check_loads(f.path_for(2), 2, two);
    if (killed && c.leaves_debris) CHECK_FALSE(debris_in(f.root()).empty());

    f.prepare();
    CHECK(debris_in(f.root()).empty());
    if (c.step2_there_first) {  // the step-2 folder is there again, the old or the new one
      REQUIRE(fs::is_directory(f.path_for(2)));
      CHECK_NOTHROW(TrainCheckpoint::open(f.path_for(2)));
    }
    // Training goes on: the next save and commit succeed.
    randomize(store);
    const Snapshot three = snapshot(store);
    save(f, 3, store, "three");
    f.commit(3, 1);
    CHECK(f.latest() == f.path_for(3));
    check_loads(f.path_for(3), 3, three);
    CHECK(debris_in(f.root()).empty());
    const auto l = f.list();
    REQUIRE(l.size() == 1);
    CHECK(l[0].first == 3);
  }
}

TEST_CASE("a SIGKILL halfway through the two-rename fallback: the previous folder is put back") {
  TempDir tmp;
  const fs::path root = tmp.path(), target = root / "t", staged = root / "t.partial-11111111";
  fs::create_directory(target);
  write_text(target / "marker", "old");
  fs::create_directory(staged);
  write_text(staged / "marker", "new");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) ::dup2(devnull, 2);
    ::setenv("MEGATRAIN_FAULTS", "crash@replace:halfway", 1);
    try {
      io::detail::replace_directory(staged, target, /*allow_exchange=*/false);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  // Between the renames: no target, the previous folder under .old-, the new one still staged.
  CHECK_FALSE(fs::exists(target));
  const auto debris = debris_in(root);
  REQUIRE(debris.size() == 2);
  CHECK(std::count_if(debris.begin(), debris.end(), [](const std::string& n) { return n.starts_with("t.old-"); }) == 1);
  CHECK(io::detail::remove_debris(target).size() == 2);
  CHECK(listing(root) == std::set<std::string>{"t"});
  CHECK(read_file(target / "marker") == "old");
}
