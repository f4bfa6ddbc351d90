// What a compute backend provides, and the shapes its primitives speak in.
//
// A backend is an object with three element types and a fixed set of primitives over views.
// The layer ops (layers/ops/) are written once against this interface; the CPU backend
// (backend/cpu) computes in T = float or double, the CUDA backend in bf16 with fp32
// accumulation. Primitives may be asynchronous (the CUDA backend queues work on its compute
// stream); views passed to one must stay valid until the backend is synchronised.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "megatrain/backend/delta_net_shape.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/model/config.hpp"

namespace megatrain {

template <class T>
struct AdamWScalars;  // optim/adamw.hpp

/// Labels equal to this are ignored by the loss (PyTorch's ignore_index).
inline constexpr std::int32_t kIgnoreIndex = -100;

/// Several sequences packed into each row of a chunk ("packing", docs/data.md): rotary positions
/// restart and attention stays within each sequence. Empty when each row is one sequence.
struct PackedRows {
  /// [tokens]: each token's position within its own sequence, in the backend's memory: 0 at a
  /// row's first token and wherever a sequence starts, the previous token's plus one elsewhere.
  View<const std::int32_t> positions;
  /// Where the sequences start, then where the last one ends (count + 1 increasing token
  /// offsets, relative to the first entry, which is the chunk's first token), in the backend's
  /// memory and in host memory. Every row starts a sequence; none crosses a row.
  View<const std::int32_t> starts;
  std::span<const std::int32_t> host_starts;

