// Writes the generated part of a fuzz target's seed corpus into a directory (the committed part
// is tests/fuzz/seeds/<target>/):
//
//   make_fuzz_seeds TARGET SEED_DIR REPO_ROOT
//
//   model_config     every config.json of the repository (tests/model/configs, tests/fixtures),
//                    ModelConfig::preset(name).to_json() of every preset, the fuzz fixtures'
//                    config.json as exported, and configs of huge models (10^9 layers, 2^40 wide)
//   train_manifest   train_state.json as megatrain-train writes it, alone and with its real
//                    checksums.xxh128, and older or partial variants
//   token_file       uint16, uint32, llm.c and text files, examples with their .mask and .idx
//                    (derived and raw), in fuzz_token_file.cpp's input layout
//   tokenizer_json   the cut-down real tokenizers of tests/fuzz/tokenizers/
//   chat_template    their tokenizer_config.json files (the template inline, and as
//                    chat_template.jinja) with a few conversations, in fuzz_chat_template.cpp's
//                    layout
//   other targets    nothing (their seeds are committed)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz_fixtures.hpp"
#include "fuzz_util.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/model/config.hpp"

namespace fs = std::filesystem;
using namespace megatrain;
using json = nlohmann::json;
using fuzz::read_file;
using fuzz::write_file;

namespace {

void seed(const fs::path& dir, const std::string& name, std::string_view bytes) { write_file(dir / name, bytes); }

std::string file_name(const fs::path& p) {
  std::string s = p.parent_path().filename().string() + "-" + p.filename().string();
  for (char& c : s)
    if (c == '/' || c == ' ') c = '_';
  return s;
}

void model_config(const fs::path& out, const fs::path& root) {
  for (const fs::path dir : {root / "tests/model/configs", root / "tests/fixtures"}) {
    std::error_code ec;
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->is_regular_file() && it->path().extension() == ".json" && it->path().filename() != "generation_config.json")
        seed(out, "repo-" + file_name(it->path()), read_file(it->path()));
  }
  for (const auto& name : ModelConfig::preset_names())
    seed(out, "preset-" + name + ".json", ModelConfig::preset(name).to_json().dump(2));
  const fuzz::Scratch tmp("seeds");
  for (const auto& f : fuzz::hf_fixtures()) {
    fuzz::write_hf_fixture(f, tmp / f.name);
    seed(out, "fixture-" + f.name + ".json", read_file(tmp / f.name / "config.json"));
  }
  // Huge models: refused, or accepted without anything of their size allocated.
  json llama = fuzz::hf_fixtures().front().config;
  const auto huge = [&](const std::string& name, json patch, json base) {
    for (const auto& [k, v] : patch.items()) base[k] = v;
    seed(out, "huge-" + name + ".json", base.dump(1));
  };
  huge("layers-1e9", {{"num_hidden_layers", 1000000000}}, llama);
  huge("layers-2e40", {{"num_hidden_layers", 1099511627776.0}}, llama);
  huge("hidden-2e40", {{"hidden_size", std::int64_t{1} << 40}, {"num_attention_heads", std::int64_t{1} << 20},
                       {"num_key_value_heads", 1}}, llama);
  huge("vocab-2e31", {{"vocab_size", std::int64_t{1} << 31}}, llama);
  huge("head-dim-2e24", {{"head_dim", std::int64_t{1} << 24}}, llama);
  huge("gemma3-layers-1e9", {{"num_hidden_layers", 1000000000}}, fuzz::hf_fixtures().back().config);
  huge("intermediate-1e18", {{"intermediate_size", 1000000000000000000}}, llama);
}

void train_manifest(const fs::path& out) {
  const fuzz::Scratch tmp("seeds");
  const fs::path dir = tmp / "step-00000003";
  fuzz::write_train_fixture(dir);
  const std::string state = read_file(dir / io::kTrainStateFile), sums = read_file(dir / io::kChecksumsFile);
  seed(out, "state", state);
  seed(out, "state-and-checksums", state + '\0' + sums);
  json j = json::parse(state);
  j["data"] = nullptr;
  j["last_grad_norm"] = nullptr;
  j.erase("rng");
  seed(out, "state-no-data", j.dump(2));
  for (const char* k : {"packed", "token_chunk", "checkpoint_every", "gradient_home", "device_units", "kept_blocks"})
    j["trainer"].erase(k);  // (a train state written before these existed)
  seed(out, "state-older", j.dump(2));
  j = json::parse(state);
  j["format_version"] = 2;
  seed(out, "state-version-2", j.dump(2));
  seed(out, "state-and-bad-checksums", state + '\0' + sums.substr(0, sums.size() / 2) + "\n" + "zz  x\n");
}

