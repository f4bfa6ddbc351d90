// Hugging Face model directories: export then load reproduces the masters (F32 exactly, BF16 and
// F16 rounded to nearest even; single file and sharded; Llama tied and untied, with and without
// biases, Qwen2, Mistral); checkpoints written by others (mixed dtypes, tolerated extras, a tied
// lm_head present); every malformed case refused by HfCheckpoint::open with the file and the
// tensor named and nothing allocated or written (dtypes other than config.json's included, unless
// HfOpenOptions::allow_dtype_mismatch); a failed export leaves the previous one intact; loading
// a ~160 MB checkpoint reads it through the file mapping, without a second copy in anonymous memory.
#include <doctest/doctest.h>

#include "io_test_util.hpp"

#include <stdlib.h>  // mkdtemp
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/core/error.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/layers/decoder_model.hpp"

using namespace megatrain;
using namespace megatrain::io;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using megatrain::test::rng;

struct TempDir : megatrain::test::TempDir {
  TempDir() : megatrain::test::TempDir("megatrain-hf") {}
};

using megatrain::test::read_file;
using megatrain::test::write_file;
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

// Small shapes with odd sizes (vocab 203, intermediate 72) so nothing lines up by accident.
json llama_json(bool tied, bool biases = false) {
  return json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64},        {"intermediate_size", 72},
              {"num_hidden_layers", 2},                {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"vocab_size", 203},                     {"rms_norm_eps", 1e-5},     {"tie_word_embeddings", tied},
              {"attention_bias", biases},              {"mlp_bias", biases},       {"bos_token_id", 1}};
}
json qwen2_json() {
  return json{{"architectures", {"Qwen2ForCausalLM"}}, {"hidden_size", 64},        {"intermediate_size", 72},
              {"num_hidden_layers", 2},                {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"vocab_size", 203},                     {"rms_norm_eps", 1e-6},     {"tie_word_embeddings", true},
              {"rope_theta", 1000000.0}};
}
json mistral_json() {
  json j = llama_json(false);
  j["architectures"] = {"MistralForCausalLM"};
  j.erase("attention_bias");
  j.erase("mlp_bias");
  j["sliding_window"] = nullptr;
  return j;
}

StoreOptions small_store() {
  StoreOptions o;
  o.host_memory_budget = std::size_t{1} << 30;
  return o;
}

/// A store for `cfg` whose every master (norms and biases included) holds fresh random values
/// spread over a few orders of magnitude, never zero.
HostParamStore<float> random_store(const ModelConfig& cfg) {
  HostParamStore<float> store(DecoderModel<>(cfg).units(), small_store());
  std::normal_distribution<float> d(0.0f, 0.5f);
  for (auto& u : store.units()) {
    for (const auto& p : u.params())
      for (float& x : store.master(p.spec.name).span()) {
        x = d(rng());
        if (x == 0.0f) x = 1e-3f;
      }
    store.sync_compute(u);
  }
  return store;
}

HfExportOptions exporting(DType t, std::uint64_t max_shard_bytes = 5'000'000'000) {
  HfExportOptions o;
  o.dtype = t;
  o.max_shard_bytes = max_shard_bytes;
  return o;
}

float stored(float x, DType t) {
  switch (t) {
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(x));
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(x));
    default: return x;
  }
}
bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

/// Every master of `got` equals `want`'s stored as `t` and read back; the bf16 copies follow.
void check_masters(const HostParamStore<float>& want, const HostParamStore<float>& got, DType t) {
  REQUIRE(got.param_count() == want.param_count());
  for (const auto& u : want.units()) {
    for (const auto& p : u.params()) {
      INFO("tensor " << p.spec.name);
      const auto a = want.master(p.spec.name).span();
      const auto b = got.master(p.spec.name).span();
      const auto c = got.compute(p.spec.name).span();
      REQUIRE(a.size() == b.size());
      std::size_t bad = 0, bad_compute = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        bad += !same_bits(b[i], stored(a[i], t));
        bad_compute += c[i].bits != float_to_bf16_bits(b[i]);
      }
      CHECK(bad == 0);
      CHECK(bad_compute == 0);
    }
  }
}

/// The store's masters as tensors to write, stored as `t` (for hand-made checkpoints).
std::vector<TensorToWrite> tensors_of(const HostParamStore<float>& store, SafetensorsDType t) {
  std::vector<TensorToWrite> v;
  for (const auto& u : store.units())
    for (const auto& p : u.params()) v.emplace_back(p.spec.name, View<const float>(store.master(p.spec.name)), t);
  return v;
}

/// A model directory as another tool would write it: the tensors given, and config.json.
void write_model(const fs::path& dir, std::span<const TensorToWrite> tensors, const json& config,
                 std::uint64_t max_shard_bytes = 5'000'000'000) {
  ShardedWriteOptions o;
  o.max_shard_bytes = max_shard_bytes;
  o.metadata = {{"format", "pt"}};
  o.extra_files = {{"config.json", config.dump(2)}};
  write_safetensors_sharded(dir, tensors, o);
}

/// Rewrites the JSON header of a safetensors file in place, keeping its length (padding with
/// spaces), so that the data section stays where it was. `edit` gets the header as compact JSON.
void rewrite_header(const fs::path& file, const std::function<std::string(const std::string&)>& edit) {
  std::string bytes = read_file(file);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)])) << (8 * i);
  // Compact, without "__metadata__": room for edits that lengthen a name or an offset.
  json j = json::parse(bytes.substr(8, n));
  j.erase("__metadata__");
  std::string header = edit(j.dump());
  REQUIRE(header.size() <= n);
  header.resize(n, ' ');
  bytes.replace(8, n, header);
  write_file(file, bytes);
}
std::string edit_json(const std::string& header, const std::function<void(json&)>& f) {
  json j = json::parse(header);
  f(j);
  return j.dump();
}

}  // namespace

// ---- round trips ------------------------------------------------------------------------------

TEST_CASE("export then load reproduces the masters: every dtype, sharded and not, every architecture") {
  struct Case {
    const char* what;
    json config;
  };
  const Case cases[] = {{"llama untied", llama_json(false)},
                        {"llama tied with attention and mlp biases", llama_json(true, true)},
                        {"qwen2 tied (q/k/v bias)", qwen2_json()},
                        {"mistral untied", mistral_json()}};
  for (const auto& c : cases) {
    const ModelConfig cfg = ModelConfig::from_json(c.config);
    const auto store = random_store(cfg);
    for (const DType t : {DType::f32, DType::bf16, DType::f16}) {
      for (const bool sharded : {false, true}) {
        INFO(c.what << ", " << dtype_name(t) << (sharded ? ", sharded" : ", one file"));
        TempDir dir;
        const auto out = dir / "export";
        HfExportOptions opt;
        opt.dtype = t;
        if (sharded) opt.max_shard_bytes = 40'000;
        export_hf_model(store, cfg, out, opt);

        const auto files = listing(out);
        CHECK(files.contains("config.json"));
        CHECK(files.contains("model.safetensors.index.json") == sharded);
        CHECK(files.contains("model.safetensors") == !sharded);
        if (sharded) CHECK(files.size() > 3);
        const json written = json::parse(read_file(out / "config.json"));
        CHECK(written.at("torch_dtype") == torch_dtype_name(t));
        CHECK(written.at("dtype") == torch_dtype_name(t));
        CHECK(ModelConfig::from_json(written).to_json() == cfg.to_json());

        const auto ckpt = SafetensorsCheckpoint::open(out);
        CHECK(ckpt.contains("lm_head.weight") == !cfg.tie_word_embeddings);
        for (const auto& name : ckpt.names()) CHECK(ckpt.tensor(name).info->dtype == to_safetensors_dtype(t));
        for (const auto& f : ckpt.files()) CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});

        HfModel m = load_hf_model(out, small_store());
        CHECK(m.config.to_json() == cfg.to_json());
        CHECK(m.ignored.empty());
        check_masters(store, m.store, t);
        // Adam moments of a freshly loaded model are zero.
        for (const auto& u : m.store.units())
          CHECK(std::all_of(u.adam_m().begin(), u.adam_m().end(), [](float x) { return x == 0.0f; }));
      }
    }
  }
}

