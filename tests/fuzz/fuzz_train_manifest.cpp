// libFuzzer target: the train-state manifest, TrainCheckpoint::open (train_state.json and
// checksums.xxh128) and train_state_from_json (what a resume reads from train_state.json).
//
// An input is the text of train_state.json, optionally followed by a NUL byte and the text of
// checksums.xxh128. Both are written into a small valid train-state checkpoint (written once per
// process in a tmpfs folder by megatrain's own writer, as megatrain-train saves one: two tensor
// shards and their index, config.json, a side file). Without a checksums part the listing is
// the fixture's with train_state.json's digest updated, so the digests verify and the JSON is
// what is tested. TrainCheckpoint::open (not verifying, and verifying where that succeeded and a
// listing was given, or for one input in 16) must succeed or throw
// megatrain::Error; an opened checkpoint lists what it read, and its state, when
// train_state_from_json accepts it, must survive to_json and back unchanged. The tensors are
// then loaded into a store of the fixture's model (the shards are never altered).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz_fixtures.hpp"
#include "fuzz_util.hpp"
#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/train/checkpointer.hpp"

using namespace megatrain;
using megatrain::fuzz::Scratch;
using json = nlohmann::json;

namespace {

struct Fixture {
  Scratch scratch{"train_manifest"};
  fuzz::fs::path dir = scratch / "step-00000003";
  std::string checksums;  // as written, less train_state.json's line
  Fixture() {
    fuzz::write_train_fixture(dir);
    const std::string text = fuzz::read_file(dir / io::kChecksumsFile);
    std::string_view all = text;
    while (!all.empty()) {
      const auto nl = all.find('\n');
      const std::string_view line = all.substr(0, nl + 1);
      all.remove_prefix(nl + 1);
      if (!line.ends_with(std::string("  ") + std::string(io::kTrainStateFile) + "\n")) checksums += line;
    }
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void check_state(const io::TrainCheckpoint& ckpt) {
  const json& state = ckpt.state();
  FUZZ_REQUIRE(state.is_object());
  std::optional<TrainState> st;
  try {
    st = train_state_from_json(state, "fuzz");
  } catch (const Error&) {
    return;
  }
  const json j = to_json(*st);
  const TrainState back = train_state_from_json(j, "fuzz round trip");
  FUZZ_REQUIRE(to_json(back) == j);
  try {
    st->options.validate();
  } catch (const Error&) {
  }
  (void)update_differences(st->options, fuzz::train_fixture_state().options);
  (void)model_differences(st->model, fuzz::train_fixture_model().to_json());
  try {
    (void)ModelConfig::from_json(st->model, "fuzz model");
  } catch (const Error&) {
  }
}

bool open_and_check(const fuzz::fs::path& dir, bool verify) {
  std::optional<io::TrainCheckpoint> ckpt;
  try {
    ckpt.emplace(io::TrainCheckpoint::open(dir, verify));
  } catch (const Error&) {
    return false;
  }
  FUZZ_REQUIRE(ckpt->dir() == dir);
  FUZZ_REQUIRE(ckpt->file(io::kTrainStateFile).has_value());
  FUZZ_REQUIRE(!ckpt->file(io::kChecksumsFile).has_value());
  (void)ckpt->file("config.json");
  check_state(*ckpt);
  HostParamStore<float> store = fuzz::train_fixture_store();
  try {
    ckpt->load_into(store);
  } catch (const Error&) {
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)fixture();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto [state, sums] = fuzz::split_at(fuzz::as_text(data, size), '\0');
  Fixture& f = fixture();
  const auto state_path = f.dir / io::kTrainStateFile;
  fuzz::write_file(state_path, state);
  // The listing: the fuzzed one, or the fixture's with train_state.json's digest brought up to
  // date. Digests are verified only where the rest opened (digest_file reads each file through
  // a fresh 8 MiB buffer: slow for fuzzing, and the same for every input).
  fuzz::write_file(f.dir / io::kChecksumsFile,
                   sums ? std::string(*sums)
                        : f.checksums + digest_of(std::as_bytes(std::span(state.data(), state.size()))).hex() + "  " +
                              std::string(io::kTrainStateFile) + "\n");
  if (open_and_check(f.dir, false) && (sums || size % 16 == 0)) open_and_check(f.dir, true);
  return 0;
}
