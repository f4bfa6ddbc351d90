// Exporting a store as a Hugging Face folder (see include/megatrain/io/hf_export.hpp).
#include "megatrain/io/hf_export.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <set>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "hf_shared.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::kConfigName;

namespace {

/// The config.json an export writes: the given text (the same model, checked) or the config's
/// own; a multimodal folder's gives its language model's, unless the whole model is carried. The
/// dtype is set to the export's.
json export_config(const ModelConfig& cfg, const HfExportOptions& options, std::string_view label) {
  json j;
  if (options.config_json.empty()) {
    j = cfg.to_json();
  } else {
    try {
      j = json::parse(options.config_json);
    } catch (const json::exception& e) {
      MT_FAIL("{}: the config.json text given is malformed JSON: {}", label, e.what());
    }
    const ModelConfig given = ModelConfig::from_json(j, "the config.json text given for the export");
    MT_CHECK(given.to_json() == cfg.to_json(), "{}: the config.json text given describes another model ({}) than the "
             "store holds ({})", label, detail::describe(given), detail::describe(cfg));
    if (!options.carry)
      if (auto text = ModelConfig::language_model_config(j)) j = std::move(*text);
    j.erase("quantization_config");  // (the weights are written unquantized: GPT-OSS's MXFP4 experts too)
  }
  MT_CHECK(!options.carry || (!cfg.checkpoint_model_prefix.empty() && j.contains("text_config")),
           "{}: HfExportOptions::carry writes the whole model of a Qwen3.5 folder (Qwen3_5ForConditionalGeneration, "
           "Qwen3_5MoeForConditionalGeneration); config_json must be that folder's config.json", label);
  const std::string_view dtype = torch_dtype_name(options.dtype);
  for (json* c : {&j, options.carry ? &j["text_config"] : nullptr}) {
    if (c == nullptr) continue;
    (*c)["torch_dtype"] = dtype;  // transformers 4 reads this spelling,
    (*c)["dtype"] = dtype;        // transformers 5 this one
  }
  return j;
}

/// Where each parameter's values come from: the fp32 masters where this process holds them
/// whole; else (a bf16 export of a ZeRO-1 store) the bf16 copy that every process holds whole,
/// which is the masters rounded to nearest even, as the export would round them (the same bits),
/// except the norm gains and the embedding, whose masters every process keeps whole.
class ExportValues {
 public:
  ExportValues(const HostParamStore<float>& store, bool from_copy) : store_(store), from_copy_(from_copy) {
    for (const auto& u : store.units())
      for (const auto& p : u.params())
        for (const auto& [a, b] : u.whole_masters())
          if (a <= p.offset && p.offset + p.numel() <= b) from_masters_.insert(p.spec.name);
  }
  bool from_copy(const std::string& name) const { return from_copy_ && !from_masters_.contains(name); }
  /// Elements [first, first + out.size()) of parameter `name`.
  void read(const std::string& name, std::int64_t first, std::span<float> out) const {
    if (!from_copy(name)) {
      std::copy_n(store_.master(name).span().begin() + first, out.size(), out.begin());
      return;
    }
    const auto copy = store_.compute(name).span().subspan(static_cast<std::size_t>(first), out.size());
    std::transform(copy.begin(), copy.end(), out.begin(), [](bf16 x) { return static_cast<float>(x); });  // (exact)
  }
  /// The whole parameter.
  std::vector<float> whole(const std::string& name) const {
    std::vector<float> v(static_cast<std::size_t>(store_.find(name).second->spec.shape.numel()));
    read(name, 0, v);
    return v;
  }