TEST_CASE("export then load, every family of the fixtures: transformers' tensor names and shapes, every dtype, sharded") {
  // Each fixture's model.safetensors was written by transformers' save_pretrained: an export of a
  // store of that config must hold the same tensors (names, shapes: fused q/k/v and gate/up of
  // Phi-3, GPT-OSS's stacked experts with their biases and sinks, per-expert tensors of Qwen3-MoE,
  // Mixtral and OLMoE, a multimodal checkpoint's language model) and load back to the same masters.
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(MEGATRAIN_TEST_FIXTURES))
    if (fs::exists(e.path() / "config.json")) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  REQUIRE(dirs.size() >= 20);
  const auto shapes = [](const SafetensorsCheckpoint& c) {  // every tensor's name and shape
    std::map<std::string, std::vector<std::int64_t>> out;
    for (const auto& n : c.names()) {
      const auto shape = c.tensor(n).info->shape;
      out[n] = std::vector<std::int64_t>(shape.begin(), shape.end());
    }
    return out;
  };
  for (const auto& d : dirs) {
    const std::string name = d.filename().string();
    const ModelConfig cfg = ModelConfig::from_file(d / "config.json");
    const auto store = random_store(cfg);
    // (the MXFP4 fixture holds the experts' blocks and scales: an export writes them dequantized,
    // under gpt_oss's names; the multimodal one, the language model's tensors of a text export)
    std::map<std::string, std::vector<std::int64_t>> published;
    if (name != "gpt_oss_mxfp4" && cfg.wrapper_architecture.empty()) published = shapes(SafetensorsCheckpoint::open(d / "model.safetensors"));
    for (const DType t : {DType::f32, DType::bf16}) {
      for (const bool sharded : {false, true}) {
        INFO(name << ", " << dtype_name(t) << (sharded ? ", sharded" : ", one file"));
        TempDir dir;
        const auto out = dir / "export";
        export_hf_model(store, cfg, out, exporting(t, sharded ? 40'000 : 5'000'000'000));
        const auto ckpt = SafetensorsCheckpoint::open(out);
        CHECK(ckpt.sharded() == sharded);
        if (!published.empty()) CHECK(shapes(ckpt) == published);
        HfModel m = load_hf_model(out, small_store());
        CHECK(m.config.to_json() == cfg.to_json());
        CHECK(m.ignored.empty());
        check_masters(store, m.store, t);
      }
    }
    // The config.json fields transformers 5 writes: rope_parameters (Phi-3's partial factor of 1.0
    // aside, which it writes and megatrain leaves to its default) and layer_types where it has them.
    INFO(name);
    const json theirs_all = json::parse(read_file(d / "config.json"));
    const json& theirs = theirs_all.contains("text_config") ? theirs_all.at("text_config") : theirs_all;
    const json ours = cfg.to_json();
    json rope = theirs.at("rope_parameters");
    if (rope.contains("partial_rotary_factor") && rope.at("partial_rotary_factor") == 1.0) rope.erase("partial_rotary_factor");
    CHECK(ours.at("rope_parameters") == rope);
    CHECK(ours.contains("layer_types") == theirs.contains("layer_types"));
    if (theirs.contains("layer_types")) CHECK(ours.at("layer_types") == theirs.at("layer_types"));
  }
}

TEST_CASE("load_into: an existing store, checked before anything is written") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto src = random_store(cfg);
  TempDir dir;
  export_hf_model(src, cfg, dir / "m", exporting(DType::f32));
  const auto ckpt = HfCheckpoint::open(dir / "m");
  CHECK(ckpt.param_count() == cfg.param_count());
  CHECK(ckpt.source("model.norm.weight").name() == "model.norm.weight");
  CHECK_ERROR_MENTIONS(ckpt.source("nope"), "nope");

  auto dst = random_store(cfg);
  ckpt.load_into(dst);
  check_masters(src, dst, DType::f32);

  // A store of another shape is refused and left as it was.
  json other = llama_json(false);
  other["intermediate_size"] = 80;
  auto wrong = random_store(ModelConfig::from_json(other));
  const std::vector<float> before(wrong.unit(1).master().begin(), wrong.unit(1).master().end());
  CHECK_ERROR_MENTIONS(ckpt.load_into(wrong), "mlp.gate_proj.weight", "[80, 64]", "[72, 64]");
  CHECK(std::equal(before.begin(), before.end(), wrong.unit(1).master().begin()));
}

namespace {

/// A memory figure of /proc/self/status ("RssAnon", "RssFile", "RssShmem"), in bytes; nullopt if
/// the kernel does not report it. Called from a sampling thread too: no doctest macros here.
std::optional<std::size_t> proc_status_bytes(std::string_view field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.size() > field.size() && line.compare(0, field.size(), field) == 0 && line[field.size()] == ':')
      return static_cast<std::size_t>(std::stoull(line.substr(field.size() + 1))) * 1024;  // "NNN kB"
  return std::nullopt;
}

