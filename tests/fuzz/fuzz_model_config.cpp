// libFuzzer target: config.json into ModelConfig, then HfCheckpoint::open's checks of a checkpoint
// against it.
//
// Each input is the text of a config.json. It is parsed (a JSON syntax error is not a finding)
// and read by ModelConfig::from_json, which validates. A config it accepts must survive to_json
// and from_json unchanged and give finite rotary frequencies. Then the text is written as the
// config.json of a tiny valid checkpoint of the config's family (written once per process in a
// tmpfs folder, fuzz_fixtures.hpp) and HfCheckpoint::open checks the weights against it: a
// checkpoint it accepts must hold the model the config describes and load into a store.
// Anything else than success or megatrain::Error is a finding, and so is an allocation beyond
// -malloc_limit_mb (a config describing a huge model must be refused before anything of its
// size is allocated).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_fixtures.hpp"
#include "fuzz_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/model/config.hpp"

using namespace megatrain;
using megatrain::fuzz::Scratch;
using json = nlohmann::json;

namespace {

struct Fixtures {
  Scratch scratch{"model_config"};
  std::map<std::string, fuzz::fs::path> dirs;  // fixture name -> model folder
  Fixtures() {
    for (const auto& f : fuzz::hf_fixtures()) {
      const auto dir = scratch / f.name;
      fuzz::write_hf_fixture(f, dir);
      dirs[f.name] = dir;
    }
  }
};

Fixtures& fixtures() {
  static Fixtures f;
  return f;
}

void check_config(const ModelConfig& c) {
  c.validate("fuzz");  // (from_json validated it: must not throw)
  const json j = c.to_json();
  const ModelConfig back = ModelConfig::from_json(j, "fuzz round trip");
  FUZZ_REQUIRE(back.to_json() == j);
  FUZZ_REQUIRE(c.param_count() > 0);
  FUZZ_REQUIRE(c.rotary_dim() >= 2 && c.rotary_dim() <= c.head_dim && c.rotary_dim() % 2 == 0);
  FUZZ_REQUIRE(std::isfinite(c.attention_scale()) && c.attention_scale() > 0);
  FUZZ_REQUIRE(std::isfinite(c.embed_scale()) && c.embed_scale() > 0);
  if (c.head_dim <= 4096) {
    const std::int64_t layers = std::min<std::int64_t>(c.num_hidden_layers, 8);
    for (std::int64_t l = 0; l < layers; ++l) {
      const ModelConfig r = c.rope_for_layer(l);
      FUZZ_REQUIRE(c.attention_window(l) >= 0);
      const double scaling = r.rope_attention_scaling();
      FUZZ_REQUIRE(std::isfinite(scaling));
      for (const std::int64_t seq : {std::int64_t{0}, c.max_position_embeddings + 1}) {
        const auto f = r.rope_inv_freq(seq);
        FUZZ_REQUIRE(static_cast<std::int64_t>(f.size()) == c.rotary_dim() / 2);
        for (const double x : f) FUZZ_REQUIRE(std::isfinite(x) && x >= 0);
      }
    }
  }
  for (const std::int64_t seq : {std::int64_t{1}, c.max_position_embeddings, c.max_position_embeddings + 1}) {
    try {
      c.check_sequence_length(seq);
    } catch (const Error&) {
    }
  }
}

void check_open(const ModelConfig& c, std::string_view text, bool allow_dtype_mismatch) {
  const auto& dir = fixtures().dirs.at(fuzz::hf_fixture_for(c));
  fuzz::write_file(dir / "config.json", text);
  io::HfOpenOptions o;
  o.allow_dtype_mismatch = allow_dtype_mismatch;
  std::optional<io::HfCheckpoint> ckpt;
  try {
    ckpt.emplace(io::HfCheckpoint::open(dir, o));
  } catch (const Error&) {
    return;
  }
  // Accepted: the checkpoint holds exactly the model the config describes, and loads.
  FUZZ_REQUIRE(ckpt->config().to_json() == c.to_json());
  FUZZ_REQUIRE(ckpt->config_text() == text);
  FUZZ_REQUIRE(ckpt->param_count() == c.param_count());
  std::int64_t n = 0;
  for (const auto& u : ckpt->units())
    for (const auto& p : u.params) {
      const io::TensorRef r = ckpt->source(p.name);
      n += p.numel();
      FUZZ_REQUIRE(r.info->numel() >= p.numel());
    }
  FUZZ_REQUIRE(n == c.param_count());
  HostParamStore<float> store(ckpt->units(), fuzz::tiny_store_options());
  ckpt->load_into(store);
  for (const auto& u : store.units())
    for (const float x : u.master()) FUZZ_REQUIRE(std::isfinite(x));
}

// HfCheckpoint::open must refuse a config.json that ModelConfig::from_json refuses (it reads the
// same file the same way), with megatrain::Error.
void check_open_refuses(std::string_view text) {
  const auto& dir = fixtures().dirs.at("llama");
  fuzz::write_file(dir / "config.json", text);
  try {
    (void)io::HfCheckpoint::open(dir);
    FUZZ_REQUIRE(!"HfCheckpoint::open accepted a config.json that ModelConfig::from_json refuses");
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)fixtures();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = fuzz::as_text(data, size);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception&) {
    // not JSON, or a number beyond a double's range (1e400: nlohmann's out_of_range):
    // HfCheckpoint::open says so, naming the file
    check_open_refuses(text);
    return 0;
  }
  std::optional<ModelConfig> c;
  try {
    c = ModelConfig::from_json(j, "fuzz");
  } catch (const Error&) {
    check_open_refuses(text);
    return 0;
  }
  check_config(*c);
  check_open(*c, text, (size & 1) != 0);
  return 0;
}