 private:
  const HostParamStore<float>& store_;
  bool from_copy_;
  std::set<std::string, std::less<>> from_masters_;
};

/// The model's tensors, in store order, streamed from `values` while the file is written, under
/// `name_of` their parameter's name. Fused tensors (Phi-3's projections, GPT-OSS's experts) are
/// written where their first part is, assembled whole from all their parts when their first chunk
/// is asked for and released after their last (an MXFP4 one unquantized, under its own name).
/// Those a checkpoint may hold part by part (Qwen3.5-MoE's experts) are written part by part, as
/// transformers' save_pretrained writes them.
std::vector<TensorToWrite> model_tensors(const HostParamStore<float>& store, const ModelConfig& cfg,
                                         const std::vector<UnitSpec>& units, const ExportValues& values,
                                         SafetensorsDType stored, const std::function<std::string(const std::string&)>& name_of,
                                         const HfExportOptions& options, std::size_t count) {
  auto fused = std::make_shared<std::vector<FusedTensor>>(fused_tensors(cfg));
  std::erase_if(*fused, [](const FusedTensor& f) { return f.optional; });
  const auto places = detail::fused_places(*fused, units);
  std::vector<TensorToWrite> tensors;
  const auto progress = [&options, count](const std::string& name, std::size_t index) {
    if (options.progress) options.progress(name, index, count);
  };
  for (const auto& u : store.units()) {
    for (const auto& p : u.params()) {
      const std::size_t index = tensors.size();
      if (const auto place = places.find(p.spec.name); place != places.end()) {
        const FusedTensor* f = place->second.tensor;
        if (place->second.part != &f->parts.front()) continue;
        auto whole = std::make_shared<std::vector<float>>();
        tensors.emplace_back(name_of(f->name), f->shape, stored,
                             [whole, fused, f, index, progress, &values, name = name_of(f->name)](std::int64_t first,
                                                                                                   std::span<float> out) {
                               if (first == 0) progress(name, index);
                               if (whole->empty()) {
                                 std::int64_t n = 1;
                                 for (const auto dim : f->shape) n *= dim;
                                 whole->assign(static_cast<std::size_t>(n), 0.0f);
                                 for (const auto& part : f->parts) scatter_part(part, values.whole(part.param), *whole);
                               }
                               std::copy_n(whole->begin() + first, out.size(), out.begin());
                               if (static_cast<std::size_t>(first) + out.size() == whole->size()) {
                                 whole->clear();
                                 whole->shrink_to_fit();
                               }
                             });
        continue;
      }
      std::vector<std::int64_t> shape(p.spec.shape.dims().begin(), p.spec.shape.dims().end());
      tensors.emplace_back(name_of(p.spec.name), std::move(shape), stored,
                           [index, progress, &values, &param = p.spec.name, name = name_of(p.spec.name)](
                               std::int64_t first, std::span<float> out) {
                             if (first == 0) progress(name, index);
                             values.read(param, first, out);
                           });
    }
  }
  return tensors;
}

}  // namespace

std::string_view torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    default: MT_FAIL("a model is exported as bf16, f16 or f32, not {}", dtype_name(dtype));
  }
}

void export_hf_model(const HostParamStore<float>& store, const ModelConfig& cfg, const fs::path& dir,
                     const HfExportOptions& options) {
  MT_NVTX_RANGE("io::export_hf_model");
  const bool masters_here = !store.masters_sharded() || store.state_whole();
  const bool from_copy = !masters_here && options.dtype == DType::bf16;
  MT_CHECK(masters_here || from_copy, "exporting to '{}' as {}: the store keeps part {} of {} of the master weights "
           "(ZeRO-1): export as bf16 (from the bf16 copy every process holds), or gather them first "
           "(HostParamStore::gather_state on every process) and export on the root", dir.string(),
           dtype_name(options.dtype), store.shard().index, store.shard().count);
  const std::string label = fmt::format("exporting to '{}'", dir.string());
  store.check_settled(label);
  MT_CHECK(!from_copy || store.weights_whole(), "{}: this process holds its part of the bf16 weights only (the GPUs "
           "gather the rest as they stream them: TrainerOptions::gather_weights_on_device); bring them whole to the "
           "process that exports first (HostParamStore::gather_weights on every process, with it as the root)", label);
  const std::vector<UnitSpec> units = DecoderModel<>(cfg).units();
  detail::check_store_matches(store, units, label);
  const json config = export_config(cfg, options, label);
  MT_CHECK(!options.extra_files.contains(std::string(kConfigName)),
           "{}: config.json comes from HfExportOptions::config_json, not extra_files", label);
  MT_CHECK(!options.extra_files.contains(std::string(kExportMarker)),
           "{}: {} comes from HfExportOptions::owner, not extra_files", label, kExportMarker);
  check_hf_export_target(dir, options.owner);  // (again: something may have changed it since the run began)
  // (the whole model: the folder's tensors beside the language model, checked against the digest)
  const std::optional<SafetensorsCheckpoint> carried =
      options.carry ? std::optional(open_carried(*options.carry)) : std::nullopt;

  ShardedWriteOptions w;
  w.max_shard_bytes = options.max_shard_bytes;
  w.metadata = {{"format", "pt"}};
  w.extra_files = options.extra_files;
  w.extra_files.emplace(kConfigName, config.dump(2) + "\n");
  if (!options.owner.empty()) {
    json marker = options.marker.is_object() ? options.marker : json::object();
    marker["format"] = "megatrain-export";
    marker["run"] = options.owner;
    w.extra_files.emplace(kExportMarker, marker.dump(2) + "\n");
  }
  const fault::WriteScope scope("export");
  // (a test hook: every file written, the new folder not yet in the old one's place)
  w.finalize = [](std::span<const WrittenFile>) {
    fault::crash_point("export:before-rename");
    return std::map<std::string, std::string>{};
  };

  std::size_t count = 0;
  for (const auto& u : store.units()) count += u.params().size();
  const ExportValues values(store, from_copy);
  const auto name_of = [&](const std::string& param) { return carried ? cfg.checkpoint_name(param) : param; };
  std::vector<TensorToWrite> tensors =
      model_tensors(store, cfg, units, values, to_safetensors_dtype(options.dtype), name_of, options, count);
  if (carried)
    for (const auto& name : options.carry->names) tensors.emplace_back(name, carried->tensor(name).bytes());
  write_safetensors_sharded(dir, tensors, w);
}

