// Hugging Face model directories (see include/megatrain/io/hf_checkpoint.hpp for the contracts).
//
// The checkpoint is checked against the model config.json describes as a whole before anything
// is allocated, and every problem found is reported at once (up to a screenful): a user fixing a
// config by hand should not have to rerun once per tensor. The safetensors layer has already
// validated each file's framing, offsets and the index by the time we look at names and shapes.
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/model/family.hpp"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "hf_shared.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::check_store_matches;
using detail::describe;
using detail::fused_places;
using detail::kConfigName;

namespace {

constexpr std::size_t kMaxProblemsShown = 12;
constexpr std::uintmax_t kMaxSideFileBytes = 64u << 20;

bool is_float_dtype(SafetensorsDType t) {
  return t == SafetensorsDType::f32 || t == SafetensorsDType::bf16 || t == SafetensorsDType::f16 ||
         t == SafetensorsDType::f64;
}

/// The dtype config.json declares for the weights, if it declares one.
struct DeclaredDType {
  std::string key;   ///< "dtype" or "torch_dtype"
  std::string text;  ///< as written, e.g. "bfloat16"
  SafetensorsDType dtype = SafetensorsDType::f32;
};

/// Reads the declared dtype: "dtype" (transformers 5) or else "torch_dtype" (transformers 4);
/// when both are there "dtype" wins, as in transformers' PretrainedConfig. Neither key, null or
/// "auto": nothing declared. A value that is not a float dtype megatrain reads is an error naming
/// config.json and the key, unless mismatches are allowed anyway (then it declares nothing).
std::optional<DeclaredDType> declared_dtype(const json& j, const std::string& config_path, bool allow_mismatch) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!j.contains(key) || j.at(key).is_null()) continue;
    const json& v = j.at(key);
    MT_CHECK(v.is_string(), "{}: field '{}' must be a string such as \"bfloat16\", not {}", config_path, key, v.dump());
    std::string text = v.get<std::string>();
    std::string_view name = text;
    if (name.starts_with("torch.")) name.remove_prefix(6);  // str(torch.bfloat16), written by some tools
    if (name == "auto") return std::nullopt;
    static constexpr std::pair<std::string_view, SafetensorsDType> kNames[] = {
        {"float32", SafetensorsDType::f32}, {"float", SafetensorsDType::f32},   {"bfloat16", SafetensorsDType::bf16},
        {"float16", SafetensorsDType::f16}, {"half", SafetensorsDType::f16},    {"float64", SafetensorsDType::f64},
        {"double", SafetensorsDType::f64}};
    for (const auto& [n, t] : kNames)
      if (name == n) return DeclaredDType{key, std::move(text), t};
    if (allow_mismatch) return std::nullopt;
    MT_FAIL("{}: \"{}\": \"{}\" is not a dtype megatrain loads (float32, bfloat16, float16 or float64); if the weights "
            "are floats stored in other dtypes, allow it explicitly (HfOpenOptions::allow_dtype_mismatch; megatrain-train "
            "--allow-dtype-mismatch)",
            config_path, key, text);
  }
  return std::nullopt;
}

/// Buffers that some exporters save but that megatrain derives from config.json.
bool is_rotary_buffer(std::string_view name) {
  return name.find("rotary_emb.") != std::string_view::npos &&
         (name.ends_with(".inv_freq") || name.ends_with(".cos_cached") || name.ends_with(".sin_cached"));
}

std::string shape_str(const Shape& s) { return s.str(); }

/// Decodes elements [first, first + out.size()) of a float tensor into `out`.
void decode(const TensorBytes& t, std::size_t first, std::span<float> out) {
  const std::size_t esize = safetensors_dtype_size(t.dtype);
  const std::byte* src = t.bytes.data() + first * esize;
  const std::size_t n = out.size();
  switch (t.dtype) {
    case SafetensorsDType::f32: std::memcpy(out.data(), src, n * sizeof(float)); return;
    case SafetensorsDType::bf16: {
      std::vector<bf16> buf(n);
      std::memcpy(buf.data(), src, n * sizeof(bf16));
      convert(std::span<const bf16>(buf), out);
      return;
    }
    case SafetensorsDType::f16: {
      std::vector<f16> buf(n);
      std::memcpy(buf.data(), src, n * sizeof(f16));
      convert(std::span<const f16>(buf), out);
      return;
    }
    case SafetensorsDType::f64: {
      std::vector<double> buf(n);
      std::memcpy(buf.data(), src, n * sizeof(double));
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(buf[i]);
      return;
    }
    default: MT_FAIL("unreachable: dtype {}", safetensors_dtype_name(t.dtype));
  }
}