/// Samples RssAnon on a thread of its own, from construction until stop() (or destruction), and
/// keeps the largest value seen.
class AnonPeakSampler {
 public:
  AnonPeakSampler() : thread_([this] {
    while (!stop_.load()) {
      const std::size_t a = proc_status_bytes("RssAnon").value_or(0);
      if (a > peak_.load()) peak_.store(a);
      samples_.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }) {
    while (samples_.load() < 2) std::this_thread::yield();  // running: its stack is already counted
  }
  ~AnonPeakSampler() { stop(); }
  AnonPeakSampler(const AnonPeakSampler&) = delete;
  AnonPeakSampler& operator=(const AnonPeakSampler&) = delete;
  void reset_peak(std::size_t to) { peak_.store(to); }
  void stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  std::size_t peak() const { return peak_.load(); }
  std::size_t samples() const { return samples_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> peak_{0}, samples_{0};
  std::thread thread_;  // last: starts after the counters exist
};

}  // namespace

// (AddressSanitizer keeps its own shadow and quarantine in anonymous memory, which this test would
// count: it skips under the sanitizer, with the reason in its name)
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAsan = true;
#else
constexpr bool kUnderAsan = false;
#endif
TEST_CASE("load_into reads a 160 MB checkpoint through the file mapping: no second copy in anonymous memory (skipped "
          "under AddressSanitizer, whose own memory is anonymous)" * doctest::skip(kUnderAsan)) {
  // A tied model that is mostly embedding table: 76,543 x 1024 plus one small block, 81.8M
  // parameters, 164 MB of bf16 (the store for it takes 14 bytes a parameter, 1.1 GB).
  json j = llama_json(true);
  j["hidden_size"] = 1024;
  j["intermediate_size"] = 256;
  j["num_hidden_layers"] = 1;
  j["num_attention_heads"] = 8;
  j["num_key_value_heads"] = 2;
  j["vocab_size"] = 76'543;
  const ModelConfig cfg = ModelConfig::from_json(j);
  StoreOptions so;
  so.host_memory_budget = std::size_t{4} << 30;
  so.seed = 11;
  HostParamStore<float> store(DecoderModel<>(cfg).units(), so);  // initialised: every page written
  TempDir dir;
  export_hf_model(store, cfg, dir / "big", exporting(DType::bf16));
  const auto file_bytes = static_cast<std::size_t>(fs::file_size(dir / "big" / "model.safetensors"));
  REQUIRE(file_bytes > 150'000'000);
  REQUIRE(file_bytes < 250'000'000);
  // What the load must give back: a sample of every tensor, rounded to bf16 as stored.
  std::map<std::string, std::vector<std::pair<std::size_t, float>>> expect;
  for (const auto& u : store.units())
    for (const auto& p : u.params()) {
      const auto m = store.master(p.spec.name).span();
      for (std::size_t i = 0; i < m.size(); i += 4099) expect[p.spec.name].emplace_back(i, stored(m[i], DType::bf16));
      expect[p.spec.name].emplace_back(m.size() - 1, stored(m.back(), DType::bf16));
    }
  for (auto& u : store.units()) {  // other values (the pages stay resident: written at construction)
    std::fill(u.master().begin(), u.master().end(), 0.0f);
    std::fill(u.compute().begin(), u.compute().end(), bf16(0.0f));
  }

  const auto ckpt = HfCheckpoint::open(dir / "big");
  REQUIRE(proc_status_bytes("RssAnon").has_value());  // Linux >= 4.5
  const auto mapped = [] { return proc_status_bytes("RssFile").value_or(0) + proc_status_bytes("RssShmem").value_or(0); };
  // Anonymous memory is also sampled while load_into runs: a copy freed before it returns shows
  // only there. The sampler starts before the first reading, so its own stack counts in both.
  AnonPeakSampler sampler;
  const std::size_t anon_before = *proc_status_bytes("RssAnon"), mapped_before = mapped();
  sampler.reset_peak(anon_before);
  ckpt.load_into(store);
  const std::size_t anon_after = *proc_status_bytes("RssAnon"), mapped_after = mapped();
  sampler.stop();
  const std::size_t anon_peak = std::max(sampler.peak(), anon_after);

  const std::size_t mb = 1'000'000;
  INFO("checkpoint " << file_bytes / mb << " MB; anonymous memory before " << anon_before / mb << " MB, after "
                     << anon_after / mb << " MB, peak " << anon_peak / mb << " MB (" << sampler.samples()
                     << " samples); file-backed and shared " << mapped_before / mb << " -> " << mapped_after / mb
                     << " MB");
  CHECK(sampler.samples() > 2);
  CHECK(anon_after < anon_before + file_bytes / 10);
  CHECK(anon_peak < anon_before + file_bytes / 10);
  // The data came through the mapping: the file's pages are now mapped in the process.
  CHECK(mapped_after > mapped_before + file_bytes / 2);
  for (const auto& entry : expect) {  // (no structured binding: clang 14 cannot capture one in INFO)
    const std::string& name = entry.first;
    INFO(name);
    const auto got = store.master(name).span();
    const auto compute = store.compute(name).span();
    std::size_t bad = 0;
    for (const auto& [i, want] : entry.second)
      bad += !same_bits(got[i], want) || compute[i].bits != float_to_bf16_bits(want);
    CHECK(bad == 0);
  }
}

TEST_CASE("checkpoints written by others: mixed dtypes, tolerated extras, tied heads") {
  const ModelConfig cfg = ModelConfig::from_json(qwen2_json());
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";

  SUBCASE("a different dtype per tensor (F64, F32, BF16, F16) is converted exactly") {
    // F64 sources from the fp32 masters: reading back rounds to the same floats.
    std::vector<std::vector<double>> wide;
    std::vector<TensorToWrite> t;
    std::map<std::string, DType> kind;
    const SafetensorsDType cycle[] = {SafetensorsDType::f64, SafetensorsDType::f32, SafetensorsDType::bf16,
                                      SafetensorsDType::f16};
    std::size_t k = 0;
    for (const auto& u : store.units())
      for (const auto& p : u.params()) {
        const auto d = cycle[k++ % 4];
        const auto m = store.master(p.spec.name);
        if (d == SafetensorsDType::f64) {
          wide.emplace_back(m.span().begin(), m.span().end());
        }
        kind[p.spec.name] = d == SafetensorsDType::bf16 ? DType::bf16 : d == SafetensorsDType::f16 ? DType::f16 : DType::f32;
        t.emplace_back(p.spec.name, View<const float>(m), d == SafetensorsDType::f64 ? SafetensorsDType::f32 : d);
      }
    // Replace the F64 ones with double sources (kept alive in `wide`).
    std::size_t w = 0;
    k = 0;
    for (auto& tw : t) {
      if (cycle[k++ % 4] != SafetensorsDType::f64) continue;
      const auto& v = wide[w++];
      tw = TensorToWrite(tw.name, View<const double>(std::span<const double>(v), Shape(std::span<const std::int64_t>(tw.shape))));
    }
    write_model(out, t, qwen2_json());
    HfModel m = load_hf_model(out, small_store());
    for (const auto& entry : kind) {  // (no structured binding: clang 14 cannot capture one in INFO)
      const std::string& name = entry.first;
      const DType d = entry.second;
      INFO(name);
      const auto a = store.master(name).span(), b = m.store.master(name).span();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < a.size(); ++i) bad += !same_bits(b[i], stored(a[i], d));
      CHECK(bad == 0);
    }
  }
  SUBCASE("rotary buffers and a tied lm_head.weight equal to the table (in another dtype) are ignored") {
    auto t = tensors_of(store, SafetensorsDType::bf16);
    // The head in F32 holding the bf16-rounded table: equal value for value.
    const auto table = store.master("model.embed_tokens.weight").span();
    std::vector<float> head(table.begin(), table.end());
    for (float& x : head) x = stored(x, DType::bf16);
    const Shape hs = store.master("model.embed_tokens.weight").shape();
    t.emplace_back("lm_head.weight", View<const float>(std::span<const float>(head), hs), SafetensorsDType::f32);
    std::vector<float> inv(8, 0.5f);
    t.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", View<const float>(std::span<const float>(inv), Shape{8}));
    t.emplace_back("model.rotary_emb.inv_freq", View<const float>(std::span<const float>(inv), Shape{8}));
    write_model(out, t, qwen2_json());
    HfModel m = load_hf_model(out, small_store());
    CHECK(m.ignored.size() == 3);
    std::string all;
    for (const auto& s : m.ignored) all += s + "\n";
    CHECK(all.find("lm_head.weight (tied") != std::string::npos);
    CHECK(all.find("model.layers.0.self_attn.rotary_emb.inv_freq (rotary") != std::string::npos);
    check_masters(store, m.store, DType::bf16);
  }
  SUBCASE("a tied model saved with only lm_head.weight takes the table from it") {
    auto t = tensors_of(store, SafetensorsDType::f32);
    for (auto& tw : t)
      if (tw.name == "model.embed_tokens.weight") tw.name = "lm_head.weight";
    write_model(out, t, qwen2_json());
    const auto ckpt = HfCheckpoint::open(out);
    CHECK(ckpt.source("model.embed_tokens.weight").name() == "lm_head.weight");
    HfModel m = load_hf_model(out, small_store());
    check_masters(store, m.store, DType::f32);
  }
}

TEST_CASE("export: the config.json of the model it came from, side files, progress") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  write_file(dir / "tokenizer.json", R"({"model": "bpe"})");
  write_file(dir / "generation_config.json", R"({"bos_token_id": 1})");
  write_file(dir / "unrelated.txt", "x");
  const auto side = hf_side_files(dir.path());
  CHECK(side == std::map<std::string, std::string>{{"generation_config.json", R"({"bos_token_id": 1})"},
                                                   {"tokenizer.json", R"({"model": "bpe"})"}});
  json base = llama_json(false);
  base["torch_dtype"] = "float32";
  base["dtype"] = "float32";
  base["transformers_version"] = "5.0.0";

  HfExportOptions opt;
  opt.config_json = base.dump();
  opt.extra_files = side;
  std::vector<std::string> seen;
  opt.progress = [&](std::string_view name, std::size_t i, std::size_t n) {
    CHECK(i == seen.size());
    CHECK(n == 1 + 2 * 9 + 2);  // the embedding, 2 blocks of 9 tensors, the final norm, the head
    seen.emplace_back(name);
  };
  export_hf_model(store, cfg, dir / "out", opt);
  CHECK(seen.size() == 21);
  CHECK(seen.front() == "model.embed_tokens.weight");
  CHECK(seen.back() == "lm_head.weight");
  CHECK(listing(dir / "out") ==
        std::set<std::string>{"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"});
  const json written = json::parse(read_file(dir / "out" / "config.json"));
  CHECK(written.at("bos_token_id") == 1);
  CHECK(written.at("transformers_version") == "5.0.0");
  CHECK(written.at("torch_dtype") == "bfloat16");
  CHECK(written.at("dtype") == "bfloat16");

  // A base config describing another model, or config.json among the extra files, is refused.
  json other = base;
  other["num_hidden_layers"] = 3;
  opt.config_json = other.dump();
  CHECK_ERROR_MENTIONS(export_hf_model(store, cfg, dir / "out2", opt), "another model", "3 layers");
  opt.config_json = "{not json";
  CHECK_ERROR_MENTIONS(export_hf_model(store, cfg, dir / "out2", opt), "malformed JSON");
  opt.config_json.clear();
  opt.extra_files = {{"config.json", "{}"}};
  CHECK_ERROR_MENTIONS(export_hf_model(store, cfg, dir / "out2", opt), "config_json");
  opt.extra_files.clear();
  opt.dtype = DType::i32;
  CHECK_ERROR_MENTIONS(export_hf_model(store, cfg, dir / "out2", opt), "bf16, f16 or f32");
  // A store that is not the model the config describes.
  const ModelConfig tied = ModelConfig::from_json(llama_json(true));
  CHECK_ERROR_MENTIONS(export_hf_model(store, tied, dir / "out2", {}), "exporting to", "lm_head.weight");
  CHECK(!fs::exists(dir / "out2"));
}