  bool empty() const { return positions.is_null(); }
  /// Sequences in the chunk.
  std::int64_t count() const { return host_starts.empty() ? 0 : static_cast<std::int64_t>(host_starts.size()) - 1; }
  /// The longest one.
  std::int64_t longest() const {
    std::int32_t m = 0;
    for (std::size_t i = 1; i < host_starts.size(); ++i) m = std::max(m, host_starts[i] - host_starts[i - 1]);
    return m;
  }
};

/// A mixture-of-experts layer's routing statistics (MoeMlp), in the backend's memory: where the
/// layer's forward adds what it routed (for the metrics and the auxiliary load-balancing loss),
/// and what the backward of that loss reads. All null: nothing recorded, no auxiliary loss.
struct RouterStats {
  View<std::int64_t> counts;            ///< [E]: the layer's assignments per expert, added to (null: not recorded)
  View<double> probs;                   ///< [E]: its router probabilities summed over the tokens, added to
  View<const std::int64_t> aux_counts;  ///< [sparse layers, E]: every sparse layer's counts of this forward (null: no auxiliary loss)
  double aux_scale = 0;                 ///< d loss / d probs[t, e] = aux_scale x the counts of e summed over the layers
  /// [T]: which of the tokens count (1) in the statistics and the auxiliary loss, as transformers'
  /// attention mask leaves padding out of them (null: every token). The rows of the tokens the
  /// op is given (a decoder block hands each token block its rows).
  View<const std::uint8_t> valid;
};

/// Decoding with a cache (the Trainer's decode_logits, for generate/): each row of the chunk is one
/// new token of its own sequence, at positions[r] of it. A token mixer keeps what later tokens
/// read of the earlier ones (attention: their keys and values; linear attention: its state) in its
/// layer's cache, carved from `cache` for `rows` rows of up to `capacity` tokens; the chunk's rows
/// are rows [first, first + chunk rows) of them. A row at position 0 starts a new sequence.
struct DecodeRows {
  View<const std::int32_t> positions;        ///< [chunk rows], in the backend's memory
  std::span<const std::int32_t> host_positions;  ///< the same, in host memory
  std::span<std::byte> cache;                ///< the layer's cache, in the backend's memory
  std::int64_t rows = 0, first = 0, capacity = 0;
  bool active() const { return capacity > 0; }
};

/// Whether backend B's decoding primitives are in use: a host backend's; a device's where it says
/// so (B::kDecodes: once its kernels have run on one).
template <class B>
constexpr bool decoding_enabled() {
  if constexpr (requires { B::kDecodes; }) return B::kDecodes;
  else return !B::kDevice;
}

/// One chunk of a batch: `rows` whole rows of `seq` tokens, each one sequence or, packed, several
/// (`packed`). Attention never crosses a row, so a unit can run a batch chunk by chunk.
struct ChunkShape {
  std::int64_t rows = 0;
  std::int64_t seq = 0;
  PackedRows packed{};
  /// Tokens per block of the token-wise work of an op that splits it (a decoder block's norms,
  /// projections and MLP), so that its transient buffers are bounded by the block and not by a
  /// long sequence; 0: the whole chunk at once. Attention always sees whole rows.
  std::int64_t token_block = 0;
  /// A mixture-of-experts block's routing statistics (the trainer's; see RouterStats).
  RouterStats router{};
  /// Decoding with a cache (seq is 1): where the token mixers keep and read the earlier tokens.
  DecodeRows decode{};
  std::int64_t tokens() const { return rows * seq; }
  /// The token-wise blocks of the chunk: [first, first + count) for each, in order.
  std::int64_t block_tokens() const { return token_block > 0 && token_block < tokens() ? token_block : tokens(); }
  template <class F>
  void for_each_block(F&& f) const {
    const std::int64_t n = block_tokens();
    for (std::int64_t t0 = 0; t0 < tokens(); t0 += n) f(t0, std::min(n, tokens() - t0));
  }
};

/// Rows [first, first + count) of a contiguous [tokens, width] (or [tokens]) view.
template <class E>
View<E> token_rows(View<E> v, std::int64_t first, std::int64_t count) {
  MT_CHECK(v.rank() >= 1 && first >= 0 && count >= 0 && first + count <= v.size(0), "rows [{}, {}) of {}", first,
           first + count, v.shape().str());
  const std::int64_t width = v.rank() == 2 ? v.size(1) : 1;
  const auto part = v.span().subspan(static_cast<std::size_t>(first * width), static_cast<std::size_t>(count * width));
  return v.rank() == 2 ? View<E>(part, Shape{count, width}) : View<E>(part, Shape{count});
}

/// sigmoid_gate's group: the features each element of `gate` ([rows, G]) scales in x ([rows, D],
/// D a multiple of G).
template <class E>
std::int64_t gate_group(View<const E> x, View<const E> gate, const char* what) {
  const std::int64_t D = x.rank() > 0 ? x.size(x.rank() - 1) : 0;
  const std::int64_t G = gate.rank() > 0 ? gate.size(gate.rank() - 1) : 0;
  MT_CHECK(D > 0 && G > 0 && gate.numel() == x.numel() / D * G && D % G == 0 && x.is_contiguous() && gate.is_contiguous(),
           "{}: the gate {} must have the rows of {} and a number of columns that divides x's", what, gate.shape().str(),
           x.shape().str());
  return D / G;
}

/// Shape of one causal grouped-query attention call.
struct AttentionShape {
  std::int64_t rows = 0;      ///< sequences
  std::int64_t seq = 0;       ///< tokens per sequence
  std::int64_t heads = 0;     ///< query heads
  std::int64_t kv_heads = 0;  ///< key/value heads; divides heads
  std::int64_t head_dim = 0;
  PackedRows packed{};        ///< several sequences per row (attention within each), or empty
  double scale = 0;           ///< the softmax scale; 0: 1 / sqrt(head_dim)
  std::int64_t window = 0;    ///< query i sees keys i - window + 1 .. i (a sliding window); 0: all from 0
  double softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim)); }
  void validate() const {
    MT_CHECK(rows > 0 && seq > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0,
             "invalid attention shape: {} rows x {} tokens, {} heads, {} kv heads, head_dim {}", rows, seq, heads,
             kv_heads, head_dim);
    MT_CHECK(packed.empty() || (packed.positions.numel() == rows * seq && packed.count() >= rows),
             "packed attention: {} positions and {} sequences for {} rows x {} tokens", packed.positions.numel(),
             packed.count(), rows, seq);
  }
};

