// Writes the fuzzer's seed corpus into a directory: small valid files written by
// megatrain's own writer (every float dtype, metadata, scalars, empty tensors, several tensors)
// and hand-made near misses (each one step from valid: a wrong length, a duplicate key, a hole,
// an overlap, a wrong type, ...), plus two index files.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "megatrain/io/safetensors.hpp"

namespace fs = std::filesystem;
using namespace megatrain;
using namespace megatrain::io;

namespace {

int counter = 0;

void write_seed(const fs::path& dir, const std::string& bytes) {
  std::ofstream out(dir / ("seed-" + std::to_string(counter++)), std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A file: length field (of the header unless `length` is given), header, `data` zero... bytes.
std::string framed(const std::string& header, std::size_t data, std::int64_t length = -1) {
  const auto n = length < 0 ? static_cast<std::uint64_t>(header.size()) : static_cast<std::uint64_t>(length);
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  s += header;
  for (std::size_t i = 0; i < data; ++i) s += static_cast<char>(0x3c + 7 * i);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SEED_DIR\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  fs::create_directories(dir);

  // Valid files from the writer.
  const std::vector<float> f = {1.5f, -2.25f, 3.0e-3f, 65504.0f, -1.0e-7f, 7.0f};
  const std::vector<double> d = {0.1, -2.5};
  const View<const float> v6(std::span<const float>(f), Shape{2, 3});
  const View<const float> v1(std::span<const float>(f).first(1), Shape{});
  const View<const float> v0(std::span<const float>(f).first(0), Shape{0, 4});
  const View<const double> vd(std::span<const double>(d), Shape{2});
  const std::vector<std::vector<TensorToWrite>> sets = {
      {},
      {TensorToWrite("w", v6)},
      {TensorToWrite("model.layers.0.mlp.up_proj.weight", v6, SafetensorsDType::bf16)},
      {TensorToWrite("a", v6, SafetensorsDType::f16), TensorToWrite("s", v1), TensorToWrite("e", v0),
       TensorToWrite("d", vd)},
  };
  const fs::path tmp = dir / "tmp.safetensors";
  for (std::size_t i = 0; i < sets.size(); ++i) {
    write_safetensors(tmp, sets[i], i % 2 ? std::map<std::string, std::string>{{"format", "pt"}}
                                          : std::map<std::string, std::string>{});
    fs::rename(tmp, dir / ("valid-" + std::to_string(i)));
  }

  // Near misses.
  const std::string w = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  write_seed(dir, framed("{" + w + "}", 8));                                 // valid
  write_seed(dir, framed("{" + w + "}", 8, 1000));                           // length past the end
  write_seed(dir, framed("{" + w + "}", 7));                                 // data too short
  write_seed(dir, framed("{" + w + "}", 9));                                 // trailing byte
  write_seed(dir, framed("{" + w + "," + w + "}", 8));                       // duplicate
  write_seed(dir, framed(R"({"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8));
  write_seed(dir, framed(R"({"w":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8));
  write_seed(dir, framed(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}})", 10));
  write_seed(dir, framed(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("z":{"dtype":"F32","shape":[0],"data_offsets":[1,1]}})", 1));
  write_seed(dir, framed(R"({"__metadata__":{"format":"pt","n":1}})", 0));
  write_seed(dir, framed(R"({"__metadata__":null,"w":[]})", 0));
  write_seed(dir, framed(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[[[[{}]]]]}})", 8));
  write_seed(dir, framed("{\"w\xc3\x28\":{}}", 0));
  write_seed(dir, framed("{}", 0));
  write_seed(dir, framed("{}      ", 0));
  write_seed(dir, framed("[]", 0));
  write_seed(dir, "\x02\x00\x00\x00");
  // Index files (the target also parses every input as an index).
  write_seed(dir, R"({"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
                  R"("b":"model-00002-of-00002.safetensors"}})");
  write_seed(dir, R"({"weight_map":{"a":"../x","a":"y"}})");
  return 0;
}