TEST_CASE("export is atomic: a failure midway leaves the previous export intact") {
  const ModelConfig cfg = ModelConfig::from_json(qwen2_json());
  const auto first = random_store(cfg);
  const auto second = random_store(cfg);
  TempDir dir;
  const auto out = dir / "export";
  for (const bool sharded : {false, true}) {
    INFO((sharded ? "sharded" : "one file"));
    HfExportOptions opt;
    if (sharded) opt.max_shard_bytes = 30'000;
    export_hf_model(first, cfg, out, opt);
    write_file(out / "README.md", "kept");
    const auto before = snapshot(out);

    // The producer of the 15th tensor throws: several files have been written by then.
    opt.progress = [](std::string_view, std::size_t i, std::size_t) {
      if (i == 14) throw std::runtime_error("interrupted");
    };
    CHECK_THROWS_WITH_AS(export_hf_model(second, cfg, out, opt), "interrupted", std::runtime_error);
    CHECK(snapshot(out) == before);
    CHECK(listing(dir.path()) == std::set<std::string>{"export"});  // no staging directory left behind
    check_masters(first, load_hf_model(out, small_store()).store, DType::bf16);

    // Done properly, the new export replaces the old one and keeps the README.
    opt.progress = nullptr;
    export_hf_model(second, cfg, out, opt);
    CHECK(read_file(out / "README.md") == "kept");
    check_masters(second, load_hf_model(out, small_store()).store, DType::bf16);
    fs::remove_all(out);
  }
}

TEST_CASE("export targets: check_hf_export_target") {
  TempDir dir;
  CHECK_NOTHROW(check_hf_export_target(dir / "absent"));
  fs::create_directory(dir / "files");
  write_file(dir / "files" / "a.json", "{}");
  CHECK_NOTHROW(check_hf_export_target(dir / "files"));
  write_file(dir / "plain", "x");
  CHECK_ERROR_MENTIONS(check_hf_export_target(dir / "plain"), "plain", "not a directory");
  fs::create_directory(dir / "files" / "sub");
  CHECK_ERROR_MENTIONS(check_hf_export_target(dir / "files"), "'sub'", "not a regular file");
  fs::create_directory_symlink(dir / "files", dir / "link");
  CHECK_ERROR_MENTIONS(check_hf_export_target(dir / "link"), "symbolic link");
}

TEST_CASE("parse_shard_size and torch_dtype_name") {
  CHECK(parse_shard_size("5GB") == 5'000'000'000ull);
  CHECK(parse_shard_size("5G") == 5'000'000'000ull);
  CHECK(parse_shard_size("500MB") == 500'000'000ull);
  CHECK(parse_shard_size("100kb") == 100'000ull);
  CHECK(parse_shard_size("2GiB") == 2ull << 30);
  CHECK(parse_shard_size("1.5Gi") == 3ull << 29);
  CHECK(parse_shard_size("12345") == 12345ull);
  CHECK(parse_shard_size("64B") == 64ull);
  CHECK_ERROR_MENTIONS(parse_shard_size(""), "not a shard size");
  CHECK_ERROR_MENTIONS(parse_shard_size("GB"), "not a shard size");
  CHECK_ERROR_MENTIONS(parse_shard_size("5XB"), "unknown unit 'XB'");
  CHECK_ERROR_MENTIONS(parse_shard_size("0"), "at least 1 byte");
  CHECK_ERROR_MENTIONS(parse_shard_size("-5GB"), "not a shard size");
  CHECK(torch_dtype_name(DType::bf16) == "bfloat16");
  CHECK(torch_dtype_name(DType::f32) == "float32");
  CHECK(torch_dtype_name(DType::f16) == "float16");
}

// ---- bad input ---------------------------------------------------------------------------------

TEST_CASE("bad input: tensors that disagree with config.json") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  const std::string file = (out / "model.safetensors").string();
  auto t = tensors_of(store, SafetensorsDType::bf16);
  const auto without = [&](std::string_view name) {
    auto v = t;
    std::erase_if(v, [&](const TensorToWrite& x) { return x.name == name; });
    return v;
  };
  const auto with_extra = [&](const std::string& name, std::vector<std::int64_t> shape, const std::vector<float>& values) {
    auto v = t;
    v.emplace_back(name, View<const float>(std::span<const float>(values), Shape(std::span<const std::int64_t>(shape))),
                   SafetensorsDType::bf16);
    return v;
  };
  const std::vector<float> small(64, 0.25f);

  SUBCASE("a missing tensor") {
    write_model(out, without("model.layers.1.mlp.up_proj.weight"), llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'model.layers.1.mlp.up_proj.weight' is missing", "[72, 64]",
                         "does not match the model its config.json describes", "LlamaForCausalLM, 2 layers");
  }
  SUBCASE("a config of 60,000 layers beside these weights: refused before the layers are built") {
    auto j = llama_json(false);
    j["num_hidden_layers"] = 60000;
    write_model(out, t, j);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "num_hidden_layers is 60000", file, "fewer than one a layer",
                         "config.json does not describe these weights");
    j["num_hidden_layers"] = 1000000000;  // (beyond any model: refused as the config is read)
    write_model(out, t, j);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), (out / "config.json").string(), "num_hidden_layers 1000000000 is beyond any model (at most 65536)");
  }
  SUBCASE("a config far larger than these weights: refused before its units are built") {
    for (const auto& [key, value] : {std::pair{"intermediate_size", std::int64_t{10000000}}, {"head_dim", std::int64_t{16384}}}) {
      CAPTURE(key);
      auto j = llama_json(false);
      j[key] = value;
      write_model(out, t, j);
      CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "describes a model of", "too little for them at any dtype",
                           "config.json does not describe these weights");
    }
  }
  SUBCASE("an untied model without lm_head.weight: the hint says tie_word_embeddings") {
    write_model(out, without("lm_head.weight"), llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'lm_head.weight' is missing", "tie_word_embeddings\": true");
  }
  SUBCASE("an unexpected tensor") {
    write_model(out, with_extra("model.layers.0.mlp.extra.weight", {64}, small), llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "unexpected tensor 'model.layers.0.mlp.extra.weight'");
  }
  SUBCASE("a layer more than config.json says") {
    write_model(out, with_extra("model.layers.2.input_layernorm.weight", {64}, small), llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'model.layers.2.input_layernorm.weight'", "num_hidden_layers 2");
  }
  SUBCASE("biases config.json does not describe") {
    write_model(out, with_extra("model.layers.0.self_attn.q_proj.bias", {64}, small), llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'model.layers.0.self_attn.q_proj.bias'", "attention_bias");
  }
  SUBCASE("a Qwen2 model without its q/k/v biases") {
    const ModelConfig q = ModelConfig::from_json(qwen2_json());
    const auto qstore = random_store(q);
    auto qt = tensors_of(qstore, SafetensorsDType::f32);
    std::erase_if(qt, [](const TensorToWrite& x) { return x.name.ends_with("k_proj.bias"); });
    write_model(out, qt, qwen2_json());
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'model.layers.0.self_attn.k_proj.bias' is missing",
                         "'model.layers.1.self_attn.k_proj.bias' is missing", "2 problems");
  }
  SUBCASE("a shape that disagrees with config.json") {
    json j = llama_json(false);
    j["num_key_value_heads"] = 4;  // k and v would be [64, 64]; the file has [32, 64]
    write_model(out, t, j);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file,
                         "tensor 'model.layers.0.self_attn.k_proj.weight' in '" + file +
                             "' has shape [32, 64] but config.json needs [64, 64]",
                         "'model.layers.1.self_attn.v_proj.weight'", "4 problems");
    j = llama_json(false);
    j["vocab_size"] = 300;
    write_model(out, t, j);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'model.embed_tokens.weight'", "[203, 64]", "[300, 64]",
                         "'lm_head.weight'");
  }
  SUBCASE("sharded: each problem names the shard that holds the tensor") {
    json j = llama_json(false);
    j["intermediate_size"] = 80;  // every MLP matrix is misshapen
    write_model(out, with_extra("model.layers.1.mlp.extra.weight", {64}, small), j, 20'000);
    const json map = json::parse(read_file(out / "model.safetensors.index.json"));
    const auto shard_of = [&](const std::string& name) {
      return (out / map["weight_map"][name].get<std::string>()).string();
    };
    REQUIRE(shard_of("model.layers.0.mlp.up_proj.weight") != shard_of("model.layers.1.mlp.extra.weight"));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), (out / "model.safetensors.index.json").string(),
                         "tensor 'model.layers.0.mlp.up_proj.weight' in '" + shard_of("model.layers.0.mlp.up_proj.weight") +
                             "' has shape [72, 64] but config.json needs [80, 64]",
                         "unexpected tensor 'model.layers.1.mlp.extra.weight' in '" +
                             shard_of("model.layers.1.mlp.extra.weight") + "'");
  }
  SUBCASE("a dtype that is not a float") {
    std::vector<std::int32_t> ints(64, 3);
    auto v = without("model.norm.weight");
    v.emplace_back("model.norm.weight", View<const std::int32_t>(std::span<const std::int32_t>(ints), Shape{64}));
    write_model(out, v, llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'model.norm.weight'", "holds I32", "quantized");
  }
  SUBCASE("a tied lm_head.weight that differs from the table") {
    json j = llama_json(true);
    auto v = t;  // holds lm_head.weight: random, unlike the table
    write_model(out, v, j);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file, "'lm_head.weight'", "differs from 'model.embed_tokens.weight'",
                         "element 0");
  }
  SUBCASE("tensor names without the 'model.' prefix") {
    auto v = t;
    for (auto& x : v)
      if (x.name.starts_with("model.")) x.name = x.name.substr(6);
    write_model(out, v, llama_json(false));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'model.embed_tokens.weight' is missing", "lack the 'model.' prefix",
                         "... and ");
  }
}