/// The first element at which two float tensors of equal shape differ as fp32 values (NaN equals
/// NaN), or -1. Streams both from their mappings in chunks.
std::int64_t first_difference(const TensorRef& a, const TensorRef& b, float* va, float* vb) {
  const TensorBytes ta = a.bytes(), tb = b.bytes();
  if (ta.dtype == tb.dtype && ta.bytes.size() == tb.bytes.size() &&
      std::memcmp(ta.bytes.data(), tb.bytes.data(), ta.bytes.size()) == 0)
    return -1;
  const auto n = static_cast<std::size_t>(a.info->numel());
  constexpr std::size_t kChunk = 4096;
  std::array<float, kChunk> xa{}, xb{};
  for (std::size_t i = 0; i < n; i += kChunk) {
    const std::size_t m = std::min(kChunk, n - i);
    decode(ta, i, std::span<float>(xa.data(), m));
    decode(tb, i, std::span<float>(xb.data(), m));
    for (std::size_t k = 0; k < m; ++k) {
      if (xa[k] == xb[k] || (std::isnan(xa[k]) && std::isnan(xb[k]))) continue;
      *va = xa[k];
      *vb = xb[k];
      return static_cast<std::int64_t>(i + k);
    }
  }
  return -1;
}

/// Where a checkpoint tensor lives, for messages: "'model-00001-of-00002.safetensors'".
std::string where(const TensorRef& r) { return fmt::format("'{}'", r.file->path().string()); }

std::string shape_text(const std::vector<std::int64_t>& dims) { return fmt::format("[{}]", fmt::join(dims, ", ")); }

/// The checkpoint tensors a fused tensor is read from: itself, or (GPT-OSS's MXFP4 experts) its
/// blocks and scales; none when absent.
struct FusedSource {
  std::optional<TensorRef> whole, blocks, scales;
};
FusedSource find_fused(const SafetensorsCheckpoint& w, const FusedTensor& f) {
  FusedSource s{w.find(f.name), {}, {}};
  if (!s.whole && f.mxfp4) {
    s.blocks = w.find(f.name + "_blocks");
    s.scales = w.find(f.name + "_scales");
  }
  return s;
}

/// The whole fused tensor in fp32 (row-major, f.shape), read or dequantized; values that are not
/// finite refused, naming the tensor.
std::vector<float> read_fused(const SafetensorsCheckpoint& w, const FusedTensor& f) {
  std::int64_t n = 1;
  for (const auto d : f.shape) n *= d;
  std::vector<float> whole(static_cast<std::size_t>(n));
  const FusedSource src = find_fused(w, f);
  if (src.whole) {
    read_into(*src.whole, View<float>(std::span<float>(whole), Shape(f.shape)));
    check_finite(*src.whole, whole);
    return whole;
  }
  const auto bytes = [](const TensorRef& r) {
    const auto b = r.bytes().bytes;
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
  };
  const auto& bd = src.blocks->info->shape;  // [E, R, G, 16]
  dequantize_mxfp4(bytes(*src.blocks), bytes(*src.scales), bd[0], bd[1], bd[2], whole);
  check_finite(*src.blocks, whole);
  return whole;
}


}  // namespace


// ---- shared with hf_export.cpp (src/io/hf_shared.hpp) -------------------------------------------

namespace detail {

std::string describe(const ModelConfig& c) {
  return fmt::format("{}, {} layers, hidden {}, {} heads ({} key/value, head_dim {}), intermediate {}, vocab {}{}{}",
                     c.architecture_name(), c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                     c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size,
                     c.tie_word_embeddings ? ", tied embeddings" : "", c.qkv_bias ? ", q/k/v bias" : "");
}

/// The fused tensors' parts by parameter name; each part's shape checked against the model's.
std::map<std::string, FusedPlace, std::less<>> fused_places(const std::vector<FusedTensor>& fused,
                                                            const std::vector<UnitSpec>& units) {
  std::map<std::string, const ParamSpec*, std::less<>> specs;
  for (const auto& u : units)
    for (const auto& p : u.params) specs[p.name] = &p;
  std::map<std::string, FusedPlace, std::less<>> out;
  for (const auto& f : fused)
    for (const auto& part : f.parts) {
      const auto it = specs.find(part.param);
      MT_CHECK(it != specs.end() && std::ranges::equal(it->second->shape.dims(), part.dims),
               "the fused tensor '{}' holds a parameter '{}' the model does not have in that shape", f.name, part.param);
      out[part.param] = {&f, &part};
    }
  return out;
}

/// Checks that `store` holds exactly the parameters of `units` (names and shapes).
void check_store_matches(const HostParamStore<float>& store, const std::vector<UnitSpec>& units, std::string_view what) {
  std::int64_t expected = 0;
  std::size_t count = 0;
  for (const auto& u : units)
    for (const auto& p : u.params) {
      ++count;
      expected += p.numel();
      MT_CHECK(store.contains(p.name), "{}: the store has no parameter '{}' (it was built for another model)", what, p.name);
      const auto [unit, param] = store.find(p.name);
      MT_CHECK(param->spec.shape == p.shape, "{}: parameter '{}' has shape {} in the store but {} in the model", what,
               p.name, shape_str(param->spec.shape), shape_str(p.shape));
    }
  std::set<std::string_view> model_names;
  for (const auto& u : units)
    for (const auto& p : u.params) model_names.insert(p.name);
  std::size_t store_count = 0;
  for (const auto& u : store.units())
    for (const auto& p : u.params()) {
      ++store_count;
      MT_CHECK(model_names.contains(p.spec.name), "{}: the store holds parameter '{}', which the model does not have",
               what, p.spec.name);
    }
  MT_CHECK(store_count == count && store.param_count() == expected,
           "{}: the store holds {} tensors ({} parameters) but the model has {} ({} parameters)", what, store_count,
           store.param_count(), count, expected);
}

}  // namespace detail

