// ModelConfig: the shape of a decoder-only model, read from a Hugging Face config.json.
//
// The families megatrain trains (Llama, Mistral, Qwen2, Qwen3, Phi-3/4, Gemma 3 text, SmolLM3,
// the mixtures of experts Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, and the hybrid Qwen3.5 text model) share this one description of a
// decoder's shape; what sets each family apart (its ops, names and config.json fields) is declared
// in its own file, src/model/families/<family>.cpp (family.hpp). A missing required field, a
// field of the wrong type, or fields that contradict each other (`architectures` and
// `model_type` naming different models, a bias the family has no option for, without head_dim a
// head count that does not divide the hidden size, key/value heads that do not divide the query
// heads, an odd head_dim, ...) is an error naming the file and the field.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/model/layer_kind.hpp"

namespace megatrain {

/// The supported families (family.hpp declares what each is made of).
enum class Architecture {
  llama, mistral, qwen2, qwen3, phi3, gemma3, qwen3_moe, mixtral, olmoe, gpt_oss, smollm3, qwen3_5, qwen3_5_moe, qwen3_next
};
struct BlockRecipe;

/// The MLP's gate activation: silu (SwiGLU: Llama, Qwen, Mistral, Phi-3), the tanh
/// approximation of GELU (GeGLU: Gemma's "gelu_pytorch_tanh"), or GPT-OSS's clamped SwiGLU of its
/// experts: with g' = min(g, 7) and u' = clamp(u, -7, 7), m = (u' + 1) g' sigmoid(1.702 g')
/// (transformers' GptOssExperts; the gradient passes where the clamp is inactive, bounds included).
enum class Activation { silu, gelu_tanh, clamped_swiglu };
/// GPT-OSS's clamped SwiGLU constants (transformers hard-codes them: its config's swiglu_limit is
/// not read).
inline constexpr double kClampedSwigluAlpha = 1.702, kClampedSwigluLimit = 7.0;

/// How rotary frequencies are derived from rope_theta (Hugging Face's rope_scaling / rope_parameters).
struct RopeScaling {
  enum class Type { none, linear, llama3, yarn, longrope } type = Type::none;
  double factor = 1.0;  ///< yarn: 0 when absent (then max_position_embeddings / original_max_position_embeddings)
  double low_freq_factor = 1.0;                       ///< llama3
  double high_freq_factor = 4.0;                      ///< llama3
  /// llama3 (default 8192); yarn (0 when absent: max_position_embeddings)
  std::int64_t original_max_position_embeddings = 8192;
  // yarn (transformers' _compute_yarn_parameters): the ramp's bounds, whether they are rounded to
  // whole dimensions, and the cos/sin scale (given, or 0.1 ln(factor) + 1, or mscale's ratio)
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  std::optional<double> attention_factor, mscale, mscale_all_dim;
  // longrope (Phi-3's long-context variants): per-frequency divisors, `long_factor` for sequences
  // longer than original_max_position_embeddings, `short_factor` otherwise; factor 0 when absent
  // (then max_position_embeddings / original_max_position_embeddings)
  std::vector<double> short_factor, long_factor;
};

/// A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS): a router picks each
/// token's experts_per_token experts of num_experts (softmax, top-k, renormalised where
/// norm_topk_prob; GPT-OSS's softmax over the top-k logits is the same), each a gated MLP of its
/// own intermediate_size. Dropless: no token is dropped.
struct MoeConfig {
  std::int64_t num_experts = 0;        ///< 0: a dense model
  std::int64_t experts_per_token = 0;  ///< num_experts_per_tok
  std::int64_t intermediate_size = 0;  ///< each expert's (Qwen3-MoE: moe_intermediate_size)
  bool norm_topk_prob = false;         ///< the chosen experts' weights divided by their sum (Mixtral: always)
  /// Qwen3-MoE: the layers whose MLP is dense (mlp_only_layers, and those decoder_sparse_step
  /// skips), as listed in config.json; every other layer is sparse.
  std::vector<std::int64_t> dense_layers;
  std::int64_t decoder_sparse_step = 1;
  /// The auxiliary load-balancing loss, router_aux_loss_coef x transformers' load_balancing_loss_func,
  /// added to the training loss (output_router_logits: true).
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.0;
  /// GPT-OSS: the router has a bias, and every expert's gate, up and down projections too.
  bool biases = false;
  /// Qwen3-Next, Qwen3.5-MoE: a shared expert every token passes through beside its routed ones,
  /// a SwiGLU MLP of this size scaled by sigmoid(shared_expert_gate(x)) (shared_expert_intermediate_size);
  /// 0: none.
  std::int64_t shared_expert_size = 0;
  /// A shared expert's parameters: its gate, up and down projections and its [1, hidden] gate.
  std::int64_t shared_expert_params(std::int64_t hidden_size) const;
};

/// The shape of Gated DeltaNet, the linear attention of Qwen3.5's and Qwen3-Next's
/// linear_attention layers (config.json's linear_* fields; layers/ops/gated_deltanet.hpp).
/// key_heads 0: a model without linear attention.
struct LinearAttentionConfig {
  std::int64_t key_heads = 0;       ///< linear_num_key_heads
  std::int64_t value_heads = 0;     ///< linear_num_value_heads (a multiple of key_heads)
  std::int64_t key_head_dim = 0;    ///< linear_key_head_dim
  std::int64_t value_head_dim = 0;  ///< linear_value_head_dim
  std::int64_t conv_kernel = 4;     ///< linear_conv_kernel_dim: the causal convolution's taps
  /// Qwen3-Next's fused projections (in_proj_qkvz, in_proj_ba); else Qwen3.5's four.
  bool fused = false;

