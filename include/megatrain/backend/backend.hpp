// What a compute backend provides, and the shapes its primitives speak in.
//
// A backend is an object with three element types and a fixed set of primitives over views.
// The layer ops (layers/ops/) are written once against this interface; the CPU backend
// (backend/cpu) computes in T = float or double, the CUDA backend in bf16 with fp32
// accumulation. Primitives may be asynchronous (the CUDA backend queues work on its compute
// stream); views passed to one must stay valid until the backend is synchronised.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "megatrain/core/error.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/core/dtype.hpp"

namespace megatrain {

template <class T>
struct AdamWScalars;  // optim/adamw.hpp

/// Labels equal to this are ignored by the loss (PyTorch's ignore_index).
inline constexpr std::int32_t kIgnoreIndex = -100;

/// One chunk of a batch: `rows` whole sequences of `seq` tokens. Attention never crosses a
/// sequence, so a unit can run a batch chunk by chunk.
struct ChunkShape {
  std::int64_t rows = 0;
  std::int64_t seq = 0;
  std::int64_t tokens() const { return rows * seq; }
};

/// Shape of one causal grouped-query attention call.
struct AttentionShape {
  std::int64_t rows = 0;      ///< sequences
  std::int64_t seq = 0;       ///< tokens per sequence
  std::int64_t heads = 0;     ///< query heads
  std::int64_t kv_heads = 0;  ///< key/value heads; divides heads
  std::int64_t head_dim = 0;
  void validate() const {
    MT_CHECK(rows > 0 && seq > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0,
             "invalid attention shape: {} rows x {} tokens, {} heads, {} kv heads, head_dim {}", rows, seq, heads,
             kv_heads, head_dim);
  }
};

// clang-format off
/// The primitives every backend implements (see backend/cpu/cpu_backend.hpp for their
/// contracts, which all backends share). Requirements, one per line:
template <class B>
concept Backend = requires(B& be, View<const typename B::Act> a, View<typename B::Act> ma,
                           View<const typename B::Weight> w, View<const full_t<typename B::Weight>> gain,
                           View<typename B::Acc> acc, View<const typename B::Acc> cacc,
                           View<const typename B::Res> r, View<typename B::Res> mr, View<const std::int32_t> ids,
                           std::span<const double> freqs, const AttentionShape& as, double x, bool flag,
                           View<double> sum, const AdamWScalars<float>& adam, std::span<float> f32,
                           std::span<const typename B::Acc> grad, std::span<typename B::Weight> wout) {
  typename B::Act;     // activation element type
  typename B::Weight;  // weight element type as the ops read it (norm gains: full_t<Weight>)
  typename B::Acc;     // gradient accumulators, saved statistics, losses
  typename B::Res;     // the residual stream between and inside blocks, and its gradient
  { B::kDevice } -> std::convertible_to<bool>;                     // views live in device memory
  be.add(a, ma);                                                   // y += x
  be.add(a, mr);                                                   // residual y += x
  be.convert(r, ma);                                               // residual values as activations
  be.linear(a, w, w, ma);                                          // y = x W^T + b
  be.linear_add(a, w, w, r, mr);                                   // residual y = r + x W^T + b (y may be r)
  be.linear_backward(a, w, a, ma, flag, acc, acc);                 // dx, dW +=, db +=
  be.rmsnorm(r, gain, x, ma, acc);                                 // y, rstd (of the residual stream)
  be.rmsnorm_backward(r, gain, cacc, a, r, mr, ma, acc);           // dx = residual + ..., its activation copy, dw +=
  be.rope(ma, std::int64_t{}, std::int64_t{}, freqs);              // rotate in place
  be.rope_backward(ma, std::int64_t{}, std::int64_t{}, freqs);     // inverse rotation in place
  be.attention(a, a, a, ma, acc, as);                              // out, lse
  be.attention_backward(a, a, a, a, cacc, a, ma, ma, ma, as);      // dq, dk, dv
  be.swiglu(a, a, ma);                                             // silu(g) * u
  be.swiglu_backward(a, a, a, ma, ma);                             // dg, du
  be.embedding(ids, w, mr);                                        // gather rows into the residual stream
  be.embedding_backward(ids, r, acc);                              // scatter-add rows
  be.take_rows(ids, acc, acc);                                     // gather rows, zero them at the source
  be.lm_head_loss(a, w, ids, x, acc, ma, acc);                     // per-token loss, dh, dW +=
  be.sum_squares(cacc, sum);                                       // sum[0] = sum of x^2 (gradient norms)
  be.adamw(adam, f32, f32, f32, grad, wout);                       // AdamW on p, m, v; w = p as the ops read it
};
// clang-format on

}  // namespace megatrain