/// What a backend's workspaces must fit, for backends that allocate them up front (a
/// `prepare(const WorkspacePlan&)` member; the CUDA backend): the largest chunk a trainer runs.
struct WorkspacePlan {
  std::int64_t max_tokens = 0;  ///< tokens in the largest chunk
  std::int64_t max_width = 0;   ///< widest activation row (hidden, intermediate, q or kv width)
  std::int64_t vocab = 0;
  std::vector<AttentionShape> attention;  ///< every chunk shape attention will see
  /// Rows may hold several sequences (packing): room is made for cuDNN's packed plans of up to
  /// `packed_sequences_per_row` sequences a row, as long as a row.
  bool packed = false;
  std::int64_t packed_sequences_per_row = 8;
  /// Gated DeltaNet's mixing (linear-attention layers), if the model has any.
  std::optional<DeltaNetShape> linear_attention{};

  /// The most sequences a chunk holds: its rows, or packed, up to packed_sequences_per_row each.
  std::int64_t most_sequences() const {
    std::int64_t seqs = 1;
    for (const auto& a : attention)
      seqs = std::max(seqs, packed ? std::min(a.rows * packed_sequences_per_row, a.rows * a.seq) : a.rows);
    return seqs;
  }
  /// The device workspace of the linear attention's backward (delta_net_workspace_bytes), 0 without it.
  std::size_t linear_attention_bytes() const {
    if (!linear_attention) return 0;
    return delta_net_workspace_bytes(*linear_attention, max_tokens, most_sequences(), true);
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
  be.linear_backward(a, w, a, ma, flag, acc, acc);                 // dx, dW +=, db += (each may be null: not made)
  be.residual_add(r, a, mr);                                       // residual y = r + x
  be.rmsnorm(r, gain, x, ma, acc, x);                              // y, rstd (of the residual stream); gain + offset
  be.rmsnorm_backward(r, gain, cacc, a, r, mr, ma, acc, x);        // dx = residual + ..., its activation copy, dw +=
  be.head_rmsnorm(a, gain, x, ma, acc, x);                         // y, rstd: RMSNorm of activation rows (q/k and post norms)
  be.head_rmsnorm_backward(a, gain, cacc, a, ma, acc, x);          // dx, dw +=
  be.rope(ma, std::int64_t{}, std::int64_t{}, freqs, ids);         // rotate in place (ids: positions, or empty)
  be.rope_backward(ma, std::int64_t{}, std::int64_t{}, freqs, ids);  // inverse rotation in place
  be.attention(a, a, a, ma, acc, as);                              // out, lse
  be.attention_backward(a, a, a, a, cacc, a, ma, ma, ma, as);      // dq, dk, dv
  be.swiglu(a, a, ma, Activation::silu);                           // act(g) * u (SwiGLU, GeGLU)
  be.swiglu_backward(a, a, a, ma, ma, Activation::silu, ma);       // dg, du, and act(g) * u again (unless null)
  be.embedding(ids, w, mr, x);                                     // gather rows (times a scale) into the residual stream
  be.embedding_backward(ids, r, acc, std::int32_t{}, x);           // scatter-add rows (times the scale), one id skipped
  be.take_rows(ids, acc, acc);                                     // gather rows, zero them at the source
  be.lm_head_loss(a, w, ids, x, cacc, acc, ma, acc);               // per-token loss, dh, dW += (token weights or null)
  be.sum_squares(cacc, sum);                                       // sum[0] = sum of x^2 (gradient norms)
  be.adamw(adam, f32, f32, f32, grad, wout);                       // AdamW on p, m, v; w = p as the ops read it
};
// clang-format on

}  // namespace megatrain
