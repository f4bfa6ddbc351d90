// The head: final RMSNorm, LM head and cross-entropy, fused and chunked over tokens so the
// full logits never exist. Its input (and input gradient) is the residual stream (B::Res). With tied embeddings the LM head is the embedding table, bound
// from the embedding unit's buffer (its gradient accumulates there too).
//
// Loss: per token, logsumexp(z) - z[label] (0 where the label is kIgnoreIndex): minus the
// log-probability of the label. The caller turns per-token losses into the batch mean by passing
// loss_scale = 1 / (tokens with a label), and into another objective by weighting each token's
// gradient (train/objective.hpp).
#pragma once

#include <vector>

#include "megatrain/layers/layer_op.hpp"
#include "megatrain/layers/ops/embedding.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

class LmHead {
 public:
  explicit LmHead(const ModelConfig& cfg)
      : vocab_(cfg.vocab_size), hidden_(cfg.hidden_size), eps_(cfg.rms_norm_eps), tied_(cfg.tie_word_embeddings),
        std_(cfg.initializer_range), offset_(cfg.norm_unit_offset() ? 1.0 : 0.0) {}

  static constexpr const char* kNorm = "model.norm.weight";
  static constexpr const char* kHead = "lm_head.weight";

  template <class E>
  struct Weights {
    View<full_t<E>> norm;  ///< [hidden], at full precision (ParamBinder::full)
    View<E> lm_head;       ///< [vocab, hidden]; the embedding table when tied
  };

  /// The head unit's own tensors (without the table when tied: that lives in the embedding unit).
  std::vector<ParamSpec> params() const {
    std::vector<ParamSpec> p{ParamSpec::norm(kNorm, hidden_, offset_ != 0)};
    if (!tied_) p.push_back(ParamSpec::matrix(kHead, Shape{vocab_, hidden_}, static_cast<float>(std_)));
    return p;
  }
  template <class E>
  Weights<E> bind(const ParamBinder<E>& p) const {
    return {p.full(kNorm), p(tied_ ? Embedding::kTable : kHead)};
  }
  bool tied() const { return tied_; }
  std::int64_t hidden_size() const { return hidden_; }

  template <class B>
  std::size_t scratch_bytes(ChunkShape c) const {
    Arena measure;
    (void)carve<B>(measure, c);
    return measure.peak();
  }

  template <class B>
  void forward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
               View<const std::int32_t> labels, View<typename B::Acc> loss, Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c);
    be.rmsnorm(x, w.norm, eps_, a.n, a.rstd, offset_);
    be.lm_head_loss(View<const typename B::Act>(a.n), w.lm_head, labels, 0.0, View<const typename B::Acc>{}, loss,
                    View<typename B::Act>{}, View<typename B::Acc>{});
  }

  /// The logits (tokens x vocab) of the final hidden states x: the final norm, then the head's
  /// projection, as the loss sees them (for evaluation, and to compare with transformers' logits).
  template <class B>
  void logits(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
              View<typename B::Act> out, Arena& scratch) const {
    MT_CHECK(out.shape() == (Shape{c.tokens(), vocab_}), "lm head logits: an output of {} for {} tokens x a vocabulary of {}",
             out.shape().str(), c.tokens(), vocab_);
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c);
    be.rmsnorm(x, w.norm, eps_, a.n, a.rstd, offset_);
    be.linear(View<const typename B::Act>(a.n), w.lm_head, View<const typename B::Weight>{}, out);
  }

  template <class B>
  void forward_backward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                        View<const std::int32_t> labels, double loss_scale, View<typename B::Acc> loss,
                        View<typename B::Res> dx, const Weights<typename B::Acc>& g, Arena& scratch) const {
    forward_backward(be, c, w, x, labels, loss_scale, View<const typename B::Acc>{}, loss, dx, g, scratch);
  }
  /// The same for sum_t loss_scale * token_weights[t] * loss_t: a weighted objective
  /// (train/objective.hpp); null weights: every one 1.
  template <class B>
  void forward_backward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Res> x,
                        View<const std::int32_t> labels, double loss_scale, View<const typename B::Acc> token_weights,
                        View<typename B::Acc> loss, View<typename B::Res> dx, const Weights<typename B::Acc>& g,
                        Arena& scratch) const {
    ArenaScope scope(scratch);
    const auto a = carve<B>(scratch, c);
    be.rmsnorm(x, w.norm, eps_, a.n, a.rstd, offset_);
    be.lm_head_loss(View<const typename B::Act>(a.n), w.lm_head, labels, loss_scale, token_weights, loss, a.dn, g.lm_head);
    be.rmsnorm_backward(x, w.norm, View<const typename B::Acc>(a.rstd), View<const typename B::Act>(a.dn),
                        View<const typename B::Res>{}, dx, View<typename B::Act>{}, g.norm, offset_);
  }

 private:
  template <class B>
  struct Acts {
    View<typename B::Act> n, dn;
    View<typename B::Acc> rstd;
  };
  template <class B>
  Acts<B> carve(Arena& ar, ChunkShape c) const {
    Acts<B> a;
    a.n = ar.alloc<typename B::Act>({c.tokens(), hidden_});
    a.dn = ar.alloc<typename B::Act>({c.tokens(), hidden_});
    a.rstd = ar.alloc<typename B::Acc>({c.tokens()});
    return a;
  }

  std::int64_t vocab_, hidden_;
  double eps_;
  bool tied_;
  double std_;
  double offset_;  // the final norm multiplies by (w + offset_): 1 for Gemma, else 0
};

}  // namespace megatrain