TEST_CASE("bad input: dtypes that disagree with config.json, and allow_dtype_mismatch") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  const std::string file = (out / "model.safetensors").string();
  const std::string norm = "model.layers.1.post_attention_layernorm.weight";
  HfOpenOptions allow;
  allow.allow_dtype_mismatch = true;
  CHECK_FALSE(HfOpenOptions{}.allow_dtype_mismatch);  // refusing is the default
  // All BF16 but one tensor, which is F32 (what a checkpoint keeping its norms in F32 looks like).
  auto mixed = tensors_of(store, SafetensorsDType::bf16);
  for (auto& x : mixed)
    if (x.name == norm) x = TensorToWrite(norm, View<const float>(store.master(norm)), SafetensorsDType::f32);
  const auto with_dtype = [](json j, const char* key, json value) {
    j[key] = std::move(value);
    return j;
  };

  SUBCASE("tensors in the declared dtype open, \"dtype\" or \"torch_dtype\"") {
    write_model(out, tensors_of(store, SafetensorsDType::bf16), with_dtype(llama_json(false), "torch_dtype", "bfloat16"));
    CHECK_NOTHROW(HfCheckpoint::open(out));
    write_model(out, tensors_of(store, SafetensorsDType::f16), with_dtype(llama_json(false), "dtype", "float16"));
    CHECK_NOTHROW(HfCheckpoint::open(out));
    // Both keys: "dtype" (transformers 5) wins, as in transformers.
    json j = with_dtype(llama_json(false), "dtype", "float32");
    j["torch_dtype"] = "bfloat16";
    write_model(out, tensors_of(store, SafetensorsDType::f32), j);
    CHECK_NOTHROW(HfCheckpoint::open(out));
  }
  SUBCASE("one tensor in another float dtype: refused by default, naming file, tensor and both dtypes") {
    write_model(out, mixed, with_dtype(llama_json(false), "torch_dtype", "bfloat16"));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out),
                         "tensor '" + norm + "' in '" + file + "' is stored as F32 but config.json declares "
                         "\"torch_dtype\": \"bfloat16\" (BF16)",
                         "1 problem in", "allow_dtype_mismatch", "--allow-dtype-mismatch");
    CHECK_ERROR_MENTIONS(load_hf_model(out, small_store()), norm, "allow_dtype_mismatch");
    // Opted in: it opens, and every tensor is converted exactly.
    CHECK_NOTHROW(HfCheckpoint::open(out, allow));
    HfModel m = load_hf_model(out, small_store(), allow);
    for (const auto& u : store.units())
      for (const auto& p : u.params()) {
        INFO(p.spec.name);
        const DType d = p.spec.name == norm ? DType::f32 : DType::bf16;
        const auto a = store.master(p.spec.name).span(), b = m.store.master(p.spec.name).span();
        std::size_t bad = 0;
        for (std::size_t i = 0; i < a.size(); ++i) bad += !same_bits(b[i], stored(a[i], d));
        CHECK(bad == 0);
      }
  }
  SUBCASE("a whole checkpoint in another dtype than transformers 5's \"dtype\"") {
    write_model(out, tensors_of(store, SafetensorsDType::f32), with_dtype(llama_json(false), "dtype", "bfloat16"));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), file,
                         "tensor 'model.embed_tokens.weight' in '" + file + "' is stored as F32 but config.json "
                         "declares \"dtype\": \"bfloat16\"",
                         "21 problems", "... and 9 more", "21 tensors stored in another dtype");
    CHECK_NOTHROW(HfCheckpoint::open(out, allow));
  }
  SUBCASE("sharded: the shard holding the tensor is named") {
    write_model(out, mixed, with_dtype(llama_json(false), "dtype", "bfloat16"), 20'000);
    const json map = json::parse(read_file(out / "model.safetensors.index.json"));
    const std::string shard = (out / map["weight_map"][norm].get<std::string>()).string();
    REQUIRE(listing(out).size() > 3);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "tensor '" + norm + "' in '" + shard + "' is stored as F32");
    CHECK_NOTHROW(HfCheckpoint::open(out, allow));
  }
  SUBCASE("a tied lm_head.weight equal to the table but in another dtype") {
    const ModelConfig tcfg = ModelConfig::from_json(llama_json(true));
    const auto tstore = random_store(tcfg);
    auto t = tensors_of(tstore, SafetensorsDType::bf16);
    // An F32 head equal to the BF16 table value for value: the master rounded to bf16.
    const auto table = tstore.master("model.embed_tokens.weight");
    std::vector<float> head(table.span().begin(), table.span().end());
    for (float& x : head) x = stored(x, DType::bf16);
    t.emplace_back("lm_head.weight", View<const float>(std::span<const float>(head), table.shape()),
                   SafetensorsDType::f32);
    write_model(out, t, with_dtype(llama_json(true), "torch_dtype", "bfloat16"));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "tensor 'lm_head.weight' in '" + file + "' is stored as F32");
    const auto ckpt = HfCheckpoint::open(out, allow);
    CHECK(ckpt.ignored().size() == 1);
  }
  SUBCASE("no declared dtype (absent, null or \"auto\"): any float dtype") {
    for (const json& j : {llama_json(false), with_dtype(llama_json(false), "torch_dtype", nullptr),
                          with_dtype(llama_json(false), "dtype", "auto")}) {
      INFO(j.dump());
      write_model(out, mixed, j);
      CHECK_NOTHROW(HfCheckpoint::open(out));
    }
  }
  SUBCASE("a config.json dtype that is not a float dtype megatrain reads, or not a string") {
    write_model(out, tensors_of(store, SafetensorsDType::bf16), with_dtype(llama_json(false), "torch_dtype", "int8"));
    const std::string config = (out / "config.json").string();
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), config, "\"torch_dtype\": \"int8\" is not a dtype megatrain loads",
                         "allow_dtype_mismatch");
    CHECK_NOTHROW(HfCheckpoint::open(out, allow));
    write_model(out, tensors_of(store, SafetensorsDType::bf16), with_dtype(llama_json(false), "dtype", 16));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), config, "'dtype' must be a string");
  }
  SUBCASE("allow_dtype_mismatch still refuses tensors that are not floats") {
    std::vector<std::int32_t> ints(64, 3);
    auto v = tensors_of(store, SafetensorsDType::bf16);
    std::erase_if(v, [](const TensorToWrite& x) { return x.name == "model.norm.weight"; });
    v.emplace_back("model.norm.weight", View<const std::int32_t>(std::span<const std::int32_t>(ints), Shape{64}));
    write_model(out, v, with_dtype(llama_json(false), "torch_dtype", "bfloat16"));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out, allow), file, "'model.norm.weight'", "holds I32");
    // ... and the I32 tensor is reported once, as not a float, not also as a dtype mismatch.
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "1 problem in");
  }
}