// ---- loading ----------------------------------------------------------------------------------

namespace {

// A checkpoint's tensors against the model its config.json describes: each parameter's source,
// the tensors left aside or ignored, and every problem found (listed together at the end).
struct Match {
  const SafetensorsCheckpoint& weights;
  const ModelConfig& cfg;
  const std::optional<DeclaredDType>& declared;
  const HfOpenOptions& options;
  std::vector<std::string> problems;
  // Float tensors stored in another dtype than config.json declares: listed after the other
  // problems (a whole checkpoint in the wrong dtype should not hide a missing tensor).
  std::vector<std::string> dtype_problems;
  std::set<std::string, std::less<>> used;
  std::map<std::string, std::string, std::less<>> source;  // parameter -> checkpoint tensor name
  std::vector<std::string> ignored, beside;
  const std::string table = Embedding::kTable, head = LmHead::kHead;

  Match(const SafetensorsCheckpoint& w, const ModelConfig& c, const std::optional<DeclaredDType>& d, const HfOpenOptions& o)
      : weights(w), cfg(c), declared(d), options(o) {}

  // (a multimodal checkpoint: the language model's tensors under their own names, checkpoint_name)
  std::optional<TensorRef> find(std::string_view name) const { return weights.find(cfg.checkpoint_name(name)); }
  void check_declared_dtype(const TensorRef& r) {
    if (!declared || options.allow_dtype_mismatch || !is_float_dtype(r.info->dtype) || r.info->dtype == declared->dtype)
      return;
    dtype_problems.push_back(fmt::format(
        "tensor '{}' in {} is stored as {} but config.json declares \"{}\": \"{}\" ({})", r.name(), where(r),
        safetensors_dtype_name(r.info->dtype), declared->key, declared->text, safetensors_dtype_name(declared->dtype)));
  }

  // Fused tensors (Phi-3's projections, GPT-OSS's experts): each holds several parameters;
  // checked whole, each parameter read from its place.
  void match_fused(const std::vector<FusedTensor>& fused) {
    for (const auto& f : fused) {
      const std::string what = fmt::format("{} parameters such as {}", f.parts.size(), f.parts.front().param);
      const FusedSource src = find_fused(weights, f);
      if (src.whole) {
        const TensorRef& ref = *src.whole;
        used.insert(ref.name());
        for (const auto& part : f.parts) source.emplace(part.param, ref.name());
        if (ref.info->shape != f.shape)
          problems.push_back(fmt::format("tensor '{}' in {} has shape {} but config.json needs {} (it holds {})",
                                         ref.name(), where(ref), ref.info->shape_str(), shape_text(f.shape), what));
        if (!is_float_dtype(ref.info->dtype))
          problems.push_back(
              fmt::format("tensor '{}' in {} holds {} elements; only F32, BF16, F16 and F64 weights can be "
                          "loaded",
                          ref.name(), where(ref), safetensors_dtype_name(ref.info->dtype)));
        check_declared_dtype(ref);
        continue;
      }
      if (src.blocks && src.scales) {  // MXFP4 (GPT-OSS): [E, R, G, 16] blocks and [E, R, G] scales of [E, G * 32, R]
        for (const auto* r : {&*src.blocks, &*src.scales}) {
          used.insert(r->name());
          if (r->info->dtype != SafetensorsDType::u8)
            problems.push_back(fmt::format("tensor '{}' in {} holds {} elements; MXFP4 blocks and scales are U8",
                                           r->name(), where(*r), safetensors_dtype_name(r->info->dtype)));
        }
        for (const auto& part : f.parts) source.emplace(part.param, src.blocks->name());
        const auto& b = src.blocks->info->shape;
        const auto& sc = src.scales->info->shape;
        const bool ok = f.shape.size() == 3 && b.size() == 4 && sc.size() == 3 && b[0] == f.shape[0] &&
                        b[1] == f.shape[2] && b[2] * 32 == f.shape[1] && b[3] == 16 &&
                        std::equal(sc.begin(), sc.end(), b.begin());
        if (!ok)
          problems.push_back(
              fmt::format("MXFP4 tensors '{}' {} and '{}' {} in {} do not hold {} (config.json needs blocks "
                          "[{}, {}, {}, 16] and scales [{}, {}, {}])",
                          src.blocks->name(), src.blocks->info->shape_str(), src.scales->name(),
                          src.scales->info->shape_str(), where(*src.blocks), shape_text(f.shape), f.shape[0],
                          f.shape[2], f.shape[1] / 32, f.shape[0], f.shape[2], f.shape[1] / 32));
        continue;
      }
      if (src.blocks || src.scales) {
        const TensorRef& r = src.blocks ? *src.blocks : *src.scales;
        used.insert(r.name());
        problems.push_back(
            fmt::format("tensor '{}' in {} has no {} beside it: an MXFP4 tensor needs both its _blocks and "
                        "its _scales",
                        r.name(), where(r), src.blocks ? f.name + "_scales" : f.name + "_blocks"));
        continue;
      }
      problems.push_back(fmt::format(
          "tensor '{}' is missing (the model needs {}: it holds {}){}{}", f.name, shape_text(f.shape), what,
          f.mxfp4 ? fmt::format(" (or, MXFP4, {0}_blocks and {0}_scales)", f.name) : "",
          f.optional ? fmt::format(" (or each of them as a tensor of its own, such as '{}')", f.parts.front().param)
                     : ""));
    }
  }

