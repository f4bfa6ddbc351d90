// Launchers of megatrain's own CUDA kernels (src/cuda/kernels.cu). Non-template, C-like: the
// CUDA backend (cuda_backend.hpp) turns views into these calls. Every launcher enqueues on
// `stream`, checks the launch (MT_CUDA_CHECK_LAUNCH) and returns; none synchronises.
//
// Element types: bf16 activations and weights (megatrain::bf16, layout-compatible with
// __nv_bfloat16), fp32 gradient accumulators, statistics and losses. All arithmetic is in fp32.
// All reductions are deterministic: the same inputs give the same bits on every run (no float
// atomics), so training results never depend on timing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda {

/// Rotary inverse frequencies, passed by value (head_dim / 2 <= 256).
struct RopeFreqs {
  static constexpr int kMax = 256;
  float inv_freq[kMax];
  int half;            ///< head_dim / 2
  float scale = 1.0f;  ///< cos and sin times this (yarn's attention factor)
};

struct AttentionDims {
  std::int64_t rows, seq, heads, kv_heads, head_dim;  ///< q/out: [rows*seq, heads*head_dim]; k/v: [rows*seq, kv_heads*head_dim]
  /// Packed rows: how many sequences the rows hold end to end (none crosses a row), and the
  /// longest; 0 when each row is one sequence.
  std::int64_t sequences = 0, longest = 0;
  double scale = 0;         ///< the softmax scale; 0: 1 / sqrt(head_dim)
  std::int64_t window = 0;  ///< query i sees keys i - window + 1 .. i only (sliding window); 0: all from 0
};

// ---- elementwise ------------------------------------------------------------------------------
void launch_add(const bf16* x, bf16* y, std::int64_t n, cudaStream_t stream);  ///< y += x
void launch_add(const bf16* x, float* y, std::int64_t n, cudaStream_t stream);  ///< y += x (into the residual stream)
/// y[r, c] += bias[c] over y [M, N] (fp32).
void launch_add_bias(const bf16* bias, float* y, std::int64_t M, std::int64_t N, cudaStream_t stream);
void launch_cast(const float* in, bf16* out, std::int64_t n, cudaStream_t stream);  ///< round to nearest even
void launch_cast(const bf16* in, float* out, std::int64_t n, cudaStream_t stream);
/// m = act(g) * u with `act` 0: silu (SwiGLU), 1: GELU's tanh approximation (GeGLU), or 2: GPT-OSS's
/// clamped SwiGLU, (clamp(u, -7, 7) + 1) g' sigmoid(1.702 g') with g' = min(g, 7) (the values of
/// megatrain::Activation); and its backward (dg, du from dm; with `m` not null, m as the forward
/// writes it, in the same pass).
void launch_swiglu_forward(const bf16* g, const bf16* u, bf16* m, std::int64_t n, cudaStream_t stream, int act = 0);
void launch_swiglu_backward(const bf16* g, const bf16* u, const bf16* dm, bf16* dg, bf16* du, std::int64_t n,
                            cudaStream_t stream, int act = 0, bf16* m = nullptr);

// ---- output gates (src/cuda/output_gate.cu) -----------------------------------------------------
/// x and gate ([n / dim rows of dim] each) from both, whose row pairs are 2h (values) and 2h + 1
/// (gate inputs); merge: both from x and gate.
void launch_split_halves(const bf16* both, std::int64_t n, std::int64_t dim, bf16* x, bf16* gate, cudaStream_t stream);
void launch_merge_halves(const bf16* x, const bf16* gate, std::int64_t n, std::int64_t dim, bf16* both, cudaStream_t stream);
/// y[i] = x[i] sigmoid(gate[i / group]) over n elements; the backward: dx, and dgate[g] = s (1 - s)
/// times the sum of dy x over group g (a warp a gate element: deterministic).
void launch_sigmoid_gate(const bf16* x, const bf16* gate, std::int64_t n, std::int64_t group, bf16* y, cudaStream_t stream);
void launch_sigmoid_gate_backward(const bf16* x, const bf16* gate, const bf16* dy, std::int64_t gates, std::int64_t group,
                                  bf16* dx, bf16* dgate, cudaStream_t stream);

