// A plain training loop over the same ops, every unit resident, the whole batch as one chunk,
// one optimizer call per unit per step: what the streaming trainer must agree with.
#pragma once

#include <cmath>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/optim/lr_schedule.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain::test {

struct ReferenceLoop {
  const DecoderModel<>& model;
  HostParamStore<float>& store;
  AdamWConfig adamw;
  LrSchedule schedule;
  double clip_norm = 0;
  std::int64_t rows, seq;
  CpuBackend<float> be;
  std::int64_t step_no = 0;
  /// When set: the gradients are multiplied by this instead (to follow ClipMode::stale).
  std::optional<double> clip_coef = std::nullopt;
  /// transformers' attention mask (rows * seq; empty: every token counts): right padding, which
  /// only leaves padding out of a mixture of experts' auxiliary loss (attention is causal).
  std::vector<std::uint8_t> attention_mask = {};
  /// When set, gradients() also writes the logits of its forward here (rows * seq * vocab).
  std::vector<float>* logits = nullptr;
  /// An objective's weight per token (train/objective.hpp): the backward of sum_t w_t * loss_t,
  /// the loss that sum; empty: cross-entropy. `weigh`, when set, makes them from the forward's
  /// per-token losses first (an objective that reads the log-probabilities).
  std::vector<float> token_weights = {};
  std::function<std::vector<float>(const std::vector<float>& losses)> weigh = {};

  struct Result {
    double loss, grad_norm;
    double aux_loss = 0;  ///< a mixture of experts' load-balancing loss (moe_aux_loss), whether trained or not
  };

  Result step(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels) {
    ++step_no;
    std::vector<std::vector<float>> grads;
    const Result r = gradients(ids, labels, grads);
    const double coef = clip_coef ? *clip_coef : clip_norm > 0 ? clip_coefficient(r.grad_norm, clip_norm) : 1.0;
    const double lr = schedule.at(step_no);
    for (std::size_t u = 0; u < store.num_units(); ++u)
      adamw_step<float>(store.unit(u), std::span<const float>(grads[u]), adamw, step_no, lr, coef);
    return r;
  }