  // The parameters held one tensor each (those in `places` come from fused tensors).
  void parameters(const std::vector<UnitSpec>& units, const std::map<std::string, detail::FusedPlace, std::less<>>& places) {
    for (const auto& u : units) {
      for (const auto& p : u.params) {
        if (places.contains(p.name)) continue;
        std::optional<TensorRef> ref = find(p.name);
        if (!ref && cfg.tie_word_embeddings && p.name == table) ref = find(head);
        if (!ref) {
          problems.push_back(fmt::format("tensor '{}' is missing (the model needs {})", cfg.checkpoint_name(p.name),
                                         shape_str(p.shape)));
          continue;
        }
        used.insert(ref->name());
        source.emplace(p.name, ref->name());
        const auto& dims = ref->info->shape;
        const auto want = p.shape.dims();
        if (!std::equal(dims.begin(), dims.end(), want.begin(), want.end()))
          problems.push_back(fmt::format("tensor '{}' in {} has shape {} but config.json needs {}", ref->name(),
                                         where(*ref), ref->info->shape_str(), shape_str(p.shape)));
        if (!is_float_dtype(ref->info->dtype))
          problems.push_back(fmt::format(
              "tensor '{}' in {} holds {} elements; only F32, BF16, F16 and F64 weights can be loaded (quantized "
              "checkpoints are not supported)",
              ref->name(), where(*ref), safetensors_dtype_name(ref->info->dtype)));
        check_declared_dtype(*ref);
      }
    }
  }

  // A tied model may carry the head anyway: then it must be the table.
  void tied_head() {
    if (cfg.tie_word_embeddings && !used.contains(cfg.checkpoint_name(head))) {
      if (auto h = find(head)) {
        used.insert(h->name());
        const auto t = find(table);
        const bool comparable =
            t && t->info->shape == h->info->shape && is_float_dtype(t->info->dtype) && is_float_dtype(h->info->dtype);
        float a = 0, b = 0;
        const std::int64_t at = comparable ? first_difference(*t, *h, &a, &b) : -1;
        if (!comparable) {
          problems.push_back(fmt::format(
              "tensor '{}' in {} ({} {}) cannot be the tied embedding table (config.json has tie_word_embeddings true)",
              head, where(*h), safetensors_dtype_name(h->info->dtype), h->info->shape_str()));
        } else if (at >= 0) {
          problems.push_back(
              fmt::format("config.json has tie_word_embeddings true, but tensor '{}' in {} differs from '{}' (element "
                          "{}: {} vs {}); "
                          "set tie_word_embeddings to false if the model has a separate LM head",
                          head, where(*h), table, at, b, a));
        } else {
          check_declared_dtype(*h);
          ignored.push_back(fmt::format("{} (tied: equal to {})", h->name(), cfg.checkpoint_name(table)));
        }
      }
    }
  }

