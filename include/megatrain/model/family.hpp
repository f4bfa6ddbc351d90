// Model families: what sets each Hugging Face decoder apart, declared in one place per family.
//
// A family is a composition of ops: the norms (w or 1 + w, two or four a block), the attention
// (q/k norms per head or over the whole projection, sinks, its softmax scale, rotary on every
// layer or not, windows per layer), the MLP (a gated MLP and its activation, or a mixture of
// experts and its router), the embedding's scale, and the checkpoint's layout (fused tensors,
// module names). `BlockRecipe` declares that composition; DecoderBlock, SelfAttention, MoeMlp,
// Embedding and io::HfCheckpoint put the ops together from it and never ask which family a
// model is. `Family` adds what transformers calls the family and how its config.json is read,
// checked and written: each family is one file, src/model/families/<family>.cpp, and one entry in
// the table of src/model/families.cpp. docs/models.md walks through adding one.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "megatrain/model/config.hpp"

namespace megatrain {

/// The ops a family's decoder block and model are made of.
struct BlockRecipe {
  /// RMSNorm of q and k before the rotation: none, each head over head_dim (Qwen3, Gemma 3,
  /// Qwen3-MoE), or each token's whole projection (OLMoE).
  enum class QkNorm { none, per_head, whole };
  QkNorm qk_norm = QkNorm::none;
  /// Every RMSNorm multiplies by (1 + w), its gain stored as w (Gemma).
  bool unit_offset_norms = false;
  /// The attention's and the MLP's outputs are normalised before they join the residual stream
  /// (Gemma 3's post_attention_layernorm and post_feedforward_layernorm; the MLP's input norm is
  /// then pre_feedforward_layernorm).
  bool sandwich_norms = false;
  /// A learned sink logit per attention head (GPT-OSS's self_attn.sinks).
  bool attention_sinks = false;
  /// The softmax scale may be query_pre_attn_scalar^-1/2 (Gemma 3) instead of head_dim^-1/2.
  bool query_pre_attn_scalar = false;
  /// Sliding-window and full layers per layer_types (Gemma 3, GPT-OSS); elsewhere a window
  /// bounds the sequence length instead.
  bool per_layer_windows = false;
  /// The sliding layers have rotary parameters of their own (Gemma 3's local rope).
  bool local_rope = false;
  /// Some layers apply no rotary embedding (SmolLM3's NoPE layers, no_rope_layers).
  bool nope_layers = false;
  /// q_proj also gives a gate per head, and o_proj reads attention * sigmoid(gate) (Qwen3.5,
  /// Qwen3-Next).
  bool attention_output_gate = false;
  /// Some layers are linear attention (Gated DeltaNet: layer_types' linear_attention entries,
  /// ModelConfig::linear_attention).
  bool linear_attention = false;
  /// The dense MLP's gate activation and the config.json key that names it.
  Activation activation = Activation::silu;
  const char* activation_key = "hidden_act";
  /// The embedding's output is multiplied by sqrt(hidden_size) (Gemma).
  bool scaled_embedding = false;
  /// Sparse layers' MLP is a mixture of experts (MoeMlp; ModelConfig::moe).
  bool moe = false;
  /// Every layer's MLP is a mixture of experts, and the config class has no intermediate_size
  /// (Qwen3.5-MoE): ModelConfig::intermediate_size is 0, whatever config.json says.
  bool every_layer_sparse = false;
  /// The module holding a sparse layer's router and experts ("mlp"; Mixtral's "block_sparse_moe"),
  /// the router's name in it ("gate"; GPT-OSS's "router") and the experts' projections' names
  /// (gate, up, down: Mixtral's w1, w3, w2).
  const char* moe_module = "mlp";
  const char* router = "gate";
  std::array<const char*, 3> expert_projections{"gate_proj", "up_proj", "down_proj"};
  /// The experts' activation where it is not the dense MLP's (GPT-OSS's clamped SwiGLU).
  std::optional<Activation> expert_activation = std::nullopt;
  /// The router and every expert's projections have biases (GPT-OSS).
  bool moe_biases = false;
  /// The checkpoint stores q/k/v as one self_attn.qkv_proj and gate/up as one mlp.gate_up_proj
  /// (Phi-3), or each layer's experts stacked with gate and up interleaved (GPT-OSS).
  bool fused_projections = false;
  bool fused_experts = false;
  /// The checkpoint may hold each layer's experts stacked, as the Hub's Qwen3.5-MoE folders do
  /// (mlp.experts.gate_up_proj [E, 2 inter, hidden]: each expert's gate rows, then its up rows;
  /// mlp.experts.down_proj [E, hidden, inter]), or one tensor per expert as transformers' save_pretrained
  /// writes them (and megatrain exports them).
  bool stacked_experts = false;
};

/// A Hugging Face family: its names, its composition and how its config.json is read.
struct Family {
  Architecture arch;
  const char* class_name;  ///< "architectures"[0]: LlamaForCausalLM, ...
  const char* model_type;  ///< model_type: llama, ...
  /// The context and rotary base its config class defaults to.
  std::int64_t default_max_position_embeddings;
  double default_rope_theta;
  /// Its config class's defaults for tie_word_embeddings and pad_token_id.
  bool default_tied;
  std::optional<std::int64_t> default_pad_token_id;
  BlockRecipe block;
  /// Reads the family's own config.json fields into `c` after the common ones (sizes, rotary,
  /// padding id, activation): biases, windows, experts, per-layer tables; refuses by name what
  /// megatrain would not train the way transformers does. `src` names the file in errors.
  void (*parse)(const nlohmann::json& j, std::string_view src, ModelConfig& c);
  /// What only this family can hold, checked by ModelConfig::validate after the common checks
  /// (the biases it has options for, its tables).
  void (*check)(const ModelConfig& c, std::string_view src);
  /// Writes the family's own fields into the config.json that ModelConfig::to_json made (which
  /// holds the common ones: sizes, rope_theta, rope_scaling, the activation).
  void (*write)(const ModelConfig& c, nlohmann::json& j);
};

/// The family of `arch`.
const Family& family(Architecture arch);
/// Every supported family, in the table's order.
std::span<const Family* const> families();

}  // namespace megatrain