void check_hf_export_target(const fs::path& dir, const std::string& owner) {
  MT_NVTX_RANGE("io::check_hf_export_target");
  std::error_code ec;
  const auto st = fs::symlink_status(dir, ec);
  if (ec || !fs::exists(st)) return;
  MT_CHECK(!fs::is_symlink(st), "cannot export to '{}': it is a symbolic link; give the directory it points to",
           dir.string());
  MT_CHECK(fs::is_directory(st), "cannot export to '{}': it exists and is not a directory", dir.string());
  bool empty = true;
  for (fs::directory_iterator it(dir, ec), end; it != end; it.increment(ec)) {
    MT_CHECK(!ec, "cannot list '{}': {}", dir.string(), ec.message());
    const auto est = it->symlink_status(ec);
    MT_CHECK(fs::is_regular_file(est) || fs::is_symlink(est),
             "cannot export to '{}': it holds '{}', which is not a regular file; an export replaces a directory of "
             "files only (choose another directory)",
             dir.string(), it->path().filename().string());
    empty = false;
  }
  MT_CHECK(!ec, "cannot list '{}': {}", dir.string(), ec.message());
  if (owner.empty() || empty) return;
  // An export replaces its folder: only its own run's earlier export.
  const fs::path marker = dir / kExportMarker;
  MT_CHECK(fs::is_regular_file(marker, ec), "cannot export to '{}': it holds files that this run did not export (it "
           "has no {}), and an export replaces its folder; choose another folder, or remove this one first",
           dir.string(), kExportMarker);
  std::string run;
  try {
    run = json::parse(io::detail::read_file(marker, 1 << 20)).at("run").get<std::string>();
  } catch (const json::exception&) {
    MT_FAIL("cannot export to '{}': its {} is malformed; choose another folder, or remove this one first", dir.string(),
            kExportMarker);
  }
  MT_CHECK(run == owner, "cannot export to '{}': another run exported to it (its {} names run {}; this is run {}), and an "
           "export replaces its folder; choose another folder, or remove this one first", dir.string(), kExportMarker,
           run, owner);
}

std::uint64_t parse_shard_size(std::string_view text) {
  const std::string s(text);
  std::size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) != 0 || s[i] == '.')) ++i;
  MT_CHECK(i > 0, "'{}' is not a shard size (examples: 5GB, 500MB, 2GiB, 1000000)", s);
  double v = 0;
  try {
    std::size_t used = 0;
    v = std::stod(s.substr(0, i), &used);
    MT_CHECK(used == i, "'{}' is not a shard size", s);
  } catch (const std::logic_error&) {
    MT_FAIL("'{}' is not a shard size (examples: 5GB, 500MB, 2GiB, 1000000)", s);
  }
  std::string unit = s.substr(i);
  for (auto& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KB") scale = 1e3;
  else if (unit == "M" || unit == "MB") scale = 1e6;
  else if (unit == "G" || unit == "GB") scale = 1e9;
  else if (unit == "T" || unit == "TB") scale = 1e12;
  else if (unit == "KI" || unit == "KIB") scale = 0x1p10;
  else if (unit == "MI" || unit == "MIB") scale = 0x1p20;
  else if (unit == "GI" || unit == "GIB") scale = 0x1p30;
  else if (unit == "TI" || unit == "TIB") scale = 0x1p40;
  MT_CHECK(scale > 0, "'{}' is not a shard size: unknown unit '{}' (KB, MB, GB, TB are decimal; KiB, MiB, GiB, TiB binary)",
           s, s.substr(i));
  const double bytes = v * scale;
  MT_CHECK(std::isfinite(bytes) && bytes >= 1 && bytes < 0x1p63, "shard size '{}' must be at least 1 byte", s);
  return static_cast<std::uint64_t>(bytes);
}

}  // namespace megatrain::io
