// Hugging Face model directories: load a checkpoint of a family megatrain knows into a
// HostParamStore (exporting: io/hf_export.hpp, included here).
//
// Loading is two-phase. HfCheckpoint::open reads config.json (ModelConfig: unknown
// architectures are errors there), opens and validates every safetensors file (the safetensors
// layer refuses truncated or malformed files, overlapping offsets, duplicates across shards,
// ...), and then checks the checkpoint against the model the config describes: every tensor
// the model needs is present with the right shape and a float dtype (the one config.json
// declares, unless HfOpenOptions::allow_dtype_mismatch), nothing unexpected is there. Only then
// does anything get allocated: load_into (or load_hf_model) converts each tensor straight from
// the file mapping into the store's fp32 master (no second copy of the model in memory) and
// refreshes the bf16 compute copy unit by unit.
//
// Decisions (see docs/huggingface.md):
//  - Tolerated extras: rotary-embedding buffers ("*.rotary_emb.inv_freq", cos/sin caches) that
//    some exporters save; megatrain recomputes them from config.json. Any other tensor the
//    model does not use is an error (a checkpoint that does not match its config is better
//    refused than half-loaded).
//  - Tied embeddings (tie_word_embeddings true): lm_head.weight may be absent (what
//    save_pretrained writes), or present and equal, value for value, to the embedding table
//    (then it is ignored); present and different is an error. If only lm_head.weight is there,
//    the table is read from it.
//  - Dtypes: F32, BF16, F16 and F64 are read (converted exactly to fp32; F64 rounds to nearest
//    even). Every tensor the model reads must be stored in the dtype config.json declares
//    ("dtype", transformers 5, or else "torch_dtype"): a BF16 tensor in a config saying float32
//    is an error naming the file, the tensor and both dtypes, unless
//    HfOpenOptions::allow_dtype_mismatch is set (checkpoints that mix dtypes on purpose). A
//    config.json without either key accepts any float dtype. Integer, boolean and FP8 tensors
//    (quantized checkpoints) are refused by name either way.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/dtype.hpp"
#include "megatrain/io/hf_carried.hpp"
#include "megatrain/io/hf_export.hpp"
#include "megatrain/io/safetensors.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/model/param_spec.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain::io {

// ---- loading ----------------------------------------------------------------------------------

/// A parameter held inside a fused checkpoint tensor: its element (i_0, i_1, ...) is the fused
/// tensor's element `offset + sum_k i_k strides[k]` (row-major, flat).
struct FusedPart {
  std::string param;                  ///< the parameter's name
  std::vector<std::int64_t> dims;     ///< the parameter's shape
  std::int64_t offset = 0;
  std::vector<std::int64_t> strides;  ///< one per dimension of the parameter
};
/// A checkpoint tensor that holds several parameters: Phi-3's self_attn.qkv_proj.weight (the rows
/// of q, k, v) and mlp.gate_up_proj.weight (gate, up); GPT-OSS's stacked experts,
/// mlp.experts.gate_up_proj [E, hidden, 2 inter] (expert e's gate transposed in the even
/// columns, its up in the odd ones), gate_up_proj_bias [E, 2 inter] (likewise), down_proj
/// [E, inter, hidden] (transposed) and down_proj_bias [E, hidden]. Every element of the tensor
/// belongs to exactly one part.
struct FusedTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<FusedPart> parts;  ///< parts[0] starts at element 0
  /// The published GPT-OSS checkpoints store this tensor as MXFP4: `name`_blocks (U8
  /// [E, cols, rows / 32, 16], two 4-bit values a byte, the low nibble first) and `name`_scales
  /// (U8 [E, cols, rows / 32], a power of two biased by 127 per 32 values), of the transposed
  /// [E, cols, rows] layout; read dequantized (dequantize_mxfp4), written unquantized.
  bool mxfp4 = false;
  /// The checkpoint may hold the parts as tensors of their own instead (Qwen3.5-MoE's experts):
  /// read either way; exported part by part, as transformers' save_pretrained writes them.
  bool optional = false;
};

/// How HfCheckpoint::open (and load_hf_model) judges a checkpoint.
struct HfOpenOptions {
  /// Accept float tensors (F32, BF16, F16, F64) stored in a dtype other than the one config.json
  /// declares ("dtype", or "torch_dtype" in transformers 4 configs), e.g. a checkpoint that keeps
  /// its norms in F32 beside BF16 matrices. Off by default: such a tensor is an error naming the
  /// file, the tensor, its dtype and the config's. Every tensor is converted to the fp32 master
  /// either way; non-float tensors are refused whatever this says.
  bool allow_dtype_mismatch = false;
};

