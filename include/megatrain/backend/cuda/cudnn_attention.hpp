// Causal grouped-query attention through cuDNN's fused flash attention (SDPA), bf16 in and out,
// fp32 softmax statistics, driven by the cuDNN graph (backend) API directly.
//
// For every shape (AttentionDims) two cuDNN operation graphs are built once, the first time the
// shape is seen: the forward (O and the natural log-sum-exp of the scaled scores) and the backward
// (dQ, dK, dV from Q, K, V, O, dO and that log-sum-exp). Each graph is lowered by cuDNN's heuristics
// to an execution plan, which is cached; later calls only bind pointers and launch. Shapes cuDNN
// cannot run (a head dimension it has no kernel for, an old cuDNN, an old GPU) are reported by
// supports() without throwing, so that the caller can use megatrain's own attention kernel
// (launch_attention_forward/backward in kernels.hpp) with exactly the same conventions.
//
// Layouts (row-major, "BSHD"): q, out, dout, dq are [rows*seq, heads*head_dim]; k, v, dk, dv are
// [rows*seq, kv_heads*head_dim]; lse is [rows, heads, seq] fp32. Query head h reads kv head
// h / (heads / kv_heads); dk and dv sum over each kv head's group of query heads. The softmax
// scale is AttentionDims::scale (1/sqrt(head_dim) when 0) and the mask is causal (query i attends
// to keys 0..i). A sliding window (AttentionDims::window) is not built here: supports() says no
// and megatrain's own kernel runs it.
//
// Packed rows (AttentionDims::sequences > 0): the rows hold that many sequences end to end (none
// crossing a row), whose starts forward() and backward() take in device memory (`starts`:
// sequences + 1 token offsets relative to starts[0], the last the end); each sequence attends
// causally within itself (cuDNN's ragged "THD" layout with a padding mask). lse is then
// token-major, [rows*seq, heads]. Plans are built per power of two of the sequence count (from
// 8, padded with empty sequences) and of the longest sequence (from 64, at most seq).
//
// Not thread-safe: one CudnnAttention per thread (or external locking), like the cuDNN handle.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn_graph.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "megatrain/backend/cuda/kernels.hpp"
#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda {

class CudnnAttention {
 public:
  /// `handle` is owned by the caller and must outlive this object; forward() and backward() set
  /// its stream. With `deterministic_backward` (the default) the backward graph asks for cuDNN's
  /// algorithm that writes dQ in a fixed order (bitwise-repeatable gradients; its workspace grows
  /// with rows*heads*seq^2). false allows cuDNN's faster dQ accumulation through fp32 atomics.
  /// A deterministic backward whose plan needs more workspace than `deterministic_workspace_limit`
  /// bytes (its dP buffer grows with rows*heads*seq^2: 56 GB for 28 heads at 32k tokens) takes
  /// the atomic dQ instead, whose workspace is linear in the tokens (said once per shape).
  explicit CudnnAttention(cudnnHandle_t handle, bool deterministic_backward = true,
                          std::size_t deterministic_workspace_limit = std::size_t{8} << 30);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  /// Builds both graphs for `d` (once) and says whether cuDNN runs this shape. Never throws for
  /// "unsupported"; throws megatrain::Error for invalid dims (non-positive, heads not a multiple
  /// of kv_heads) or when the cuDNN API itself is misused.
  bool supports(const AttentionDims& d);
  /// Why supports(d) is false (empty when it is true): the check or the cuDNN status that refused.
  std::string unsupported_reason(const AttentionDims& d);
  /// One line naming the engines and workspaces chosen for `d` (for logs and tests).
  std::string plan_summary(const AttentionDims& d);
  /// Whether the backward plan for `d` is the deterministic algorithm. Precondition: supports(d).
  bool backward_is_deterministic(const AttentionDims& d);

  /// Device workspace bytes forward()/backward() need for `d`. Precondition: supports(d).
  std::size_t forward_workspace_bytes(const AttentionDims& d);
  std::size_t backward_workspace_bytes(const AttentionDims& d);

  /// out and lse from q, k, v. Every pointer (workspace included) must be 16-byte aligned.
  /// Precondition: supports(d), workspace_bytes >= forward_workspace_bytes(d).
  void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, const AttentionDims& d,
               void* workspace, std::size_t workspace_bytes, cudaStream_t stream, const std::int32_t* starts = nullptr);
  /// dq, dk, dv (overwritten) from the forward's inputs, out and lse and the output gradient dout.
  /// Precondition: supports(d), workspace_bytes >= backward_workspace_bytes(d), 16-byte alignment.
  void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                bf16* dq, bf16* dk, bf16* dv, const AttentionDims& d, void* workspace, std::size_t workspace_bytes,
                cudaStream_t stream, const std::int32_t* starts = nullptr);

  /// Number of shapes whose graphs have been built (supported or not).
  std::size_t cached_plans() const { return plans_.size(); }
  /// cudnnGetVersion() of the library actually loaded, e.g. 91900 for 9.19.0.
  static std::size_t runtime_version();

 private:
  struct Plans;
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, double>;
  Plans& plans(const AttentionDims& d);
  Plans& supported_plans(const AttentionDims& d, const char* caller);

  cudnnHandle_t handle_;
  bool deterministic_;
  std::size_t deterministic_limit_;
  std::map<Key, std::unique_ptr<Plans>> plans_;
};

}  // namespace megatrain::cuda