TEST_CASE("bad input: directories, config.json and architectures") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "absent"), "absent", "does not exist", "huggingface-cli download");
  write_file(dir / "file", "x");
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "file"), "not a directory");
  fs::create_directory(out);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "holds no config.json");

  export_hf_model(store, cfg, out, exporting(DType::f32));
  const std::string config = (out / "config.json").string();
  const std::string good = read_file(out / "config.json");
  write_file(out / "config.json", "{\"architectures\": [\"LlamaForCausalLM\"], ");
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), config, "malformed JSON");
  json j = json::parse(good);
  j["architectures"] = {"GPT2LMHeadModel"};
  write_file(out / "config.json", j.dump());
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), config, "architecture 'GPT2LMHeadModel' is not supported");
  j = json::parse(good);
  j.erase("hidden_size");
  write_file(out / "config.json", j.dump());
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), config, "'hidden_size' is missing");
  write_file(out / "config.json", good);
  CHECK_NOTHROW(HfCheckpoint::open(out));

  // Only PyTorch pickles.
  fs::remove(out / "model.safetensors");
  write_file(out / "pytorch_model.bin", "pickle");
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "pytorch_model.bin", "safetensors only");
  fs::remove(out / "pytorch_model.bin");
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "neither model.safetensors.index.json nor model.safetensors");
}

TEST_CASE("bad input: corrupt safetensors files, through the HF loader") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  const auto file = out / "model.safetensors";
  const std::string f = file.string();
  export_hf_model(store, cfg, out, exporting(DType::f32));
  const std::string good = read_file(file);
  // The tensor stored last in the file and the one before it (data order).
  const auto ckpt = SafetensorsCheckpoint::open(out);
  const auto tensors = ckpt.files()[0].tensors();
  const std::string last = tensors.back().name, before_last = tensors[tensors.size() - 2].name;
  const auto restore = [&] { write_file(file, good); };

  SUBCASE("truncated") {
    write_file(file, good.substr(0, good.size() - 100));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "'" + last + "'", "past the end of the data section");
    write_file(file, good.substr(0, 5));
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "too short");
  }
  SUBCASE("a header length past the end of the file") {
    std::string b = good;
    const std::uint64_t n = b.size();
    for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_file(file, b);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "past the end of the file");
  }
  SUBCASE("malformed JSON in the header") {
    rewrite_header(file, [](const std::string& h) { return h.substr(0, h.rfind('}')); });
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "not valid JSON");
  }
  SUBCASE("an unknown dtype") {
    rewrite_header(file, [&](const std::string& h) {
      return edit_json(h, [&](json& j) { j[last]["dtype"] = "F13"; });
    });
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "'" + last + "'", "unknown dtype \"F13\"");
  }
  SUBCASE("overlapping data offsets") {
    rewrite_header(file, [&](const std::string& h) {
      return edit_json(h, [&](json& j) {
        auto& o = j[last]["data_offsets"];
        o = {o[0].get<std::uint64_t>() - 4, o[1].get<std::uint64_t>() - 4};
      });
    });
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "'" + last + "'", "overlaps tensor '" + before_last + "'");
  }
  SUBCASE("data offsets past the end of the data") {
    rewrite_header(file, [&](const std::string& h) {
      return edit_json(h, [&](json& j) {
        auto& o = j[last]["data_offsets"];
        o = {o[0].get<std::uint64_t>() + 4, o[1].get<std::uint64_t>() + 4};
      });
    });
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "'" + last + "'", "past the end of the data section");
  }
  SUBCASE("a duplicate tensor name in one header") {
    rewrite_header(file, [&](const std::string& h) {
      // Rename the last tensor to the one before it: the JSON then holds that key twice.
      std::string s = h;
      const auto at = s.find("\"" + last + "\"");
      REQUIRE(at != std::string::npos);
      s.replace(at, last.size() + 2, "\"" + before_last + "\"");
      return s;
    });
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), f, "'" + before_last + "' appears twice");
  }
  restore();
  CHECK_NOTHROW(HfCheckpoint::open(out));
}

TEST_CASE("bad input: a weight holding NaN or an infinity is refused at load, naming the tensor") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  export_hf_model(store, cfg, out, exporting(DType::f32));
  const std::string good = read_file(out / "model.safetensors");
  const auto ckpt = SafetensorsCheckpoint::open(out);
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const auto& info = ckpt.files()[0].tensor(name);
  const std::uint64_t header = ckpt.files()[0].header().data_start;
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    CAPTURE(bad);
    std::string b = good;
    const std::size_t at = header + info.data_begin + 7 * sizeof(float);  // element 7
    std::memcpy(b.data() + at, &bad, sizeof(float));
    write_file(out / "model.safetensors", b);
    CHECK_ERROR_MENTIONS(load_hf_model(out), "'" + name + "'", "non-finite", "element 7",
                         (out / "model.safetensors").string());
  }
  write_file(out / "model.safetensors", good);
  CHECK_NOTHROW(load_hf_model(out));
}

TEST_CASE("bad input: sharded checkpoints, through the HF loader") {
  const ModelConfig cfg = ModelConfig::from_json(llama_json(false));
  const auto store = random_store(cfg);
  TempDir dir;
  const auto out = dir / "m";
  export_hf_model(store, cfg, out, exporting(DType::f32, 60'000));
  const auto index = out / "model.safetensors.index.json";
  const std::string idx = index.string();
  json map = json::parse(read_file(index));
  const std::string shard1 = map["weight_map"]["model.embed_tokens.weight"];
  const std::string shard_last = map["weight_map"]["lm_head.weight"];
  REQUIRE(shard1 != shard_last);

  SUBCASE("the same tensor in two shards") {
    // Rewrite the last shard with model.norm.weight added; the index keeps mapping it to its shard.
    const std::string norm_shard = map["weight_map"]["model.norm.weight"];
    REQUIRE(norm_shard < shard_last);  // a later shard also holding it: the index is consistent with the first
    const std::string other = shard_last;
    const auto ckpt = SafetensorsCheckpoint::open(out);
    std::vector<TensorToWrite> t;
    for (const auto& f : ckpt.files())
      if (f.path().filename() == other)
        for (const auto& info : f.tensors()) t.emplace_back(info.name, View<const float>(store.master(info.name)));
    t.emplace_back("model.norm.weight", View<const float>(store.master("model.norm.weight")));
    write_safetensors(dir / "tmp.safetensors", t);
    fs::rename(dir / "tmp.safetensors", out / other);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'model.norm.weight'", "two shards", norm_shard, other);
  }
  SUBCASE("a missing shard") {
    fs::remove(out / shard_last);
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), idx, "'" + shard_last + "'", "does not exist");
  }
  SUBCASE("a tensor missing from the index") {
    // The embedding's shard also holds other tensors, so the index still names it.
    map["weight_map"].erase("model.embed_tokens.weight");
    write_file(index, map.dump());
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'model.embed_tokens.weight'", shard1, "does not list");
  }
  SUBCASE("malformed index JSON") {
    write_file(index, "{\"weight_map\": {");
    CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), idx, "not valid JSON");
  }
}

TEST_CASE("MXFP4 dequantization: E2M1 values times 2^(scale - 127), transposed, at sizes that split across threads") {
  // (the format's definition, written out: the low nibble first, value = sign x {0, .5, 1, 1.5,
  // 2, 3, 4, 6}[magnitude] x 2^(scale - 127), out[p, g * 32 + 2 b (+ 1), r] from blocks[p, r, g, b])
  std::mt19937 rng(77);
  const std::int64_t P = 3, R = 67, G = 5;
  std::vector<std::uint8_t> blocks(static_cast<std::size_t>(P * R * G * 16)), scales(static_cast<std::size_t>(P * R * G));
  for (auto& b : blocks) b = static_cast<std::uint8_t>(rng() & 0xFF);
  for (auto& s : scales) s = static_cast<std::uint8_t>(100 + rng() % 50);
  std::vector<float> out(static_cast<std::size_t>(P * R * G * 32), std::numeric_limits<float>::quiet_NaN());
  megatrain::io::dequantize_mxfp4(blocks, scales, P, R, G, out);
  const float magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::size_t mismatches = 0;
  for (std::int64_t p = 0; p < P; ++p)
    for (std::int64_t r = 0; r < R; ++r)
      for (std::int64_t g = 0; g < G; ++g)
        for (int b = 0; b < 16; ++b)
          for (int half = 0; half < 2; ++half) {
            const std::size_t grp = static_cast<std::size_t>((p * R + r) * G + g);
            const int nibble = half == 0 ? blocks[grp * 16 + b] & 0x0F : blocks[grp * 16 + b] >> 4;
            const double want = (nibble & 8 ? -1.0 : 1.0) * magnitude[nibble & 7] * std::pow(2.0, scales[grp] - 127);
            const float got = out[static_cast<std::size_t>((p * G * 32 + g * 32 + 2 * b + half) * R + r)];
            mismatches += static_cast<double>(got) != want;
          }
  CHECK(mismatches == 0);
}