  // The tensors no parameter read: beside the language model (kept for the export), rotary
  // buffers (ignored), or problems.
  void leftovers() {
    std::vector<std::string> extras;
    std::size_t vision = 0;  // (a multimodal checkpoint's tensors beside its language model's)
    const bool wrapped = !cfg.wrapper_architecture.empty();
    const auto is_beside = [&](std::string_view name) {  // (the vision tower, a projector, Qwen3.5's mtp.* layers)
      return wrapped && (name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.") ||
                         (!cfg.checkpoint_model_prefix.empty() &&
                          (name.starts_with("model.visual.") || name.starts_with("mtp."))));
    };
    for (const auto& name : weights.names()) {
      if (used.contains(name)) continue;
      if (is_beside(name)) {
        ++vision;
        beside.push_back(name);
        continue;
      }
      if (is_rotary_buffer(name)) {
        ignored.push_back(name + " (rotary buffer: recomputed from config.json)");
        continue;
      }
      extras.push_back(name);
    }
    if (vision > 0)
      ignored.push_back(
          fmt::format("{} tensors of the vision tower and its projector{} (not trained; {})", vision,
                      cfg.checkpoint_model_prefix.empty() ? "" : " and of the multi-token prediction (mtp.*)",
                      cfg.checkpoint_model_prefix.empty()
                          ? fmt::format("an export is the language model alone, {}", cfg.architecture_name())
                          : "an export of the whole model writes them back unchanged"));
    for (const auto& name : extras) {
      const TensorRef r = weights.tensor(name);
      std::string why = "the model config.json describes has no such parameter";
      if (wrapped && !cfg.param_name(name))
        why = fmt::format(
            "config.json is a {} whose language model's tensors are read under '{}', and whose other "
            "tensors are the vision tower's and projector's",
            cfg.wrapper_architecture,
            cfg.checkpoint_prefix.empty() ? cfg.checkpoint_model_prefix : cfg.checkpoint_prefix);
      else if (name.ends_with("_proj.bias") && name.starts_with("model.layers."))
        why = "config.json describes no bias for this projection (Llama: attention_bias / mlp_bias)";
      else if (name.starts_with("model.layers."))
        why = fmt::format("config.json has num_hidden_layers {}; a layer or parameter it does not describe",
                          cfg.num_hidden_layers);
      problems.push_back(fmt::format("unexpected tensor '{}' in {}: {}", name, where(r), why));
    }
  }

  // Refuses the checkpoint where anything did not match, every problem listed (with hints).
  void refuse_problems(const fs::path& dir, const std::string& ckpt_label) {
    const std::size_t dtype_mismatches = dtype_problems.size();
    problems.insert(problems.end(), dtype_problems.begin(), dtype_problems.end());
    if (!problems.empty()) {
      std::string hint;
      if (dtype_mismatches > 0)
        hint += fmt::format(
            "\n  ({} tensor{} stored in another dtype than config.json's \"{}\": \"{}\"; if the checkpoint "
            "mixes dtypes on purpose, allow it explicitly (HfOpenOptions::allow_dtype_mismatch; "
            "megatrain-train --allow-dtype-mismatch): every float dtype is converted to the fp32 master)",
            dtype_mismatches, dtype_mismatches == 1 ? "" : "s", declared->key, declared->text);
      if (!cfg.tie_word_embeddings && !find(head) && find(table))
        hint +=
            "\n  (lm_head.weight is missing: if the model shares its embedding table with the LM head, set "
            "\"tie_word_embeddings\": true in config.json)";
      if (!find(table) && weights.contains("embed_tokens.weight"))
        hint +=
            "\n  (the tensor names lack the 'model.' prefix: a base-model checkpoint without the causal-LM wrapper is "
            "not supported)";
      std::string list;
      for (std::size_t i = 0; i < problems.size() && i < kMaxProblemsShown; ++i) list += "\n  " + problems[i];
      if (problems.size() > kMaxProblemsShown)
        list += fmt::format("\n  ... and {} more", problems.size() - kMaxProblemsShown);
      MT_FAIL("'{}' does not match the model its config.json describes ({}): {} problem{} in {}:{}{}", dir.string(),
              describe(cfg), problems.size(), problems.size() == 1 ? "" : "s", ckpt_label, list, hint);
    }
  }
};

}  // namespace

