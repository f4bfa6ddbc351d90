// libFuzzer target: megatrain-train's --config file (src/app/parse.hpp, options.hpp) and what
// the program derives from the options before it opens anything.
//
// An input is the text of a --config file, optionally followed by a NUL byte and command-line
// arguments, one per line (those naming another --config file are dropped: the file is the
// harness's). parse() must succeed or refuse with CLI::ParseError or megatrain::Error (what
// megatrain-train's main catches). Then, as the program does: check_model_source, min_lr_of,
// the model shape given by flags or a preset (ModelConfig; a --model-config path is not
// followed), step_layout for its layers and TrainerOptions::validate, parse_shard_size,
// parse_byte_size of --host-memory and --gpu-memory: each succeeds or throws megatrain::Error.
// The options a checkpoint records (recorded_options) must replay (replay_args, parse again as a
// resumed run does) to the same record.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "options.hpp"
#include "parse.hpp"

using namespace megatrain;
using namespace megatrain::app;
using megatrain::fuzz::Scratch;

namespace {

Scratch& scratch() {
  static Scratch s("cli_config");
  return s;
}

template <class F>
void refusable(F&& f) {
  try {
    f();
  } catch (const Error&) {
  }
}

void derive(const Parsed& p) {
  const Settings& s = *p.settings;
  refusable([&] { check_model_source(s); });
  refusable([&] { (void)min_lr_of(s); });
  std::int64_t layers = s.layers;
  if (s.model_config.empty()) {
    refusable([&] { layers = model_config(s, *p.app, 256, nullptr).num_hidden_layers; });
  }
  refusable([&] {
    const TrainerOptions o = step_layout(s, layers);
    refusable([&] { o.validate(); });
    (void)o.resolved();
  });
  refusable([&] { (void)io::parse_shard_size(s.shard_size); });
  for (const std::string* size : {&s.host_memory, &s.gpu_memory})
    if (!size->empty()) refusable([&] { (void)parse_byte_size(size->c_str()); });
  for (const std::string* v : {&s.device_units, &s.keep_activations}) (void)parse_auto_all_count(*v);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::limit_threads();
  (void)scratch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto [config, rest] = fuzz::split_at(fuzz::as_text(data, size), '\0');
  const auto path = scratch() / "config.json";
  fuzz::write_file(path, config);
  std::vector<std::string> args{"--config", path.string()};
  if (rest) {
    std::string_view r = *rest;
    while (!r.empty()) {
      const auto nl = r.find('\n');
      const std::string a(r.substr(0, nl));
      r.remove_prefix(nl == std::string_view::npos ? r.size() : nl + 1);
      if (a.find("--config") == std::string::npos && a.find('\0') == std::string::npos) args.push_back(a);
    }
  }
  Parsed p;
  try {
    parse(p, args);
  } catch (const CLI::ParseError&) {
    return 0;
  } catch (const Error&) {
    return 0;
  }
  derive(p);

  // What a checkpoint records must replay to the same record (a resumed run's options).
  std::optional<nlohmann::json> recorded;
  try {
    recorded = recorded_options(p);
  } catch (const Error&) {
    return 0;  // (min_lr_of refuses contradictory options: the program stops there too)
  }
  Parsed again;
  parse(again, {}, replay_args(*recorded));
  FUZZ_REQUIRE(recorded_options(again) == *recorded);
  derive(again);
  return 0;
}