// ---- embedding ------------------------------------------------------------------------------
/// out[t] = table[ids[t]] * scale (into the fp32 residual stream), out: [M, d]. Ids outside
/// [0, V) are a device-side error (trap).
void launch_embedding_forward(const std::int32_t* ids, const bf16* table, float* out, std::int64_t M, std::int64_t d,
                              std::int64_t V, cudaStream_t stream, float scale = 1.0f);
/// The same from an fp32 table (the embedding's fp32 master rows).
void launch_embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t M, std::int64_t d,
                              std::int64_t V, cudaStream_t stream, float scale = 1.0f);
std::size_t embedding_backward_workspace_bytes(std::int64_t M);
/// dtable[ids[t]] += dy[t] * scale for all t except ids equal to skip_id, deterministically
/// (positions grouped by id, summed in order).
void launch_embedding_backward(const std::int32_t* ids, const float* dy, float* dtable, std::int64_t M, std::int64_t d,
                               std::int64_t V, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                               std::int32_t skip_id = -1, float scale = 1.0f);
/// out[i] = table[rows[i]] and table[rows[i]] = 0, out: [U, d] fp32. Rows must be distinct;
/// rows outside [0, V) are a device-side error (trap).
void launch_take_rows(const std::int32_t* rows, float* table, float* out, std::int64_t U, std::int64_t d, std::int64_t V,
                      cudaStream_t stream);

// ---- RMSNorm ---------------------------------------------------------------------------------
/// y = x * rstd * (w + offset) per row of [M, d] (x the fp32 residual stream, w an fp32 gain, y
/// bf16; offset 1 for Gemma's (1 + w) norms, else 0); rstd[M] = 1 / sqrt(mean(x^2) + eps).
void launch_rmsnorm_forward(const float* x, const float* w, bf16* y, float* rstd, std::int64_t M, std::int64_t d, float eps,
                            cudaStream_t stream, float offset = 0.0f);
std::size_t rmsnorm_backward_workspace_bytes(std::int64_t M, std::int64_t d);
/// dx = residual + rstd * (dy*g - xhat * mean(dy*g*xhat)) with g = w + offset, in fp32 (residual null: none; it may
/// be dx), dx_act = bf16(dx) unless null; dw += sum_rows dy * xhat.
void launch_rmsnorm_backward(const float* x, const float* w, const float* rstd, const bf16* dy, const float* residual,
                             float* dx, bf16* dx_act, float* dw, std::int64_t M, std::int64_t d, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream, float offset = 0.0f);
/// The same over bf16 activation rows (Qwen3's q/k norms: [tokens * heads, head_dim]): y bf16,
/// and its backward with dx bf16 (no residual); workspace as rmsnorm_backward_workspace_bytes.
void launch_head_rmsnorm_forward(const bf16* x, const float* w, bf16* y, float* rstd, std::int64_t M, std::int64_t d,
                                 float eps, cudaStream_t stream, float offset = 0.0f);
void launch_head_rmsnorm_backward(const bf16* x, const float* w, const float* rstd, const bf16* dy, bf16* dx, float* dw,
                                  std::int64_t M, std::int64_t d, void* workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream, float offset = 0.0f);

// ---- rotary ----------------------------------------------------------------------------------
/// Rotates every head of x [M, heads*head_dim] in place (Hugging Face rotate-half over a head's
/// first 2 * freqs.half dimensions: all, or fewer with partial rotary), position of
/// token t = positions[t] (device memory), or t % seq where positions is null; `inverse` applies
/// the transpose (for gradients).
void launch_rope(bf16* x, const std::int32_t* positions, std::int64_t M, std::int64_t heads, std::int64_t head_dim,
                 std::int64_t seq, const RopeFreqs& freqs, bool inverse, cudaStream_t stream);