TEST_CASE("fused parts: gather and scatter are each other's inverse over strided places") {
  // GPT-OSS's layout: expert e's gate in the even columns of gate_up_proj [E, H, 2I], transposed
  const std::int64_t E = 3, H = 37, I = 53;
  std::vector<megatrain::io::FusedPart> parts;
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t half = 0; half < 2; ++half)
      parts.push_back({fmt::format("p{}", e * 2 + half), {I, H}, e * H * 2 * I + half, {2, 2 * I}});
  std::vector<float> fused(static_cast<std::size_t>(E * H * 2 * I));
  for (std::size_t i = 0; i < fused.size(); ++i) fused[i] = static_cast<float>(i);
  std::vector<float> back(fused.size(), -1.0f);
  for (const auto& part : parts) {
    std::vector<float> v(static_cast<std::size_t>(I * H));
    megatrain::io::gather_part(part, fused, v);
    for (std::int64_t o = 0; o < I; ++o)  // element (o, i) of the part: fused[e, i, 2 o + half]
      for (std::int64_t i = 0; i < H; ++i)
        REQUIRE(v[static_cast<std::size_t>(o * H + i)] == fused[static_cast<std::size_t>(part.offset + i * 2 * I + 2 * o)]);
    megatrain::io::scatter_part(part, v, back);
  }
  CHECK(back == fused);  // every element placed once, where it came from
}

TEST_CASE("Gemma3ForConditionalGeneration: the language model read under language_model., the vision tower left alone") {
  const json text = json::parse(R"({"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","hidden_size":32,
    "intermediate_size":56,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
    "vocab_size":97,"query_pre_attn_scalar":8,"sliding_window":4,"layer_types":["sliding_attention","full_attention"]})");
  json mm = {{"architectures", json::array({"Gemma3ForConditionalGeneration"})}, {"model_type", "gemma3"}, {"text_config", text}};
  mm["text_config"].erase("architectures");
  const ModelConfig cfg = ModelConfig::from_json(text);
  const auto store = random_store(cfg);
  auto t = tensors_of(store, SafetensorsDType::f32);
  for (auto& x : t) x.name = "language_model." + x.name;
  const std::vector<float> patch(48, 0.5f);
  t.emplace_back("vision_tower.vision_model.embeddings.patch_embedding.weight",
                 View<const float>(std::span<const float>(patch), Shape{4, 12}), SafetensorsDType::f32);
  TempDir dir;
  const auto out = dir / "m";
  write_model(out, t, mm);
  const HfModel m = load_hf_model(out);
  CHECK(m.config.checkpoint_prefix == "language_model.");
  REQUIRE(m.ignored.size() == 1);
  CHECK(m.ignored[0].starts_with("1 tensors of the vision tower"));
  for (const auto& u : store.units())
    for (const auto& p : u.params()) {
      CAPTURE(p.spec.name);
      const auto a = store.master(p.spec.name).span(), b = m.store.master(p.spec.name).span();
      CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
    }
  // a tensor under another name (transformers 5's in-memory "model.language_model."): missing,
  // and the stray one named with where the language model is read from
  auto renamed = t;
  for (auto& x : renamed)
    if (x.name == "language_model.model.norm.weight") x.name = "model.language_model.norm.weight";
  write_model(out, renamed, mm);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(out), "'language_model.model.norm.weight' is missing",
                       "unexpected tensor 'model.language_model.norm.weight'", "read under 'language_model.'");
}

TEST_CASE("Qwen3.5-MoE's experts: read stacked (the Hub's folders) or one tensor per expert (transformers'), exported per expert") {
  const json config = json::parse(R"({"architectures":["Qwen3_5MoeForCausalLM"],"model_type":"qwen3_5_moe_text",
    "hidden_size":16,"num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":8,"vocab_size":37,
    "linear_num_key_heads":1,"linear_num_value_heads":2,"linear_key_head_dim":4,"linear_value_head_dim":4,
    "layer_types":["linear_attention","full_attention"],"num_experts":3,"num_experts_per_tok":2,
    "moe_intermediate_size":6,"shared_expert_intermediate_size":5})");
  const ModelConfig cfg = ModelConfig::from_json(config);
  const auto store = random_store(cfg);
  const auto same_masters = [&](const HostParamStore<float>& loaded) {
    for (const auto& u : store.units())
      for (const auto& p : u.params()) {
        CAPTURE(p.spec.name);
        const auto a = store.master(p.spec.name).span(), b = loaded.master(p.spec.name).span();
        CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
      }
  };
  TempDir dir;
  // one tensor per expert, as transformers' save_pretrained writes them (and the export)
  const auto per_expert = tensors_of(store, SafetensorsDType::f32);
  write_model(dir / "per-expert", per_expert, config);
  same_masters(load_hf_model(dir / "per-expert").store);
  HfExportOptions f32;
  f32.dtype = DType::f32;
  export_hf_model(store, cfg, dir / "export", f32);
  std::set<std::string> names;
  for (const auto& t : per_expert) names.insert(t.name);
  const auto exported = SafetensorsCheckpoint::open(dir / "export").names();
  CHECK(std::set<std::string>(exported.begin(), exported.end()) == names);
  // stacked, as the Hub's folders hold them: expert e's gate rows, then its up rows; its down
  const std::int64_t E = 3, I = 6, d = 16;
  std::vector<std::vector<float>> stacks;
  std::vector<TensorToWrite> stacked;
  for (const auto& t : per_expert)
    if (t.name.find(".mlp.experts.") == std::string::npos) stacked.push_back(t);
  for (const int l : {0, 1}) {
    const auto w = [&](std::int64_t e, const char* what) {
      return store.master(fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", l, e, what)).span();
    };
    std::vector<float> gate_up, down;
    for (std::int64_t e = 0; e < E; ++e) {
      for (const char* part : {"gate_proj", "up_proj"}) gate_up.insert(gate_up.end(), w(e, part).begin(), w(e, part).end());
      down.insert(down.end(), w(e, "down_proj").begin(), w(e, "down_proj").end());
    }
    stacks.push_back(std::move(gate_up));
    stacks.push_back(std::move(down));
  }
  for (const int l : {0, 1}) {
    const auto& gu = stacks[static_cast<std::size_t>(2 * l)];
    const auto& dn = stacks[static_cast<std::size_t>(2 * l + 1)];
    stacked.emplace_back(fmt::format("model.layers.{}.mlp.experts.gate_up_proj", l),
                         View<const float>(std::span<const float>(gu), Shape{E, 2 * I, d}), SafetensorsDType::f32);
    stacked.emplace_back(fmt::format("model.layers.{}.mlp.experts.down_proj", l),
                         View<const float>(std::span<const float>(dn), Shape{E, d, I}), SafetensorsDType::f32);
  }
  write_model(dir / "stacked", stacked, config);
  same_masters(load_hf_model(dir / "stacked").store);
  // the Hub's Qwen3_5MoeForConditionalGeneration folder: the stacked experts and the rest under
  // model.language_model. (lm_head.weight at the top), a vision tower and mtp.* beside them
  json mm = {{"architectures", json::array({"Qwen3_5MoeForConditionalGeneration"})}, {"model_type", "qwen3_5_moe"},
             {"text_config", config}};
  mm["text_config"].erase("architectures");
  auto published = stacked;
  for (auto& t : published)
    if (t.name.starts_with("model.")) t.name = "model.language_model." + t.name.substr(6);
  const std::vector<float> side(24, 0.25f);
  for (const char* name : {"model.visual.patch_embed.proj.weight", "mtp.fc.weight"})
    published.emplace_back(name, View<const float>(std::span<const float>(side), Shape{4, 6}), SafetensorsDType::f32);
  write_model(dir / "published", published, mm);
  const HfModel wrapped = load_hf_model(dir / "published");
  same_masters(wrapped.store);
  CHECK(wrapped.config.wrapper_architecture == "Qwen3_5MoeForConditionalGeneration");
  REQUIRE(wrapped.ignored.size() == 1);
  CHECK(wrapped.ignored[0].starts_with("2 tensors of the vision tower and its projector and of the multi-token prediction"));
  // a text model's name in it: missing where the wrapper keeps it, and a stray
  auto plain_name = published;
  for (auto& t : plain_name)
    if (t.name == "model.language_model.norm.weight") t.name = "model.norm.weight";
  write_model(dir / "published-bad", plain_name, mm);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "published-bad"), "'model.language_model.norm.weight' is missing",
                       "unexpected tensor 'model.norm.weight'", "read under 'model.language_model.'");
  // both at once: the per-expert tensors are strays beside the stacked ones
  auto both = stacked;
  for (const auto& t : per_expert)
    if (t.name == "model.layers.0.mlp.experts.0.gate_proj.weight") both.push_back(t);
  write_model(dir / "both", both, config);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "both"), "unexpected tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'");
  // a per-expert folder without one of them: that one named
  auto short_one = per_expert;
  std::erase_if(short_one, [](const TensorToWrite& t) { return t.name == "model.layers.0.mlp.experts.0.gate_proj.weight"; });
  write_model(dir / "short", short_one, config);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "short"), "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' is missing");
  // neither layout: the stacked tensor named, and the per-expert one it may be instead
  auto none = stacked;
  std::erase_if(none, [](const TensorToWrite& t) { return t.name == "model.layers.1.mlp.experts.down_proj"; });
  write_model(dir / "none", none, config);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "none"), "tensor 'model.layers.1.mlp.experts.down_proj' is missing",
                       "or each of them as a tensor of its own, such as 'model.layers.1.mlp.experts.0.down_proj.weight'");
  // a stacked tensor of the wrong shape: refused, naming it
  auto bad = stacked;
  for (auto& t : bad)
    if (t.name == "model.layers.1.mlp.experts.down_proj")
      t = TensorToWrite(t.name, View<const float>(std::span<const float>(stacks[3]), Shape{E, I, d}), SafetensorsDType::f32);
  write_model(dir / "bad", bad, config);
  CHECK_ERROR_MENTIONS(HfCheckpoint::open(dir / "bad"), "tensor 'model.layers.1.mlp.experts.down_proj'", "has shape [3, 6, 16]");
}

