// Token embedding: ids -> rows of model.embed_tokens.weight, into the residual stream (B::Res).
// With a pad_token_id in the config the row of that id gets no gradient from the lookup, as
// PyTorch's nn.Embedding(padding_idx=pad_token_id) in transformers' models (a tied LM head still
// adds its own gradient to it). Gemma multiplies the looked-up rows by sqrt(hidden_size)
// (ModelConfig::embed_scale), and their gradient by the same.
#pragma once

#include <string>
#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class Embedding {
 public:
  explicit Embedding(const ModelConfig& cfg)
      : vocab_(cfg.vocab_size),
        hidden_(cfg.hidden_size),
        std_(cfg.initializer_range),
        padding_(cfg.pad_token_id ? static_cast<std::int32_t>(*cfg.pad_token_id) : -1),
        scale_(cfg.embed_scale()) {}

  static constexpr const char* kTable = "model.embed_tokens.weight";

  template <class E>
  struct Weights {
    View<E> table;  ///< [vocab, hidden]
  };

  std::vector<ParamSpec> params() const {
    return {ParamSpec::matrix(kTable, Shape{vocab_, hidden_}, static_cast<float>(std_))};
  }
  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p(kTable)};
  }
  std::int64_t hidden_size() const { return hidden_; }
  std::int64_t vocab_size() const { return vocab_; }
  /// The id whose row the lookup's backward leaves alone (padding_idx), or -1.
  std::int32_t padding_id() const { return padding_; }
  /// What the looked-up rows are multiplied by (1 but for Gemma).
  double scale() const { return scale_; }

  template <class B>
  void forward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const std::int32_t> ids,
               View<typename B::Res> y, Arena&) const {
    MT_CHECK(ids.numel() == c.tokens(), "embedding: {} ids for a chunk of {} tokens", ids.numel(), c.tokens());
    be.embedding(ids, w.table, y, scale_);
  }
  /// The forward from fp32 rows: `table` is the fp32 master table, or the rows the `ids` index
  /// (the batch's distinct tokens' rows). The lookup PyTorch's autocast does (it does not round
  /// the embedding to bf16); the trainer uses it.
  template <class B>
  void forward_full(B& be, ChunkShape c, View<const float> table, View<const std::int32_t> ids, View<typename B::Res> y,
                    Arena&) const {
    MT_CHECK(ids.numel() == c.tokens(), "embedding: {} ids for a chunk of {} tokens", ids.numel(), c.tokens());
    MT_CHECK(table.size(1) == hidden_, "embedding: fp32 rows of width {} for hidden size {}", table.size(1), hidden_);
    be.embedding(ids, table, y, scale_);
  }
  template <class B>
  void backward(B& be, ChunkShape c, View<const std::int32_t> ids, View<const typename B::Res> dy,
                const Weights<typename B::Acc>& grads, Arena& arena) const {
    backward(be, c, ids, dy, grads, arena, padding_);
  }
  /// The same where `ids` index another table (the batch's distinct rows: the trainer's compact
  /// ids), `skip_id` being the padding row's index there (-1: none).
  template <class B>
  void backward(B& be, ChunkShape c, View<const std::int32_t> ids, View<const typename B::Res> dy,
                const Weights<typename B::Acc>& grads, Arena&, std::int32_t skip_id) const {
    MT_CHECK(ids.numel() == c.tokens(), "embedding: {} ids for a chunk of {} tokens", ids.numel(), c.tokens());
    be.embedding_backward(ids, dy, grads.table, skip_id, scale_);
  }

 private:
  std::int64_t vocab_, hidden_;
  double std_;
  std::int32_t padding_;
  double scale_;
};

}  // namespace megatrain