/// A Hugging Face model directory (config.json + safetensors), opened and fully validated.
/// Holds the file mappings; nothing is read into memory until load_into.
class HfCheckpoint {
 public:
  /// Opens `dir` (a directory holding config.json and model.safetensors or
  /// model.safetensors.index.json plus its shards) and validates config and weights against each
  /// other. Throws megatrain::Error naming the file and the tensor for anything wrong: unknown
  /// architecture, malformed config.json or safetensors, a missing, unexpected or misshapen
  /// tensor, a non-float dtype, a float dtype other than config.json's (unless
  /// options.allow_dtype_mismatch), a tied lm_head.weight that differs from the embedding table.
  static HfCheckpoint open(const std::filesystem::path& dir, const HfOpenOptions& options = {});

  const std::filesystem::path& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  /// The text of config.json as read (export keeps its extra fields: token ids, ...).
  const std::string& config_text() const { return config_text_; }
  const SafetensorsCheckpoint& weights() const { return weights_; }
  /// The model's units (DecoderModel<>(config()).units()): what a store for it must hold.
  const std::vector<UnitSpec>& units() const { return units_; }
  /// The checkpoint tensor each parameter is read from (by parameter name); for a parameter
  /// stored in a fused tensor (Phi-3's qkv_proj, gate_up_proj; GPT-OSS's experts), that tensor
  /// (an MXFP4 one: its _blocks).
  TensorRef source(std::string_view param) const;
  /// Checkpoint tensors that are present but not loaded, each with the reason.
  const std::vector<std::string>& ignored() const { return ignored_; }
  /// A multimodal folder's tensors beside its language model (the vision tower and its projector,
  /// Qwen3.5's mtp.* layers), sorted; none elsewhere.
  const std::vector<std::string>& beside() const { return beside_; }
  /// What an export of the whole model carries (HfExportOptions::carry): the beside() tensors of a
  /// folder whose whole model megatrain writes back (Qwen3.5's, Qwen3.5-MoE's); nullopt for other
  /// folders and where there are none (Gemma 3's published folders are exported as their language
  /// model). Reads those tensors once, for their digest.
  std::optional<CarriedTensors> carried() const;
  /// Parameters and bytes of tensor data that load_into reads.
  std::int64_t param_count() const;

  /// Reads every parameter into `store`'s fp32 masters and refreshes each unit's bf16 copy.
  /// The store must hold exactly this model's parameters (names and shapes; checked before
  /// anything is written). Adam moments are left as they are (zero in a fresh store). A tensor
  /// holding NaN or an infinity is refused, naming it and its file (the store is then partly
  /// loaded: load into a fresh one, as load_hf_model does).
  void load_into(HostParamStore<float>& store) const;

 private:
  std::filesystem::path dir_;
  ModelConfig config_;
  std::string config_text_;
  SafetensorsCheckpoint weights_;
  std::vector<UnitSpec> units_;
  std::map<std::string, std::string, std::less<>> source_;  // parameter -> checkpoint tensor name
  std::vector<FusedTensor> fused_;  // the fused tensors this checkpoint holds
  std::vector<std::string> ignored_;
  std::vector<std::string> beside_;
};

/// The fused tensors of `cfg`'s checkpoints (none for most families).
std::vector<FusedTensor> fused_tensors(const ModelConfig& cfg);
/// Part `p` of a fused tensor whose elements are `fused` (row-major): the parameter's elements in
/// its own row-major order, into `out`.
void gather_part(const FusedPart& p, std::span<const float> fused, std::span<float> out);
/// The inverse: the parameter's elements `in` into their places in `fused`.
void scatter_part(const FusedPart& p, std::span<const float> in, std::span<float> fused);
/// MXFP4 to fp32 as transformers' GPT-OSS integration dequantizes it: blocks [P, R, G, 16] and
/// scales [P, R, G] (P the leading dimensions' product) give out [P, G * 32, R], each value an
/// FP4 (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times 2^(scale - 127), the last two
/// dimensions transposed. Exact.
void dequantize_mxfp4(std::span<const std::uint8_t> blocks, std::span<const std::uint8_t> scales, std::int64_t P,
                      std::int64_t R, std::int64_t G, std::span<float> out);

/// A model loaded from a Hugging Face directory.
struct HfModel {
  ModelConfig config;
  HostParamStore<float> store;
  std::vector<std::string> ignored;  ///< see HfCheckpoint::ignored
};

/// HfCheckpoint::open(dir, open_options), then a store for it (with `options`: seed, gradients,
/// budget, ...) and load_into. Everything is validated before the store is allocated.
HfModel load_hf_model(const std::filesystem::path& dir, const StoreOptions& options = {},
                      const HfOpenOptions& open_options = {});

/// The files of a model directory that belong with an export of a model fine-tuned from it:
/// tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model, vocab.json,
/// merges.txt, added_tokens.json, generation_config.json, chat_template.jinja/.json (those that
/// exist). name -> contents.
std::map<std::string, std::string> hf_side_files(const std::filesystem::path& dir);

/// The contents of one such small file (at most 64 MiB); throws naming it where it cannot be read.
std::string read_side_file(const std::filesystem::path& path);

}  // namespace megatrain::io