HfCheckpoint HfCheckpoint::open(const fs::path& dir, const HfOpenOptions& options) {
  MT_NVTX_RANGE("io::HfCheckpoint::open");
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  MT_CHECK(fs::exists(st),
           "model directory '{}' does not exist (megatrain reads local directories: download a Hub model first, e.g. "
           "`huggingface-cli download <id> --local-dir <dir>`)",
           dir.string());
  MT_CHECK(fs::is_directory(st), "'{}' is not a directory; give the model directory (the one holding config.json)",
           dir.string());

  HfCheckpoint c;
  c.dir_ = dir;
  const fs::path config_path = dir / kConfigName;
  MT_CHECK(fs::is_regular_file(config_path, ec), "'{}' holds no config.json: not a Hugging Face model directory",
           dir.string());
  c.config_text_ = io::detail::read_file(config_path, 16u << 20);
  json j;
  try {
    j = json::parse(c.config_text_);
  } catch (const json::exception& e) {
    MT_FAIL("{}: malformed JSON: {}", config_path.string(), e.what());
  }
  c.config_ = ModelConfig::from_json(j, config_path.string());
  const std::optional<DeclaredDType> declared = declared_dtype(j, config_path.string(), options.allow_dtype_mismatch);

  // Weights. A directory holding only PyTorch pickles gets a message saying so.
  if (!fs::exists(dir / "model.safetensors", ec) && !fs::exists(dir / "model.safetensors.index.json", ec)) {
    bool pickles = false;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      pickles = pickles || n == "pytorch_model.bin" || n == "pytorch_model.bin.index.json" || n.ends_with(".pt") ||
                n.ends_with(".pth");
    }
    MT_CHECK(!pickles,
             "'{}' holds PyTorch pickle weights (pytorch_model.bin), not safetensors; megatrain reads safetensors only "
             "(convert with transformers: from_pretrained(...).save_pretrained(dir, safe_serialization=True))",
             dir.string());
  }
  c.weights_ = SafetensorsCheckpoint::open(dir);
  // Each decoder layer has tensors of its own: a config describing more layers than the files
  // hold tensors does not describe them, and is refused here, before the model's units (as many
  // as its layers) are built.
  MT_CHECK(static_cast<std::uint64_t>(c.config_.num_hidden_layers) <= c.weights_.size(),
           "{}: num_hidden_layers is {} but the checkpoint {} holds {} tensors in all, fewer than one a layer: "
           "config.json does not describe these weights (fix the config, or give the folder these weights came with)",
           config_path.string(), c.config_.num_hidden_layers, c.weights_.path().string(), c.weights_.size());
  // Likewise for the model's size: what the units hold per layer (names, rotary tables of
  // head_dim / 2) is bounded by the parameters they describe, and those must be in the files, at
  // half a byte each at the least (4-bit blocks): a config describing more is refused before the
  // units are built, not after (a 300-byte config.json with head_dim 2^14 would otherwise build
  // tables for parameters nobody stored).
  std::uint64_t file_bytes = 0;
  for (const auto& f : c.weights_.files()) file_bytes += f.file_size();
  MT_CHECK(static_cast<std::uint64_t>(c.config_.param_count()) / 2 <= file_bytes,
           "{}: config.json describes a model of {} parameters ({}), but the checkpoint {} holds {} in all, too little "
           "for them at any dtype: config.json does not describe these weights (fix the config, or give the folder "
           "these weights came with)",
           config_path.string(), c.config_.param_count(), describe(c.config_), c.weights_.path().string(),
           format_bytes(file_bytes));
  c.units_ = DecoderModel<>(c.config_).units();

  // ---- names, shapes and dtypes against the model -------------------------------------------
  const ModelConfig& cfg = c.config_;
  Match m(c.weights_, cfg, declared, options);
  // (fused tensors that may be held part by part instead, and are: read as the parameters they hold)
  c.fused_ = fused_tensors(cfg);
  for (auto& f : c.fused_) f.name = cfg.checkpoint_name(f.name);
  // (any of its parts there: read part by part, a missing one named as such)
  std::erase_if(c.fused_, [&](const FusedTensor& f) {
    const FusedSource s = find_fused(c.weights_, f);
    return f.optional && !s.whole && !s.blocks && !s.scales &&
           std::ranges::any_of(f.parts, [&](const FusedPart& p) { return m.find(p.param).has_value(); });
  });
  m.match_fused(c.fused_);
  m.parameters(c.units_, fused_places(c.fused_, c.units_));
  m.tied_head();
  m.leftovers();
  m.refuse_problems(dir, c.weights_.path().string());
  c.source_ = std::move(m.source);
  c.ignored_ = std::move(m.ignored);
  c.beside_ = std::move(m.beside);
  return c;
}

std::optional<CarriedTensors> HfCheckpoint::carried() const {
  // (Gemma 3's published folders name their language model in transformers 4's way: exported as
  // that language model, a Gemma3ForCausalLM)
  if (config_.checkpoint_model_prefix.empty() || beside_.empty()) return std::nullopt;
  return carried_tensors(dir_, weights_, beside_);
}

TensorRef HfCheckpoint::source(std::string_view param) const {
  const auto it = source_.find(param);
  MT_CHECK(it != source_.end(), "'{}': the model has no parameter '{}'", dir_.string(), param);
  return weights_.tensor(it->second);
}

std::int64_t HfCheckpoint::param_count() const {
  std::int64_t n = 0;
  for (const auto& u : units_)
    for (const auto& p : u.params) n += p.numel();
  return n;
}


