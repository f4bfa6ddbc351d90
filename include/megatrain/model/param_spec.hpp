// What a model's parameters are, before any memory exists: names (Hugging Face's, e.g.
// "model.layers.3.self_attn.q_proj.weight"), shapes, how to initialise them, and whether AdamW
// decays them. A model is a list of units (the embedding, each decoder block, the head): the
// granularity at which weights stream to the GPU and the optimizer steps.
#pragma once

#include <string>
#include <vector>

#include "megatrain/core/tensor.hpp"

namespace megatrain {

enum class ParamInit : std::uint8_t {
  normal,  ///< N(0, init_std^2): matrices and embeddings
  ones,    ///< norm weights
  zeros,   ///< biases
  a_log,   ///< Gated DeltaNet's A_log: log(u), u uniform in [0.01, 16) (transformers' initialisation)
};

struct ParamSpec {
  std::string name;
  Shape shape;
  ParamInit init = ParamInit::normal;
  float init_std = 0.02f;
  bool weight_decay = true;  ///< AdamW's decoupled decay applies (off for norms and biases)
  /// Read by the ops at master precision even where the weights are bf16 (norm gains, as
  /// PyTorch's autocast reads them: a gain near 1 has bf16's coarsest spacing, 2^-7, so its
  /// updates would be lost in the rounding). See ParamBinder::full.
  bool full_precision = false;

  static ParamSpec matrix(std::string name, Shape shape, float init_std = 0.02f) {
    return {std::move(name), shape, ParamInit::normal, init_std, true};
  }
  /// A norm's gain; `unit_offset`: the norm multiplies by (1 + w) (Gemma), so w starts at 0.
  static ParamSpec norm(std::string name, std::int64_t dim, bool unit_offset = false) {
    return {std::move(name), Shape{dim}, unit_offset ? ParamInit::zeros : ParamInit::ones, 0.0f, false, true};
  }
  static ParamSpec bias(std::string name, std::int64_t dim) {
    return {std::move(name), Shape{dim}, ParamInit::zeros, 0.0f, false};
  }
  std::int64_t numel() const { return shape.numel(); }
};

struct UnitSpec {
  std::string name;               ///< e.g. "embed", "layers.3", "head"
  std::vector<ParamSpec> params;  ///< in slab order
};

}  // namespace megatrain