  std::int64_t key_dim() const { return key_heads * key_head_dim; }
  std::int64_t value_dim() const { return value_heads * value_head_dim; }
  /// The convolution's channels: q, k and v.
  std::int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  /// The parameters of one layer's linear attention (the same fused or not).
  std::int64_t params(std::int64_t hidden_size) const;
  /// Throws naming the first field out of range; `src` names where it came from.
  void check(std::string_view src) const;
  bool operator==(const LinearAttentionConfig&) const = default;
};

struct ModelConfig {
  /// Bounds far beyond any published model (the deepest have ~128 layers, the widest heads 512
  /// dimensions), checked as soon as a config is read, before anything sized by them is built.
  static constexpr std::int64_t kMaxLayers = std::int64_t{1} << 16;
  static constexpr std::int64_t kMaxHeadDim = std::int64_t{1} << 14;

  Architecture architecture = Architecture::llama;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;   ///< biases on q, k, v projections (Qwen2 always; Llama's attention_bias)
  bool o_bias = false;     ///< bias on the output projection (Llama's attention_bias)
  bool mlp_bias = false;   ///< biases on gate/up/down (Llama's mlp_bias)
  std::optional<std::int64_t> sliding_window;  ///< Mistral/Qwen2: attention window, if any
  /// config.json's layer_types: each layer's token mixer (layer_kind). Gemma 3, GPT-OSS: which
  /// layers attend within `sliding_window` tokens (sliding_attention) and which over the whole
  /// sequence (full_attention). Empty: every layer attends over the whole sequence, and a window,
  /// if any, bounds the sequence length instead (check_sequence_length).
  std::vector<TokenMixerKind> layer_types;
  /// Gemma 3: the sliding layers' own rotary base and scaling (rope_parameters'
  /// "sliding_attention"; transformers 4's rope_local_base_freq); the full layers use rope_theta
  /// and rope_scaling.
  double local_rope_theta = 10000.0;
  RopeScaling local_rope_scaling;
  /// SmolLM3: the layers that apply no rotary embedding (no_rope_layers' zeros: NoPE layers).
  /// Empty for the other families.
  std::vector<bool> nope_layers;
  Activation hidden_act = Activation::silu;
  /// The share of each head the rotary embedding turns (transformers' partial_rotary_factor:
  /// Phi-4-mini's 0.75): the first rotary_dim() dimensions; the rest pass through unrotated.
  double partial_rotary_factor = 1.0;
  /// Gemma 3: the softmax scale is query_pre_attn_scalar^-1/2 instead of head_dim^-1/2.
  std::optional<double> query_pre_attn_scalar;
  /// pad_token_id: transformers builds the embedding with padding_idx = this id, whose row then
  /// gets no gradient from the lookup (Embedding follows it); none when absent or null.
  std::optional<std::int64_t> pad_token_id;
  double initializer_range = 0.02;
  /// The experts of Qwen3-MoE, Mixtral, OLMoE and GPT-OSS (num_experts 0 for the dense families).
  MoeConfig moe;
  /// The linear-attention layers' shape (layer_types' linear_attention entries); none elsewhere.
  LinearAttentionConfig linear_attention;
  /// The activation of the experts' gated MLPs (GPT-OSS: clamped_swiglu); hidden_act elsewhere.
  Activation expert_act() const;
  /// Where the checkpoint keeps this model's tensors when config.json describes a multimodal
  /// model whose language model this is: prepended to every name ("language_model." for
  /// Gemma3ForConditionalGeneration: language_model.model.layers.0...), or in place of the text
  /// model's leading "model." (checkpoint_model_prefix, "model.language_model." for
  /// Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration: lm_head.weight stays
  /// at the top); else empty. The vision tower (and Qwen3.5's mtp.* layers) is not part of the model.
  std::string checkpoint_prefix;
  std::string checkpoint_model_prefix;
  /// The multimodal class config.json named (wrapping this language model), else empty.
  std::string wrapper_architecture;
  /// The checkpoint tensor holding parameter `param` (a text model's name), as above.
  std::string checkpoint_name(std::string_view param) const;
  /// The parameter a checkpoint tensor holds, or nullopt for a multimodal checkpoint's tensors
  /// beside its language model's (the vision tower, a projector, Qwen3.5's mtp.* layers).
  std::optional<std::string> param_name(std::string_view tensor) const;

