// Matrix products through cuBLASLt: bf16 operands, fp32 accumulation, bf16 or fp32 results.
//
// Row-major, nn.Linear conventions (W is [out, in]):
//   forward      y[M,N]  = x[M,K] W[N,K]^T (+ bias[N])       bf16 out
//   input grad   dx[M,K] = dy[M,N] W[N,K]       (= or +=)    bf16 out
//   weight grad  dW[N,K] += dy[M,N]^T x[M,K]                  fp32 out, accumulated
// A plan (matmul descriptor, layouts, the heuristic's algorithm) is built once per shape and
// kind and cached; later calls with the same shape only launch.
//
// Tuning (optional): cuBLASLt's heuristic picks one algorithm per shape, not always the fastest
// (docs/performance.md: a 1.5B step 2% faster with the fastest). With tuning on, a plan keeps the
// heuristic's first few candidates and its calls take them in turn (each call a correct product,
// its GPU time measured between events) until end_tuning() picks each shape's fastest; from then
// on, and for shapes first seen after it, the choice is fixed. The choices differ in the last
// bits of their sums, so a run that must continue bit for bit saves algorithms() (text) and gives
// it to restore() before it continues: the same shapes then take the same algorithms.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda {

class Gemm {
 public:
  /// `workspace` of `workspace_bytes` device memory (owned by the caller) is given to cuBLASLt.
  /// `tune`: time the heuristic's candidates until end_tuning() (see above).
  Gemm(void* workspace, std::size_t workspace_bytes, bool tune = false);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  /// y = x W^T (+ bias, if not null).
  void forward(const bf16* x, const bf16* w, const bf16* bias, bf16* y, std::int64_t M, std::int64_t N, std::int64_t K,
               cudaStream_t stream);
  /// y (fp32) = x W^T: the LM head's logits.
  void forward_f32(const bf16* x, const bf16* w, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                   cudaStream_t stream);
  /// y (fp32) = r (fp32) + x W^T, the sum formed in fp32 in the epilogue (y may be r): a
  /// projection added to the residual stream.
  void forward_add(const bf16* x, const bf16* w, const float* r, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                   cudaStream_t stream);
  /// dx = dy W, or dx += dy W when accumulate.
  void input_grad(const bf16* dy, const bf16* w, bf16* dx, bool accumulate, std::int64_t M, std::int64_t N, std::int64_t K,
                  cudaStream_t stream);
  /// dW += dy^T x in fp32.
  void weight_grad(const bf16* dy, const bf16* x, float* dw, std::int64_t M, std::int64_t N, std::int64_t K,
                   cudaStream_t stream);

  std::size_t cached_plans() const { return plans_.size(); }

  /// Ends tuning: waits for the timed calls, fixes each shape's fastest algorithm (the heuristic's
  /// first where nothing was timed). Later shapes take the heuristic's first. Idempotent.
  void end_tuning();
  bool tuning() const { return tuning_; }
  /// Calls timed so far for the tuning (0 once it has ended).
  std::size_t timed_calls() const;
  /// Every shape's algorithm as text: a header naming cuBLASLt's version, then one line a shape
  /// (while tuning, a shape's heuristic first: call it once tuning has ended).
  std::string algorithms() const;
  /// Takes the algorithms of `text` (from algorithms()) for their shapes, those built and those to
  /// come (added to any taken before), and ends tuning. Returns false, changing nothing, where
  /// `text` was written with another cuBLASLt or GPU; throws on text that is not algorithms()'s,
  /// or where an algorithm does not run here.
  bool restore(const std::string& text);

 private:
  struct Plan;
  enum class Kind : int { forward, forward_bias, forward_f32, forward_add, input_grad, input_grad_acc, weight_grad };
  using Key = std::tuple<int, std::int64_t, std::int64_t, std::int64_t, bool>;
  /// `aligned`: every pointer and row pitch is a multiple of 16 bytes (the fast kernels' need);
  /// otherwise the plan asks cuBLASLt for algorithms that accept 2-byte alignment.
  Plan& plan(Kind kind, std::int64_t M, std::int64_t N, std::int64_t K, bool aligned);
  /// D = A B (+ bias) + beta C; c_in: C when it is not D (null: C is D).
  void run(Plan& p, const void* a, const void* b, void* c, const void* bias, float beta, cudaStream_t stream,
           const void* c_in = nullptr);
  /// `algo` where it runs on this plan's shape here; else throws naming the shape.
  cublasLtMatmulAlgo_t checked(const Plan& p, const Key& key, const cublasLtMatmulAlgo_t& algo);
  static void drop_timed(Plan& p);  // destroys the plan's timing events

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  std::size_t workspace_bytes_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  bool tuning_ = false;
  std::map<Key, cublasLtMatmulAlgo_t> restored_;
};

}  // namespace megatrain::cuda