std::string u16s(const std::vector<std::uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

void token_file(const fs::path& out) {
  std::vector<std::uint16_t> ids(300);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::uint16_t>((i * 7919 + i / 3) % 50000);
  std::vector<std::uint32_t> wide(150);
  for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<std::uint32_t>((i * 104729) % 150000);
  const std::string wide_bytes(reinterpret_cast<const char*>(wide.data()), wide.size() * 4);
  const auto with = [](unsigned flags, unsigned seq_byte, std::string body) {
    return std::string{static_cast<char>(flags), static_cast<char>(seq_byte)} + body;
  };
  seed(out, "u16", with(0x80, 15, u16s(ids)));
  seed(out, "u16-val", with(0xC0, 0x80 | 7, u16s(ids)));
  seed(out, "u16-small-vocab", with(0x00, 3, u16s(ids)));
  seed(out, "u32", with(0x81, 31, wide_bytes));
  seed(out, "u32-as-u16", with(0x80, 15, wide_bytes));
  std::int32_t header[256] = {20240520, 1, 100};
  seed(out, "llmc", with(0x80, 15, std::string(reinterpret_cast<const char*>(header), sizeof header) +
                                      u16s(std::vector<std::uint16_t>(ids.begin(), ids.begin() + 100))));
  header[1] = 2;
  seed(out, "llmc-v2", with(0x80, 15, std::string(reinterpret_cast<const char*>(header), sizeof header) + u16s(ids)));
  seed(out, "text", with(0x82, 7, "17 plus 25 is 42.\n3 times 4 is 12.\nAda has 3 coins and finds 4 more.\n"));
  for (const unsigned extra : {0x00u, 0x10u, 0x20u, 0x30u, 0x40u})
    seed(out, "examples-" + std::to_string(extra), with(0x84 | extra, 0x40 | 9, u16s(ids)));
  // Raw sidecars: three examples of 4, 3 and 5 tokens.
  const std::vector<std::uint16_t> ex = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const std::string mask{0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1};
  const std::vector<std::int64_t> at = {0, 4, 7, 12};
  const std::string index(reinterpret_cast<const char*>(at.data()), at.size() * 8);
  const auto le16 = [](std::size_t n) { return std::string{static_cast<char>(n & 0xff), static_cast<char>(n >> 8)}; };
  seed(out, "examples-raw", with(0x8C, 0x40 | 3, le16(mask.size()) + le16(index.size()) + mask + index + u16s(ex)));
  seed(out, "examples-raw-packed", with(0x9C, 0x40 | 7, le16(mask.size()) + le16(index.size()) + mask + index + u16s(ex)));
  seed(out, "examples-text-name", with(0x86, 3, u16s(ex)));
}

void tokenizer_json(const fs::path& out, const fs::path& root) {
  for (const auto& d : fs::directory_iterator(root / "tests/fuzz/tokenizers"))
    seed(out, d.path().filename().string() + ".json", read_file(d.path() / "tokenizer.json"));
}

void chat_template(const fs::path& out, const fs::path& root) {
  const std::vector<std::string> conversations = {
      std::string("user\x1fWhat is 2 + 2?\x1e" "assistant\x1f" "4"),
      std::string("system\x1fYou are terse.\x1euser\x1fHi\x1e" "assistant\x1fHello!\x1euser\x1f" "And 3 + 4?\x1e"
                  "assistant\x1f" "7\x1f" "3 plus 4 is 7."),
      std::string("user\x1f  caf\xC3\xA9?  \x1e" "assistant\x1f<think>\nthinking\n</think>\n\nanswer\x1euser\x1f"
                  "<tool_response>x</tool_response>\x1e" "assistant\x1f" "done"),
      std::string("tool\x1f{}\x1e" "assistant\x1fok"),
  };
  for (const auto& d : fs::directory_iterator(root / "tests/fuzz/tokenizers")) {
    const std::string name = d.path().filename().string();
    const std::string config = read_file(d.path() / "tokenizer_config.json");
    for (std::size_t i = 0; i < conversations.size(); ++i)
      seed(out, name + "-" + std::to_string(i), config + '\0' + '\0' + conversations[i]);
    json c = json::parse(config);
    if (c.contains("chat_template") && c["chat_template"].is_string()) {
      const std::string t = c["chat_template"];
      c.erase("chat_template");
      seed(out, name + "-jinja", c.dump(2) + '\0' + t + '\0' + conversations[1]);
      c["chat_template"] = json::array({{{"name", "default"}, {"template", t}}, {{"name", "tool_use"}, {"template", "{{x}}"}}});
      seed(out, name + "-named", c.dump(2) + '\0' + '\0' + conversations[0]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s TARGET SEED_DIR REPO_ROOT\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1];
  const fs::path out = argv[2], root = argv[3];
  fs::create_directories(out);
  try {
    if (target == "model_config") model_config(out, root);
    else if (target == "train_manifest") train_manifest(out);
    else if (target == "token_file") token_file(out);
    else if (target == "tokenizer_json") tokenizer_json(out, root);
    else if (target == "chat_template") chat_template(out, root);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_fuzz_seeds %s: %s\n", target.c_str(), e.what());
    return 1;
  }
  return 0;
}
