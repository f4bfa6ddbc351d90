// Exporting a store as a Hugging Face model folder that transformers' from_pretrained loads.
//
// Export writes config.json and the safetensors weights (one model.safetensors, or shards with
// model.safetensors.index.json when larger than max_shard_bytes) through
// write_safetensors_sharded: the whole folder is replaced atomically (docs/safetensors.md), so a
// failed or interrupted export never leaves a half-written model in place of a good one. Weights
// are converted from the fp32 masters chunk by chunk while they are written.
//
// A model read from a published multimodal folder (Qwen3_5ForConditionalGeneration) is exported
// as its language model (a ...ForCausalLM folder), or, with HfExportOptions::carry, as the whole
// model: the folder's own config.json, the language model under the folder's names, and the
// vision tower and multi-token-prediction layers copied unchanged (io/hf_carried.hpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "megatrain/core/dtype.hpp"
#include "megatrain/io/hf_carried.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain::io {

struct HfExportOptions {
  /// Stored element type: bf16 (default, what models are published in), f16 or f32.
  DType dtype = DType::bf16;
  /// Shard size limit in bytes of tensor data; above it the weights are sharded with an index.
  /// 5 GB (decimal), as transformers' save_pretrained.
  std::uint64_t max_shard_bytes = 5'000'000'000;
  /// The config.json to write, as text (e.g. HfCheckpoint::config_text() of the model that was
  /// fine-tuned, which keeps its token ids and other fields). It must describe the same model as
  /// `cfg` (checked). Empty: cfg.to_json(). "torch_dtype" and "dtype" are set to `dtype` either way.
  /// A multimodal folder's config.json gives its language model's (text_config), unless `carry`.
  std::string config_json;
  /// The whole model of a published multimodal folder (HfCheckpoint::carried()): config_json is
  /// that folder's own and is written as it is (the dtype set); the language model's tensors take
  /// the folder's names; the carried tensors are read again from the folder (checked against the
  /// digest first: a folder that changed is refused) and written byte for byte, in their dtype.
  std::optional<CarriedTensors> carry;
  /// More small files for the directory (tokenizer files, generation_config.json): name -> bytes.
  std::map<std::string, std::string> extra_files;
  /// Called before each of the model's tensors is written (index counts from 0; the carried ones,
  /// copied byte for byte, are not counted). May throw: the export is then abandoned and `dir` left
  /// as it was.
  std::function<void(std::string_view tensor, std::size_t index, std::size_t count)> progress;
  /// The run this export belongs to (megatrain-train: its run id). Non-empty: the folder gets a
  /// megatrain_export.json naming it (with `marker`'s fields), and an existing folder is replaced
  /// only where its own megatrain_export.json names the same owner (check_hf_export_target).
  /// Empty: no marker, and any folder of files is replaced.
  std::string owner;
  nlohmann::json marker = nlohmann::json::object();
};

/// The file that names the run an export belongs to (HfExportOptions::owner).
inline constexpr std::string_view kExportMarker = "megatrain_export.json";

/// Writes the store's fp32 masters as a Hugging Face model directory at `dir`: config.json and
/// safetensors weights, every parameter under its Hugging Face name (no lm_head.weight when the
/// embeddings are tied), with {"format": "pt"} metadata. The store must hold exactly the model
/// `cfg` describes (checked first). The directory is replaced atomically: see
/// write_safetensors_sharded; its parent must exist. Other files already in `dir` (a tokenizer,
/// a README) are kept unless `extra_files` replaces them.
void export_hf_model(const HostParamStore<float>& store, const ModelConfig& cfg, const std::filesystem::path& dir,
                     const HfExportOptions& options = {});

/// Checks, before hours of training, that `dir` can later be exported to: it is absent, or a
/// directory that holds only files (what export_hf_model replaces) and, with an `owner`, is empty
/// or was written by an export of the same owner (its megatrain_export.json says so). Throws
/// naming `dir` otherwise.
void check_hf_export_target(const std::filesystem::path& dir, const std::string& owner = {});

/// Parses a shard size the way transformers' max_shard_size does: "5GB" = 5·10^9 bytes,
/// "500MB", "100KB" (decimal), "2GiB" = 2·2^30 (binary), a plain number of bytes. "G", "M", "K"
/// without the B are decimal too. Throws megatrain::Error for anything else or zero.
std::uint64_t parse_shard_size(std::string_view text);

/// "float32", "bfloat16", "float16": the torch_dtype spelling of an export dtype.
std::string_view torch_dtype_name(DType dtype);

}  // namespace megatrain::io