void HfCheckpoint::load_into(HostParamStore<float>& store) const {
  MT_NVTX_RANGE("io::HfCheckpoint::load_into");
  store.check_settled(fmt::format("loading '{}'", dir_.string()));
  check_store_matches(store, units_, fmt::format("loading '{}'", dir_.string()));
  const auto places = fused_places(fused_, units_);
  // The fused tensor last read, whole (its parameters come one after another in slab order, so
  // each is read once).
  std::vector<float> whole;
  const FusedTensor* whole_of = nullptr;
  for (auto& unit : store.units()) {
    for (const auto& p : unit.params()) {
      const auto place = places.find(p.spec.name);
      if (place == places.end()) {
        const TensorRef ref = source(p.spec.name);
        read_into(ref, store.master(p.spec.name));
        check_finite(ref, store.master(p.spec.name).span());
        continue;
      }
      if (whole_of != place->second.tensor) {
        whole.clear();
        whole.shrink_to_fit();
        whole = read_fused(weights_, *place->second.tensor);
        whole_of = place->second.tensor;
      }
      gather_part(*place->second.part, whole, store.master(p.spec.name).span());
    }
    store.sync_compute(unit);
  }
}

namespace {
/// Calls f(i, at) for each element i of part p (`count` of them: the product of its dims), with
/// `at` its flat index in the fused tensor (the last dimension innermost; any rank); the rows of
/// the first dimension in parallel (a GPT-OSS-120B layer's experts hold 3.2 billion elements).
template <class F>
void for_each_place(const FusedPart& p, std::size_t count, F f) {
  const std::size_t rank = p.dims.size();
  if (rank == 0 || count == 0) return;
  const auto rows = static_cast<std::size_t>(p.dims[0]), per_row = count / rows;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, std::max<std::size_t>(1, (std::size_t{1} << 16) / std::max<std::size_t>(per_row, 1))),
                    [&](const tbb::blocked_range<std::size_t>& range) {
    std::vector<std::int64_t> idx(rank, 0);
    for (std::size_t row = range.begin(); row != range.end(); ++row) {
      std::fill(idx.begin(), idx.end(), 0);
      std::int64_t at = p.offset + static_cast<std::int64_t>(row) * p.strides[0];
      for (std::size_t j = 0; j < per_row; ++j) {
        f(row * per_row + j, static_cast<std::size_t>(at));
        for (std::size_t k = rank; k-- > 1;) {
          at += p.strides[k];
          if (++idx[k] < p.dims[k]) break;
          at -= p.strides[k] * p.dims[k];
          idx[k] = 0;
        }
      }
    }
  });
}
}  // namespace

void gather_part(const FusedPart& p, std::span<const float> fused, std::span<float> out) {
  for_each_place(p, out.size(), [&](std::size_t i, std::size_t at) { out[i] = fused[at]; });
}

void scatter_part(const FusedPart& p, std::span<const float> in, std::span<float> fused) {
  for_each_place(p, in.size(), [&](std::size_t i, std::size_t at) { fused[at] = in[i]; });
}

void dequantize_mxfp4(std::span<const std::uint8_t> blocks, std::span<const std::uint8_t> scales, std::int64_t P,
                      std::int64_t R, std::int64_t G, std::span<float> out) {
  static constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  MT_CHECK(blocks.size() == static_cast<std::size_t>(P * R * G * 16) && scales.size() == static_cast<std::size_t>(P * R * G) &&
               out.size() == static_cast<std::size_t>(P * R * G * 32),
           "MXFP4: {} block bytes and {} scales for [{}, {}, {}] groups into {} values", blocks.size(), scales.size(), P, R,
           G, out.size());
  const std::int64_t C = G * 32;  // out[p, c, r]: column c = g * 32 + 2 b (+ 1 for the high nibble) of row r
  // (each (p, g) writes 32 rows of out, r running along them: in parallel, each row in order)
  tbb::parallel_for(tbb::blocked_range<std::int64_t>(0, P * G), [&](const tbb::blocked_range<std::int64_t>& range) {
    for (std::int64_t pg = range.begin(); pg != range.end(); ++pg)
      for (std::int64_t p = pg / G, g = pg % G, r = 0; r < R; ++r) {
        const std::size_t grp = static_cast<std::size_t>((p * R + r) * G + g);
        const int e = static_cast<int>(scales[grp]) - 127;
        const std::uint8_t* b = blocks.data() + grp * 16;
        float* o = out.data() + p * C * R + g * 32 * R + r;
        for (int i = 0; i < 16; ++i) {
          o[(2 * i) * R] = std::ldexp(kFp4[b[i] & 0x0F], e);
          o[(2 * i + 1) * R] = std::ldexp(kFp4[b[i] >> 4], e);
        }
      }
  });
}