  /// Parses a config.json object; `source` names it in errors (a path, or "<flags>"). A multimodal
  /// config (Gemma3ForConditionalGeneration, Qwen3_5ForConditionalGeneration,
  /// Qwen3_5MoeForConditionalGeneration) gives its language model (language_model_config), with
  /// checkpoint_prefix or checkpoint_model_prefix set.
  static ModelConfig from_json(const nlohmann::json& j, std::string_view source = "config.json");
  /// For a config.json of a multimodal model above: its language model's config.json, as its text
  /// class would have it: text_config, for Gemma 3 the keys a published text_config leaves out
  /// filled with Gemma3TextConfig's defaults (as transformers fills them), the wrapper's dtype and
  /// tie_word_embeddings where text_config has none. nullopt for any other config.
  static std::optional<nlohmann::json> language_model_config(const nlohmann::json& j, std::string_view source = "config.json");
  /// Reads and parses a config.json file.
  static ModelConfig from_file(const std::filesystem::path& path);
  /// A built-in shape of a public model by name: "qwen2.5-1.5b", "qwen3-8b", "gemma-3-1b",
  /// "smollm3-3b", "qwen3-30b-a3b", "gpt-oss-20b", ... (preset_names() lists them all). Throws for
  /// an unknown name (listing them).
  static ModelConfig preset(std::string_view name);
  static std::vector<std::string> preset_names();

  /// Throws megatrain::Error naming the first inconsistent field (including biases the
  /// architecture cannot have: Llama's qkv_bias and o_bias agree, Qwen2 has exactly q/k/v biases,
  /// Mistral none).
  void validate(std::string_view source = "model config") const;
  /// The config.json a Hugging Face loader reads back into the same model.
  nlohmann::json to_json() const;