TEST_CASE("Qwen3.5's published folders: the whole model exported, the vision tower and mtp.* carried byte for byte") {
  // The fixture is a Qwen3_5ForConditionalGeneration folder written by transformers' save_pretrained
  // (a Conv3d patch embedding among its vision tensors: rank 5).
  const fs::path src = fs::path(MEGATRAIN_TEST_FIXTURES) / "qwen3_5_mm";
  const auto original = SafetensorsCheckpoint::open(src / "model.safetensors");
  std::vector<std::string> beside;
  for (const auto& n : original.names())
    if (n.starts_with("model.visual.") || n.starts_with("mtp.")) beside.push_back(n);
  REQUIRE(beside.size() >= 5);
  const HfCheckpoint ckpt = HfCheckpoint::open(src);
  CHECK(ckpt.beside() == beside);
  const auto carried = ckpt.carried();
  REQUIRE(carried.has_value());
  CHECK(carried->names == beside);
  CHECK(carried->dir == fs::absolute(src).lexically_normal());
  CHECK(CarriedTensors::from_json(carried->to_json(), "test").digest == carried->digest);
  // a trained store: the fixture's weights, moved
  HfModel m = load_hf_model(src, small_store());
  std::normal_distribution<float> d(0.0f, 0.01f);
  for (auto& u : m.store.units()) {
    for (const auto& p : u.params())
      for (float& x : m.store.master(p.spec.name).span()) x += d(rng());
    m.store.sync_compute(u);
  }
  const auto bytes_of = [](const TensorRef& r) {
    const auto b = r.bytes();
    return std::string(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
  };
  for (const DType t : {DType::f32, DType::bf16}) {
    for (const bool sharded : {false, true}) {
      INFO(dtype_name(t) << (sharded ? ", sharded" : ", one file"));
      TempDir dir;
      HfExportOptions o = exporting(t, sharded ? 20'000 : 5'000'000'000);
      o.config_json = ckpt.config_text();
      o.carry = carried;
      export_hf_model(m.store, m.config, dir / "export", o);
      // the folder's config.json, the dtype set (at the top and in text_config)
      const json written = json::parse(read_file(dir / "export" / "config.json"));
      json want = json::parse(ckpt.config_text());
      for (json* c : {&want, &want["text_config"]}) (*c)["dtype"] = (*c)["torch_dtype"] = std::string(torch_dtype_name(t));
      CHECK(written == want);
      // every tensor of the folder, under its name; the carried ones byte for byte, in their dtype
      const auto out = SafetensorsCheckpoint::open(dir / "export");
      CHECK(out.sharded() == sharded);
      CHECK(out.names() == original.names());
      for (const auto& n : beside) {
        CAPTURE(n);
        const TensorRef a = original.tensor(n), b = out.tensor(n);
        CHECK(b.bytes().dtype == a.bytes().dtype);
        CHECK(b.info->shape == a.info->shape);
        CHECK(bytes_of(b) == bytes_of(a));
      }
      // the language model: the store's masters, as stored in `t`; the export carries the same again
      const HfCheckpoint back = HfCheckpoint::open(dir / "export");
      CHECK(back.config().wrapper_architecture == "Qwen3_5ForConditionalGeneration");
      HfModel reread = load_hf_model(dir / "export", small_store());
      check_masters(m.store, reread.store, t);
      const auto again = back.carried();
      REQUIRE(again.has_value());
      CHECK(again->digest == carried->digest);
      // without carry: the language model alone, a Qwen3_5ForCausalLM folder
      export_hf_model(m.store, m.config, dir / "text", exporting(t));
      CHECK(json::parse(read_file(dir / "text" / "config.json")).at("architectures") == json::array({"Qwen3_5ForCausalLM"}));
      for (const auto& n : SafetensorsCheckpoint::open(dir / "text").names())
        CHECK((!n.starts_with("model.visual.") && !n.starts_with("mtp.") && !n.starts_with("model.language_model.")));
    }
  }
  // a folder that changed since it was read: refused, naming it; nothing written
  TempDir dir;
  fs::copy(src, dir / "model");
  const auto moved = HfCheckpoint::open(dir / "model").carried();
  REQUIRE(moved.has_value());
  CHECK(moved->digest == carried->digest);
  std::vector<float> keep;
  {
    auto weights = SafetensorsCheckpoint::open(dir / "model" / "model.safetensors");
    std::vector<TensorToWrite> ts;
    std::vector<std::vector<float>> values;
    values.reserve(weights.names().size());
    for (const auto& n : weights.names()) {
      const auto info = weights.tensor(n).info;
      std::vector<std::int64_t> shape(info->shape.begin(), info->shape.end());
      if (n == "mtp.fc.weight") {
        auto& v = values.emplace_back(static_cast<std::size_t>(info->numel()));
        read_into(weights.tensor(n), View<float>(std::span<float>(v), Shape(shape)));
        v[3] += 1.0f;
        ts.emplace_back(n, View<const float>(std::span<const float>(v), Shape(shape)), SafetensorsDType::f32);
      } else {
        ts.emplace_back(n, weights.tensor(n).bytes());
      }
    }
    write_safetensors(dir / "model" / "model.safetensors", ts, {{"format", "pt"}});
  }
  HfExportOptions o = exporting(DType::bf16);
  o.config_json = ckpt.config_text();
  o.carry = moved;
  CHECK_ERROR_MENTIONS(export_hf_model(m.store, m.config, dir / "export", o), (dir / "model").string(),
                       "they changed since the run read them", "--export-language-model");
  CHECK(!fs::exists(dir / "export"));
  fs::remove_all(dir / "model");
  CHECK_ERROR_MENTIONS(export_hf_model(m.store, m.config, dir / "export", o), "it is gone");
  // carry with a text model's config.json, or none: refused before anything is written
  o.carry = carried;
  o.config_json.clear();
  CHECK_ERROR_MENTIONS(export_hf_model(m.store, m.config, dir / "export", o), "HfExportOptions::carry",
                       "config_json must be that folder's config.json");
  CHECK(!fs::exists(dir / "export"));
  // folders with nothing to carry: a text model's, Gemma 3's published ones (exported as their language model)
  CHECK(!HfCheckpoint::open(fs::path(MEGATRAIN_TEST_FIXTURES) / "qwen3_5").carried().has_value());
  CHECK(!HfCheckpoint::open(fs::path(MEGATRAIN_TEST_FIXTURES) / "gemma3_mm").carried().has_value());
}