// ---- reductions --------------------------------------------------------------------------------
std::size_t column_sum_workspace_bytes(std::int64_t M, std::int64_t N);
/// out[c] += sum_r x[r, c] over x [M, N] (bias gradients).
void launch_column_sum(const bf16* x, float* out, std::int64_t M, std::int64_t N, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream);
std::size_t sum_squares_workspace_bytes(std::int64_t n);
/// *out = sum x[i]^2 in double (a device pointer), in a fixed order.
void launch_sum_squares(const float* x, std::int64_t n, double* out, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream);

// ---- optimizer ---------------------------------------------------------------------------------
/// AdamW's per-step scalars (megatrain::AdamWScalars<float>, optim/adamw.hpp), by value.
struct AdamWArgs {
  float decay, one_minus_b1, beta2, one_minus_b2, bc2_sqrt, eps, step_size, grad_scale;
};
/// One AdamW step over n elements (optim/adamw.hpp's formula): p, m, v updated in place from the
/// gradient g, and w = bf16(p). Every operation is the CPU's, IEEE-rounded, with fused
/// multiply-adds at the same places and no others, so the result is bit for bit the CPU's.
void launch_adamw(const AdamWArgs& s, float* p, float* m, float* v, const float* g, bf16* w, std::int64_t n,
                  cudaStream_t stream);

// ---- cross-entropy -----------------------------------------------------------------------------
/// For each of n rows of fp32 logits [n, V]: loss[r] = logsumexp(z_r) - z_r[label_r] (0 if the
/// label is -100); if dlogits is not null, dlogits[r] = s_r * (softmax(z_r) - onehot(label_r))
/// (zeros for ignored rows), in bf16, with s_r = scale x weights[r] (weights null: scale). Labels
/// outside [0, V) other than -100 trap.
void launch_cross_entropy(const float* logits, const std::int32_t* labels, float* loss, bf16* dlogits, float scale,
                          const float* weights, std::int64_t n, std::int64_t V, cudaStream_t stream);
/// The same with every row's weight 1.
inline void launch_cross_entropy(const float* logits, const std::int32_t* labels, float* loss, bf16* dlogits, float scale,
                                 std::int64_t n, std::int64_t V, cudaStream_t stream) {
  launch_cross_entropy(logits, labels, loss, dlogits, scale, nullptr, n, V, stream);
}

// ---- tests ---------------------------------------------------------------------------------------
/// Holds `stream` for `nanoseconds` (a kernel that waits on the GPU's clock): tests delay copies
/// with it to show that what must wait for them does.
void launch_spin(std::int64_t nanoseconds, cudaStream_t stream);