  /// The loss (mean over labelled tokens) and each unit's gradient (laid out as its slab), from
  /// the store's master weights; nothing is updated.
  Result gradients(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                   std::vector<std::vector<float>>& grads) {
    const std::int64_t M = rows * seq, d = model.config().hidden_size;
    const std::size_t L = model.num_blocks();
    const ChunkShape c{rows, seq};
    std::vector<std::byte> mem(64 << 20);
    Arena arena{std::span<std::byte>(mem)};
    std::vector<std::vector<float>> acts(L + 1, std::vector<float>(static_cast<std::size_t>(M * d)));
    grads.clear();
    for (const auto& u : store.units()) grads.emplace_back(static_cast<std::size_t>(u.numel()), 0.0f);
    auto view = [&](std::vector<float>& v) { return View<float>(std::span<float>(v), Shape{M, d}); };
    View<const std::int32_t> idv(ids, Shape{M}), lbv(labels, Shape{M});
    auto master = [&](std::size_t u) { return std::span<const float>(store.unit(u).master()); };
    // A mixture of experts: each sparse layer's routing statistics of this forward, and the
    // auxiliary loss's gradient from them in the backward where the config asks for that loss.
    const ModelConfig& cfg = model.config();
    const std::int64_t Lm = cfg.moe_layer_count(), E = cfg.moe.num_experts;
    std::vector<std::int64_t> counts(static_cast<std::size_t>(Lm * E), 0);
    std::vector<double> probs(counts.size(), 0.0);
    std::vector<std::int64_t> sparse(L, -1);
    std::int64_t counted = M;  // (the tokens the auxiliary loss counts)
    if (!attention_mask.empty()) {
      MT_CHECK(static_cast<std::int64_t>(attention_mask.size()) == M, "an attention mask of {} for {} tokens", attention_mask.size(), M);
      counted = 0;
      for (const auto v : attention_mask) counted += v;
    }
    for (std::size_t l = 0, n = 0; l < L; ++l)
      if (cfg.is_moe_layer(static_cast<std::int64_t>(l))) sparse[l] = static_cast<std::int64_t>(n++);
    auto chunk = [&](std::size_t l, bool backward) {
      ChunkShape cl = c;
      if (sparse[l] < 0) return cl;
      if (!attention_mask.empty()) cl.router.valid = View<const std::uint8_t>(std::span<const std::uint8_t>(attention_mask), Shape{M});
      const auto at = static_cast<std::size_t>(sparse[l] * E);
      if (!backward) {
        cl.router.counts = View<std::int64_t>(std::span<std::int64_t>(counts).subspan(at, static_cast<std::size_t>(E)), Shape{E});
        cl.router.probs = View<double>(std::span<double>(probs).subspan(at, static_cast<std::size_t>(E)), Shape{E});
      } else if (cfg.moe.output_router_logits) {
        cl.router.aux_counts = View<const std::int64_t>(std::span<const std::int64_t>(counts), Shape{Lm, E});
        cl.router.aux_scale = moe_aux_scale(cfg.moe.router_aux_loss_coef, 1.0, Lm, E, counted);
      }
      return cl;
    };
    const auto& emb = model.embedding();
    const auto embed_w = emb.bind(master(0));
    emb.op().forward(be, c, embed_w, idv, view(acts[0]), arena);
    for (std::size_t l = 0; l < L; ++l)
      model.block(l).op().forward(be, chunk(l, false), model.block(l).bind(master(l + 1)), View<const float>(view(acts[l])),
                                  view(acts[l + 1]), arena);
    std::int64_t valid = 0;
    for (auto y : labels) valid += y != kIgnoreIndex;
    std::vector<float> loss(static_cast<std::size_t>(M)), dy(static_cast<std::size_t>(M * d)), dx(dy.size());
    const std::size_t H = model.head_unit();
    const auto head_w = model.head().bind(master(H), {{&emb.layout(), master(0)}});
    if (logits != nullptr) {
      logits->assign(static_cast<std::size_t>(M * cfg.vocab_size), 0.0f);
      model.head().op().logits(be, c, head_w, View<const float>(view(acts[L])),
                               View<float>(std::span<float>(*logits), Shape{M, cfg.vocab_size}), arena);
    }
    const auto head_g = model.head().bind(std::span<float>(grads[H]), {{&emb.layout(), std::span<float>(grads[0])}});
    if (weigh) {
      model.head().op().forward(be, c, head_w, View<const float>(view(acts[L])), lbv, View<float>(std::span<float>(loss), Shape{M}),
                                arena);
      token_weights = weigh(loss);
    }
    const bool weighted = !token_weights.empty();
    model.head().op().forward_backward(be, c, head_w, View<const float>(view(acts[L])), lbv,
                                       weighted ? 1.0 : 1.0 / static_cast<double>(valid),
                                       weighted ? View<const float>(std::span<const float>(token_weights), Shape{M}) : View<const float>{},
                                       View<float>(std::span<float>(loss), Shape{M}), view(dy), head_g, arena);
    for (std::size_t l = L; l-- > 0;) {
      model.block(l).op().backward(be, chunk(l, true), model.block(l).bind(master(l + 1)), View<const float>(view(acts[l])),
                                   View<const float>(view(dy)), view(dx), model.block(l).bind(std::span<float>(grads[l + 1])),
                                   arena);
      std::swap(dy, dx);
    }
    emb.op().backward(be, c, idv, View<const float>(view(dy)), emb.bind(std::span<float>(grads[0])), arena);
    double sumsq = 0;
    for (auto& g : grads) sumsq += grad_sum_squares<float>(g);
    const double norm = std::sqrt(sumsq);
    double total = 0;
    for (std::size_t t = 0; t < loss.size(); ++t) total += weighted ? static_cast<double>(token_weights[t]) * loss[t] : loss[t];
    return {weighted ? total : total / static_cast<double>(valid), norm, Lm > 0 ? moe_aux_loss(counts, probs, Lm, E, counted) : 0.0};
  }
};

}  // namespace megatrain::test