  std::string_view architecture_name() const;  ///< "LlamaForCausalLM", ...
  /// What this family's blocks are made of (family.hpp): the ops DecoderBlock composes.
  const BlockRecipe& block() const;
  std::string_view model_type() const;  ///< "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"
  /// Each query and key head is RMS-normalised over head_dim (its own gain, rms_norm_eps) before
  /// the rotary embedding: q_norm and k_norm of Qwen3.
  bool qk_norm() const;
  /// OLMoE: q_norm and k_norm normalise the whole q and k projections of a token (widths q_dim
  /// and kv_dim), not each head.
  bool qk_norm_full() const;
  /// What layer `layer` is made of: its token mixer (layer_types) and its channel mixer (a
  /// mixture of experts on the sparse layers, else a dense MLP).
  LayerKind layer_kind(std::int64_t layer) const;
  /// Which layers attend within sliding_window tokens (layer_types' sliding_attention entries;
  /// empty where layer_types is).
  std::vector<bool> sliding_layers() const;
  /// Layer `layer`'s MLP is a mixture of experts (MoeMlp) rather than a dense gated MLP.
  bool is_moe_layer(std::int64_t layer) const;
  /// How many layers are mixtures of experts (0 for a dense model).
  std::int64_t moe_layer_count() const;
  /// The module holding a sparse layer's router and experts: "mlp", or Mixtral's "block_sparse_moe".
  std::string_view moe_module() const;
  /// The checkpoint stores q/k/v as one self_attn.qkv_proj.weight and gate/up as one
  /// mlp.gate_up_proj.weight (rows concatenated in that order): Phi-3.
  bool fused_projections() const;
  /// Every RMSNorm multiplies by (1 + w) instead of w, its gain stored as w (Gemma's norms; a
  /// model initialised from scratch starts them at 0).
  bool norm_unit_offset() const;
  /// Gemma 3's block: the attention's and the MLP's outputs are normalised before they join the
  /// residual stream (post_attention_layernorm, post_feedforward_layernorm), and the MLP's input
  /// norm is pre_feedforward_layernorm.
  bool sandwich_norms() const;
  /// The embedding's output is multiplied by this: sqrt(hidden_size) in fp32 for Gemma, else 1.
  double embed_scale() const;
  /// The softmax scale of attention: 1/sqrt(query_pre_attn_scalar) where given, else 1/sqrt(head_dim).
  double attention_scale() const;
  /// Qwen3.5, Qwen3-Next: q_proj gives each head's query then its gate (2 x q_dim rows), and the
  /// attention's output is multiplied by sigmoid(gate) before o_proj.
  bool attention_output_gate() const;
  /// GPT-OSS: each attention head has a learned sink (self_attn.sinks, [heads]), a logit added to
  /// every query's softmax that takes probability and carries no value.
  bool attention_sinks() const;
  /// The keys a query of layer `layer` sees: the last `window` ones (itself included), or 0: all
  /// before it. Nonzero only for the sliding layers of Gemma 3 and GPT-OSS.
  std::int64_t attention_window(std::int64_t layer) const;
  /// Layer `layer` applies the rotary embedding to q and k (all but SmolLM3's NoPE layers).
  bool rotary_layer(std::int64_t layer) const;
  /// This config with layer `layer`'s rotary parameters in rope_theta / rope_scaling (Gemma 3's
  /// sliding layers have their own); the config itself for every other layer and family.
  ModelConfig rope_for_layer(std::int64_t layer) const;
  std::int64_t q_dim() const { return num_attention_heads * head_dim; }
  /// The rotated dimensions of a head: int(head_dim * partial_rotary_factor), as transformers.
  std::int64_t rotary_dim() const;
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  /// The rotary inverse frequencies (rotary_dim() / 2 of them), rope scaling applied, in double.
  /// longrope's depend on the length of the longest sequence (`seq_len`; 0: a short one), as
  /// transformers picks them per forward.
  std::vector<double> rope_inv_freq(std::int64_t seq_len = 0) const;
  /// The scale of the rotary cos and sin (yarn's attention factor; 1 for the other types), as
  /// transformers multiplies them: q and k both scaled by it.
  double rope_attention_scaling() const;
  /// yarn: the original context length and the factor, absent ones resolved as transformers does.
  std::int64_t yarn_original_length() const;
  double yarn_factor() const;
  /// Parameters in the whole model (embedding, blocks, final norm, LM head unless tied).
  std::int64_t param_count() const;
  /// One expert's parameters: gate, up and down (and their biases where the family has them).
  std::int64_t expert_params() const;
  /// The parameters one token's forward uses: param_count() less the experts a token is not routed
  /// to (num_experts - experts_per_token per sparse layer); param_count() for a dense model.
  std::int64_t active_param_count() const;
  /// This config with `layers` decoder layers and its per-layer tables (layer types, dense
  /// layers) cut with it: the model's first layers (benchmarks' cuts of a preset); layers beyond
  /// the original ones repeat its layer types from the first. Validated.
  ModelConfig with_layers(std::int64_t layers) const;
  /// Throws if a sequence of `seq_len` tokens is beyond what this model can attend over exactly.
  void check_sequence_length(std::int64_t seq_len) const;
};

}  // namespace megatrain
