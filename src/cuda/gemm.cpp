// cuBLASLt plans for the three products of a linear layer (see gemm.hpp). cuBLAS is
// column-major: a row-major [R, C] matrix is a column-major [C, R] one, so each row-major
// product is written as its transpose:
//   y = x W^T       ->  y^T (N x M)  = (W^T)^T . x^T      A = W (K x N, op T),  B = x (K x M, op N)
//   dx = dy W       ->  dx^T (K x M) = W^T . dy^T         A = W (K x N, op N),  B = dy (N x M, op N)
//   dW += dy^T x    ->  dW^T (K x N) = x^T . dy           A = x (K x M, op N),  B = dy (N x M, op T)
#include "megatrain/backend/cuda/gemm.hpp"

#include <initializer_list>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain::cuda {

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_bias = false;
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm(void* workspace, std::size_t workspace_bytes) : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  MT_CUDA_CHECK(cublasLtCreate(&handle_));
}

Gemm::~Gemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

namespace {
bool aligned16(std::initializer_list<const void*> ptrs, std::initializer_list<std::int64_t> pitches_bytes) {
  for (const void* p : ptrs)
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  for (std::int64_t b : pitches_bytes)
    if (b % 16 != 0) return false;
  return true;
}
}  // namespace

Gemm::Plan& Gemm::plan(Kind kind, std::int64_t M, std::int64_t N, std::int64_t K, bool aligned) {
  const Key key{static_cast<int>(kind), M, N, K, aligned};
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  MT_NVTX_RANGE("gemm_plan_build");  // once per shape (a cached plan returns above, without a range)
  MT_CHECK(M > 0 && N > 0 && K > 0, "matrix product of [{}, {}] x [{}, {}]^T has an empty side", M, K, N, K);
  auto p = std::make_unique<Plan>();
  MT_CUDA_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  std::uint64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0, arows = 0, acols = 0, brows = 0, bcols = 0;
  cudaDataType_t ctype = CUDA_R_16BF;
  switch (kind) {
    case Kind::forward:
    case Kind::forward_bias:
    case Kind::forward_f32:
    case Kind::forward_add:
      ta = CUBLAS_OP_T;
      m = N, n = M, k = K;
      arows = K, acols = N, lda = K;  // W
      brows = K, bcols = M, ldb = K;  // x
      ldc = N;
      if (kind == Kind::forward_f32 || kind == Kind::forward_add) ctype = CUDA_R_32F;
      break;
    case Kind::input_grad:
    case Kind::input_grad_acc:
      m = K, n = M, k = N;
      arows = K, acols = N, lda = K;  // W
      brows = N, bcols = M, ldb = N;  // dy
      ldc = K;
      break;
    case Kind::weight_grad:
      tb = CUBLAS_OP_T;
      m = K, n = N, k = M;
      arows = K, acols = M, lda = K;  // x
      brows = N, bcols = M, ldb = N;  // dy
      ldc = K;
      ctype = CUDA_R_32F;
      break;
  }
  MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (kind == Kind::forward_bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    MT_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    p->has_bias = true;
  }
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, arows, acols, static_cast<std::int64_t>(lda)));
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, brows, bcols, static_cast<std::int64_t>(ldb)));
  MT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&p->c, ctype, m, n, static_cast<std::int64_t>(ldc)));
  (void)k;

  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  MT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                                     sizeof workspace_bytes_));
  const std::uint32_t align = aligned ? 16 : 2;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    MT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  MT_CUDA_CHECK(st);
  MT_CHECK(found > 0, "cuBLASLt has no algorithm for a bf16 product of m={} n={} k={}", m, n, k);
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Gemm::run(Plan& p, const void* a, const void* b, void* c, const void* bias, float beta, cudaStream_t stream,
               const void* c_in) {
  if (p.has_bias)
    MT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  const float alpha = 1.0f;
  MT_CUDA_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, a, p.a, b, p.b, &beta, c_in ? c_in : c, p.c, c, p.c, &p.algo,
                               workspace_, workspace_bytes_, stream));
}

void Gemm::forward(const bf16* x, const bf16* w, const bf16* bias, bf16* y, std::int64_t M, std::int64_t N,
                   std::int64_t K, cudaStream_t stream) {
  const bool al = aligned16({x, w, bias, y}, {2 * K, 2 * N});
  run(plan(bias ? Kind::forward_bias : Kind::forward, M, N, K, al), w, x, y, bias, 0.0f, stream);
}

void Gemm::forward_f32(const bf16* x, const bf16* w, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({x, w, y}, {2 * K, 4 * N});
  run(plan(Kind::forward_f32, M, N, K, al), w, x, y, nullptr, 0.0f, stream);
}

void Gemm::forward_add(const bf16* x, const bf16* w, const float* r, float* y, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({x, w, r, y}, {2 * K, 4 * N});
  run(plan(Kind::forward_add, M, N, K, al), w, x, y, nullptr, 1.0f, stream, r);
}

void Gemm::input_grad(const bf16* dy, const bf16* w, bf16* dx, bool accumulate, std::int64_t M, std::int64_t N,
                      std::int64_t K, cudaStream_t stream) {
  const bool al = aligned16({dy, w, dx}, {2 * K, 2 * N});
  run(plan(accumulate ? Kind::input_grad_acc : Kind::input_grad, M, N, K, al), w, dy, dx, nullptr,
      accumulate ? 1.0f : 0.0f, stream);
}

void Gemm::weight_grad(const bf16* dy, const bf16* x, float* dw, std::int64_t M, std::int64_t N, std::int64_t K,
                       cudaStream_t stream) {
  const bool al = aligned16({dy, x, dw}, {2 * K, 2 * N, 4 * K});
  run(plan(Kind::weight_grad, M, N, K, al), x, dy, dw, nullptr, 1.0f, stream);
}

}  // namespace megatrain::cuda
