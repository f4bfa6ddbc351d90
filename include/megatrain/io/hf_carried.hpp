// The tensors of a published multimodal folder that are not its language model's: Qwen3.5's
// vision tower (model.visual.*) and multi-token-prediction layers (mtp.*). megatrain does not
// train them. An export of the whole model writes them back byte for byte (HfExportOptions::carry),
// so that the fine-tuned folder loads in transformers as the model it came from.
//
// They are named by their folder and a digest of their names, dtypes, shapes and bytes. The
// folder is read again when the export is written, and a folder that changed since is refused:
// an export never mixes two models' tensors.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/digest.hpp"
#include "megatrain/io/safetensors.hpp"

namespace megatrain::io {

/// Tensors of a model folder that an export carries unchanged.
struct CarriedTensors {
  std::filesystem::path dir;       ///< the folder they come from (absolute)
  std::vector<std::string> names;  ///< sorted
  std::uint64_t bytes = 0;         ///< their data's size
  Digest128 digest;                ///< of each one's name, dtype, shape and bytes, in name order

  /// {"dir", "tensors", "bytes", "digest"}: what a training checkpoint records.
  nlohmann::json to_json() const;
  /// The inverse; `source` names the record in errors.
  static CarriedTensors from_json(const nlohmann::json& j, std::string_view source);
};

/// Names `names` of `weights` (the folder `dir`'s) and digests them (reading their bytes once).
CarriedTensors carried_tensors(const std::filesystem::path& dir, const SafetensorsCheckpoint& weights,
                               std::vector<std::string> names);

/// Opens the folder's weights again and checks the carried tensors against the record: every one
/// present, the same digest. Throws naming the folder and what to do otherwise.
SafetensorsCheckpoint open_carried(const CarriedTensors& carried);

}  // namespace megatrain::io