// ---- mixture of experts (src/cuda/moe.cu; the CPU backend's moe_* primitives are the reference) --
inline constexpr std::int64_t kMoeMaxExperts = 1024;  ///< experts a layer may have on the GPU
inline constexpr std::int64_t kMoeMaxTopK = 32;       ///< experts a token may choose on the GPU
/// Device bytes the routing's grouping needs (per-chunk counts; any number of assignments).
inline constexpr std::size_t kMoeRouteWorkspace = std::size_t{1} << 20;
/// The routing of M tokens over E experts (CpuBackend::moe_route): probs = softmax of the bf16
/// logits [M, E] in fp32; experts/weights [M, k] the top k (the lower index first among equals),
/// renormalised where asked; the M * k assignments grouped by expert, stably: order[r] is row
/// r's assignment, slot[a] its row, offsets [E + 1] each expert's first row. `workspace`: at least
/// kMoeRouteWorkspace bytes. E <= kMoeMaxExperts, k <= kMoeMaxTopK.
void launch_moe_route(const bf16* logits, std::int64_t M, std::int64_t E, std::int64_t k, bool renormalize, float* probs,
                      std::int32_t* experts, float* weights, std::int32_t* order, std::int32_t* slot, std::int64_t* offsets,
                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
/// xs[r] = x[order[r] / k] for the N = M * k rows, d wide.
void launch_moe_gather(const bf16* x, const std::int32_t* order, std::int64_t k, std::int64_t N, std::int64_t d, bf16* xs,
                       cudaStream_t stream);
/// y[t] = h[t] + sum of weights[t, j] * out[slot[t, j]] over j, the experts in increasing index,
/// in fp32 (y may be h).
void launch_moe_combine(const bf16* out, const std::int32_t* slot, const float* weights, std::int64_t k, const float* h,
                        float* y, std::int64_t M, std::int64_t d, cudaStream_t stream);
/// dout[slot[t, j]] = bf16(weights[t, j] * dy[t]); dweights[t, j] = <dy[t], out[slot[t, j]]>.
void launch_moe_combine_backward(const bf16* dy, const bf16* out, const std::int32_t* slot, const float* weights,
                                 std::int64_t k, std::int64_t M, std::int64_t d, bf16* dout, float* dweights,
                                 cudaStream_t stream);
/// dlogits [M, E] from the routing weights' gradient, through the renormalisation and the softmax;
/// aux_counts [aux_layers, E] (device; null: none): the auxiliary load-balancing loss's
/// aux_scale x the counts of expert i over the layers added to every token's dp_i (valid [M]
/// (device; null: every token): only the tokens it flags).
void launch_moe_route_backward(const float* probs, const std::int32_t* experts, const float* weights, const float* dweights,
                               std::int64_t k, bool renormalize, const std::int64_t* aux_counts, std::int64_t aux_layers,
                               double aux_scale, const std::uint8_t* valid, std::int64_t M, std::int64_t E, bf16* dlogits,
                               cudaStream_t stream);
/// counts[e] += offsets[e + 1] - offsets[e]; prob_sums[e] += the sum over the M tokens of probs[t, e] (double).
/// With valid [M] (device; null: every token): only the tokens it flags, their assignments counted
/// from experts [M, k].
void launch_moe_record(const float* probs, const std::int32_t* experts, std::int64_t k, const std::int64_t* offsets,
                       const std::uint8_t* valid, std::int64_t M, std::int64_t E, std::int64_t* counts, double* prob_sums,
                       cudaStream_t stream);
/// The experts' products over the rows grouped by expert (offsets [E + 1], device, as
/// launch_moe_route makes them: 0, increasing, `rows` = offsets[E], which the caller knows; not
/// checked here, since reading them would synchronise: the CPU backend checks them): one kernel each, which
/// reads the offsets on the device (the host never waits for the routing), bf16 tensor cores
/// with fp32 accumulation, each output element summed in a fixed order (deterministic). w[e]
/// (host array of E device pointers): expert e's weight [N, K].
/// y[rows of e] = bf16(x[rows of e] w[e]^T): x [rows, K], y [rows, N].
void launch_grouped_forward(const bf16* x, std::span<const bf16* const> w, bf16* y, const std::int64_t* offsets,
                            std::int64_t rows, std::int64_t N, std::int64_t K, cudaStream_t stream);
/// dx[rows of e] = bf16(dy[rows of e] w[e]) (with `accumulate`, bf16(dx + that), rounded once).
void launch_grouped_input_grad(const bf16* dy, std::span<const bf16* const> w, bf16* dx, bool accumulate,
                               const std::int64_t* offsets, std::int64_t rows, std::int64_t N, std::int64_t K,
                               cudaStream_t stream);
/// dw[e] += dy[rows of e]^T x[rows of e] in fp32 (dw[e] [N, K]; an expert without rows untouched).
void launch_grouped_weight_grad(const bf16* dy, const bf16* x, std::span<float* const> dw, const std::int64_t* offsets,
                                std::int64_t rows, std::int64_t N, std::int64_t K, cudaStream_t stream);
/// GPT-OSS's experts' biases: y[r] = bf16(y[r] + bias_e) for every row r of expert e, over the rows
/// [offsets[0], offsets[E]) (offsets: [E + 1] device, increasing; `rows` bounds their count), with
/// bias_e = bias0 + e * stride (bf16).
void launch_moe_bias_add(bf16* y, std::int64_t rows, std::int64_t N, const std::int64_t* offsets, std::int64_t E,
                         const bf16* bias0, std::int64_t stride, cudaStream_t stream);
/// dbias_e += the column sums of dy's rows of expert e (dy [rows, N]; dbias_e = dbias0 + e * stride,
/// fp32); deterministic.
void launch_moe_bias_grad(const bf16* dy, std::int64_t N, const std::int64_t* offsets, std::int64_t E, float* dbias0,
                          std::int64_t stride, cudaStream_t stream);
/// dx[t] = bf16(dx[t] + the sum of dxs[slot[t, j]] over j, in increasing row).
void launch_moe_scatter_add(const bf16* dxs, const std::int32_t* slot, std::int64_t k, bf16* dx, std::int64_t M,
                            std::int64_t d, cudaStream_t stream);

// ---- attention (the fallback when cuDNN is missing or refuses a shape) ------------------------
/// For cuDNN's packed (ragged) attention: from `count` + 1 sequence starts (device, token offsets
/// relative to starts[0], the last one the end), element offsets qo[i] = qo_mul * start_i,
/// kv[i] = kv_mul * start_i, st[i] = st_mul * start_i and lengths len[i] for i < `padded`
/// (entries past `count` are empty sequences at the end: offsets of the end, length 0).
void launch_packed_offsets(const std::int32_t* starts, std::int64_t count, std::int64_t padded, std::int64_t qo_mul,
                           std::int64_t kv_mul, std::int64_t st_mul, std::int64_t* qo, std::int64_t* kv, std::int64_t* st,
                           std::int32_t* len, cudaStream_t stream);
/// Causal grouped-query attention; lse: [rows, heads, seq] fp32 (natural log-sum-exp of the
/// scaled scores, the same statistic cuDNN's SDPA returns). Packed rows: `positions` (device,
/// [rows*seq]) holds each token's position within its sequence, and query i sees keys
/// i - positions[i] .. i of its row; null: a row is one sequence. `sinks` (device, [heads] fp32;
/// GPT-OSS's): a logit per query head that joins every query's softmax (and lse) and carries no
/// value; null: none.
void launch_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, const AttentionDims& dims,
                              cudaStream_t stream, const std::int32_t* positions = nullptr, const float* sinks = nullptr);
std::size_t attention_backward_workspace_bytes(const AttentionDims& dims);
/// dq, dk, dv overwritten; dk, dv sum over each kv head's group of query heads. With sinks, their
/// gradient is added to dsinks ([heads] fp32; deterministic).
void launch_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                               const bf16* dout, bf16* dq, bf16* dk, bf16* dv, const AttentionDims& dims, void* workspace,
                               std::size_t workspace_bytes, cudaStream_t stream, const std::int32_t* positions = nullptr,
                               const float* sinks = nullptr, float* dsinks = nullptr);
/// Sinks around an attention that has none (cuDNN's; rows not packed): each query's output times
/// exp(lse - lse') and lse replaced by lse' = log(exp(lse) + exp(sink)), which is the attention
/// with sinks; its backward is then the usual one given these out and lse, and the sinks' gradient
/// launch_attention_sinks_grad's (adds to dsinks; the workspace of attention_backward_workspace_bytes).
void launch_attention_add_sinks(bf16* out, float* lse, const float* sinks, const AttentionDims& dims, cudaStream_t stream);
void launch_attention_sinks_grad(const bf16* out, const bf16* dout, const float* lse, const float* sinks, float* dsinks,
                                 const AttentionDims& dims, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace megatrain::cuda