std::vector<FusedTensor> fused_tensors(const ModelConfig& cfg) {
  std::vector<FusedTensor> out;
  const std::int64_t d = cfg.hidden_size;
  if (cfg.fused_projections()) {  // Phi-3: the parameters' rows one after another
    const auto rows = [d](std::string name, std::vector<std::pair<std::string, std::int64_t>> parts) {
      FusedTensor f{std::move(name), {0, d}, {}, false};
      for (auto& [param, n] : parts) {
        f.parts.push_back({std::move(param), {n, d}, f.shape[0] * d, {d, 1}});
        f.shape[0] += n;
      }
      return f;
    };
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      const std::string a = fmt::format("model.layers.{}.self_attn.", l), m = fmt::format("model.layers.{}.mlp.", l);
      out.push_back(rows(a + "qkv_proj.weight",
                         {{a + "q_proj.weight", cfg.q_dim()}, {a + "k_proj.weight", cfg.kv_dim()}, {a + "v_proj.weight", cfg.kv_dim()}}));
      out.push_back(rows(m + "gate_up_proj.weight",
                         {{m + "gate_proj.weight", cfg.intermediate_size}, {m + "up_proj.weight", cfg.intermediate_size}}));
    }
  }
  if (cfg.block().fused_experts) {  // (GPT-OSS) the experts, stacked; gate and up interleaved
    const std::int64_t E = cfg.moe.num_experts, I = cfg.moe.intermediate_size;
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      const std::string x = fmt::format("model.layers.{}.mlp.experts.", l);
      const auto param = [&](std::int64_t e, const char* what) { return fmt::format("{}{}.{}", x, e, what); };
      FusedTensor gu{x + "gate_up_proj", {E, d, 2 * I}, {}, true}, gub{x + "gate_up_proj_bias", {E, 2 * I}, {}, false};
      FusedTensor dn{x + "down_proj", {E, I, d}, {}, true}, dnb{x + "down_proj_bias", {E, d}, {}, false};
      for (std::int64_t e = 0; e < E; ++e) {
        gu.parts.push_back({param(e, "gate_proj.weight"), {I, d}, e * d * 2 * I, {2, 2 * I}});
        gu.parts.push_back({param(e, "up_proj.weight"), {I, d}, e * d * 2 * I + 1, {2, 2 * I}});
        gub.parts.push_back({param(e, "gate_proj.bias"), {I}, e * 2 * I, {2}});
        gub.parts.push_back({param(e, "up_proj.bias"), {I}, e * 2 * I + 1, {2}});
        dn.parts.push_back({param(e, "down_proj.weight"), {d, I}, e * I * d, {1, d}});
        dnb.parts.push_back({param(e, "down_proj.bias"), {d}, e * d, {1}});
      }
      for (auto* f : {&gu, &gub, &dn, &dnb}) out.push_back(std::move(*f));
    }
  }
  if (cfg.block().stacked_experts) {  // (Qwen3.5-MoE) the experts stacked: gate's rows then up's; down
    const std::int64_t E = cfg.moe.num_experts, I = cfg.moe.intermediate_size;
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      const std::string x = fmt::format("model.layers.{}.mlp.experts.", l);
      const auto param = [&](std::int64_t e, const char* what) { return fmt::format("{}{}.{}", x, e, what); };
      FusedTensor gu{x + "gate_up_proj", {E, 2 * I, d}, {}, false, true}, dn{x + "down_proj", {E, d, I}, {}, false, true};
      for (std::int64_t e = 0; e < E; ++e) {
        gu.parts.push_back({param(e, "gate_proj.weight"), {I, d}, e * 2 * I * d, {d, 1}});
        gu.parts.push_back({param(e, "up_proj.weight"), {I, d}, e * 2 * I * d + I * d, {d, 1}});
        dn.parts.push_back({param(e, "down_proj.weight"), {d, I}, e * d * I, {I, 1}});
      }
      out.push_back(std::move(gu));
      out.push_back(std::move(dn));
    }
  }
  return out;
}

HfModel load_hf_model(const fs::path& dir, const StoreOptions& options, const HfOpenOptions& open_options) {
  MT_NVTX_RANGE("io::load_hf_model");
  const HfCheckpoint ckpt = HfCheckpoint::open(dir, open_options);
  HfModel m{ckpt.config(), HostParamStore<float>(ckpt.units(), options), ckpt.ignored()};
  ckpt.load_into(m.store);
  return m;
}

// ---- exporting --------------------------------------------------------------------------------

std::map<std::string, std::string> hf_side_files(const fs::path& dir) {
  MT_NVTX_RANGE("io::hf_side_files");
  static constexpr const char* kNames[] = {
      "tokenizer.json",   "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json",       "merges.txt",            "added_tokens.json",       "generation_config.json",
      "chat_template.jinja", "chat_template.json"};
  std::map<std::string, std::string> files;
  std::error_code ec;
  for (const char* n : kNames)
    if (fs::is_regular_file(dir / n, ec)) files.emplace(n, io::detail::read_file(dir / n, kMaxSideFileBytes));
  return files;
}

std::string read_side_file(const fs::path& path) { return io::detail::read_file(path, kMaxSideFileBytes); }

}  // namespace megatrain::io
